"""A drafter's own paged KV cache (a draft model's, an EAGLE head's): blocks handed to each request it drafts for,
the pool doubled when it runs out (its footprint is a few percent of the target's, so nothing is evicted)."""
from __future__ import annotations

from executor.model.cache_engine import KVCache


class PagedDraftCache:
    """Mixed into a drafter: `kv` (its pool), `free` (block numbers), `seqs` (request key -> state with `.blocks`)."""

    kv: KVCache
    free: list[int]
    seqs: dict

    def _init_cache(self, config, num_blocks: int, block_size: int, dtype, device) -> None:
        self.kv = KVCache.for_model(config, num_blocks, block_size, dtype, device)
        self.free = list(range(num_blocks))
        self.seqs = {}

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def _grow(self) -> None:
        """Double the pool, the blocks in use copied over."""
        old = self.kv
        self.kv = KVCache(old.num_layers, 2 * old.num_blocks, old.block_size, old.data.shape[4], old.data.shape[5],
                          old.dtype, old.device)
        self.kv.data[:, :, :old.num_blocks] = old.data
        self.free.extend(range(old.num_blocks, 2 * old.num_blocks))

    def _reserve(self, seq, num_tokens: int) -> None:
        """Blocks for `num_tokens` positions of `seq` (a request's state)."""
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        while need > len(self.free):
            self._grow()
        for _ in range(max(0, need)):
            seq.blocks.append(self.free.pop())

    def release(self, key) -> None:
        """Forget a request: its blocks go back to the pool."""
        seq = self.seqs.pop(key, None)
        if seq is not None:
            self.free.extend(seq.blocks)

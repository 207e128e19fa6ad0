"""KV-cache block allocators (vLLM's block manager): paged blocks with a block table per request.

A contiguous allocator is the same object with block_size = max_model_len: each request reserves one
max_model_len slot at admission, and the reserved-but-unused part is the waste paging removes.
"""
from __future__ import annotations

from sim.policy.request import Request


class BlockAllocator:
    """Fixed pool of KV blocks; request.block_table lists the physical block ids a request holds."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, num_swap_blocks: int = 0,
                 contiguous: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.num_swap_blocks = num_swap_blocks
        self.free_host_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_blocks - len(self.free_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` still needs so that `num_tokens` of its tokens fit."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_table))

    def can_allocate(self, req: Request, num_tokens: int, watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if watermark else 0
        return len(self.free_blocks) - self.extra_blocks(req, num_tokens) >= reserve

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Grow req.block_table to hold `num_tokens` tokens (the caller checked can_allocate)."""
        need = self.extra_blocks(req, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"request {req.id}: needs {need} blocks, {len(self.free_blocks)} free")
        if need:
            req.block_table.extend(reversed(self.free_blocks[-need:]))
            del self.free_blocks[-need:]

    def append_block(self, req: Request) -> None:
        req.block_table.append(self.free_blocks.pop())

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks past those `num_tokens` tokens need (speculative slots of rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_table) > keep:
            self.free_blocks.extend(reversed(req.block_table[keep:]))
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        self.release(req.block_table)
        req.block_table = []

    def release(self, block_table: list[int]) -> None:
        """Give back the blocks of a table no request holds any more (a handed-off prefill's, once sent)."""
        self.free_blocks.extend(reversed(block_table))

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self.free_host_blocks)

    def can_swap_out(self, req: Request) -> bool:
        return len(req.block_table) <= len(self.free_host_blocks)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move req's blocks to host memory; returns (device block, host block) copies to make before the
        device blocks are written again (i.e. before the step's forward)."""
        n = len(req.block_table)
        host = self.free_host_blocks[-n:][::-1] if n else []
        del self.free_host_blocks[len(self.free_host_blocks) - n:]
        pairs = list(zip(req.block_table, host))
        req.host_block_table = host
        self.free(req)
        return pairs

    def swap_in(self, req: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back with room for `num_tokens`; returns (host block, device block)
        copies to make before the step's forward."""
        self.allocate(req, num_tokens)
        pairs = list(zip(req.host_block_table, req.block_table))
        self.free_host_blocks.extend(reversed(req.host_block_table))
        req.host_block_table = ()
        return pairs

"""The KV cache: per layer, a pool of fixed-size blocks for K and for V.

One tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` holds it all.
Which block a sequence uses is decided elsewhere (the block allocator); here a token's K/V
live at the flat slot `block_id * block_size + offset`. A contiguous cache (one reservation
of max_model_len per sequence, like HF's static cache) is the same structure with
block_size = max_model_len and one block per sequence.
"""

from __future__ import annotations

import torch


class KVCache:
    """Block pools for K and V of every layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        # each layer's (k_pool, v_pool) views, made once: every layer of every step asks for them
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "KVCache":
        """A paged cache of `num_blocks` blocks shaped for a LlamaConfig."""
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)

    @classmethod
    def contiguous(cls, config, max_num_seqs: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> "KVCache":
        """A per-sequence reservation of max_model_len tokens: block i is sequence slot i's whole cache."""
        return cls.for_model(config, max_num_seqs, max_model_len, dtype, device)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool) of a layer, each `[num_blocks, block_size, num_kv_heads, head_dim]` (views)."""
        return self._layers[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at their flat slots."""
        k_pool, v_pool = self.layer(layer)
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slot_mapping, k.to(self.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of a sequence's first `length` cached K and V, each `[length, num_kv_heads, head_dim]`."""
        k_pool, v_pool = self.layer(layer)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        k = k_pool[table].flatten(0, 1)[:length]
        v = v_pool[table].flatten(0, 1)[:length]
        return k, v

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared prefix)."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.data[:, :, d] = self.data[:, :, s]

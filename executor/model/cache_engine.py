"""The KV cache: per layer, a pool of fixed-size blocks for K and for V.

One tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` holds it all.
Which block a sequence uses is decided elsewhere (the block allocator); here a token's K/V
live at the flat slot `block_id * block_size + offset`. A contiguous cache (one reservation
of max_model_len per sequence, like HF's static cache) is the same structure with
block_size = max_model_len and one block per sequence.

int8 KV (`kv_dtype="int8"`): each (token, head) row of head_dim values is stored as head_dim int8 values followed by
their fp32 scale (4 bytes), symmetric: x ≈ q · scale, scale = max |x| / 127. So the last dimension is head_dim + 4
bytes and the tensor is int8; every copy of whole rows (swap, copy-on-write, tree compaction, the disaggregated
transfer) moves values and scales together unchanged. A scale per (token, head), not per (block, head): a block
fills token by token, and a per-token scale needs no requantizing nor a guessed headroom, at 4 bytes per 64
(llama.cpp's Q8_0 KV carries the same 1/16: an fp16 scale per 32 values).
"""

from __future__ import annotations

import torch

KV_DTYPES = (None, "int8")
SCALE_BYTES = 4  # an int8 row's fp32 scale


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (float) as int8 KV rows [..., D + 4]: D values round(x / s), then s = max |x| / 127 (fp32)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(x / scale), torch.zeros_like(x)).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 KV rows [..., D + 4] back to values [..., D] in `dtype`; other tensors are returned as they are."""
    if rows.dtype != torch.int8:
        return rows
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def _check_kv_dtype(kv_dtype: str | None) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not supported; allowed: None (the model's dtype) or 'int8'")


class CacheTensor:
    """What a cache's one tensor `data` (its blocks along dim 2) and `kv_dtype` say of it, for every KV cache."""

    data: torch.Tensor
    kv_dtype: str | None

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (int8 for an int8 cache; `compute_dtype` is what attention reads)."""
        return self.data.dtype

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class KVCache(CacheTensor):
    """Block pools for K and V of every layer (int8 rows with their scales where kv_dtype is "int8")."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", kv_dtype: str | None = None):
        _check_kv_dtype(kv_dtype)
        self.block_size = block_size
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.compute_dtype = dtype  # what the attention reads: the model's dtype
        row = head_dim + SCALE_BYTES if kv_dtype == "int8" else head_dim
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, row)
        self.data = torch.zeros(shape, dtype=torch.int8 if kv_dtype == "int8" else dtype, device=device)
        # each layer's (k_pool, v_pool) views, made once: every layer of every step asks for them
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", kv_dtype: str | None = None) -> "KVCache":
        """A paged cache of `num_blocks` blocks shaped for a LlamaConfig; kv_dtype None: values in `dtype`,
        "int8": int8 rows with a scale per (token, head)."""
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device,
                   kv_dtype)

    @classmethod
    def contiguous(cls, config, max_num_seqs: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", kv_dtype: str | None = None) -> "KVCache":
        """A per-sequence reservation of max_model_len tokens: block i is sequence slot i's whole cache."""
        return cls.for_model(config, max_num_seqs, max_model_len, dtype, device, kv_dtype)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype = torch.float32,
                        kv_dtype: str | None = None) -> int:
        """Bytes one block takes across all layers, K and V (int8: head_dim + 4 bytes per token and head)."""
        _check_kv_dtype(kv_dtype)
        if kv_dtype == "int8":
            row = config.head_dim + SCALE_BYTES
        else:
            row = config.head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * row

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool) of a layer, each `[num_blocks, block_size, num_kv_heads, head_dim]` (views)."""
        return self._layers[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V `[T, num_kv_heads, head_dim]` at their flat slots (quantized for an int8 cache)."""
        k_pool, v_pool = self.layer(layer)
        store = quantize_kv if self.quantized else (lambda x: x.to(self.dtype))
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slot_mapping, store(k))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slot_mapping, store(v))

    def read(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of a sequence's first `length` cached K and V, each `[length, num_kv_heads, head_dim]` (in
        `compute_dtype`, dequantized, for an int8 cache)."""
        k_pool, v_pool = self.layer(layer)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        k = k_pool[table].flatten(0, 1)[:length]
        v = v_pool[table].flatten(0, 1)[:length]
        if self.quantized:
            return dequantize_kv(k, self.compute_dtype), dequantize_kv(v, self.compute_dtype)
        return k, v

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of a shared prefix)."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.data[:, :, d] = self.data[:, :, s]

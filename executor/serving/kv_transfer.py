"""Moving a finished prompt's KV from a prefill instance's cache into the blocks a decode instance reserved for it.

The decode side pulls, as vLLM's NIXL connector reads a prefill instance's blocks over RDMA: the prefill instance's
KV tensor lives in shared memory, and the decode instance gathers the request's tokens from the prefill block table
into one contiguous payload (what a link would carry) and scatters it into its own blocks. Token by token, so the two
pools may use different block sizes, and the bytes moved are the KV formula's: 2 × layers × kv_heads × head_dim ×
dtype bytes × tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Transfer:
    """One request's KV crossing from the prefill pool to a decode instance (times on the serve's clock)."""

    request: int
    decode: int  # the decode instance that took it
    tokens: int
    bytes: int
    handoff_s: float  # its first token, at the end of the prefill step that handed it off
    start_s: float
    end_s: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


def token_slots(block_table: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat cache slots (block * block_size + offset) of a sequence's first `num_tokens` tokens."""
    i = torch.arange(num_tokens)
    return torch.tensor(block_table, dtype=torch.long)[i // block_size] * block_size + i % block_size


def copy_kv(src: torch.Tensor, src_table: list[int], dst: torch.Tensor, dst_table: list[int],
            num_tokens: int) -> int:
    """Copy the K/V of a sequence's first `num_tokens` tokens from cache tensor `src` (its blocks `src_table`) to
    `dst` (blocks `dst_table`); both `[layers, 2, blocks, block_size, kv_heads, head_dim]`. Returns the bytes moved."""
    layers, _, _, src_bs, heads, dim = src.shape
    payload = src.view(layers, 2, -1, heads, dim).index_select(2, token_slots(src_table, src_bs, num_tokens))
    dst.view(layers, 2, -1, heads, dim).index_copy_(2, token_slots(dst_table, dst.shape[3], num_tokens),
                                                    payload.to(dst.dtype))
    return payload.numel() * payload.element_size()


def fit_link(transfers: list[Transfer]) -> dict:
    """The link the transfers saw, as the simulator prices one (seconds = bytes / bandwidth + latency): a least-squares
    line through (bytes, seconds); None where fewer than two sizes were moved."""
    b = np.array([t.bytes for t in transfers], float)
    s = np.array([t.end_s - t.start_s for t in transfers], float)
    if len(np.unique(b)) < 2:
        return {"bandwidth": None, "latency_s": None}
    slope, latency = np.polyfit(b, s, 1)
    return {"bandwidth": float(1 / slope) if slope > 0 else None, "latency_s": float(max(latency, 0.0))}

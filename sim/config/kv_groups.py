"""The KV cache groups of a hybrid model, as vLLM's hybrid KV cache manager forms them (kv_cache_utils.py,
`_get_kv_cache_groups_uniform_page_size`; model_executor/models/config.py, `HybridAttentionMambaModelConfig`).

Layers are grouped by attention kind; every group holds the same number of layers, `group_size`: the fewest layers of
any kind, or the most where that is under 1.5 times the fewest (gpt-oss: 18 full + 18 sliding -> 2 groups of 18;
Qwen3-Next: 12 full + 36 linear -> 1 + 3 groups of 12; Llama-4: 12 full + 36 chunked -> 1 + 3). All groups draw
from one pool of blocks, and a block is the same bytes in every group: `group_size` layers' pages of `block_size`
tokens (attention) or one state (linear). Where a linear layer's state is larger than an attention page, vLLM raises
the attention block size to the smallest multiple of 16 tokens whose page holds it, and pads the state to the page.
A linear group keeps one block per sequence (its block spans max_model_len); with prefix caching (vLLM's mamba
"align" mode) its blocks are block_size tokens and a sequence holds the state of its last block boundary.

A model of full attention alone (or MLA alone) has no groups here: its one group is the classic paged allocator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sim.config import layers
from sim.config.sharding import Sharding

KERNEL_BLOCK_ALIGNMENT = 16  # FlashAttention's block sizes are multiples of 16 tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVKind:
    """The groups of one attention kind."""

    kind: str  # full (MLA too) | sliding_window | chunked_local | linear
    window: int  # sliding_window: W; chunked_local: the chunk C; else 0
    layers: int  # the stage's layers of this kind
    groups: int  # KV cache groups of this kind (`group_size` layers each, the last padded)


@dataclass(frozen=True)
class KVGroups:
    """A hybrid model's KV cache groups on one device."""

    kinds: tuple[KVKind, ...]
    group_size: int  # layers a group holds
    block_size: int  # tokens a block of an attention group holds
    page_bytes: float  # one layer's block on one device (attention: block_size tokens; linear: its state, padded)
    bytes_per_token_layer: float  # one attention layer's K/V of one token on one device
    state_bytes: float  # one linear layer's state of one sequence on one device, unpadded (0: none)
    linear_block_tokens: int  # tokens a linear group's block spans: max_model_len, or block_size with prefix caching

    @property
    def block_bytes(self) -> float:
        """One block: `group_size` layers' pages."""
        return self.page_bytes * self.group_size

    @property
    def num_groups(self) -> int:
        return sum(k.groups for k in self.kinds)

    def peak_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once when a step computes up to `step_tokens` of it
        (vLLM's max_memory_usage_bytes of each spec): a full group its whole length, a sliding group its window and
        a step's tokens (+1: a window need not start at a block's start), a chunked group a chunk and a step's tokens,
        a linear group its state (two blocks while a boundary's state is kept, with prefix caching)."""
        bs, whole = self.block_size, cdiv(num_tokens, self.block_size)
        total = 0
        for k in self.kinds:
            if k.kind == "full":
                n = whole
            elif k.kind == "sliding_window":
                n = min(whole, cdiv(min(k.window - 1 + step_tokens, num_tokens), bs) + 1)
            elif k.kind == "chunked_local":
                n = min(whole, cdiv(min(k.window + step_tokens, num_tokens), bs) + 1)
            else:
                n = 1 if self.linear_block_tokens > bs else 2
            total += k.groups * n
        return total

    def bytes_per_token_by_kind(self) -> dict[str, float]:
        """One token's K/V on one device over each attention kind's layers (linear: 0, its state is per sequence)."""
        return {k.kind: (0.0 if k.kind == "linear" else k.layers * self.bytes_per_token_layer) for k in self.kinds}


def group_size(counts: list[int]) -> int:
    """Layers a group holds: the fewest of any kind, or the most where that is under 1.5 times the fewest."""
    fewest, most = min(counts), max(counts)
    return most if most < fewest * 1.5 else fewest


def stage_kinds(model, stage_layers: int) -> dict[tuple[str, int], int]:
    """(kind, window) -> layers of the first pipeline stage (as large as the largest); MLA is full attention."""
    counts: dict[tuple[str, int], int] = {}
    for layer in model.layers[:stage_layers]:
        a = layer.attention
        key = ("full" if a.kind == "mla" else a.kind, a.window)
        counts[key] = counts.get(key, 0) + 1
    return counts


def kv_groups(model, sharding: Sharding, block_size: int, max_model_len: int, prefix_caching: bool,
              stage_layers: int) -> KVGroups:
    """The groups of a hybrid model on one device of tensor-parallel `sharding` (ValueError naming what does not
    fit: linear heads that do not split over the ranks, a model with no attention layer)."""
    counts = stage_kinds(model, stage_layers)
    attention = next(layer.attention for layer in model.layers if layer.attention.kind != "linear") \
        if any(k != "linear" for k, _ in counts) else None
    if attention is None:
        raise ValueError("no attention layer in the stage: a model of linear-attention layers alone is not modelled")
    per_token = layers.kv_bytes_per_token(model, attention)
    per_token = per_token if attention.kind == "mla" else sharding.kv_bytes(per_token)
    state = 0.0
    if any(k == "linear" for k, _ in counts):
        tp = sharding.tp
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(model, key) % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide {key} ({getattr(model, key)}) of "
                                 f"{model.name}")
        state = layers.state_bytes(model, layers.Attention("linear")) / tp
        # the smallest attention block (a multiple of 16 tokens) whose page holds a linear state
        needed = KERNEL_BLOCK_ALIGNMENT * math.ceil(state / (KERNEL_BLOCK_ALIGNMENT * per_token))
        block_size = max(block_size, needed)
    size = group_size(list(counts.values()))
    kinds = tuple(KVKind(kind, window, n, cdiv(n, size)) for (kind, window), n in counts.items())
    linear_tokens = block_size if prefix_caching else max(max_model_len, block_size)
    return KVGroups(kinds, size, block_size, block_size * per_token, per_token, state, linear_tokens)

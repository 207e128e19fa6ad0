"""The KV cache of a model whose layers do not all cache the same thing, laid out as vLLM's hybrid KV cache manager
lays it out (kv_cache_utils `_get_kv_cache_groups_uniform_page_size`, `KVCacheTensor`).

Layers are grouped by attention kind (sim/config/kv_groups.py: every group holds `group_size` layers); the allocator
(sim/policy/hybrid_allocator.py) hands each request, per kind, a table of bundles: one block per group of that kind,
or None where the block was freed out of a window. Memory is `group_size` page tensors of `num_blocks` pages each;
layer j of every group shares tensor j, and a block id picks the same page in all of them, so the groups draw on one
pool as the allocator counts it. A page holds one layer's block:

- full, sliding-window or chunked-local attention: K and V of `block_size` tokens, [2, block_size, kv_heads, head_dim];
- latent attention (MLA): one latent and one rotary key a token, [block_size, kv_lora_rank + rope dim];
- linear attention (Gated DeltaNet): one sequence's state, its convolution columns then its recurrent matrix; a
  sequence reads the state of its last computed token and writes the state after the step's (`StateSlots`).

A model of one kind under the plain allocator (full attention with sinks or biases, MLA) is one group of every
layer, its tables the requests' `block_table`. The tensor is [slots, 1, num_blocks, page] so that whole blocks copy as
the runner copies them (`data[:, :, blocks]`: swap).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from executor.model.attention import AttentionMetadata, _token_positions
from executor.model.cache_engine import CacheTensor

ATTENTION_KINDS = ("full", "sliding_window", "chunked_local")


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer's blocks live: its kind (the allocator's kind index), its group among that kind's, and the
    page tensor it shares with the same position of the other groups."""

    kind: int
    group: int
    slot: int


@dataclass(frozen=True)
class CacheLayout:
    """The groups of a model's layers and the page each kind needs (elements of the cache's dtype)."""

    kinds: tuple[tuple[str, int], ...]  # (kind, window) in the allocator's order; MLA is "full"
    layers: tuple[LayerSlot, ...]
    group_size: int
    page_elements: int
    align: bool = False  # linear states kept per block of block_size tokens (prefix caching's "align" mode)

    @property
    def num_groups(self) -> dict[int, int]:
        """Groups of each kind."""
        out: dict[int, int] = {}
        for s in self.layers:
            out[s.kind] = max(out.get(s.kind, 0), s.group + 1)
        return out


def group_layers(layer_kinds: list[tuple[str, int]], group_size: int) -> tuple[tuple[tuple[str, int], ...],
                                                                                tuple[LayerSlot, ...]]:
    """Kinds in order of first appearance, and each layer's slot: a kind's layers fill its groups in layer order."""
    kinds = tuple(dict.fromkeys(layer_kinds))
    seen = dict.fromkeys(kinds, 0)
    slots = []
    for kind in layer_kinds:
        n = seen[kind]
        seen[kind] += 1
        slots.append(LayerSlot(kinds.index(kind), n // group_size, n % group_size))
    return kinds, tuple(slots)


class HybridKVCache(CacheTensor):
    """Page tensors of a hybrid model's KV cache (see the module docstring); `data` [slots, 1, num_blocks, page]."""

    hybrid = True

    def __init__(self, layout: CacheLayout, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.layout = layout
        self.block_size = block_size
        self.kv_dtype = None
        self.compute_dtype = dtype
        self.data = torch.zeros(layout.group_size, 1, num_blocks, layout.page_elements, dtype=dtype, device=device)

    def page(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s pages, [num_blocks, page elements] (a view)."""
        return self.data[self.layout.layers[layer].slot, 0]

    def write_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens' K and V [T, kv_heads, head_dim] at their flat slots; the layer's (K pool, V pool)."""
        kvh, d = k.shape[1], k.shape[2]
        pages = self.page(layer)[:, :2 * self.block_size * kvh * d].view(-1, 2, self.block_size, kvh, d)
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        pages[blocks, 0, offsets] = k.to(self.dtype)
        pages[blocks, 1, offsets] = v.to(self.dtype)
        return pages[:, 0], pages[:, 1]

    def latent_pool(self, layer: int, width: int) -> torch.Tensor:
        """An MLA layer's latents, [num_blocks, block_size, width] (a view)."""
        return self.page(layer)[:, :self.block_size * width].view(-1, self.block_size, width)

    def step_metadata(self, query_lens: list[int], context_lens: list[int], tables: list, device=None,
                      num_decode_rows: int | None = None) -> "HybridMetadata":
        """A step's metadata: each row's tables as the allocator keeps them (a request's `group_tables`, or under the
        plain allocator its `block_table`)."""
        return HybridMetadata(list(query_lens), list(context_lens), tables, self.block_size, self.layout,
                              torch.device(device or self.device), num_decode_rows)


@dataclass
class StateSlots:
    """Where each row of a step reads and writes its linear-attention state: `read` the block holding the state of
    its last computed token (-1: none yet, it starts from zeros), `write` the block to hold the state after it."""

    read: list[int]
    write: list[int]


@dataclass
class HybridMetadata:
    """One step over a hybrid cache: the rows' lengths, and per (kind, group) the attention metadata (block tables with
    freed entries as block 0, never read) or the state slots, made when a layer first asks."""

    query_lens: list[int]
    context_lens: list[int]
    tables: list
    block_size: int
    layout: CacheLayout
    device: torch.device
    num_decode_rows: int | None = None
    trees: dict = field(default_factory=dict)
    _per_group: dict = field(default_factory=dict, init=False, repr=False)

    @functools.cached_property
    def cu_query_lens(self) -> list[int]:
        return [0, *itertools.accumulate(self.query_lens)]

    def positions(self) -> torch.Tensor:
        return _token_positions(self.query_lens, self.context_lens, self.device)[1]

    def kind_tables(self, kind: int, group: int) -> list[list[int | None]]:
        """Each row's block ids of one group (None where freed or never taken)."""
        out = []
        for t in self.tables:
            if t and isinstance(t[0], list):  # a hybrid allocator's tables: per kind, bundles
                out.append([None if e is None else e[group] for e in t[kind]])
            else:  # the plain allocator's block table: one group of every layer
                out.append(list(t))
        return out

    def attention(self, kind: int, group: int) -> AttentionMetadata:
        """The attention metadata of one group of an attention kind."""
        key = ("attn", kind, group)
        if key not in self._per_group:
            tables = [[0 if b is None else b for b in t] for t in self.kind_tables(kind, group)]
            self._per_group[key] = AttentionMetadata.build(self.query_lens, self.context_lens, tables,
                                                           self.block_size, self.device, self.num_decode_rows)
        return self._per_group[key]

    def states(self, kind: int, group: int) -> StateSlots:
        """The state blocks of one linear-attention group: the entry of the last computed token is read, the entry of
        the step's last token written (one entry, the state, without prefix caching)."""
        key = ("state", kind, group)
        if key not in self._per_group:
            read, write = [], []
            for t, n, c in zip(self.kind_tables(kind, group), self.query_lens, self.context_lens):
                computed = c - n
                if self.layout.align:
                    old, new = (computed - 1) // self.block_size, (c - 1) // self.block_size
                else:
                    old = new = 0
                read.append(t[old] if computed else -1)
                write.append(t[new])
            if None in write or None in read:
                raise RuntimeError("a linear-attention state block was freed while its sequence needs it")
            self._per_group[key] = StateSlots(read, write)
        return self._per_group[key]

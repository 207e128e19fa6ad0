"""Attention over a paged KV cache for a flat, packed (varlen) batch of sequences.

A step packs the new tokens of several sequences into one flat batch of T tokens. Each
sequence contributes `query_len` new tokens (a whole prompt, a chunk of one, or 1 for a
decode) whose K/V have already been written to the cache; its `context_len` counts every
cached token after the step. A query at position p attends to cached positions 0..p.

Every backend has one signature, `backend(q [T, H, D], k_cache, v_cache, meta, scale)
-> [T, H, D]`, where the caches are one layer's block pools `[num_blocks, block_size,
num_kv_heads, D]` (or an int8 KV cache's `[.., num_kv_heads, D + 4]` rows, which every backend dequantizes as
it reads them). Sequences with a single query (decodes) are attended as one padded
batch; longer ones (prefills) one at a time, since padding a prompt batch wastes work. The sdpa
backend also batches short multi-token rows (speculative verify rows: a last token and its drafts), and on
a CPU attends decode and verify rows through the native paged kernel (executor/model/native.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from executor.model import native
from executor.model.cache_engine import dequantize_kv


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch (one entry per sequence, in token order).

    query_lens: new tokens of each sequence in this step (1 for a decode).
    context_lens: tokens of each sequence in the cache after this step (old + new).
    block_tables: physical block ids of each sequence, in logical order.
    slot_mapping: LongTensor[T], flat slot `block_id * block_size + offset` of each new token.
    block_size: tokens per block (block_size = max_model_len gives a contiguous cache).
    Derived index tensors are computed once per step and shared by all layers.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    block_size: int
    # speculative candidate trees: sequence -> [q, q] bool, which of its new tokens each one attends to
    # (itself and its ancestors) instead of all earlier ones; the engine sets them
    trees: dict = field(default_factory=dict, repr=False, compare=False)
    # the engine's rows: the first num_decode_rows sequences decode (one token, or a verify row: the last token
    # and its drafts), the rest are prompt chunks; None: rows of one token decode, longer ones are chunks
    num_decode_rows: int | None = None
    _per_step: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_sequences(self.query_lens, self.context_lens, self.block_tables, self.block_size)
        if self.slot_mapping.numel() != sum(self.query_lens):
            raise ValueError("slot_mapping needs one slot per new token")

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size, device=None,
              num_decode_rows: int | None = None) -> "AttentionMetadata":
        """Build metadata, deriving the slot mapping from the block tables."""
        _check_sequences(query_lens, context_lens, block_tables, block_size)
        seq, pos = _token_positions(query_lens, context_lens, device)
        slots = _padded_tables(block_tables, device)[seq, pos // block_size] * block_size + pos % block_size
        return cls(list(query_lens), list(context_lens), [list(b) for b in block_tables], slots, block_size,
                   num_decode_rows=num_decode_rows)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @functools.cached_property
    def cu_query_lens(self) -> list[int]:
        """Start offset of each sequence in the flat batch, plus the total at the end."""
        return [0, *itertools.accumulate(self.query_lens)]

    def positions(self) -> torch.Tensor:
        """LongTensor[T]: the position of each new token within its sequence."""
        return _token_positions(self.query_lens, self.context_lens, self.device)[1]

    def last_token_indices(self) -> torch.Tensor:
        """LongTensor[num_seqs]: row of each sequence's last new token (where logits are needed)."""
        return torch.tensor(self.cu_query_lens[1:], dtype=torch.long, device=self.device) - 1

    @functools.cached_property
    def decode_seqs(self) -> list[int]:
        """Sequences with a single query this step; they are batched together."""
        return [i for i, q in enumerate(self.query_lens) if q == 1]

    @functools.cached_property
    def prefill_seqs(self) -> list[int]:
        return [i for i, q in enumerate(self.query_lens) if q > 1]

    @functools.cached_property
    def verify_groups(self) -> list[tuple[int, list[int], torch.Tensor, torch.Tensor | None]]:
        """Multi-token rows short enough to attend batched, in groups of one call each: (n queries per row,
        sequences, the token row of each of the b·n query slots, which slots are real — None: all are).

        Where the first `num_decode_rows` sequences are the step's decode rows and some carry drafts
        (speculative verify rows), they attend in one group with the step's plain decodes, each row padded
        at its front to the longest one's n (a padding slot repeats its row's first token): one attention
        path per step, not a decode call beside a verify call. Other short rows (short prompt chunks, or
        verify rows when the decode rows are not marked) group by query length, unpadded."""
        groups, done = [], set()
        d = self.num_decode_rows or 0
        if any(q > 1 for q in self.query_lens[:d]) and max(self.query_lens[:d]) <= VERIFY_MAX_TOKENS:
            n, index, keep = max(self.query_lens[:d]), [], []
            for i in range(d):
                pad, first = n - self.query_lens[i], self.cu_query_lens[i]
                index += [first] * pad + list(range(first, first + self.query_lens[i]))
                keep += [False] * pad + [True] * self.query_lens[i]
            groups.append((n, list(range(d)), torch.tensor(index, dtype=torch.long, device=self.device),
                           torch.tensor(keep, dtype=torch.bool, device=self.device)))
            done = set(range(d))
        by_len: dict[int, list[int]] = {}
        for i, q in enumerate(self.query_lens):
            if 1 < q <= VERIFY_MAX_TOKENS and i not in done:
                by_len.setdefault(q, []).append(i)
        for n, seqs in sorted(by_len.items()):
            index = torch.tensor([self.cu_query_lens[i] + t for i in seqs for t in range(n)], device=self.device)
            groups.append((n, seqs, index, None))
        return groups

    @functools.cached_property
    def decode_token_index(self) -> torch.Tensor:
        return torch.tensor([self.cu_query_lens[i] for i in self.decode_seqs], dtype=torch.long, device=self.device)

    @functools.cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """LongTensor[B, max_blocks] of the decode sequences, padded with block 0 (masked by position)."""
        return _padded_tables([self.block_tables[i] for i in self.decode_seqs], self.device)

    @functools.cached_property
    def decode_context_lens(self) -> torch.Tensor:
        return torch.tensor([self.context_lens[i] for i in self.decode_seqs], dtype=torch.long, device=self.device)

    @functools.cached_property
    def decode_slots(self) -> torch.Tensor:
        """LongTensor[B, max_context]: cache slot of every context position of each decode sequence."""
        width = max(self.context_lens[i] for i in self.decode_seqs)
        pos = torch.arange(width, device=self.device)
        return self.decode_block_tables[:, pos // self.block_size] * self.block_size + pos % self.block_size

    @functools.cached_property
    def decode_buckets(self) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
        """The decode sequences in groups of similar context length, each attended as one padded batch:
        (rows into the decode batch or None for all of them in order, block tables [b, max_blocks] padded
        with block 0, context lens, key mask [b, 1, 1, width] or None when no key is padding, width: keys
        attended, the widest context rounded up to KEY_ALIGN — a contiguous cache's one big block is
        not read past it)."""
        return self.buckets_of(self.decode_seqs)

    def buckets_of(self, seqs: list[int]):
        """decode_buckets for any sequences (rows index into `seqs`); the mask is built for one query."""
        lens = [self.context_lens[i] for i in seqs]
        order = sorted(range(len(lens)), key=lambda j: -lens[j])
        groups = _buckets([lens[j] for j in order], self.block_size)
        if len(groups) == 1:
            order = list(range(len(lens)))  # one bucket: keep the batch order, no gather/scatter of rows
        out = []
        for start, end in groups:
            members = order[start:end]
            tables = _padded_tables([self.block_tables[seqs[j]] for j in members], self.device)
            ctx = torch.tensor([lens[j] for j in members], dtype=torch.long, device=self.device)
            width = _key_width(max(lens[j] for j in members), self.block_size, tables.shape[1])
            mask = None
            if any(lens[j] != width for j in members):
                mask = (torch.arange(width, device=self.device)[None, :] < ctx[:, None])[:, None, None, :]
            rows = None if len(groups) == 1 else torch.tensor(members, dtype=torch.long, device=self.device)
            out.append((rows, tables, ctx, mask, width))
        return out

    def once(self, key, make: Callable):
        """make() the first time a layer asks for `key`, the same object for every later layer of this step
        (index tensors and masks depend on the batch, not on the layer)."""
        if key not in self._per_step:
            self._per_step[key] = make()
        return self._per_step[key]

    def context_slots(self, seq: int) -> torch.Tensor:
        """LongTensor[context_len]: cache slot of every context position of sequence `seq`."""
        def make():
            pos = torch.arange(self.context_lens[seq], device=self.device)
            table = torch.tensor(self.block_tables[seq], dtype=torch.long, device=self.device)
            return table[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.once(("context_slots", seq), make)

    def query_positions(self, seq: int) -> torch.Tensor:
        """LongTensor[query_len]: positions of sequence `seq`'s new tokens."""
        c = self.context_lens[seq]
        return torch.arange(c - self.query_lens[seq], c, device=self.device)

    def visible(self, seq: int, width: int | None = None) -> torch.Tensor:
        """Bool [query_len, width] (default width: the context): which cached keys each new token of `seq`
        attends to — causal, or within a candidate tree only its ancestors."""
        c, n = self.context_lens[seq], self.query_lens[seq]
        mask = torch.arange(width or c, device=self.device)[None, :] <= self.query_positions(seq)[:, None]
        if seq in self.trees:
            mask[:, c - n:c] = self.trees[seq].to(self.device)
        return mask


# ---- shared helpers ---------------------------------------------------------------------


def _check_sequences(query_lens, context_lens, block_tables, block_size) -> None:
    n = len(query_lens)
    if len(context_lens) != n or len(block_tables) != n:
        raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
    for q, c, bt in zip(query_lens, context_lens, block_tables):
        if not 1 <= q <= c:
            raise ValueError(f"need 1 <= query_len <= context_len, got {q}, {c}")
        if len(bt) * block_size < c:
            raise ValueError(f"block table of {len(bt)} blocks cannot hold {c} tokens")


# Switch off to attend prompt, decode and verify rows through gathered K/V and SDPA even where the native kernels
# are built.
USE_NATIVE_ATTENTION = True
# Multi-token rows up to this long attend batched, like decodes (speculative verify rows); longer ones are
# prompts, attended one at a time.
VERIFY_MAX_TOKENS = 16
# A bucket costs about as much fixed work as attending this many padded keys more per sequence.
BUCKET_OVERHEAD_TOKENS = 512
# Decode keys are padded to a multiple of this (or of the block size, if smaller).
KEY_ALIGN = 16
# Decode and verify rows attend through batched GEMMs over all keys instead of SDPA: on a GPU (None), always (True)
# or never (False). SDPA's fused kernels give each (row, kv head) one thread block that walks every key, which
# leaves a GPU nearly idle for a few query rows (H200, a batch-1 graph step: 3.9 / 5.5 / 10 ms at 256 / 1024 /
# 2048 keys).
GEMM_ROW_ATTENTION = None


def masked_attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of q [b, kvh, r, D] over k, v [b, kvh, W, D] where `mask` (bool, broadcastable to [b, kvh, r, W],
    True: attend; None: all keys) allows, as two batched GEMMs over all keys and a softmax."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def attend_rows(q, k, v, mask, scale) -> torch.Tensor:
    """Decode or verify rows (q [b, kvh, r, D], a few query rows per kv head) over their gathered keys: SDPA, or on a
    GPU (see GEMM_ROW_ATTENTION) masked_attention."""
    if GEMM_ROW_ATTENTION or (GEMM_ROW_ATTENTION is None and q.is_cuda):
        return masked_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _key_width(max_len: int, block_size: int, num_blocks: int) -> int:
    """Keys a padded decode batch attends: its longest context rounded up to the alignment, at most
    its blocks' capacity."""
    align = min(KEY_ALIGN, block_size)
    return min(num_blocks * block_size, -(-max_len // align) * align)


def _buckets(lens_desc: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split context lengths (sorted descending) into contiguous groups minimising the padded keys a
    bucket-per-call attention reads, Σ (size · widest, aligned) + BUCKET_OVERHEAD_TOKENS per call."""
    n = len(lens_desc)
    align = min(KEY_ALIGN, block_size)
    width = [-(-c // align) * align for c in lens_desc]
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # group i..j-1, widest is lens_desc[i]
            c = best[i] + BUCKET_OVERHEAD_TOKENS + (j - i) * width[i]
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def _token_positions(query_lens, context_lens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position) of every new token, vectorized over the batch."""
    q = torch.tensor(query_lens, dtype=torch.long, device=device)
    first = torch.tensor(context_lens, dtype=torch.long, device=device) - q
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=device), q)
    offset = torch.arange(seq.numel(), device=device) - (torch.cumsum(q, 0) - q)[seq]
    return seq, first[seq] + offset


def _padded_tables(block_tables, device) -> torch.Tensor:
    """LongTensor[num_seqs, max_blocks], short tables padded with block 0."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Copy the K or V rows at `slots` (any shape) out of a block pool -> [*slots.shape, kvh, D] (an int8 pool's
    rows dequantized to `dtype`)."""
    return dequantize_kv(cache.view(-1, cache.shape[-2], cache.shape[-1])[slots], dtype)


def _group(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, L, H, D] -> [B, kvh, L*G, D]: the G query heads sharing a kv head become extra rows,
    so GQA/MQA is a plain batched matmul against the unrepeated K/V."""
    b, l, h, d = q.shape  # noqa: E741 (batch, length, heads, dim)
    g = h // num_kv_heads
    return q.view(b, l, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, l * g, d)


def _ungroup(o: torch.Tensor, length: int) -> torch.Tensor:
    """[B, kvh, L*G, D] -> [B, L, H, D], inverse of `_group`."""
    b, kvh, rows, d = o.shape
    return o.view(b, kvh, length, rows // length, d).permute(0, 2, 1, 3, 4).reshape(b, length, -1, d)


def _native_rows(meta: AttentionMetadata, n: int, seqs: list[int]):
    """(block tables [b, max_blocks], context lens [b], visibility [b, n, n] or None) of rows of n query slots
    for the native kernel: a row's real queries are its last query_len slots; candidate trees replace the
    causal pattern among its new tokens."""
    tables = _padded_tables([meta.block_tables[i] for i in seqs], meta.device)
    lens = torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.long, device=meta.device)
    visible = None
    if any(i in meta.trees for i in seqs):
        visible = torch.ones(n, n, dtype=torch.bool).tril().repeat(len(seqs), 1, 1)
        for j, i in enumerate(seqs):
            if i in meta.trees:
                m = meta.query_lens[i]
                visible[j, n - m:, n - m:] = meta.trees[i].to("cpu")
        visible = visible.to(torch.uint8)
    return tables, lens, visible


def _native_prefill(meta: AttentionMetadata, seqs: list[int]):
    """(first token, query length, context length, padded block table) of each prompt row for the native
    prefill kernel."""
    def longs(xs):
        return torch.tensor(xs, dtype=torch.long, device=meta.device)
    return (longs([meta.cu_query_lens[i] for i in seqs]), longs([meta.query_lens[i] for i in seqs]),
            longs([meta.context_lens[i] for i in seqs]),
            _padded_tables([meta.block_tables[i] for i in seqs], meta.device))


def _native_decodes(qd: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The step's decode rows qd [B, H, D], in decode order, through the native paged kernel."""
    return native.paged_attention(qd.contiguous()[:, None], k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_context_lens, scale)[:, 0]


def _no_trees(meta: AttentionMetadata, name: str) -> None:
    if meta.trees:
        raise NotImplementedError(f"the {name} backend has no tree attention; Medusa verifies with sdpa or naive")


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.shape[1] % k_cache.shape[-2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[-2]} kv heads")


def _per_group(q, meta, attend_prefill, attend_decodes, attend_verifies=None, attend_prefills=None) -> torch.Tensor:
    """Run a backend's prefill path per multi-token sequence and its decode path once for all
    single-token sequences, scattering results back into token order. With `attend_verifies`, short
    multi-token sequences go to it instead, one call per group of `meta.verify_groups` (which may take
    the decodes too). With `attend_prefills(seqs, out)`, the prefills go to it in one call instead."""
    out = torch.empty_like(q)
    batched = set()
    if attend_verifies is not None:
        for n, seqs, index, keep in meta.verify_groups:
            o = attend_verifies(q[index], n, seqs)
            if keep is None:
                out[index] = o
            else:  # only the decode group pads; its real slots as positions once per step, not a mask per layer
                kept = meta.once("verify_kept_slots", lambda: keep.nonzero().squeeze(1))
                out[meta.once("verify_real_rows", lambda: index[kept])] = o[kept]
            batched.update(seqs)
    prefills = [i for i in meta.prefill_seqs if i not in batched]
    if attend_prefills is not None and prefills:
        attend_prefills(prefills, out)
    else:
        for i in prefills:
            s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
            out[s:e] = attend_prefill(q[s:e], i)
    if meta.decode_seqs and not batched.issuperset(meta.decode_seqs):
        b = len(meta.decode_seqs)
        if meta.decode_seqs[-1] == b - 1:  # the decodes lead the batch (the engine's order): a slice
            out[:b] = attend_decodes(q[:b])
        else:
            idx = meta.decode_token_index
            out[idx] = attend_decodes(q[idx])
    return out


# ---- naive --------------------------------------------------------------------------------


def naive_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None):
    """Reference: per sequence, gather K/V, repeat kv heads, full masked score matrix, softmax."""
    _check_heads(q, k_cache)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k_cache.shape[-2]
    out = torch.empty_like(q)
    for i in range(len(meta.query_lens)):
        s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
        slots = meta.context_slots(i)
        k = _gather(k_cache, slots, q.dtype).repeat_interleave(group, dim=1)  # [S, H, D]
        v = _gather(v_cache, slots, q.dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[s:e].float(), k.float()) * scale
        probs = scores.masked_fill(~meta.visible(i), float("-inf")).softmax(dim=-1)
        out[s:e] = torch.einsum("hls,shd->lhd", probs, v.float()).to(q.dtype)
    return out


# ---- sdpa ---------------------------------------------------------------------------------


class _SdpaStep:
    """One layer's attention over the K/V pool as sdpa_attention runs it: prompt rows, decode rows and verify rows
    each their own way, over the same queries, pool and metadata."""

    __slots__ = ("q", "k_cache", "v_cache", "meta", "scale", "kvh", "group", "use_native")

    def __init__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kvh: int, group: int,
                 use_native: bool):
        self.q, self.k_cache, self.v_cache, self.meta, self.scale = q, k_cache, v_cache, meta, scale
        self.kvh, self.group, self.use_native = kvh, group, use_native

    def prefill(self, qs, i):
        """Attention of one prompt (or chunk, or candidate tree) `qs` over its sequence's gathered context."""
        slots = self.meta.context_slots(i)
        k = _gather(self.k_cache, slots, self.q.dtype)  # [S, kvh, D]
        v = _gather(self.v_cache, slots, self.q.dtype)
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        qt, k, v = qs[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2)  # [1, H, L|S, D]
        length, ctx = qs.shape[0], slots.numel()
        if length == ctx and i not in self.meta.trees:
            o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=self.scale)
        else:
            # Chunked prefill: causal mask aligned to the bottom-right (queries are the last L positions).
            o = F.scaled_dot_product_attention(qt, k, v, attn_mask=self.meta.visible(i), scale=self.scale)
        return o[0].transpose(0, 1)

    def gather(self, tables, width):
        """K and V [b, kvh, width, D] of the sequences whose block tables are `tables` [b, blocks]."""
        b = tables.shape[0]
        if tables.shape[1] == 1:  # one block per sequence (a contiguous cache): read only `width` keys of it
            k = self.k_cache[:, :width].index_select(0, tables[:, 0])
            v = self.v_cache[:, :width].index_select(0, tables[:, 0])
        else:
            # whole blocks of every sequence, padded to the bucket's widest table; the blocks are rows of a
            # 2-D view, so index_select copies each with one memcpy (on the 4-D pool it dispatches a copy per
            # block, ~10x slower)
            flat = tables.view(-1)
            full = tables.shape[1] * self.meta.block_size
            k_cache, v_cache, kvh = self.k_cache, self.v_cache, self.kvh
            k = k_cache.view(k_cache.shape[0], -1).index_select(0, flat).view(b, full, kvh, -1)[:, :width]
            v = v_cache.view(v_cache.shape[0], -1).index_select(0, flat).view(b, full, kvh, -1)[:, :width]
        return dequantize_kv(k, self.q.dtype).transpose(1, 2), dequantize_kv(v, self.q.dtype).transpose(1, 2)

    def verify_buckets(self, n, seqs):
        """Per bucket of verify rows: (rows, block tables, key mask [b, 1, n·G, width] under which each query
        sees the context up to its own position, or within a candidate tree only its ancestors, width).
        Rows are padded at the front to n queries; a padding query sees the context up to the position
        before its row's first (at least position 0), so its softmax stays finite, and is dropped."""
        out = []
        for rows, tables, lens, _, width in self.meta.buckets_of(seqs):
            b = tables.shape[0]
            positions = torch.arange(n, device=self.q.device)[None, :]
            last = (lens[:, None] - n + positions).clamp_(min=0)  # query positions
            mask = torch.arange(width, device=self.q.device)[None, None, :] <= last[:, :, None]  # [b, n, width]
            for j, m in enumerate(range(b) if rows is None else rows.tolist()):
                if seqs[m] in self.meta.trees:  # a candidate tree: each node sees the context and its ancestors
                    mask[j, n - self.meta.query_lens[seqs[m]]:] = self.meta.visible(seqs[m], width)
            g = self.group
            out.append((rows, tables, mask[:, :, None, :].expand(b, n, g, width).reshape(b, 1, n * g, width), width))
        return out

    def verifies(self, qv, n, seqs):
        """Rows of n queries each ([b·n, H, D], sequence-major): the G query heads sharing a kv head and the
        n positions become n·G query rows of one SDPA call per bucket, under a causal mask aligned to the
        end of each context."""
        if self.use_native:
            tables, lens, visible = self.meta.once(("native_rows", seqs[0], n),
                                                   lambda: _native_rows(self.meta, n, seqs))
            o = native.paged_attention(qv.contiguous().view(len(seqs), n, *qv.shape[1:]), self.k_cache, self.v_cache,
                                       tables, lens, self.scale, visible)
            return o.view(qv.shape)
        out = torch.empty_like(qv).view(len(seqs), n, -1, qv.shape[-1])
        qs = qv.view(len(seqs), n, self.kvh, self.group, -1)
        buckets = self.meta.once(("verify_buckets", seqs[0], self.group), lambda: self.verify_buckets(n, seqs))
        for rows, tables, mask, width in buckets:
            b = tables.shape[0]
            k, v = self.gather(tables, width)
            qb = qs if rows is None else qs[rows]
            qg = qb.permute(0, 2, 1, 3, 4).reshape(b, self.kvh, n * self.group, -1)
            o = attend_rows(qg, k, v, mask, self.scale)
            o = o.view(b, self.kvh, n, self.group, -1).permute(0, 2, 1, 3, 4).reshape(b, n, -1, qv.shape[-1])
            if rows is None:
                return o.reshape(qv.shape)
            out[rows] = o
        return out.view(qv.shape)

    def decodes(self, qd):
        """Decode rows, one padded SDPA call per bucket of similar context length (or the native paged kernel)."""
        if self.use_native:
            return _native_decodes(qd, self.k_cache, self.v_cache, self.meta, self.scale)
        buckets = self.meta.decode_buckets
        out = torch.empty_like(qd) if len(buckets) > 1 else None
        for rows, tables, lens, mask, width in buckets:
            b = tables.shape[0]
            k, v = self.gather(tables, width)
            qb = qd if rows is None else qd[rows]
            qg = qb.view(b, self.kvh, self.group, -1)  # the G query heads sharing a kv head are G query rows
            o = attend_rows(qg, k, v, mask, self.scale).reshape(b, -1, qd.shape[-1])
            if out is None:
                return o
            out[rows] = o
        return out

    def prefills(self, seqs, out):
        """Whole prompts and chunks in one native call; a candidate tree (never a prompt) keeps its mask."""
        plain = [i for i in seqs if i not in self.meta.trees]
        for i in seqs:
            if i in self.meta.trees:
                s, e = self.meta.cu_query_lens[i], self.meta.cu_query_lens[i + 1]
                out[s:e] = self.prefill(self.q[s:e], i)
        if plain:
            starts, lens, ctx, tables = self.meta.once(("native_prefill", tuple(plain)),
                                                       lambda: _native_prefill(self.meta, plain))
            native.prefill_attention(self.q, out, self.k_cache, self.v_cache, starts, lens, ctx, tables, self.scale)


def sdpa_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None):
    """torch SDPA on gathered K/V: one call per prefill, one padded call per bucket of decodes of similar
    context length (padding every decode to the longest context wastes the gather and the attention).
    On a CPU with the native kernels built (fp32), decode and verify rows instead go to the native paged
    kernel, which reads the pool in place through the block tables (no gather), and a step's prompts to the
    native flash-style prefill kernel in one call (2-4x torch's flash SDPA on 40-1000-token prompts).

    Inputs are 4-D with the kv heads repeated: that is what takes torch's fused (flash) CPU kernel;
    `enable_gqa` or 3-D inputs fall back to the math path, which builds the whole score matrix."""
    _check_heads(q, k_cache)
    kvh = k_cache.shape[-2]
    group = q.shape[1] // kvh
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    use_native = USE_NATIVE_ATTENTION and q.dtype == torch.float32 and native.kv_pool_usable(k_cache) \
        and native.kv_pool_usable(v_cache)
    if use_native and not meta.prefill_seqs:  # decodes only (most steps): one kernel call, nothing to regroup
        return _native_decodes(q, k_cache, v_cache, meta, scale)
    step = _SdpaStep(q, k_cache, v_cache, meta, scale, kvh, group, use_native)

    native_prefill = use_native and q.is_contiguous() and q.shape[-1] in native.PREFILL_HEAD_DIMS
    if native_prefill and not meta.trees:
        # chain verify rows are short causal prompts to the prefill kernel, which takes them at their own lengths
        # (no padding) 1.5-2x faster than the paged kernel's rows of n slots; plain decodes stay on the latter
        return _per_group(q, meta, step.prefill, step.decodes, None, step.prefills)
    return _per_group(q, meta, step.prefill, step.decodes, step.verifies, step.prefills if native_prefill else None)


# ---- online softmax (flash and paged) -------------------------------------------------------


def _online_softmax(q, row_pos, key_tiles, scale):
    """FlashAttention's running max / running sum over key tiles; never holds the full scores.

    q: [B, kvh, R, D] grouped queries; row_pos: [B, R] position of each query row.
    key_tiles: iterable of (k [B, kvh, t, D], v [B, kvh, t, D], key_pos [t]) starting at key 0,
    so every row sees a finite max after the first tile and later fully-masked tiles add zero.
    """
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row_max = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    row_sum = torch.zeros(q.shape[:-1], device=q.device)
    qf = q.float()
    for k, v, key_pos in key_tiles:
        scores = qf @ k.float().transpose(-1, -2) * scale  # [B, kvh, R, t]
        scores.masked_fill_((key_pos[None, :] > row_pos[:, :, None])[:, None], float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        correction = torch.exp(row_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        row_sum = row_sum * correction + p.sum(dim=-1)
        acc = acc * correction[..., None] + p @ v.float()
        row_max = new_max
    return (acc / row_sum[..., None]).to(q.dtype)


def flash_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None, tile_size: int = 128):
    """Tiled FlashAttention in torch: query tiles x key tiles of `tile_size`, online softmax,
    key tiles past a query tile's last position skipped (causal)."""
    _check_heads(q, k_cache)
    _no_trees(meta, "flash")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kvh = k_cache.shape[-2]
    group = q.shape[1] // kvh

    def tiles(k, v, stop):
        for s in range(0, stop, tile_size):
            e = min(s + tile_size, stop)
            yield k[:, :, s:e], v[:, :, s:e], torch.arange(s, e, device=q.device)

    def prefill(qs, i):
        slots = meta.context_slots(i)
        k = _gather(k_cache, slots, q.dtype).transpose(0, 1)[None]  # [1, kvh, S, D]
        v = _gather(v_cache, slots, q.dtype).transpose(0, 1)[None]
        pos = meta.query_positions(i)
        out = torch.empty_like(qs)
        for s in range(0, qs.shape[0], tile_size):
            e = min(s + tile_size, qs.shape[0])
            row_pos = pos[s:e].repeat_interleave(group)[None]
            last = meta.context_lens[i] - qs.shape[0] + e  # causal: later keys are unseen by this query tile
            o = _online_softmax(_group(qs[None, s:e], kvh), row_pos, tiles(k, v, last), scale)
            out[s:e] = _ungroup(o, e - s)[0]
        return out

    def decodes(qd):
        slots = meta.decode_slots
        k = _gather(k_cache, slots, q.dtype).transpose(1, 2)  # [B, kvh, S, D]
        v = _gather(v_cache, slots, q.dtype).transpose(1, 2)
        row_pos = (meta.decode_context_lens - 1)[:, None].expand(-1, group)
        return _ungroup(_online_softmax(_group(qd[:, None], kvh), row_pos, tiles(k, v, slots.shape[1]), scale), 1)[:, 0]

    return _per_group(q, meta, prefill, decodes)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None):
    """PagedAttention in torch: walk the block table, each block is a key tile of the online
    softmax; no contiguous copy of a sequence's K/V is made. A prefill reads its blocks as
    views of the pool; the decode batch loads block j of every sequence per tile."""
    _check_heads(q, k_cache)
    _no_trees(meta, "paged")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kvh, bs = k_cache.shape[-2], meta.block_size
    group = q.shape[1] // kvh

    def prefill(qs, i):
        ctx = meta.context_lens[i]
        table = meta.block_tables[i]

        def blocks():
            for j in range(math.ceil(ctx / bs)):
                n = min(bs, ctx - j * bs)  # last block may be partly filled
                # a view into the pool ([1, kvh, n, D]; an int8 pool's block dequantized)
                k = dequantize_kv(k_cache[table[j], :n], q.dtype).transpose(0, 1)[None]
                v = dequantize_kv(v_cache[table[j], :n], q.dtype).transpose(0, 1)[None]
                yield k, v, torch.arange(j * bs, j * bs + n, device=q.device)

        row_pos = meta.query_positions(i).repeat_interleave(group)[None]
        return _ungroup(_online_softmax(_group(qs[None], kvh), row_pos, blocks(), scale), qs.shape[0])[0]

    def decodes(qd):
        tables = meta.decode_block_tables  # [B, max_blocks]
        ctx = meta.decode_context_lens
        max_ctx = max(meta.context_lens[i] for i in meta.decode_seqs)

        def blocks():
            for j in range(math.ceil(max_ctx / bs)):
                n = min(bs, max_ctx - j * bs)
                # One block per sequence per tile, like a kernel loading block j of every sequence.
                k = dequantize_kv(k_cache[tables[:, j], :n], q.dtype).transpose(1, 2)
                v = dequantize_kv(v_cache[tables[:, j], :n], q.dtype).transpose(1, 2)
                yield k, v, torch.arange(j * bs, j * bs + n, device=q.device)

        row_pos = (ctx - 1)[:, None].expand(-1, group)
        return _ungroup(_online_softmax(_group(qd[:, None], kvh), row_pos, blocks(), scale), 1)[:, 0]

    return _per_group(q, meta, prefill, decodes)


# ---- registry -----------------------------------------------------------------------------

AttentionBackend = Callable[..., torch.Tensor]

BACKENDS: dict[str, AttentionBackend] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
    "paged": paged_attention,
}


def get_backend(name: str, **options) -> AttentionBackend:
    """Return the backend called `name`, with `options` (e.g. flash's tile_size) bound."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    fn = BACKENDS[name]
    return functools.partial(fn, **options) if options else fn

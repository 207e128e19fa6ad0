"""Attention of one layer kind over its paged K/V, in torch: full, sliding-window or chunked-local, with learned sinks.

A query at position p attends keys [lo(p), p]: lo = 0 (full), p - W + 1 (a sliding window of W tokens, itself
included), p // C · C (its own chunk of C tokens). Only the blocks holding those keys are read: the allocator frees
the ones before (sim/policy/hybrid_allocator.py), and their table entries may name blocks other sequences now hold.
Sinks (gpt-oss): one learned logit per head joins every query's softmax as an extra column that takes probability and
gives no value. Decode rows attend as one padded batch (each row's first needed block onwards); longer rows (prompt
chunks) one at a time, in query tiles so a long prompt never holds its whole score matrix.
"""
from __future__ import annotations

import torch

from executor.model.attention import AttentionMetadata

QUERY_TILE = 256  # prompt queries attended at once


def lowest_key(kind: str, window: int, position: torch.Tensor | int):
    """The first key position a query at `position` attends."""
    if kind == "sliding_window":
        return (position - window + 1).clamp(min=0) if torch.is_tensor(position) else max(0, position - window + 1)
    if kind == "chunked_local":
        return position // window * window
    return position * 0 if torch.is_tensor(position) else 0


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [..., heads-shaped prefix, q, L], with each head's sink logit (broadcast
    from `sinks`, shaped like scores but for the last two dims) as one more column, dropped after."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.expand(*scores.shape[:-1], 1).to(scores.dtype)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def _gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """K or V rows of the blocks `tables` [b, n] names, [b, n·block_size, kv_heads, D]."""
    b, n = tables.shape
    return pool[tables.reshape(-1)].reshape(b, n * pool.shape[1], *pool.shape[2:])


def kind_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                   scale: float, kind: str = "full", window: int = 0, sinks: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Attention output [T, heads, Dv] of the step's queries q [T, heads, D] over the pools ([blocks, block_size,
    kv_heads, D] and [.., Dv]) through `meta`'s block tables, for a layer of `kind` (window: W or the chunk C)."""
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    decodes = meta.decode_seqs
    if decodes:
        rows = meta.decode_token_index
        out[rows] = _decode_rows(q[rows], k_pool, v_pool, meta, decodes, scale, kind, window, sinks)
    for i in meta.prefill_seqs:
        s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
        out[s:e] = _prompt_row(q[s:e], k_pool, v_pool, meta, i, scale, kind, window, sinks)
    return out


def _decode_rows(q, k_pool, v_pool, meta: AttentionMetadata, seqs: list[int], scale, kind, window, sinks):
    """One query a row, every row's needed blocks gathered into one padded batch."""
    bs, dev = meta.block_size, q.device
    ctx = [meta.context_lens[i] for i in seqs]
    first = [lowest_key(kind, window, c - 1) // bs for c in ctx]
    width = max((c - 1) // bs - f + 1 for c, f in zip(ctx, first))
    tables = torch.tensor([(meta.block_tables[i][f:f + width] + [0] * width)[:width] for i, f in zip(seqs, first)],
                          dtype=torch.long, device=dev)
    k, v = _gather_blocks(k_pool, tables), _gather_blocks(v_pool, tables)  # [b, L, kvh, D]
    b, kvh = len(seqs), k.shape[2]
    pos = torch.tensor(first, device=dev)[:, None] * bs + torch.arange(width * bs, device=dev)[None]
    last = torch.tensor(ctx, device=dev)[:, None] - 1
    mask = (pos <= last) & (pos >= lowest_key(kind, window, last))  # [b, L]
    qg = q.view(b, kvh, -1, q.shape[-1])  # the heads sharing a kv head: rows of one product
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).mul_(scale)  # [b, kvh, G, L]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    p = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, kvh, -1, 1))
    return torch.matmul(p, v.transpose(1, 2)).reshape(b, q.shape[1], -1)


def _prompt_row(q, k_pool, v_pool, meta: AttentionMetadata, i: int, scale, kind, window, sinks):
    """A prompt chunk's queries [n, heads, D] over the keys they attend, a tile of queries at a time."""
    bs, dev = meta.block_size, q.device
    n, c = q.shape[0], meta.context_lens[i]
    out = q.new_empty(n, q.shape[1], v_pool.shape[-1])
    table = meta.block_tables[i]
    for s in range(0, n, QUERY_TILE):
        e = min(n, s + QUERY_TILE)
        first_pos, last_pos = c - n + s, c - n + e - 1
        fb, lb = lowest_key(kind, window, first_pos) // bs, last_pos // bs
        blocks = torch.tensor(table[fb:lb + 1], dtype=torch.long, device=dev)
        k = k_pool[blocks].flatten(0, 1)  # [L, kvh, D]
        v = v_pool[blocks].flatten(0, 1)
        kvh = k.shape[1]
        pos = fb * bs + torch.arange(k.shape[0], device=dev)
        qpos = torch.arange(first_pos, last_pos + 1, device=dev)[:, None]
        mask = (pos[None] <= qpos) & (pos[None] >= lowest_key(kind, window, qpos))  # [q, L]
        qg = q[s:e].view(e - s, kvh, -1, q.shape[-1]).permute(1, 2, 0, 3)  # [kvh, G, q, D]
        scores = torch.matmul(qg, k.permute(1, 2, 0)[:, None]).mul_(scale)  # [kvh, G, q, L]
        scores.masked_fill_(~mask, float("-inf"))
        p = softmax_with_sinks(scores, None if sinks is None else sinks.view(kvh, -1, 1, 1))
        o = torch.matmul(p, v.permute(1, 0, 2)[:, None])  # [kvh, G, q, Dv]
        out[s:e] = o.permute(2, 0, 1, 3).reshape(e - s, q.shape[1], -1)
    return out

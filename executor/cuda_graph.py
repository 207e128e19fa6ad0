"""Engine steps replayed from CUDA graphs (what vLLM and nano-vllm do for decodes): on a GPU a small model's step is
thousands of tiny kernel launches from Python and a dozen small uploads, so the host, not the GPU, sets its time
(measured on an H200: 17.8 ms a batch-1 decode step, the GPU busy 2.5 ms of it). A graph launches the whole
forward at once.

Three kinds of step are captured: plain decode steps (one token per row, up to max_num_seqs rows), steps of one
prompt or prompt chunk alone (up to the step's token budget), and — with speculative decoding by chains of drafts
(prompt lookup, a draft model) — decode steps whose rows carry drafts, every row padded at its front to
num_speculative_tokens + 1 tokens. Candidate trees (Medusa) and steps mixing prompts with decodes run eagerly. A graph has fixed shapes and fixed addresses, so a
step is run padded to the next captured size (rows, or prompt tokens) and key width: its tokens, positions, slots,
context lengths and block tables are written into static buffers (one upload from pinned memory) and the graph
captured over those buffers is replayed. A padding row repeats a real one exactly — row 0 of a batch, the last
token of a prompt, the first token of a verify row: same token, position, slot, keys — so it computes and writes the same K/V into the same
slot and the cache is unchanged by it. Attention reads a row's blocks whole, up to the captured width, under a
mask of its context (and, for a prompt, of each token's position).

Off the GPU (`capture=False`) the same static-shape forward runs eagerly: the tests check on the CPU that it
gives what the engine's own path gives.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from executor.attention import masked_attention
from executor.kv_cache import KVCache

# Batch sizes captured (nano-vllm's choice), cut at the engine's max_num_seqs, which is always one of them.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Prompt tokens captured for a step of one prompt (or chunk), doubling, cut at the step's token budget.
PROMPT_SIZES = tuple(16 * 2 ** i for i in range(12))
# Key widths captured: from this many tokens up, doubling, up to max_model_len (always one of them): a step pads
# its keys to at most twice its longest context.
MIN_WIDTH = 256


@dataclass
class GraphMeta:
    """What the model's layers read about a graph step: the slots its tokens' K/V go to, per row the block table
    (its first `width / block_size` blocks) and context length the attention masks by, and for a prompt step each
    token's position (a token sees the keys up to its own)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    width: int
    positions: torch.Tensor | None = None


def _keys(cache: torch.Tensor, meta: GraphMeta) -> torch.Tensor:
    """K or V of each row's first `meta.width` cache positions -> [rows, kvh, width, D]."""
    rows, kvh, d = meta.block_tables.shape[0], cache.shape[-2], cache.shape[-1]
    tables = meta.block_tables[:, :meta.width // meta.block_size].reshape(-1)
    return cache.view(cache.shape[0], -1).index_select(0, tables).view(rows, meta.width, kvh, d).transpose(1, 2)


def graph_decode_attention(q, k_cache, v_cache, meta: GraphMeta, scale: float | None = None):
    """One query per row [b, H, D] against that row's keys up to `meta.width`, masked by its context length: every
    shape fixed by (b, width), nothing read back to the host."""
    b, h, d = q.shape
    kvh = k_cache.shape[-2]
    visible = (torch.arange(meta.width, device=q.device)[None, :] < meta.context_lens[:, None])[:, None, None, :]
    o = masked_attention(q.reshape(b, kvh, h // kvh, d), _keys(k_cache, meta), _keys(v_cache, meta), visible,
                         d ** -0.5 if scale is None else scale)
    return o.reshape(b, h, d)


def graph_prompt_attention(q, k_cache, v_cache, meta: GraphMeta, scale: float | None = None):
    """The T tokens of one prompt or chunk [T, H, D] against its keys up to `meta.width`, each token seeing the
    keys up to its own position (block_tables and context_lens have the one row)."""
    t, h, d = q.shape
    kvh = k_cache.shape[-2]
    g = h // kvh
    visible = torch.arange(meta.width, device=q.device)[None, :] <= meta.positions[:, None]  # [T, width]
    qg = q.reshape(t, kvh, g, d).permute(1, 0, 2, 3).reshape(1, kvh, t * g, d)  # rows (token, query head)
    mask = visible[:, None, :].expand(t, g, meta.width).reshape(1, 1, t * g, meta.width)
    o = masked_attention(qg, _keys(k_cache, meta), _keys(v_cache, meta), mask, d ** -0.5 if scale is None else scale)
    return o.view(kvh, t, g, d).permute(1, 0, 2, 3).reshape(t, h, d)


def graph_verify_attention(q, k_cache, v_cache, meta: GraphMeta, scale: float | None = None):
    """Rows of n tokens each — a decode row's last token and its drafts, padded at the front [b·n, H, D] — against
    the row's keys up to `meta.width`, each token seeing the keys up to its own position."""
    b = meta.block_tables.shape[0]
    t, h, d = q.shape
    n, kvh = t // b, k_cache.shape[-2]
    g = h // kvh
    visible = torch.arange(meta.width, device=q.device)[None, None, :] <= meta.positions.view(b, n)[:, :, None]
    qg = q.reshape(b, n, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, n * g, d)
    mask = visible[:, :, None, :].expand(b, n, g, meta.width).reshape(b, 1, n * g, meta.width)
    o = masked_attention(qg, _keys(k_cache, meta), _keys(v_cache, meta), mask, d ** -0.5 if scale is None else scale)
    return o.view(b, kvh, n, g, d).permute(0, 2, 1, 3, 4).reshape(t, h, d)


def _sizes(limit: int, candidates) -> list[int]:
    out = [c for c in candidates if c < limit]
    return out + [limit]


# Captured sets kept per model (graphs bake in the weights' addresses): the profile sweep builds ~140 engines
# of a handful of shapes, each with a fresh KV cache that the allocator puts where the last one was.
MAX_CACHED = 16


def step_graphs(model, kv_cache: KVCache, cfg, capture: bool = True, verify: bool = False) -> "StepGraphs":
    """The model's captured graphs for this KV cache and these scheduler limits (a SchedulerConfig; `verify`: chains
    of up to cfg.num_speculative_tokens drafts are verified too): reused when an earlier engine's cache had the same
    shape at the same address (its graphs then read and write this one), else captured now — while the cache is
    still empty, since capturing writes one slot of block 0."""
    limits = (cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens,
              cfg.num_speculative_tokens + 1 if verify and cfg.num_speculative_tokens else 0)
    if not capture:
        return StepGraphs(model, kv_cache, *limits, capture=False)
    cache = model.__dict__.setdefault("_step_graphs", {})
    key = (kv_cache.data.data_ptr(), tuple(kv_cache.data.shape), kv_cache.dtype, *limits)
    if key not in cache:
        if len(cache) >= MAX_CACHED:
            cache.pop(next(iter(cache)))
        cache[key] = StepGraphs(model, kv_cache, *limits)
    graphs = cache[key]
    graphs.kv_cache = kv_cache  # the same memory; the object the engine holds
    return graphs


class StepGraphs:
    """Plain decode steps of up to `max_num_seqs` rows, steps of one prompt (chunk) of up to
    `max_num_batched_tokens` tokens and, with `verify_tokens` n > 1, decode steps whose rows carry up to n - 1
    drafts each (every row padded at its front to n tokens), with up to `max_model_len` tokens of context, run
    from captured CUDA graphs (or, with capture=False, the same static forward eagerly)."""

    def __init__(self, model, kv_cache: KVCache, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 verify_tokens: int = 0, capture: bool = True):
        self._model = weakref.ref(model)  # the model holds its captured sets: no cycle for the GC to find later
        self.kv_cache = kv_cache
        self.block_size = bs = kv_cache.block_size
        self.max_blocks = min(-(-max_model_len // bs), kv_cache.num_blocks)
        widest = self.max_blocks * bs
        self.batch_sizes = _sizes(max_num_seqs, BATCH_SIZES)
        self.prompt_sizes = _sizes(min(max_num_batched_tokens, widest), PROMPT_SIZES)
        self.widths = _sizes(widest, [w for w in (MIN_WIDTH * 2 ** i for i in range(16)) if w % bs == 0])
        self.verify_tokens = verify_tokens if verify_tokens > 1 else 0
        n = max(self.batch_sizes[-1] * max(1, self.verify_tokens), self.prompt_sizes[-1])
        m = self.max_blocks
        rows = self.batch_sizes[-1]
        dev = kv_cache.device
        # ids, positions, slots (per token), context lens, block tables [rows, m] (per row): one upload a step
        self._layout = [n, n, n, rows, rows * m]
        self.device_buf = torch.zeros(sum(self._layout), dtype=torch.long, device=dev)
        self.host_buf = torch.zeros(sum(self._layout), dtype=torch.long, pin_memory=dev.type == "cuda")
        ids, pos, slots, ctx, tables = self.device_buf.split(self._layout)
        self.input_ids, self.positions, self.slots, self.context_lens = ids, pos, slots, ctx
        self.block_tables = tables.view(rows, m)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=dev)
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.replays = {"decode": 0, "prompt": 0, "verify": 0}
        self.context_lens.fill_(1)  # capture and warm-up attend one key of block 0; the cache is still empty
        if capture:
            self._capture()

    @property
    def model(self):
        return self._model()

    def _forward(self, kind: str, n: int, width: int) -> None:
        if kind == "decode":
            meta = GraphMeta(self.slots[:n], self.block_tables[:n], self.context_lens[:n], self.block_size, width)
            attention = graph_decode_attention
        elif kind == "verify":  # n rows of verify_tokens tokens
            rows, n = n, n * self.verify_tokens
            meta = GraphMeta(self.slots[:n], self.block_tables[:rows], self.context_lens[:rows], self.block_size,
                             width, self.positions[:n])
            attention = graph_verify_attention
        else:
            meta = GraphMeta(self.slots[:n], self.block_tables[:1], self.context_lens[:1], self.block_size, width,
                             self.positions[:n])
            attention = graph_prompt_attention
        self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n], meta, self.kv_cache, attention=attention)

    def _shapes(self) -> list[tuple[str, int, int]]:
        """Every (kind, rows or tokens, width) captured, largest first (they share one memory pool)."""
        out = [("prompt", t, w) for w in self.widths for t in self.prompt_sizes if t <= w]
        out += [("decode", b, w) for w in self.widths for b in self.batch_sizes]
        if self.verify_tokens:
            out += [("verify", b, w) for w in self.widths for b in self.batch_sizes]
        return sorted(out, key=lambda s: -s[1] * s[2] * (self.verify_tokens if s[0] == "verify" else 1))

    def _capture(self) -> None:
        pool = None
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()  # a graph freed by the collector while another is being captured breaks that capture
        try:
            for shape in self._shapes():
                self._forward(*shape)  # warm-up: kernels chosen, workspaces allocated outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(*shape)
                pool = graph.pool() if pool is None else pool
                self.graphs[shape] = graph
            torch.cuda.synchronize()
        finally:
            if collecting:
                gc.enable()

    def fits_decode(self, num_rows: int, context_lens: list[int]) -> bool:
        return num_rows <= self.batch_sizes[-1] and max(context_lens) <= self.widths[-1]

    def fits_prompt(self, num_tokens: int, context_len: int) -> bool:
        return num_tokens <= self.prompt_sizes[-1] and context_len <= self.widths[-1]

    def fits_verify(self, query_lens: list[int], context_lens: list[int]) -> bool:
        return (self.verify_tokens > 0 and len(query_lens) <= self.batch_sizes[-1]
                and max(query_lens) <= self.verify_tokens and max(context_lens) <= self.widths[-1])

    def _replay(self, kind: str, n: int, width: int) -> torch.Tensor:
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        if self.graphs:
            self.graphs[(kind, n, width)].replay()
        else:
            self._forward(kind, n, width)
        self.replays[kind] += 1
        return self.hidden  # the buffer is the next replay's output: callers copy what they keep

    def _sections(self):
        host = self.host_buf.numpy()
        ids, pos, slots, ctx, tables = np.split(host, np.cumsum(self._layout)[:-1])
        return ids, pos, slots, ctx, tables.reshape(self.batch_sizes[-1], self.max_blocks)

    def _fill_tables(self, tables: np.ndarray, block_tables: list[list[int]]) -> None:
        tables[:len(block_tables)] = 0
        for i, t in enumerate(block_tables):
            k = min(len(t), self.max_blocks)
            tables[i, :k] = t[:k]

    def run_decode(self, input_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [len(input_ids), hidden] of one decode-only step (each row one token at
        position context_len - 1, its K/V written to that position's slot)."""
        n = len(input_ids)
        b = next(s for s in self.batch_sizes if s >= n)
        width = next(w for w in self.widths if w >= max(context_lens))
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections()
        self._fill_tables(tables, block_tables)
        lens = np.asarray(context_lens, dtype=np.int64)
        at = lens - 1
        for section, values in ((ids, input_ids), (pos, at), (slots, tables[np.arange(n), at // bs] * bs + at % bs),
                                (ctx, lens)):
            section[:n] = values
            section[n:b] = section[0]  # padding rows repeat row 0
        tables[n:b] = tables[0]
        return self._replay("decode", b, width)[:n].clone()

    def run_prompt(self, input_ids: list[int], context_len: int, block_table: list[int]) -> torch.Tensor:
        """Final-normed hidden states [len(input_ids), hidden] of a step of one prompt or chunk: its tokens at the
        positions that end at context_len, their K/V written to those positions' slots."""
        t = len(input_ids)
        p = next(s for s in self.prompt_sizes if s >= t)
        width = next(w for w in self.widths if w >= context_len)
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections()
        self._fill_tables(tables, [block_table])
        at = np.arange(context_len - t, context_len, dtype=np.int64)
        for section, values in ((ids, input_ids), (pos, at), (slots, tables[0, at // bs] * bs + at % bs)):
            section[:t] = values
            section[t:p] = section[t - 1]  # padding tokens repeat the last one
        ctx[0] = context_len
        return self._replay("prompt", p, width)[:t].clone()

    def run_verify(self, input_ids: list[int], query_lens: list[int], context_lens: list[int],
                   block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [sum(query_lens), hidden] of a decode step whose rows carry drafts: row i's
        query_lens[i] tokens (its last token, then its drafts; flat in `input_ids`) at the positions that end at
        context_lens[i]. Each row goes in padded at its front to verify_tokens slots that repeat its first token."""
        rows, n = len(query_lens), self.verify_tokens
        b = next(s for s in self.batch_sizes if s >= rows)
        width = next(w for w in self.widths if w >= max(context_lens))
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections()
        self._fill_tables(tables, block_tables)
        first, keep = 0, []
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            row = slice(i * n, (i + 1) * n)
            at = np.arange(c - q, c, dtype=np.int64)
            for section, values in ((ids, input_ids[first:first + q]), (pos, at),
                                    (slots, tables[i, at // bs] * bs + at % bs)):
                section[row][n - q:] = values
                section[row][:n - q] = section[row][n - q]  # front padding repeats the row's first token
            ctx[i] = c
            keep.extend(range(i * n + n - q, (i + 1) * n))
            first += q
        for section in (ids, pos, slots):
            section[rows * n:b * n] = np.tile(section[:n], b - rows)  # padding rows repeat row 0
        ctx[rows:b] = ctx[0]
        tables[rows:b] = tables[0]
        return self._replay("verify", b, width)[keep].clone()

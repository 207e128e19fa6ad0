"""Engine steps replayed from CUDA graphs (what vLLM and nano-vllm do for decodes): on a GPU a small model's step is
thousands of tiny kernel launches from Python and a dozen small uploads, so the host, not the GPU, sets its time
(measured on an H200: 17.8 ms a batch-1 decode step, the GPU busy 2.5 ms of it). A graph launches the whole
forward at once.

Four kinds of step are captured: plain decode steps (one token per row, up to max_num_seqs rows), steps of one
prompt or prompt chunk alone (up to the step's token budget), steps of several whole prompts packed (no cached
context: each attends to its own new keys), and — with speculative decoding by chains of drafts (prompt lookup, a
draft model) — decode steps whose rows carry drafts, every row padded at its front to num_speculative_tokens + 1
tokens. Candidate trees (Medusa) and steps mixing prompts with decodes run eagerly.

A graph has fixed shapes and fixed addresses, so a step is run padded to the next captured size (rows, or prompt
tokens) and key width: its tokens, positions, slots, context lengths and block tables are written into static
buffers (one upload from pinned memory) and the graph captured over those buffers is replayed. A padding row
repeats a real one exactly — row 0 of a batch, the last token of a prompt, the first token of a verify row: same
token, position, slot, keys — so it computes and writes the same K/V into the same slot and the cache is
unchanged by it. Attention reads a row's blocks whole, up to the captured width, under a mask of its context
(and, for prompt and verify tokens, of each token's position).

Off the GPU (`capture=False`) the same static-shape forward runs eagerly: the tests check on the CPU that it
gives what the engine's own path gives.
"""
from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from executor.model.attention import masked_attention
from executor.model.cache_engine import KVCache
from sim.config.errors import ConfigError

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
    (its first `width / block_size` blocks) and context length the attention masks by, and for a prompt or verify
    step each token's position (a token sees the keys up to its own)."""

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


def graph_packed_prompt_attention(q, k_cache, v_cache, meta: GraphMeta, scale: float | None = None):
    """Several whole prompts packed [T, H, D] (no cached context): each token against the step's own keys — read
    back from its slots — of its own prompt up to its own position. `meta.context_lens` holds each token's prompt
    index here, and -(index + 1) for a padding token: as a query it is its prompt's last token again, as a key it
    is no one's (the real last token's key is already there once)."""
    t, h, d = q.shape
    kvh = k_cache.shape[-2]
    g = h // kvh
    k = k_cache.view(-1, kvh, d)[meta.slot_mapping].transpose(0, 1)[None]  # [1, kvh, T, D]
    v = v_cache.view(-1, kvh, d)[meta.slot_mapping].transpose(0, 1)[None]
    seq, pos = meta.context_lens, meta.positions
    query_seq = torch.where(seq < 0, -seq - 1, seq)
    visible = (query_seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [T queries, T keys]
    qg = q.reshape(t, kvh, g, d).permute(1, 0, 2, 3).reshape(1, kvh, t * g, d)
    mask = visible[:, None, :].expand(t, g, t).reshape(1, 1, t * g, t)
    o = masked_attention(qg, k, v, mask, d ** -0.5 if scale is None else scale)
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


def _widest(kv_cache: KVCache, max_model_len: int) -> int:
    """Keys a row can have: max_model_len rounded up to whole blocks, at most the pool."""
    return min(-(-max_model_len // kv_cache.block_size), kv_cache.num_blocks) * kv_cache.block_size


def _sizes(limit: int, candidates) -> list[int]:
    out = [c for c in candidates if c < limit]
    return out + [limit]


# Captured sets kept per model (graphs bake in the weights' addresses): the profile sweep builds ~140 engines of
# 23 configurations, each with a fresh KV cache that the allocator puts where the last one was; a set per kind of
# step, keyed by the limits that shape it, is shared by every configuration with those limits.
MAX_CACHED = 48


class GraphSet:
    """The graphs of one kind of step over one KV cache, with the static buffers they read and write: per token the
    input id, position and slot, per row the context length and block table (one upload a step), and the final
    hidden states."""

    kind = ""

    def __init__(self, model, kv_cache: KVCache, max_model_len: int, tokens: int, rows: int,
                 table_rows: int | None = None):
        self._model = weakref.ref(model)  # the model holds its captured sets: no cycle for the GC to find later
        self.kv_cache = kv_cache
        self.block_size = bs = kv_cache.block_size
        self.max_blocks = m = _widest(kv_cache, max_model_len) // bs
        self.widths = _sizes(m * bs, [w for w in (MIN_WIDTH * 2 ** i for i in range(16)) if w % bs == 0])
        table_rows = rows if table_rows is None else table_rows
        self._layout = [tokens, tokens, tokens, rows, table_rows * m]
        dev = kv_cache.device
        self.device_buf = torch.zeros(sum(self._layout), dtype=torch.long, device=dev)
        self.host_buf = torch.zeros(sum(self._layout), dtype=torch.long, pin_memory=dev.type == "cuda")
        ids, pos, slots, ctx, tables = self.device_buf.split(self._layout)
        self.input_ids, self.positions, self.slots, self.context_lens = ids, pos, slots, ctx
        self.block_tables = tables.view(table_rows, m)
        self.hidden = torch.zeros(tokens, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.context_lens.fill_(1)  # capture and warm-up attend one key of block 0; the cache is still empty

    @property
    def model(self):
        return self._model()

    @property
    def kv_cache(self) -> KVCache:
        return self._kv_cache()

    @kv_cache.setter
    def kv_cache(self, kv_cache: KVCache) -> None:
        # held weakly: a cached set must not keep a finished engine's cache alive, or the next engine's cache can
        # never take its address and reuse the graphs (which read and write that address, not the object)
        self._kv_cache = weakref.ref(kv_cache)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (size, width) captured."""
        raise NotImplementedError

    def tokens(self, size: int) -> int:
        return size

    def meta_and_attention(self, size: int, width: int):
        raise NotImplementedError

    def _forward(self, size: int, width: int) -> None:
        n = self.tokens(size)
        meta, attention = self.meta_and_attention(size, width)
        self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n], meta, self.kv_cache, attention=attention)

    def capture(self, scratch_slot: int = 0) -> "GraphSet":
        """One graph per shape, largest first, all sharing one memory pool (nano-vllm's order). The warm-up
        forwards write K/V at `scratch_slot` (a slot nobody reads: slot 0 of a cache still empty, else a free
        block's); the graphs themselves read every slot from the buffer when replayed."""
        pool = None
        self.slots.fill_(scratch_slot)
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()  # a graph freed by the collector while another is being captured breaks that capture
        try:
            for size, width in sorted(self.shapes(), key=lambda s: -self.tokens(s[0]) * max(s[1], 1)):
                self._forward(size, width)  # warm-up: kernels chosen, workspaces allocated outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(size, width)
                pool = graph.pool() if pool is None else pool
                self.graphs[(size, width)] = graph
            torch.cuda.synchronize()
        finally:
            if collecting:
                gc.enable()
        return self

    def _replay(self, size: int, width: int) -> torch.Tensor:
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        if self.graphs:
            self.graphs[(size, width)].replay()
        else:
            self._forward(size, width)
        self.replays += 1
        return self.hidden  # the buffer is the next replay's output: callers copy what they keep

    def _width(self, longest: int) -> int:
        return next(w for w in self.widths if w >= longest)

    def _sections(self, block_tables: list[list[int]]):
        """The host buffer's sections (ids, positions, slots, context lens, tables [rows, max_blocks]), the tables
        of `block_tables` written into the first rows."""
        ids, pos, slots, ctx, tables = np.split(self.host_buf.numpy(), np.cumsum(self._layout)[:-1])
        tables = tables.reshape(-1, self.max_blocks)
        tables[:len(block_tables)] = 0
        for i, t in enumerate(block_tables):
            k = min(len(t), self.max_blocks)
            tables[i, :k] = t[:k]
        return ids, pos, slots, ctx, tables


class DecodeGraphs(GraphSet):
    """Plain decode steps of up to `max_num_seqs` rows, one token each."""

    kind = "decode"

    def __init__(self, model, kv_cache, max_model_len: int, max_num_seqs: int):
        self.batch_sizes = _sizes(max_num_seqs, BATCH_SIZES)
        super().__init__(model, kv_cache, max_model_len, self.batch_sizes[-1], self.batch_sizes[-1])

    def shapes(self):
        return [(b, w) for w in self.widths for b in self.batch_sizes]

    def meta_and_attention(self, b, width):
        meta = GraphMeta(self.slots[:b], self.block_tables[:b], self.context_lens[:b], self.block_size, width)
        return meta, graph_decode_attention

    def fits(self, num_rows: int, context_lens: list[int]) -> bool:
        return num_rows <= self.batch_sizes[-1] and max(context_lens) <= self.widths[-1]

    def run(self, input_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [len(input_ids), hidden] of one decode-only step (each row one token at
        position context_len - 1, its K/V written to that position's slot)."""
        n = len(input_ids)
        b = next(s for s in self.batch_sizes if s >= n)
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections(block_tables)
        lens = np.asarray(context_lens, dtype=np.int64)
        at = lens - 1
        for section, values in ((ids, input_ids), (pos, at), (slots, tables[np.arange(n), at // bs] * bs + at % bs),
                                (ctx, lens)):
            section[:n] = values
            section[n:b] = section[0]  # padding rows repeat row 0
        tables[n:b] = tables[0]
        return self._replay(b, self._width(max(context_lens)))[:n].clone()


class PromptGraphs(GraphSet):
    """Steps of one prompt or chunk alone, of up to `max_num_batched_tokens` tokens."""

    kind = "prompt"

    def __init__(self, model, kv_cache, max_model_len: int, max_num_batched_tokens: int):
        self.prompt_sizes = _sizes(min(max_num_batched_tokens, _widest(kv_cache, max_model_len)), PROMPT_SIZES)
        super().__init__(model, kv_cache, max_model_len, self.prompt_sizes[-1], 1)

    def shapes(self):
        return [(t, w) for w in self.widths for t in self.prompt_sizes if t <= w]

    def meta_and_attention(self, t, width):
        meta = GraphMeta(self.slots[:t], self.block_tables, self.context_lens, self.block_size, width,
                         self.positions[:t])
        return meta, graph_prompt_attention

    def fits(self, num_tokens: int, context_len: int) -> bool:
        return num_tokens <= self.prompt_sizes[-1] and context_len <= self.widths[-1]

    def run(self, input_ids: list[int], context_len: int, block_table: list[int]) -> torch.Tensor:
        """Final-normed hidden states [len(input_ids), hidden] of a step of one prompt or chunk: its tokens at the
        positions that end at context_len, their K/V written to those positions' slots."""
        t = len(input_ids)
        p = next(s for s in self.prompt_sizes if s >= t)
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections([block_table])
        at = np.arange(context_len - t, context_len, dtype=np.int64)
        for section, values in ((ids, input_ids), (pos, at), (slots, tables[0, at // bs] * bs + at % bs)):
            section[:t] = values
            section[t:p] = section[t - 1]  # padding tokens repeat the last one
        ctx[0] = context_len
        return self._replay(p, self._width(context_len))[:t].clone()


class PackedPromptGraphs(GraphSet):
    """Steps of several whole prompts (no cached context) packed, up to `max_num_batched_tokens` tokens: the
    per-row section of the buffers holds each token's prompt index, and no block tables are needed (each token's
    keys are the step's own)."""

    kind = "prompts"

    def __init__(self, model, kv_cache, max_model_len: int, max_num_batched_tokens: int):
        self.prompt_sizes = _sizes(max_num_batched_tokens, PROMPT_SIZES)
        t = self.prompt_sizes[-1]
        super().__init__(model, kv_cache, max_model_len, t, t, table_rows=0)

    def shapes(self):
        return [(t, 0) for t in self.prompt_sizes]

    def meta_and_attention(self, t, width):
        meta = GraphMeta(self.slots[:t], self.block_tables, self.context_lens[:t], self.block_size, width,
                         self.positions[:t])
        return meta, graph_packed_prompt_attention

    def fits(self, query_lens: list[int], context_lens: list[int]) -> bool:
        return (query_lens == context_lens and sum(query_lens) <= self.prompt_sizes[-1]
                and max(context_lens) <= self.widths[-1])

    def run(self, input_ids: list[int], query_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [sum(query_lens), hidden] of a step of whole prompts (flat in `input_ids`),
        their K/V written to the slots of positions 0.. of each."""
        total = sum(query_lens)
        p = next(s for s in self.prompt_sizes if s >= total)
        bs = self.block_size
        ids, pos, slots, seq, _ = self._sections([])
        first = 0
        for i, (q, table) in enumerate(zip(query_lens, block_tables)):
            at = np.arange(q, dtype=np.int64)
            blocks = np.asarray(table, dtype=np.int64)
            for section, values in ((ids, input_ids[first:first + q]), (pos, at),
                                    (slots, blocks[at // bs] * bs + at % bs), (seq, i)):
                section[first:first + q] = values
            first += q
        for section in (ids, pos, slots):
            section[total:p] = section[total - 1]  # padding tokens repeat the last one...
        seq[total:p] = -seq[total - 1] - 1  # ...but are no one's key
        return self._replay(p, 0)[:total].clone()


class VerifyGraphs(GraphSet):
    """Decode steps of up to `max_num_seqs` rows whose rows carry up to n - 1 drafts each (a chain: the row's last
    token, then its drafts), every row padded at its front to n tokens."""

    kind = "verify"

    def __init__(self, model, kv_cache, max_model_len: int, max_num_seqs: int, n: int):
        self.batch_sizes, self.n = _sizes(max_num_seqs, BATCH_SIZES), n
        super().__init__(model, kv_cache, max_model_len, self.batch_sizes[-1] * n, self.batch_sizes[-1])

    def shapes(self):
        return [(b, w) for w in self.widths for b in self.batch_sizes]

    def tokens(self, b):
        return b * self.n

    def meta_and_attention(self, b, width):
        t = b * self.n
        meta = GraphMeta(self.slots[:t], self.block_tables[:b], self.context_lens[:b], self.block_size, width,
                         self.positions[:t])
        return meta, graph_verify_attention

    def fits(self, query_lens: list[int], context_lens: list[int]) -> bool:
        return (len(query_lens) <= self.batch_sizes[-1] and max(query_lens) <= self.n
                and max(context_lens) <= self.widths[-1])

    def run(self, input_ids: list[int], query_lens: list[int], context_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [sum(query_lens), hidden]: row i's query_lens[i] tokens (flat in `input_ids`)
        at the positions that end at context_lens[i]; each row goes in padded at its front with copies of its first
        token."""
        rows, n = len(query_lens), self.n
        b = next(s for s in self.batch_sizes if s >= rows)
        bs = self.block_size
        ids, pos, slots, ctx, tables = self._sections(block_tables)
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
        return self._replay(b, self._width(max(context_lens)))[keep].clone()


@dataclass
class StepGraphs:
    """An engine's graph sets: plain decode steps, lone prompt steps, several whole prompts packed and (with chain
    drafts) verify steps."""

    decode: DecodeGraphs
    prompt: PromptGraphs
    prompts: PackedPromptGraphs
    verify: VerifyGraphs | None = None

    @property
    def replays(self) -> dict[str, int]:
        return {s.kind: s.replays for s in (self.decode, self.prompt, self.prompts, self.verify) if s is not None}

    def run(self, input_ids: list[int], query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
            num_decode: int, num_padding: int, sampling_rows: list[int]) -> torch.Tensor | None:
        """The final hidden states of a step's logit rows (every position of a verify row, the last of a sampling
        prompt) from the first kind of graph that fits the step, or None: run it eagerly. The step's rows are
        `num_decode` decode rows, then prompt chunks, then `num_padding` static-batching padding rows."""
        rows = len(query_lens) - num_padding
        if len(sampling_rows) == rows == num_decode:  # every row decodes
            if all(n == 1 for n in query_lens) and self.decode.fits(len(query_lens), context_lens):
                return self.decode.run(input_ids, context_lens, block_tables)[:rows]  # padding rows ride along
            if self.verify is not None and not num_padding and self.verify.fits(query_lens, context_lens):
                return self.verify.run(input_ids, query_lens, context_lens, block_tables)
        if num_decode or num_padding:
            return None
        if len(query_lens) == 1 and self.prompt.fits(query_lens[0], context_lens[0]):
            return self.prompt.run(input_ids, context_lens[0], block_tables[0])[query_lens[0] - len(sampling_rows):]
        if self.prompts.fits(query_lens, context_lens):  # several whole prompts (or first chunks)
            ends = list(itertools.accumulate(query_lens))
            return self.prompts.run(input_ids, query_lens, block_tables)[[ends[i] - 1 for i in sampling_rows]]
        return None


def capture_or_explain(graphs: GraphSet, scratch_slot: int = 0) -> GraphSet:
    """graphs.capture(), a failure (out of memory, an op that cannot be captured) told in one line with the way out."""
    try:
        return graphs.capture(scratch_slot)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"capturing the {graphs.kind} steps' CUDA graphs failed ({first}); set "
                          "executor.cuda_graphs: false to run every step eagerly", "executor.cuda_graphs") from None


def step_graphs(model, kv_cache: KVCache, cfg, capture: bool = True, verify: bool = False) -> StepGraphs:
    """The model's graph sets for this KV cache and these scheduler limits (a SchedulerConfig; `verify`: chains of up
    to cfg.num_speculative_tokens drafts are verified too), captured (capture=False: run eagerly). A set is reused
    when an earlier engine's cache had the same shape at the same address (its graphs then read and write this
    one), else captured now — while the cache is still empty, since capturing writes one slot of block 0."""
    wanted = [(DecodeGraphs, cfg.max_num_seqs), (PromptGraphs, cfg.max_num_batched_tokens),
              (PackedPromptGraphs, cfg.max_num_batched_tokens)]
    if verify and cfg.num_speculative_tokens:
        wanted.append((VerifyGraphs, cfg.max_num_seqs, cfg.num_speculative_tokens + 1))
    cache = model.__dict__.setdefault("_graph_sets", {}) if capture else {}
    sets = []
    for cls, *limits in wanted:
        key = (cls.kind, kv_cache.data.data_ptr(), tuple(kv_cache.data.shape), kv_cache.dtype, cfg.max_model_len,
               *limits)
        if key not in cache:
            if len(cache) >= MAX_CACHED:
                cache.pop(next(iter(cache)))
            made = cls(model, kv_cache, cfg.max_model_len, *limits)
            cache[key] = capture_or_explain(made) if capture else made
        cache[key].kv_cache = kv_cache  # the same memory; the object the engine holds
        sets.append(cache[key])
    return StepGraphs(*sets)

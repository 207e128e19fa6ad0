"""Decode steps replayed from CUDA graphs (what vLLM and nano-vllm do): on a GPU a small model's decode step is
thousands of tiny kernel launches from Python and a dozen small uploads, so the host, not the GPU, sets its time
(measured on an H200: 17.8 ms a batch-1 step, the GPU busy 2.5 ms of it). A graph launches the whole forward
at once.

A graph has fixed shapes and fixed addresses, so every decode-only step is run padded to the next captured batch
size and key width: its tokens, positions, slots, context lengths and block tables are written into static
buffers (one upload from pinned memory) and the graph captured over those buffers is replayed. A padding row
repeats row 0 exactly (same token, position, slot, table): it computes and writes the same K/V, so the cache is
unchanged by it. Attention reads each row's blocks whole, up to the captured width, under a mask of its context.

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
# Key widths captured: from this many tokens up, doubling, up to max_model_len (always one of them): a step pads
# its keys to at most twice its longest context.
MIN_WIDTH = 256


@dataclass
class GraphMeta:
    """What the model's layers read about a graph step: the slots its tokens' K/V go to, and per row the block
    table (its first `width / block_size` blocks) and context length the attention masks by."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    width: int


def graph_decode_attention(q, k_cache, v_cache, meta: GraphMeta, scale: float | None = None):
    """One query per row [b, H, D] against that row's blocks read whole up to `meta.width` keys, masked by its
    context length: every shape fixed by (b, width), nothing read back to the host."""
    b, h, d = q.shape
    kvh = k_cache.shape[-2]
    tables = meta.block_tables[:, :meta.width // meta.block_size].reshape(-1)
    k = k_cache.view(k_cache.shape[0], -1).index_select(0, tables).view(b, meta.width, kvh, d).transpose(1, 2)
    v = v_cache.view(v_cache.shape[0], -1).index_select(0, tables).view(b, meta.width, kvh, d).transpose(1, 2)
    visible = (torch.arange(meta.width, device=q.device)[None, :] < meta.context_lens[:, None])[:, None, None, :]
    o = masked_attention(q.reshape(b, kvh, h // kvh, d), k, v, visible, d ** -0.5 if scale is None else scale)
    return o.reshape(b, h, d)


def _sizes(limit: int, candidates) -> list[int]:
    out = [c for c in candidates if c < limit]
    return out + [limit]


# Captured sets kept per model (graphs bake in the weights' addresses): the profile sweep builds ~140 engines
# of a handful of shapes, each with a fresh KV cache that the allocator puts where the last one was.
MAX_CACHED = 16


def decode_graphs(model, kv_cache: KVCache, max_num_seqs: int, max_model_len: int, capture: bool = True
                  ) -> "DecodeGraphs":
    """The model's captured graphs for this KV cache and these limits: reused when an earlier engine's cache had
    the same shape at the same address (its graphs then read and write this one), else captured now — while
    the cache is still empty, since capturing writes one slot of block 0."""
    if not capture:
        return DecodeGraphs(model, kv_cache, max_num_seqs, max_model_len, capture=False)
    cache = model.__dict__.setdefault("_decode_graphs", {})
    key = (kv_cache.data.data_ptr(), tuple(kv_cache.data.shape), kv_cache.dtype, max_num_seqs, max_model_len)
    if key not in cache:
        if len(cache) >= MAX_CACHED:
            cache.pop(next(iter(cache)))
        cache[key] = DecodeGraphs(model, kv_cache, max_num_seqs, max_model_len)
    graphs = cache[key]
    graphs.kv_cache = kv_cache  # the same memory; the object the engine holds
    return graphs


class DecodeGraphs:
    """Decode-only steps of up to `max_num_seqs` rows and `max_model_len` tokens of context, run from captured
    CUDA graphs (or, with capture=False, the same static forward eagerly)."""

    def __init__(self, model, kv_cache: KVCache, max_num_seqs: int, max_model_len: int, capture: bool = True):
        self._model = weakref.ref(model)  # the model holds its captured sets: no cycle for the GC to find later
        self.kv_cache = kv_cache
        self.block_size = bs = kv_cache.block_size
        self.max_blocks = min(-(-max_model_len // bs), kv_cache.num_blocks)
        self.batch_sizes = _sizes(max_num_seqs, BATCH_SIZES)
        widest = self.max_blocks * bs
        self.widths = _sizes(widest, [w for w in (MIN_WIDTH * 2 ** i for i in range(16)) if w % bs == 0])
        n, m = self.batch_sizes[-1], self.max_blocks
        dev = kv_cache.device
        # ids, positions, slots, context lens, then the block tables [n, m]: one buffer, one upload a step
        self._layout = [n, n, n, n, n * m]
        self.device_buf = torch.zeros(sum(self._layout), dtype=torch.long, device=dev)
        self.host_buf = torch.zeros(sum(self._layout), dtype=torch.long, pin_memory=dev.type == "cuda")
        ids, pos, slots, ctx, tables = self.device_buf.split(self._layout)
        self.input_ids, self.positions, self.slots, self.context_lens = ids, pos, slots, ctx
        self.block_tables = tables.view(n, m)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.context_lens.fill_(1)  # capture and warm-up attend one key of block 0; the cache is still empty
        if capture:
            self._capture()

    @property
    def model(self):
        return self._model()

    def _forward(self, b: int, width: int) -> None:
        meta = GraphMeta(self.slots[:b], self.block_tables[:b], self.context_lens[:b], self.block_size, width)
        self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_cache,
                                     attention=graph_decode_attention)

    def _capture(self) -> None:
        """One graph per (batch size, width), largest first, all sharing one memory pool (nano-vllm's order)."""
        pool = None
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()  # a graph freed by the collector while another is being captured breaks that capture
        try:
            for width in reversed(self.widths):
                for b in reversed(self.batch_sizes):
                    self._forward(b, width)  # warm-up: kernels chosen, workspaces allocated outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool):
                        self._forward(b, width)
                    pool = graph.pool() if pool is None else pool
                    self.graphs[(b, width)] = graph
            torch.cuda.synchronize()
        finally:
            if collecting:
                gc.enable()

    def fits(self, num_rows: int, context_lens: list[int]) -> bool:
        return num_rows <= self.batch_sizes[-1] and max(context_lens) <= self.widths[-1]

    def run(self, input_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Final-normed hidden states [len(input_ids), hidden] of one decode-only step (each row one token at
        position context_len - 1, its K/V written to that position's slot)."""
        n = len(input_ids)
        b = next(s for s in self.batch_sizes if s >= n)
        width = next(w for w in self.widths if w >= max(context_lens))
        bs, m = self.block_size, self.max_blocks
        host = self.host_buf.numpy()
        sections = np.split(host, np.cumsum(self._layout)[:-1])
        tables = sections[4].reshape(self.batch_sizes[-1], m)
        tables[:n] = 0
        for i, t in enumerate(block_tables):
            k = min(len(t), m)
            tables[i, :k] = t[:k]
        ctx = np.asarray(context_lens, dtype=np.int64)
        pos = ctx - 1
        rows = np.arange(n)
        slot = tables[rows, pos // bs] * bs + pos % bs
        for section, values in zip(sections[:4], (input_ids, pos, slot, ctx)):
            section[:n] = values
            section[n:b] = section[0]  # padding rows repeat row 0
        tables[n:b] = tables[0]
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        if self.graphs:
            self.graphs[(b, width)].replay()
        else:
            self._forward(b, width)
        self.replays += 1
        return self.hidden[:n].clone()  # the buffer is the next replay's output

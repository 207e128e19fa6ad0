"""The model runner: a scheduled batch in, the final hidden states and logits of its sampling rows out
(nano-vllm's ModelRunner).

It owns what runs on the device: the model, the KV cache tensors (and the host swap space) and the captured CUDA
graph sets. `prepare` turns a ScheduledBatch into the step's flat inputs (token ids, per row the query and context
length and block table, which rows sample); `run` copies swapped blocks, replays a graph where one fits the step or
runs the forward eagerly, and computes logits for the sampling rows only. Sampling, verification and the
scheduler's bookkeeping stay with the engine. A sharded or pipelined runner keeps this interface: `prepare` once,
`run` on every rank or stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache
from executor.model.cuda_graph import step_graphs
from executor.model.llama import LlamaModel
from executor.speculative.verify import tree_depths, tree_mask
from sim.policy.request import Request
from sim.policy.scheduler import ScheduledBatch


@dataclass
class StepInput:
    """One step as the model reads it: the batch's real rows (decodes first, then prompt chunks), then
    `num_padding` static-batching padding rows of one token each; per row its new tokens (flat in `input_ids`),
    context length after the step and block table."""

    rows: list[tuple[Request, int, int]]  # (request, new tokens, context length after the step) per real row
    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decode: int
    num_padding: int
    sampling_rows: list[int]  # rows that produce tokens: every decode, a prompt's last chunk
    counts: list[int]  # logit rows per sampling row: all positions of a verify row (each checks the draft after it)
    swap_out: list[tuple[int, int]]  # (device, host) block copies made before the forward
    swap_in: list[tuple[int, int]]  # (host, device)
    tree_parents: list[int] | None = None  # candidate trees (Medusa): each node's parent; None: drafts are chains
    # where the runner keeps them (ModelRunner.all_hidden): the final hidden states of every position run, all rows'
    hidden_all: torch.Tensor | None = None

    def spans(self) -> list[tuple[Request, int, int]]:
        """(request, first logit row, logit rows) per sampling row."""
        spans, first = [], 0
        for i, c in zip(self.sampling_rows, self.counts):
            spans.append((self.rows[i][0], first, c))
            first += c
        return spans


class ModelRunner:
    """Runs scheduled steps of `model` over `kv_cache`: through captured graphs where `use_graphs` (on a GPU, else
    the same static-shape forward run eagerly) and a step fits one, else the eager forward. `cfg` (a
    SchedulerConfig) sets the graphs' limits; `verify_graphs`: steps verifying chains of drafts get graphs too."""

    # an EAGLE drafter reads the target's hidden state at every position a step runs, prompt chunks' too (the engine
    # sets it): `run` leaves them in the step's hidden_all, the last layer computed for every row
    all_hidden: bool = False

    def __init__(self, model: LlamaModel, kv_cache: KVCache, cfg, host_cache: KVCache | None = None,
                 use_graphs: bool = False, verify_graphs: bool = False):
        if use_graphs and kv_cache.quantized:
            raise ValueError("CUDA graphs with an int8 KV cache are not supported: the graphs' attention reads fp "
                             "pools; run eagerly (use_graphs=False, executor.cuda_graphs: false)")
        if host_cache is not None and host_cache.kv_dtype != kv_cache.kv_dtype:
            raise ValueError(f"the host swap cache holds {host_cache.kv_dtype or host_cache.dtype} KV, the device "
                             f"cache {kv_cache.kv_dtype or kv_cache.dtype}: they must match")
        self.model = model
        if hasattr(model, "tune_projections"):
            model.tune_projections()  # once per shape: a later runner over the same model finds them tuned
        self.kv_cache = kv_cache
        self.host_cache = host_cache
        self.device = kv_cache.device
        self.graphs = None
        if use_graphs:
            self.graphs = step_graphs(model, kv_cache, cfg, capture=self.device.type == "cuda", verify=verify_graphs)
        self._padding_ctx: dict[Request, int] = {}

    def prepare(self, batch: ScheduledBatch, tokens: dict[Request, list[int]], drafts: dict[Request, list[int]],
                tree_parents: list[int] | None = None) -> StepInput:
        """The step's inputs: each row's new tokens from `tokens` (a verify row: its last token, then its drafts
        from `drafts`), lengths and tables from the batch's requests; `tree_parents` where drafts are trees."""
        rows = batch.rows()
        for r in batch.padding:  # static batching: finished rows keep computing a token each step
            self._padding_ctx[r] = self._padding_ctx.get(r, r.num_computed) + 1
        ids: list[int] = []
        for r, n, ctx in rows:
            seq = tokens[r]
            ids.extend(seq[ctx - n:ctx] if ctx <= len(seq) else seq[ctx - n:] + drafts[r][:ctx - len(seq)])
        for r in batch.padding:
            ids.append(tokens[r][-1])
        query_lens = [n for _, n, _ in rows] + [1] * len(batch.padding)
        context_lens = [c for _, _, c in rows] + [self._padding_ctx[r] for r in batch.padding]
        # a hybrid allocator's requests hold per-kind tables of bundles (sim/policy/hybrid_allocator.py)
        tables = [r.group_tables or r.block_table for r, _, _ in rows] + [r.block_table for r in batch.padding]
        num_decode = len(batch.decode)
        sampling_rows = [i for i, (r, n, ctx) in enumerate(rows) if ctx >= r.num_tokens]
        counts = [rows[i][1] if i < num_decode else 1 for i in sampling_rows]
        return StepInput(rows, ids, query_lens, context_lens, tables, num_decode, len(batch.padding), sampling_rows,
                         counts, batch.swap_out, batch.swap_in, tree_parents)

    def run(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Swapped blocks copied, then the step's forward: (final hidden states of its logit rows, their logits;
        None where no row samples)."""
        self.swap(step.swap_out, step.swap_in)
        hidden = None
        prompts = len(step.rows) > step.num_decode  # a graph returns the sampling rows, a prompt's last only
        if self.graphs is not None and not (self.all_hidden and prompts):  # a captured step that fits: one replay
            hidden = self.graphs.run(step.input_ids, step.query_lens, step.context_lens, step.block_tables,
                                     step.num_decode, step.num_padding, step.sampling_rows)
            if self.all_hidden:  # decode rows alone: every position samples
                step.hidden_all = hidden
        if hidden is None:
            hidden = self._forward(step)
        return hidden, self.model.compute_logits(hidden) if step.sampling_rows else None

    def _forward(self, step: StepInput, hidden: torch.Tensor | None = None, final: bool = True) -> torch.Tensor:
        """The step's forward, eager: final hidden states of the logit rows (`step.counts` per sampling row).
        A pipeline stage's (executor.distributed.pipeline): `hidden`, the residual stream from the stage before,
        instead of the token ids; `final=False`: the residual stream after this stage's layers, every row."""
        if getattr(self.kv_cache, "hybrid", False):  # per group of layers (executor.model.hybrid_cache)
            meta = self.kv_cache.step_metadata(step.query_lens, step.context_lens, step.block_tables, self.device,
                                               step.num_decode)
        else:
            meta = AttentionMetadata.build(step.query_lens, step.context_lens, step.block_tables,
                                           self.kv_cache.block_size, self.device, num_decode_rows=step.num_decode)
        positions = meta.positions()
        if step.tree_parents is not None:
            self._attend_trees(step, meta, positions)
        input_ids = None if hidden is not None else torch.tensor(step.input_ids, dtype=torch.long,
                                                                 device=self.device)
        if not final:
            return self.model(input_ids, positions, meta, self.kv_cache, hidden=hidden, final=False)
        if step.num_padding or any(c > 1 for c in step.counts) or self.all_hidden:  # every position's, then pick
            out = self.model(input_ids, positions, meta, self.kv_cache, hidden=hidden)
            if self.all_hidden:
                step.hidden_all = out
            return out[[meta.cu_query_lens[i + 1] - c + j for i, c in zip(step.sampling_rows, step.counts)
                        for j in range(c)]]
        # the model's last layer and the LM head run only for the rows that sample
        return self.model(input_ids, positions, meta, self.kv_cache, last_of=step.sampling_rows, hidden=hidden)

    @staticmethod
    def _attend_trees(step: StepInput, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """Candidate-tree verify rows: a node's position is its root's + its depth, and it attends to its
        ancestors only (masks in `meta.trees`)."""
        parents = step.tree_parents
        for i, (r, n, ctx) in enumerate(step.rows[:step.num_decode]):
            if n > 1:
                meta.trees[i] = tree_mask(parents[:n - 1])
                first = meta.cu_query_lens[i]
                positions[first:first + n] = ctx - n + torch.tensor(tree_depths(parents[:n - 1]))

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Block copies for swapped requests, device to host (`swap_out`) then host to device (`swap_in`), made
        before the forward reuses the device blocks."""
        if not (swap_out or swap_in):
            return
        if self.host_cache is None:
            raise RuntimeError("swap preemption needs a host cache (kv_cache.swap_space_gib > 0)")
        dev, host = self.kv_cache.data, self.host_cache.data
        if swap_out:
            d, h = zip(*swap_out)
            host[:, :, list(h)] = dev[:, :, list(d)].to(host.device)
        if swap_in:
            h, d = zip(*swap_in)
            dev[:, :, list(d)] = host[:, :, list(h)].to(dev.device)

    def compact_tree(self, block_table: list[int], root: int, path: list[int]) -> None:
        """Move the K/V of a candidate tree's accepted nodes (`path`, node numbers from the root at position
        `root`) to the positions right after the root, where the sequence continues; the other nodes' slots are
        given back by the scheduler."""
        src = [root + j for j in path]
        dst = [root + 1 + i for i in range(len(path))]
        if src == dst:
            return
        bs = self.kv_cache.block_size
        slot = lambda pos: block_table[pos // bs] * bs + pos % bs  # noqa: E731
        data = self.kv_cache.data
        flat = data.view(data.shape[0], 2, -1, *data.shape[-2:])
        flat[:, :, [slot(p) for p in dst]] = flat[:, :, [slot(p) for p in src]]

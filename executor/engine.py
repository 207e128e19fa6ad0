"""The executor's engine loop: the simulator's scheduler picks every step, the real model runs it.

One `step()` = schedule (shared policy object) → copy swapped blocks → one packed forward over the
mixed batch (prompt chunks and decodes together) → sample → tell the scheduler. Logits are computed
only for rows that sample. Every step is recorded with its batch shape and wall-clock time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from executor.attention import AttentionMetadata
from executor.kv_cache import KVCache
from executor.model import LlamaModel
from sim.request import Request
from sim.scheduler import Scheduler


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise top-k / top-p sampling from a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = True  # a workload's output length is the number of tokens to generate


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of `logits` [N, vocab]."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class StepRecord:
    """One engine step as the trace stores it (the batch shape is what calibration fits)."""

    step: int
    start_s: float
    end_s: float
    new_tokens: list[int]
    context_lens: list[int]
    num_prefill: int
    num_decode: int
    num_padding: int
    num_sampled: int  # rows that produced a token (a partial prompt chunk does not)
    kv_blocks_used: int
    preempted: list[int]
    swapped_blocks: int

    def to_json(self) -> dict:
        return self.__dict__


@dataclass
class Engine:
    """One replica on real hardware."""

    model: LlamaModel
    scheduler: Scheduler
    kv_cache: KVCache
    sampling: SamplingParams = SamplingParams()
    eos_token_id: int | None = None
    host_cache: KVCache | None = None  # swap space, on the host
    t0: float = field(default_factory=time.perf_counter)
    tokens: dict[Request, list[int]] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)
    # (time, running, KV blocks used, KV tokens stored, waiting) after each step, as the simulator samples
    samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    _padding_ctx: dict[Request, int] = field(default_factory=dict)

    def __post_init__(self):
        self.device = self.kv_cache.device
        self.generator = None
        if self.sampling.temperature > 0:
            self.generator = torch.Generator(device=self.device).manual_seed(self.sampling.seed)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, req: Request, prompt_ids: list[int]) -> bool:
        """Queue a request with its prompt token ids; False if the scheduler rejected it."""
        if len(prompt_ids) != req.prompt_len:
            raise ValueError(f"request {req.id}: {len(prompt_ids)} prompt ids for prompt_len {req.prompt_len}")
        accepted = self.scheduler.add(req)
        if accepted:
            self.tokens[req] = list(prompt_ids)
        return accepted

    def output_ids(self, req: Request) -> list[int]:
        return self.tokens[req][req.prompt_len:]

    def _swap(self, batch) -> None:
        """Block copies for swapped requests, made before the forward reuses the device blocks."""
        if not (batch.swap_out or batch.swap_in):
            return
        if self.host_cache is None:
            raise RuntimeError("swap preemption needs a host cache (kv_cache.swap_space_gib > 0)")
        dev, host = self.kv_cache.data, self.host_cache.data
        if batch.swap_out:
            d, h = zip(*batch.swap_out)
            host[:, :, list(h)] = dev[:, :, list(d)].to(host.device)
        if batch.swap_in:
            h, d = zip(*batch.swap_in)
            dev[:, :, list(d)] = host[:, :, list(h)].to(dev.device)

    def step(self) -> StepRecord | None:
        """Run one engine step; None if the scheduler had nothing to run."""
        start = self.now()
        sched = self.scheduler
        batch = sched.schedule()
        if not batch:
            return None
        self._swap(batch)
        rows = batch.rows()
        for r in batch.padding:  # static batching: finished rows keep computing a token each step
            self._padding_ctx[r] = self._padding_ctx.get(r, r.num_computed) + 1
        ids: list[int] = []
        for r, n, ctx in rows:
            ids.extend(self.tokens[r][ctx - n:ctx])
        for r in batch.padding:
            ids.append(self.tokens[r][-1])
        query_lens = [n for _, n, _ in rows] + [1] * len(batch.padding)
        context_lens = [c for _, _, c in rows] + [self._padding_ctx[r] for r in batch.padding]
        tables = [r.block_table for r, _, _ in rows] + [r.block_table for r in batch.padding]
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.kv_cache.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        sampling_rows = [i for i, (r, n, ctx) in enumerate(rows) if ctx == r.num_tokens]
        sampled: list[Request] = [rows[i][0] for i in sampling_rows]
        if batch.padding:  # static batching: padding rows compute in full, as the policy models it
            hidden = self.model(input_ids, meta.positions(), meta, self.kv_cache)
            hidden = hidden[[meta.cu_query_lens[i + 1] - 1 for i in sampling_rows]]
        else:  # the model's last layer and the LM head run only for the rows that sample
            hidden = self.model(input_ids, meta.positions(), meta, self.kv_cache, last_of=sampling_rows)
        if sampled:
            next_ids = sample(self.model.compute_logits(hidden), self.sampling, self.generator).tolist()
        end = self.now()
        stopped = set()
        for r, tok in (zip(sampled, next_ids) if sampled else ()):
            self.tokens[r].append(tok)
            r.token_times.append(end)
            if r.first_token_s is None:
                r.first_token_s = end
            if not self.sampling.ignore_eos and tok == self.eos_token_id:
                stopped.add(r)
        _, finished = sched.complete_step(batch, stopped)
        for r in finished:
            r.finish_s = end
        kv = sched.kv
        record = StepRecord(
            step=len(self.records), start_s=start, end_s=end, new_tokens=query_lens, context_lens=context_lens,
            num_prefill=len(batch.prefill), num_decode=len(batch.decode), num_padding=len(batch.padding),
            num_sampled=len(sampled), kv_blocks_used=kv.num_used, preempted=[r.id for r in batch.preempted],
            swapped_blocks=len(batch.swap_out) + len(batch.swap_in))
        self.records.append(record)
        self.samples.append((end, len(sched.running), kv.num_used, sched.num_kv_tokens, len(sched.waiting)))
        return record

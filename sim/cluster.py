"""The simulated cluster: arrivals → router → replicas, run to completion in SimPy."""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.cost_model import RooflineCostModel, StepCostModel
from sim.errors import ConfigError
from sim.fitted_cost import load_profile
from sim.kv_cache import BlockAllocator
from sim.metrics import RequestRecords, records_from_requests
from sim.replica import Replica
from sim.request import Request
from sim.router import make_router
from sim.scenario import Plan
from sim.scheduler import Scheduler, SchedulerConfig, make_scheduler
from sim.speculative import SpeculationModel, reference_step_s
from sim.workload import RequestSpec, generate_requests


@dataclass
class ReplicaTrace:
    """What metrics and plots need from one replica (the executor fills the same)."""

    step_end: list[float]
    step_decodes_all: list[bool]
    samples: list[tuple[float, int, int, int, int]]
    num_blocks: int
    block_size: int
    num_preemptions: int
    peak_blocks: int


@dataclass
class RunResult:
    requests: list[Request]
    replicas: list[ReplicaTrace]
    wall_time_s: float
    engine: str = "sim"
    extra: dict = field(default_factory=dict)


def scheduler_config(plan: Plan) -> SchedulerConfig:
    sv, spec = plan.scenario.serving, plan.scenario.speculative
    return SchedulerConfig(
        batching=sv.batching, max_num_seqs=sv.max_num_seqs, max_num_batched_tokens=plan.max_num_batched_tokens,
        enable_chunked_prefill=sv.enable_chunked_prefill, prefill_chunk_size=plan.prefill_chunk_size,
        waiting_served_ratio=sv.waiting_served_ratio, max_waiting_tokens=sv.max_waiting_tokens,
        max_model_len=plan.max_model_len, preemption=plan.scenario.kv_cache.preemption, batch_size=sv.batch_size,
        num_speculative_tokens=spec.num_draft_tokens if spec else 0,
        speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else None)


def make_allocator(plan: Plan) -> BlockAllocator:
    kv = plan.scenario.kv_cache
    return BlockAllocator(plan.num_blocks, plan.block_size, watermark=kv.watermark,
                          num_swap_blocks=plan.num_swap_blocks, contiguous=kv.allocator == "contiguous")


def make_policy(plan: Plan, eager: bool = True) -> Scheduler:
    """The scheduler + KV allocator pair one replica runs (the executor builds the same)."""
    return make_scheduler(scheduler_config(plan), make_allocator(plan), eager=eager)


def make_cost_model(plan: Plan) -> StepCostModel:
    c = plan.scenario.cost_model
    if c.profile:
        return load_profile(plan.base_dir / c.profile, plan.model).scaled(c.profile_scale)
    return RooflineCostModel(plan.model, plan.hardware, compute_efficiency=c.compute_efficiency,
                             memory_efficiency=c.memory_efficiency, step_overhead_s=c.step_overhead_s,
                             per_seq_overhead_s=c.per_seq_overhead_s,
                             block_bytes=plan.block_size * plan.model.kv_bytes_per_token)


def speculation_model(plan: Plan, replica: int, draw: int = 0, cost: StepCostModel | None = None
                      ) -> SpeculationModel | None:
    """The simulator's drafter for one replica (its own seeded acceptance draws; `draw` picks another
    sequence of them), or None. With `draft_s_reference_step` the drafter's times are scaled by how fast
    `cost` (default: the plan's) runs that reference step against the profile they were measured with."""
    spec = plan.scenario.speculative
    if spec is None:
        return None
    seed = plan.scenario.workload.seed * 1000 + replica + 7919 * draw
    scale = reference_step_s(cost or make_cost_model(plan)) / spec.draft_s_reference_step \
        if spec.draft_s_reference_step else 1.0
    per_seq, per_step, per_token = (scale * spec.draft_s_per_seq, scale * spec.draft_s_per_step,
                                    scale * spec.draft_s_per_token)
    if spec.method == "medusa":
        if spec.medusa_rank_probs is None:
            raise ConfigError("required to simulate Medusa (per depth, the chance of each candidate rank; "
                              "`infersim serve` of the scenario measures it)", "speculative.medusa_rank_probs")
        return SpeculationModel(len(spec.medusa_tree), 0.0, spec.proposal_rate, per_seq, per_step, seed,
                                [tuple(p) for p in spec.medusa_tree],
                                spec.medusa_rank_probs, spec.verify_cost_ratio)
    if spec.acceptance_rate is None and not spec.request_rates:
        raise ConfigError("required to simulate speculative decoding (α, the chance each draft is accepted; "
                          "`infersim serve` of the scenario measures it), or request_rates",
                          "speculative.acceptance_rate")
    return SpeculationModel(spec.num_speculative_tokens, spec.acceptance_rate or 0.0, spec.proposal_rate,
                            per_seq, per_step, seed, verify_cost_ratio=spec.verify_cost_ratio,
                            draft_s_per_token=per_token,
                            request_rates=[tuple(p) for p in spec.request_rates] if spec.request_rates else None)


def simulate(plan: Plan, specs: list[RequestSpec] | None = None, bulk: bool = True,
             progress: Callable[[int], None] | None = None, spec_draw: int = 0) -> RunResult:
    """Simulate the plan's workload (or `specs`) until every request has completed or been rejected.
    `spec_draw`: which seeded sequence of speculative acceptance draws to use (0: the scenario's own)."""
    t0 = time.perf_counter()
    specs = generate_requests(plan.scenario.workload, plan.base_dir) if specs is None else specs
    env = simpy.Environment()
    cost = make_cost_model(plan)
    pending = [math.inf]  # arrival time of the next request not yet handed to a replica
    done = [0]

    def on_finish(_: Request) -> None:
        done[0] += 1
        if progress:
            progress(done[0])

    replicas = [Replica(env, i, make_policy(plan, eager=not bulk), cost, lambda: pending[0], bulk=bulk,
                        on_finish=on_finish, speculation=speculation_model(plan, i, spec_draw, cost))
                for i in range(plan.scenario.replicas)]
    router = make_router(plan.scenario.router)
    requests: list[Request] = []

    def arrivals():
        for i, spec in enumerate(specs):
            pending[0] = spec.arrival_s
            if spec.arrival_s > env.now:
                yield env.timeout(spec.arrival_s - env.now)
            req = Request(spec.id, spec.arrival_s, spec.prompt_len, spec.output_len)
            requests.append(req)
            if not replicas[router.pick(replicas)].add(req) and progress:
                done[0] += 1
                progress(done[0])
        pending[0] = math.inf

    env.process(arrivals())
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the run allocates millions of small objects and frees none of them in cycles
    try:
        env.run()
    finally:
        if gc_was_enabled:
            gc.enable()
    traces = [ReplicaTrace(r.step_end, r.step_decodes_all, r.samples, r.scheduler.kv.num_blocks,
                           r.scheduler.kv.block_size, r.scheduler.num_preemptions,
                           r.scheduler.kv.peak_used) for r in replicas]
    return RunResult(requests, traces, time.perf_counter() - t0)


def sim_records(result: RunResult) -> RequestRecords:
    """Rebuild every token's time from the replicas' step tables and each request's runs of steps.

    A run (first, last) holds the token of its first step (a prefill, or a swap-in) and then one token
    for every step in (first, last] that decoded all running requests. With speculative decoding a step
    yields a varying number of tokens per request: the replicas keep each token's time on the request.
    """
    if any(r.token_times for r in result.requests):
        return records_from_requests(result.requests)
    step_offset = np.cumsum([0] + [len(t.step_end) for t in result.replicas])
    ends = np.concatenate([np.asarray(t.step_end, float) for t in result.replicas] + [np.zeros(0)])
    mask = np.concatenate([np.asarray(t.step_decodes_all, bool) for t in result.replicas] + [np.zeros(0, bool)])
    decode_steps = np.flatnonzero(mask)
    starts, lasts, owners = [], [], []
    for i, r in enumerate(result.requests):
        off = step_offset[r.replica]
        for first, last in r.runs:
            starts.append(first + off)
            lasts.append(last + off)
            owners.append(i)
    starts, lasts = np.asarray(starts, np.int64), np.asarray(lasts, np.int64)
    a = np.searchsorted(decode_steps, starts, side="right")
    b = np.searchsorted(decode_steps, lasts, side="right")
    per_run = 1 + (b - a)
    run_off = np.concatenate([[0], np.cumsum(per_run)])
    # token j ≥ 1 of a run is decode step a + j - 1; token 0 is the run's first step
    pos = np.repeat(a - 1 - run_off[:-1], per_run) + np.arange(run_off[-1])
    idx = decode_steps[np.maximum(pos, 0)] if len(decode_steps) else np.zeros(run_off[-1], np.int64)
    idx[run_off[:-1]] = starts
    token_times = ends[idx]
    counts = np.bincount(np.asarray(owners, np.int64), weights=per_run, minlength=len(result.requests))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return records_from_requests(result.requests, token_times, offsets)

"""The simulated cluster: arrivals → router → replicas, run to completion in SimPy."""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.config.plan import Plan
from sim.config.workload import RequestSpec, generate_requests
from sim.cost.build import make_cost_model, speculation_model
from sim.policy.build import make_policy, make_router
from sim.policy.request import Request
from sim.report.metrics import RequestRecords, records_from_requests
from sim.report.trace import ReplicaTrace
from sim.simulator.replica import Replica


@dataclass
class RunResult:
    requests: list[Request]
    replicas: list[ReplicaTrace]
    wall_time_s: float
    engine: str = "sim"
    extra: dict = field(default_factory=dict)


def simulate(plan: Plan, specs: list[RequestSpec] | None = None, bulk: bool = True,
             progress: Callable[[int], None] | None = None, spec_draw: int = 0) -> RunResult:
    """Simulate the plan's workload (or `specs`) until every request has completed or been rejected.
    `spec_draw`: which seeded sequence of speculative acceptance draws to use (0: the scenario's own)."""
    t0 = time.perf_counter()
    specs = generate_requests(plan.workload, plan.base_dir) if specs is None else specs
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
                for i in range(plan.replicas)]
    router = make_router(plan.router)
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

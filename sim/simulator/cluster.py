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
from sim.report.metrics import RequestRecords, records_from_requests, summarize_gaps
from sim.report.trace import ReplicaTrace
from sim.simulator.pipeline import Pipeline
from sim.simulator.replica import Replica


@dataclass
class RunResult:
    requests: list[Request]
    replicas: list[ReplicaTrace]
    wall_time_s: float
    engine: str = "sim"
    extra: dict = field(default_factory=dict)


def make_pipeline(env: simpy.Environment, plan: Plan) -> Pipeline:
    """The stages of one pipelined replica: activations of hidden_size cross the hardware's link between them."""
    hw, m = plan.hardware, plan.model
    return Pipeline(env, plan.pipeline_parallel_size, m.hidden_size * m.act_bytes / hw.interconnect_bandwidth,
                    hw.interconnect_latency_s)


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

    engines = plan.virtual_engines  # per replica: 1, or the batches a pipelined replica keeps in flight
    pipelines = [make_pipeline(env, plan) if plan.pipeline_parallel_size > 1 else None for _ in range(plan.replicas)]
    replicas = [Replica(env, i, make_policy(plan, eager=not bulk), cost, lambda: pending[0], bulk=bulk,
                        on_finish=on_finish, speculation=speculation_model(plan, i, spec_draw, cost),
                        pipeline=pipelines[i // engines])
                for i in range(plan.replicas * engines)]
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
    traces = [ReplicaTrace(np.frombuffer(r.step_end, float), np.frombuffer(r.step_decodes_all, np.int8).view(bool),
                           np.frombuffer(r.samples, float).reshape(-1, 5), r.scheduler.kv.num_blocks,
                           r.scheduler.kv.block_size, r.scheduler.num_preemptions,
                           r.scheduler.kv.peak_used, np.frombuffer(r.runs, np.int64).reshape(-1, 3)) for r in replicas]
    if plan.pipeline_parallel_size > 1:
        for i, trace in enumerate(traces):
            trace.pipeline_busy_s = pipelines[i // engines].busy_s  # one list per replica, shared by its engines
    return RunResult(requests, traces, time.perf_counter() - t0)


def sim_records(result: RunResult) -> RequestRecords:
    """The requests' records. With speculative decoding a step yields each request its own number of tokens and
    the replicas keep every token's time on its request; otherwise the inter-token gaps come from itl_sample."""
    if any(r.token_times for r in result.requests):
        return records_from_requests(result.requests)
    return records_from_requests(result.requests, summarize_gaps(itl_sample(result)))


def itl_sample(result: RunResult) -> list[np.ndarray]:
    """Every completed request's inter-token gaps as a weighted sample (values[k] occurs weights[k] times),
    rebuilt from the replicas' step tables and each request's runs of steps: memory goes with steps, not tokens.

    A run (first, last) holds the token of its first step (a prefill, or a swap-in) and then one token for every
    step in (first, last] that decoded all running requests. So the gap between a decode step and the decode step
    before it is the gap of every run that holds both; a run adds its first gap (first step to its first decode
    step) and, after a preemption, the gap since its request's previous token.
    """
    values, weights = [], []
    for trace in result.replicas:  # every logged run is of a request that finished: none is cut short
        if not len(trace.runs):
            continue
        ends = np.asarray(trace.step_end, float)
        decode = np.arange(len(ends), dtype=np.int32)[np.asarray(trace.step_decodes_all, bool)]
        owner, first, last = trace.runs[:, 0], trace.runs[:, 1], trace.runs[:, 2]
        a = np.searchsorted(decode, first, side="right")  # the run's tokens after its first: decode[a:b]
        b = np.searchsorted(decode, last, side="right")
        has = b > a
        values.append(ends[decode[a[has]]] - ends[first[has]])  # first step -> first decode step
        weights.append(np.ones(int(has.sum()), np.int32))
        # a run after a preemption: from the request's previous token (its last run's last) to this run's first
        order = np.lexsort((first, owner))
        o, f = owner[order], first[order]
        prev_last = np.where(has[order], ends[decode[np.maximum(b[order] - 1, 0)]], ends[f])
        again = np.flatnonzero(o[1:] == o[:-1]) + 1
        values.append(ends[f[again]] - prev_last[again - 1])
        weights.append(np.ones(len(again), np.int32))
        del order, o, f, prev_last, again
        cover = np.zeros(len(decode) + 1, np.int32)  # runs holding both decode[j] and decode[j + 1]
        np.add.at(cover, a[has], 1)
        np.add.at(cover, b[has] - 1, -1)
        del a, b, has, owner, first, last
        np.cumsum(cover, out=cover)
        cover = cover[:max(0, len(decode) - 1)]
        held = cover > 0
        ends_decode = ends[decode]
        del decode
        values.append(np.diff(ends_decode)[held] if len(ends_decode) > 1 else np.zeros(0))
        weights.append(cover[held])
        del cover, held, ends_decode
    if not values:
        return [np.zeros(0), np.zeros(0, np.int32)]
    values = np.concatenate(values)
    return [values, np.concatenate(weights)]

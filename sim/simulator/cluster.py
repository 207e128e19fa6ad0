"""The simulated cluster: arrivals → router → replicas, run to completion in SimPy."""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import simpy

from sim.config.client import slides
from sim.config.generator import plan_requests
from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.policy.build import make_router
from sim.policy.prefix import request_maker
from sim.policy.request import Request
from sim.report.metrics import RequestRecords, records_from_requests, summarize_gaps
from sim.simulator.engines import Arrivals, Done, RunResult, SameInstant, make_engines, make_pipeline, run_env, trace_of

__all__ = ["Done", "RunResult", "make_pipeline", "simulate", "sim_records", "itl_sample"]


def simulate(plan: Plan, specs: list[RequestSpec] | None = None, bulk: bool = True,
             progress: Callable[[int], None] | None = None, spec_draw: int = 0,
             watch: Callable[[Request | None], bool] | None = None) -> RunResult:
    """Simulate the plan's workload (or `specs`) until every request has completed or been rejected, or until
    `watch`, told of each request that ends (None: rejected on arrival), returns True (`RunResult.stopped`).
    `spec_draw`: which seeded sequence of speculative acceptance draws to use (0: the scenario's own)."""
    if plan.pools is not None:
        from sim.simulator.disaggregated import simulate_pools  # disaggregated plans alone load it

        return simulate_pools(plan, specs, bulk, progress, watch)
    t0 = time.perf_counter()
    specs = plan_requests(plan) if specs is None else specs
    env = simpy.Environment()
    done = Done(env, progress, watch)
    make = request_maker(plan.enable_prefix_caching, plan.block_size, plan.scheduler.max_model_len)
    arrivals = Arrivals(env, specs, done, make, SameInstant(env), plan.workload.max_concurrency, slides(plan.client),
                        plan.replicas)
    # with no early stop, an engine's steps before the next arrival need no events (Replica.ahead)
    replicas, pipelines = make_engines(env, plan, arrivals.next_s, bulk, done, spec_draw,
                                       ahead=arrivals.known and watch is None, arrivals_known=arrivals.known,
                                       sends=arrivals.sends)
    router = make_router(plan.router)
    # one engine: every router picks it (their picks keep no state that shows in a run)
    arrivals.start(replicas[0].add if len(replicas) == 1 else lambda req: replicas[router.pick(replicas, req)].add(req))
    run_env(env, done.stop)
    for r in replicas:
        r.settle_token_times()
    engines = plan.virtual_engines
    traces = [trace_of(r, pipelines[i // engines]) for i, r in enumerate(replicas)]
    return RunResult(arrivals.requests, traces, time.perf_counter() - t0, stopped=bool(done.stop and done.stop.triggered))


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
    warm = np.array([r.id for r in result.requests if r.warmup], np.int64)  # workload.client's: in no figure
    for trace in result.replicas:  # every logged run is of a request that finished: none is cut short
        runs = trace.runs[~np.isin(trace.runs[:, 0], warm)] if len(warm) and len(trace.runs) else trace.runs
        if not len(runs):
            continue
        ends = np.asarray(trace.step_end, float)
        decode = np.arange(len(ends), dtype=np.int32)[np.asarray(trace.step_decodes_all, bool)]
        owner, first, last = runs[:, 0], runs[:, 1], runs[:, 2]
        a = np.searchsorted(decode, first, side="right")  # the run's tokens after its first: decode[a:b]
        b = np.searchsorted(decode, last, side="right")
        has = b > a
        values.append(ends[decode[a[has]]] - ends[first[has]])  # first step -> first decode step
        weights.append(np.ones(int(has.sum()), np.int32))
        # a run after a preemption: from the request's previous token (its last run's last) to this run's first
        order = np.lexsort((first, owner))
        o, f = owner[order], first[order]
        prev_last = np.where(has[order], ends[decode[np.maximum(b[order] - 1, 0)]], ends[f]) if len(decode) \
            else ends[f]  # a trace with no decode step (a prefill instance's): every run is its first step
        again = np.flatnonzero(o[1:] == o[:-1]) + 1
        values.append(ends[f[again]] - prev_last[again - 1])
        weights.append(np.ones(len(again), np.int32))
        del order, o, f, prev_last, again
        # runs holding both decode[j] and decode[j + 1]: +1 where each starts, -1 where it ends, summed
        cover = np.bincount(a[has], minlength=len(decode) + 1).astype(np.int32)
        cover -= np.bincount(b[has] - 1, minlength=len(decode) + 1).astype(np.int32)
        del a, b, has, owner, first, last
        np.cumsum(cover, out=cover)
        cover = cover[:max(0, len(decode) - 1)]
        held = cover > 0
        ends_decode = ends[decode]
        del decode
        values.append(np.diff(ends_decode)[held] if len(ends_decode) > 1 else np.zeros(0))
        weights.append(cover[held])
        del cover, held, ends_decode
    for trace in result.replicas:  # disaggregated: first token (prefill pool) to second (decode pool)
        if len(trace.handoff_gaps):
            values.append(trace.handoff_gaps)
            weights.append(np.ones(len(trace.handoff_gaps), np.int32))
    if not values:
        return [np.zeros(0), np.zeros(0, np.int32)]
    values = np.concatenate(values)
    return [values, np.concatenate(weights)]

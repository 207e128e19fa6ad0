"""Disaggregated serving (DistServe, Splitwise) in SimPy: a prefill pool and a decode pool of replicas.

A request arrives at a prefill instance (the prefill pool's router), whose step computes its prompt and first token;
the instance then hands it off (the prefill pool's scheduler keeps its blocks) to a decode instance (the decode
pool's router). The decode instance queues it until it has blocks for its KV, reserves them, and the KV crosses the
link (one transfer at a time into each decode instance: `Pools.transfer_s`); then the prefill instance frees its
blocks and the request joins the decode instance's next decode step. Time waiting for decode memory and on the link
lands in the gap between the first token and the second, as it does on real clusters.
"""
from __future__ import annotations

import math
import time
from array import array
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
from sim.report.metrics import mean_p50_p99
from sim.simulator.engines import Arrivals, Done, RunResult, SameInstant, make_engines, run_env, trace_of
from sim.simulator.replica import Replica


class KVTransfers:
    """The hand-off between the pools: routing to a decode instance, the links, and what crossed them."""

    def __init__(self, env: simpy.Environment, plan: Plan, done: Done, instant: SameInstant):
        self.env, self.pools, self.done, self.instant = env, plan.pools, done, instant
        self.router = make_router(plan.pools.decode.router)
        self.decode: list[Replica] = []
        self.link_free_at: list[float] = []  # per decode instance: when its link takes the next transfer
        self.source: dict[Request, tuple[Replica, float]] = {}  # handed off: its prefill instance, when
        self.seconds = array("d")  # per transfer: time on the link
        self.waits = array("d")  # per transfer: hand-off to the link (decode memory, then the link's queue)
        self.tokens = 0

    def attach(self, decode: list[Replica]) -> None:
        self.decode = decode
        self.link_free_at = [0.0] * len(decode)

    def hand_off(self, prefill: Replica, reqs: list[Request]) -> None:
        """Replica.on_handoff: each request to a decode instance's queue, once every prefill instance whose step ends
        now has handed off its own (the router's picks and the queues in request order, whichever step SimPy took
        first)."""
        for r in reqs:
            self.instant.then(r.id, lambda r=r: self._route(prefill, r))

    def _route(self, prefill: Replica, r: Request) -> None:
        d = self.router.pick(self.decode)
        replica = self.decode[d]
        if not replica.scheduler.add_prefilled(r):
            prefill.scheduler.handoff.release(r)
            prefill.wake(r.first_token_s, after_the_instant=True)
            self.done(r, r.first_token_s)  # turned away at its hand-off
            return
        r.replica = replica.index
        # the logical time (its first token: this hand-off), not env.now, whose last bits differ in bulk runs
        self.source[r] = (prefill, r.first_token_s)
        replica.wake(r.first_token_s, after_the_instant=True)

    def start(self, replica: Replica, reqs: list[Request]) -> None:
        """Replica.on_reserve: blocks reserved for these requests on `replica`; their KV goes over its link."""
        d = replica.index - self.decode[0].index
        now = replica.clock
        for r in reqs:
            begin = max(now, self.link_free_at[d])
            seconds = self.pools.transfer_s(r.num_computed)
            self.link_free_at[d] = begin + seconds
            self.seconds.append(seconds)
            self.waits.append(begin - self.source[r][1])
            self.tokens += r.num_computed
            self.env.process(self._arrive(r, replica, begin + seconds))

    def _arrive(self, r: Request, replica: Replica, at: float):
        yield self.env.timeout(at - self.env.now)
        prefill, _ = self.source.pop(r)
        prefill.scheduler.handoff.release(r)
        prefill.wake(at)
        replica.scheduler.handoff.received(r)
        replica.wake(at)

    def summary(self) -> dict:
        """The report's kv_transfer section."""
        # sorted: the same transfers in another event order (bulk runs or step by step) give the same bits
        secs, waits = np.sort(np.frombuffer(self.seconds, float)), np.sort(np.frombuffer(self.waits, float))
        return {"transfers": len(secs), "bytes": self.tokens * self.pools.prefill.model.kv_bytes_per_token,
                "link_bandwidth": self.pools.kv_bandwidth, "links_per_transfer": self.pools.kv_links,
                "transfer_s": mean_p50_p99(secs), "wait_s": mean_p50_p99(waits)}


def simulate_pools(plan: Plan, specs: list[RequestSpec] | None = None, bulk: bool = True,
                   progress: Callable[[int], None] | None = None,
                   watch: Callable[[Request | None], bool] | None = None) -> RunResult:
    """Simulate a disaggregated plan's workload until every request has completed or been rejected (or `watch`
    stops it: see cluster.simulate)."""
    t0 = time.perf_counter()
    specs = plan_requests(plan) if specs is None else specs
    env = simpy.Environment()
    done = Done(env, progress, watch)
    instant = SameInstant(env)
    link = KVTransfers(env, plan, done, instant)
    pools = plan.pools
    arrivals = Arrivals(env, specs, done, request_maker(pools.prefill.enable_prefix_caching, pools.prefill.block_size,
                                                   pools.prefill.scheduler.max_model_len),
                        instant, plan.workload.max_concurrency, slides(plan.client), pools.prefill.replicas)
    prefill, p_pipes = make_engines(env, pools.prefill, arrivals.next_s, bulk, done, hand_off=pools.decode,
                                    on_handoff=link.hand_off, arrivals_known=arrivals.known, sends=arrivals.sends)
    # nothing arrives at a decode instance from outside: hand-offs and transfers cut its runs short (Replica.wake)
    decode, d_pipes = make_engines(env, pools.decode, lambda: math.inf, bulk, done, first_index=len(prefill),
                                   on_reserve=link.start)
    link.attach(decode)
    router = make_router(pools.prefill.router)
    arrivals.start(lambda req: prefill[router.pick(prefill, req)].add(req))
    run_env(env, done.stop)
    for r in prefill + decode:
        r.settle_token_times()
    traces = [trace_of(r, p_pipes[i // pools.prefill.virtual_engines], "prefill") for i, r in enumerate(prefill)] + \
        [trace_of(r, d_pipes[i // pools.decode.virtual_engines], "decode") for i, r in enumerate(decode)]
    return RunResult(arrivals.requests, traces, time.perf_counter() - t0, extra={"kv_transfer": link.summary()},
                     stopped=bool(done.stop and done.stop.triggered))

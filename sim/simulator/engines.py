"""What both cluster shapes are built from: a plan's replicas as SimPy engines, their traces, the run itself."""
from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import simpy

from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.cost.build import make_cost_model, make_pricer, speculation_model
from sim.policy.build import make_policy
from sim.policy.conversation import ended_at, reject_unsent
from sim.policy.request import Request, Status
from sim.policy.stages import arrival_book
from sim.report.trace import ReplicaTrace
from sim.simulator.replica import Replica

if TYPE_CHECKING:
    from sim.simulator.pipeline import Pipeline


@dataclass(eq=False, repr=False)
class RunResult:
    requests: list[Request]
    replicas: list[ReplicaTrace]
    wall_time_s: float
    engine: str = "sim"
    extra: dict = field(default_factory=dict)
    stopped: bool = False  # ended early by `watch`: some requests never finished


# SimPy takes an instant's events by priority (URGENT 0, NORMAL 1), then in the order they were scheduled
AFTER_THE_INSTANT = 2


class _AfterTheInstant(simpy.Event):
    """An event already triggered, taken after every other event of the current instant."""

    def __init__(self, env: simpy.Environment, callback: Callable[[simpy.Event], None]):
        super().__init__(env)
        self._ok, self._value = True, None  # triggered, as SimPy's own Timeout is when made
        self.callbacks.append(callback)
        env.schedule(self, AFTER_THE_INSTANT)


class SameInstant:
    """Work handed over at one instant by several engines (requests handed off, conversations' next turns), done after
    every event of that instant, in the order of its keys. SimPy takes simultaneous events in the order they were
    scheduled, which differs between bulk runs and step-by-step ones; a round-robin router or a queue would carry
    that order into the results."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.pending: list[tuple[int, Callable[[], None]]] = []

    def then(self, key: int, work: Callable[[], None]) -> None:
        """Do `work()` at the end of this instant; keys (request ids: unique) order the instant's work."""
        if not self.pending:
            _AfterTheInstant(self.env, self._run)
        self.pending.append((key, work))

    def _run(self, _event: simpy.Event) -> None:
        todo, self.pending = sorted(self.pending, key=lambda p: p[0]), []
        for _, work in todo:
            work()


def make_pipeline(env: simpy.Environment, plan: Plan) -> Pipeline:
    """The stages of one pipelined replica (its engines' steps come priced by stage: make_pricer)."""
    from sim.simulator.pipeline import Pipeline  # pipeline-parallel plans alone load it

    return Pipeline(env, plan.pipeline_parallel_size)


def make_engines(env: simpy.Environment, plan: Plan, next_arrival: Callable[[], float], bulk: bool,
                 on_finish: Callable[[Request, float], None], spec_draw: int = 0, first_index: int = 0,
                 hand_off: Plan | None = None, ahead: bool = False, **hooks) -> tuple[list[Replica], list[Pipeline | None]]:
    """The plan's replicas as SimPy engines (a pipelined replica: one per virtual engine, sharing its stages), and
    each replica's pipeline. `hand_off`: a prefill pool's decode pool (make_policy); `ahead`: nothing but the book's
    arrivals reaches the engines, which may run ahead of SimPy's clock up to the next (one without a pipeline);
    `hooks`: the disaggregated hand-off callbacks and the book's sendings (see Replica)."""
    cost = make_cost_model(plan)
    pricer = make_pricer(plan, cost)
    engines = plan.virtual_engines  # per replica: 1, or the batches a pipelined replica keeps in flight
    pipelines = [make_pipeline(env, plan) if plan.pipeline_parallel_size > 1 else None for _ in range(plan.replicas)]
    replicas = [Replica(env, first_index + i, make_policy(plan, eager=not bulk, hand_off=hand_off),
                        pricer, next_arrival, bulk=bulk, on_finish=on_finish,
                        speculation=speculation_model(plan, i, spec_draw, cost), pipeline=pipelines[i // engines],
                        async_scheduling=plan.engine is not None and plan.engine.async_scheduling,
                        ahead=ahead and pipelines[i // engines] is None, **hooks)
                for i in range(plan.replicas * engines)]
    for i, pipeline in enumerate(pipelines):
        if pipeline is not None:
            pipeline.engines = replicas[i * engines:(i + 1) * engines]
    return replicas, pipelines


def trace_of(r: Replica, pipeline: Pipeline | None = None, pool: str | None = None) -> ReplicaTrace:
    """What the report needs from one simulated engine."""
    kv = r.scheduler.kv
    decodes_all = np.ones(len(r.step_end), bool)
    decodes_all[np.frombuffer(r.prompt_steps, np.int64)] = False
    return ReplicaTrace(np.frombuffer(r.step_end, float), decodes_all,
                        np.frombuffer(r.samples, float).reshape(-1, 5), kv.num_blocks, kv.block_size,
                        r.scheduler.num_preemptions, kv.peak_used, np.frombuffer(r.runs, np.int64).reshape(-1, 3),
                        pipeline.busy_s if pipeline is not None else None, pool, r.busy_s,
                        np.frombuffer(r.handoff_gaps, float), kv.queried_tokens, kv.hit_tokens, kv.peak_by_kind)


class Arrivals:
    """The workload's arrival book (sim.policy.arrivals) on SimPy's clock: each request sent at its time to
    `admit(req)` (False: rejected, so it ends now). The book is told of every request that ends (Done.on_end) and
    what that makes due is taken in after every other event of the instant (SameInstant), so the order SimPy took
    the instant's events in does not matter. `book.next_s()` is the earliest arrival known now (the replicas' bulk
    decode stops short of it)."""

    def __init__(self, env: simpy.Environment, specs: list[RequestSpec], done: Done,
                 make_request: Callable[[RequestSpec], Request], instant: SameInstant,
                 max_concurrency: int | None = None, slide: bool = False, frontends: int = 1):
        self.env, self.specs, self.done, self.make, self.instant = env, specs, done, make_request, instant
        self.book = arrival_book(specs, max_concurrency, slide=slide, frontends=frontends)
        self.next_s = self.book.reader()  # book.next_s, a known book's without a Python call
        self.requests: list[Request] = []
        self.admit: Callable[[Request], bool] | None = None
        self.known = self.book.known  # every arrival time known from the start
        # every request sent ahead where the book knows them all, so that no event waits at a sending; the replicas
        # keep stopping their runs at these times (Replica.sends)
        self.sends = self.book.send_all() if self.known and self.book.transport else None
        self.alarms: list[float] = []  # heap: times a timeout will look at the book
        self.flushing = False  # a look at the end of this instant is booked
        if not self.known:
            done.on_end = self.ended

    def start(self, admit: Callable[[Request], bool]) -> None:
        self.admit = admit
        self._arm(self.env.now)

    def _arm(self, now: float) -> None:
        """A timeout at the book's next time, unless one is set for then or earlier (`now`: SimPy's clock)."""
        next_s = self.next_s  # held by the Arrivals: from a local, as Python 3.11 specializes no method load
        t = next_s()
        if t < math.inf and (not self.alarms or t < self.alarms[0]):
            heapq.heappush(self.alarms, t)
            wait = t - now
            self.env.timeout(wait if wait > 0.0 else 0.0).callbacks.append(self._ring)  # max() without the call

    def _ring(self, _event: simpy.Event) -> None:
        heapq.heappop(self.alarms)
        if self.known:  # first turns alone: sent as their time comes
            self._flush()
        else:
            self._flush_after_instant()

    def _flush_after_instant(self) -> None:
        if not self.flushing:
            self.flushing = True
            self.instant.then(-1, self._flush)  # no request has id -1

    def _flush(self) -> None:
        self.flushing = False
        now = self.env.now
        for send in self.book.due(now):
            req = self.make(self.specs[send.index])
            req.arrival_s, req.client_wait_s, req.client_in_s = send.arrival_s, send.client_wait_s, send.in_s
            self.requests.append(req)
            if send.unsent:
                reject_unsent(req, send.arrival_s)
                self.done()
            elif not self.admit(req):
                self.done()
                self.ended(req, req.arrival_s)
        self._arm(now)

    def ended(self, req: Request, at: float | None = None) -> None:
        """A request ended (or was turned away) at `at`, by the clock that ended it (None: now): the book takes it in
        at the end of the instant. Times run from the end, not env.now, whose last bits differ between bulk runs and
        steps."""
        self.book.ended(req.id, ended_at(req, self.env.now if at is None else at), req.status is Status.FINISHED)
        self._flush_after_instant()


def run_env(env: simpy.Environment, until: simpy.Event | None = None) -> None:
    """Run the simulation to its end (or until `until` fires), the garbage collector paused."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the run allocates millions of small objects and frees none of them in cycles
    try:
        env.run(until=until)
    except RuntimeError as e:  # every request ended before `until` fired: the natural end
        if until is None or until.triggered or not str(e).startswith("No scheduled events left"):
            raise
    finally:
        if gc_was_enabled:
            gc.enable()


class Done:
    """Counts requests that ended (completed or rejected; a rejection at arrival is reported as None), telling
    `progress`; `watch(request)` returning True stops the run early (`stop` fires: e.g. an SLO already missed)."""

    def __init__(self, env: simpy.Environment, progress: Callable[[int], None] | None = None,
                 watch: Callable[[Request | None], bool] | None = None):
        self.count, self.progress, self.watch = 0, progress, watch
        self.stop = env.event() if watch is not None else None
        # told of each request that ends after it was admitted, and when, by the clock that ended it (None: now)
        self.on_end: Callable[[Request, float | None], None] | None = None

    def __call__(self, req: Request | None = None, at: float | None = None) -> None:
        if req is not None and self.on_end is not None:
            self.on_end(req, at)
        self.count += 1
        if self.progress:
            self.progress(self.count)
        if self.watch is not None and self.watch(req) and not self.stop.triggered:
            self.stop.succeed()

"""What both cluster shapes are built from: a plan's replicas as SimPy engines, their traces, the run itself."""
from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.cost.build import make_cost_model, make_pricer, speculation_model
from sim.policy.build import make_policy
from sim.policy.client import ClientGate
from sim.policy.conversation import Conversations, ended_at, reject_unsent
from sim.policy.request import Request
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
    return Pipeline(env, plan.pipeline_parallel_size)


def make_engines(env: simpy.Environment, plan: Plan, next_arrival: Callable[[], float], bulk: bool,
                 on_finish: Callable[[Request, float], None], spec_draw: int = 0, first_index: int = 0,
                 hand_off: Plan | None = None, **hooks) -> tuple[list[Replica], list[Pipeline | None]]:
    """The plan's replicas as SimPy engines (a pipelined replica: one per virtual engine, sharing its stages), and
    each replica's pipeline. `hand_off`: a prefill pool's decode pool (make_policy); `hooks`: the disaggregated
    hand-off callbacks (see Replica)."""
    cost = make_cost_model(plan)
    pricer = make_pricer(plan, cost)
    engines = plan.virtual_engines  # per replica: 1, or the batches a pipelined replica keeps in flight
    pipelines = [make_pipeline(env, plan) if plan.pipeline_parallel_size > 1 else None for _ in range(plan.replicas)]
    replicas = [Replica(env, first_index + i, make_policy(plan, eager=not bulk, hand_off=hand_off),
                        pricer, next_arrival, bulk=bulk, on_finish=on_finish,
                        speculation=speculation_model(plan, i, spec_draw, cost), pipeline=pipelines[i // engines],
                        **hooks)
                for i in range(plan.replicas * engines)]
    for i, pipeline in enumerate(pipelines):
        if pipeline is not None:
            pipeline.engines = replicas[i * engines:(i + 1) * engines]
    return replicas, pipelines


def trace_of(r: Replica, pipeline: Pipeline | None = None, pool: str | None = None) -> ReplicaTrace:
    """What the report needs from one simulated engine."""
    kv = r.scheduler.kv
    return ReplicaTrace(np.frombuffer(r.step_end, float), np.frombuffer(r.step_decodes_all, np.int8).view(bool),
                        np.frombuffer(r.samples, float).reshape(-1, 5), kv.num_blocks, kv.block_size,
                        r.scheduler.num_preemptions, kv.peak_used, np.frombuffer(r.runs, np.int64).reshape(-1, 3),
                        pipeline.busy_s if pipeline is not None else None, pool, r.busy_s,
                        np.frombuffer(r.handoff_gaps, float), kv.queried_tokens, kv.hit_tokens)


class Arrivals:
    """The arrival process: each request at its time to `admit(req)` (False: rejected, so it ends now). A
    conversation's later turn (RequestSpec.after) arrives its think time after the turn before it ends
    (sim.policy.conversation). A closed loop's units (RequestSpec.users: requests, or conversations) go in order to
    the first user free, each sent its think time after that user's unit before it ended. With `max_concurrency`, a
    request whose time comes while that many are in flight waits at the client and is sent when one ends; its arrival
    is then when it was sent. Users and the client's limit are one gate (sim.policy.client). `next_arrival()` is the
    earliest arrival known now (the replicas' bulk decode stops short of it)."""

    def __init__(self, env: simpy.Environment, specs: list[RequestSpec], done: Done,
                 make_request: Callable[[RequestSpec], Request], instant: SameInstant,
                 max_concurrency: int | None = None):
        self.env, self.specs, self.done, self.make, self.instant = env, specs, done, make_request, instant
        self.requests: list[Request] = []
        self.turns = Conversations(specs)
        users = next((s.users for s in specs if s.users), 0)  # a closed loop's, on each of its units
        self.by_user = users > 0
        limit = users or max_concurrency
        self.gate = ClientGate(limit) if limit else None
        self.next_first = math.inf  # the next request that follows no other
        self.scheduled: list[float] = []  # heap: arrival times known since a request ended (later turns, the gate's)
        self.admit: Callable[[Request], bool] | None = None
        self.known = not self.turns.any and self.gate is None  # every arrival time known from the start
        if not self.known:
            done.on_end = self.ended

    def next_arrival(self) -> float:
        return min(self.next_first, self.scheduled[0]) if self.scheduled else self.next_first

    def start(self, admit: Callable[[Request], bool]) -> None:
        self.admit = admit
        if self.by_user:  # each user takes a unit and thinks before sending it; the rest wait for a user
            for spec in self.specs:
                if spec.users and self.gate.offer(spec):
                    self._schedule(spec, spec.think_s)
        else:
            self.env.process(self._first())

    def _first(self):
        env = self.env
        for spec in self.specs:
            if spec.after >= 0:
                continue
            self.next_first = spec.arrival_s
            if spec.arrival_s > env.now:
                yield env.timeout(spec.arrival_s - env.now)
            self._arrive(self.make(spec))
        self.next_first = math.inf

    def _arrive(self, req: Request) -> None:
        if self.gate is not None and not self.by_user and not self.gate.offer(req):
            return  # waits at the client for a request in flight to end
        self._enter(req)

    def _enter(self, req: Request) -> None:
        """A request sent: to the deployment, which admits it or turns it away (it ends now)."""
        self.requests.append(req)
        if not self.admit(req):
            self.done()
            if not self.known:
                self.ended(req, req.arrival_s)

    def ended(self, req: Request, at: float | None = None) -> None:
        """A request ended (a rejected one at `at`, by the clock that turned it away; None: env.now): the turn after
        it (if any) arrives after its think time, or ends then unsent; the request waiting longest at the client (if
        any) is sent then; a closed loop's unit that ended frees its user for the next unit. Times run from the end,
        not env.now, whose last bits differ between bulk runs and steps."""
        end = ended_at(req, self.env.now if at is None else at)
        spec, gone = self.turns.ended(req)
        if spec is not None:
            self._schedule(spec, end + spec.think_s)
        for s in gone:
            turn = self.make(s)
            reject_unsent(turn, end)
            self.requests.append(turn)
            self.done()
        if self.gate is not None and (spec is None or not self.by_user):
            waiting = self.gate.release()
            if waiting is None:
                return
            if self.by_user:
                self._schedule(waiting, end + waiting.think_s)
            else:
                heapq.heappush(self.scheduled, end)
                self.instant.then(waiting.id, lambda: self._send(waiting, end))

    def _schedule(self, spec: RequestSpec, at: float) -> None:
        heapq.heappush(self.scheduled, at)
        self.env.process(self._later(spec, at))

    def _later(self, spec: RequestSpec, at: float):
        yield self.env.timeout(max(0.0, at - self.env.now))
        self.instant.then(spec.id, lambda: self._arrive_later(spec, at))  # turns due together: in id order

    def _arrive_later(self, spec: RequestSpec, at: float) -> None:
        heapq.heappop(self.scheduled)
        req = self.make(spec)
        req.arrival_s = at
        self._arrive(req)

    def _send(self, req: Request, at: float) -> None:
        """A request that waited at the client takes the slot a request freed at `at` (now): it arrives then."""
        heapq.heappop(self.scheduled)
        req.client_wait_s = at - req.arrival_s
        req.arrival_s = at
        self._enter(req)


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

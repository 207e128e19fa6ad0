"""One serving replica as a SimPy process: one event per engine step (or per run of identical steps)."""
from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from functools import partial
from itertools import repeat

import numpy as np
import simpy

from sim.cost.pricer import StepPricer
from sim.policy.request import Request
from sim.policy.scheduler import Scheduler

# Longest run of identical decode steps taken as one event; bounds the work wasted when cut short.
MAX_BULK_STEPS = 4096
# Speculative steps logged before their token times are written out: bounds the log's memory.
TOKEN_LOG_STEPS = 1024


class Replica:
    """Engine loop of one replica. Time advances by each step's price (sim/cost/pricer.py: StepPricer).

    Token times are not stored per token: each request keeps runs of steps (first step, last step)
    and the replica keeps each step's end time and the steps that decoded no running request (prompts alone),
    from which metrics rebuild every token's time. With speculative decoding, where a step yields each
    request its own number of tokens, every token's time is kept on its request instead, written from a log
    of the steps every so many steps and once the run is over (`settle_token_times`).
    """

    def __init__(self, env: simpy.Environment, index: int, scheduler: Scheduler, pricer: StepPricer,
                 next_arrival: Callable[[], float], bulk: bool = True,
                 on_finish: Callable[[Request, float], None] | None = None, speculation=None, pipeline=None,
                 on_handoff: Callable[[Replica, list[Request]], None] | None = None,
                 on_reserve: Callable[[Replica, list[Request]], None] | None = None, arrivals_known: bool = True,
                 async_scheduling: bool = False, ahead: bool = False, sends=None):
        self.env = env
        self.index = index
        self.scheduler = scheduler
        self.pricer = pricer
        self.next_arrival = next_arrival
        self.bulk = bulk
        self.on_finish = on_finish
        self.speculation = speculation  # sim.speculative.SpeculationModel: drafts and their acceptance
        self.pipeline = pipeline  # sim.simulator.pipeline.Pipeline: this engine is one of its virtual engines
        self.on_handoff = on_handoff  # disaggregated prefill instance: takes the requests handed off by a step
        self.on_reserve = on_reserve  # disaggregated decode instance: starts the KV transfers it reserved blocks for
        self.busy_s = 0.0  # time spent in steps
        self.handoff_gaps = array("d")  # disaggregated decode instance: first token (prefill pool) to the second
        self.in_run = False  # in a run of decode steps that `wake` may cut short
        self.run_horizon = math.inf  # the next arrival the run in progress was priced to stop at
        self.passing = -1  # the first sending the run in progress was priced past (_close_sends); -1: none
        # False where an arrival can become known during a run (a conversation's next turn, when the turn before it
        # ends): a run is then cut short by an arrival before its horizon, and a pipelined engine, whose stages are
        # booked for the whole run, does not run in bulk
        self.arrivals_known = arrivals_known
        # the engine schedules a step while the one before it runs: an arrival joins the step after next
        self.async_scheduling = async_scheduling
        # nothing reaches this engine but the book's arrivals (every one known, no hand-offs, no early stop): a step
        # or run that ends before the next one needs no SimPy event, the engine's clock runs ahead of SimPy's
        self.ahead = ahead
        self.settles = ahead and bulk  # a run's next step may be settled at once (_decode_runs), without timeouts
        # the sending times of a book that sent every request ahead (ArrivalBook.send_all): a run still ends an
        # event at each, as it did when the book stopped there, so the KV samples and busy time are the same bit for
        # bit (priced past them where the scheduler is settled, each such event closed by _close_sends)
        self.sends = sends
        self.next_send = 0  # the first of them after the engine's clock, as of the last run priced
        self.clock = 0.0
        # typed arrays, not lists of Python floats: a simulated day is tens of millions of steps
        self.step_end = array("d")
        # the steps that computed prompts alone (no chunked prefill); every other step decoded every running request
        self.prompt_steps = array("q")
        # (time, running sequences, KV blocks used, KV tokens stored, waiting) after each event, flat
        self.samples = array("d")
        # each run of steps a request ran without preemption: (request id, first step, last step), flat
        self.runs = array("q")
        # speculative: per step (end, decode rows, their accepted drafts, rows whose prompt ended), for token times
        self.token_log: list[tuple[float, list[Request], dict, list[Request]]] = []
        self.wakeup: simpy.Event | None = None
        # (rows, context, clock, steps at most, until, step ends) -> (steps, clock): StepCostModel.decode_run's; the
        # cost model's own (StepPricer forwards to it) without the pricer's call, as its decode_time: the hot path
        self.run_decodes = pricer.cost.decode_run if pipeline is None else partial(pipeline.decode_run, pricer)
        self.decode_time = pricer.cost.decode_time
        self.process = env.process(self.run())

    @property
    def num_outstanding(self) -> int:
        return self.scheduler.num_outstanding

    def add(self, req: Request) -> bool:
        """Hand an arriving request to the scheduler; wakes the engine if it was idle."""
        req.replica = self.index
        accepted = self.scheduler.add(req)
        if accepted and self.wakeup is not None and not self.wakeup.triggered:
            self.wakeup.succeed(req.arrival_s)
        elif accepted and self.in_run and req.arrival_s < self.run_horizon:  # a turn the run was not priced for
            self.in_run = False
            self.process.interrupt(True)  # sent after the instant's events (SameInstant), as every such turn is
        return accepted

    def wake(self, at: float, after_the_instant: bool = False) -> None:
        """Something this replica waits for happened at `at`, now (a hand-off, a transfer done, blocks released): an
        idle engine looks again from then, one in a run of decode steps stops it at the step in flight.
        `after_the_instant`: it happened after every other event of this instant (SameInstant: a hand-off)."""
        if self.wakeup is not None and not self.wakeup.triggered:
            self.wakeup.succeed(at)
        elif self.in_run:
            self.in_run = False
            self.process.interrupt(after_the_instant)

    def _cut_run(self, first: int, k: int, after_the_instant: bool) -> tuple[int, float]:
        """A run of k decode steps from step `first` interrupted now: the steps that ended by now and the one in
        flight stay, the rest are dropped. Returns (steps kept, their end). A step ending at this very instant is in
        flight for an event SimPy takes before it (a transfer landing, scheduled before the step began), and done for
        work done after the instant's events: step by step, the engine has begun its next step by then."""
        ends = self.step_end
        find = bisect_right if after_the_instant else bisect_left
        done = find(ends, self.env.now, first, first + k) - first  # steps done by now
        kept = min(k, done + 1)
        del ends[first + kept:]
        return kept, ends[-1]

    def _end_runs(self, preempted: list[Request], last: int) -> None:
        """Preempted requests: their runs of steps end at step `last`."""
        for r in preempted:
            if r.run_start >= 0:
                self.runs.extend((r.id, r.run_start, last))
                r.run_start = -1

    def run(self):
        sched, env, spec, next_arrival = self.scheduler, self.env, self.speculation, self.next_arrival
        handoff, step_end = sched.handoff, self.step_end
        timeouts = sched.cfg.max_queue_delay_s is not None
        while True:
            if timeouts:
                for r in sched.expire(self.clock):
                    if self.on_finish:
                        self.on_finish(r, self.clock)
            if handoff.incoming:
                self.on_reserve(self, sched.reserve_transfers())
            if self.async_scheduling:  # what arrived once the step that just ended was under way waits a step more
                sched.visible_until = step_end[-2] if sched.running and len(step_end) > 1 else math.inf
            draft_s = spec.propose(sched.decoding.members) if spec and sched.drafting else 0.0
            batch = sched.schedule() if sched.has_work() else None
            if batch is None or batch.shape.num_seqs <= 0:  # not batch, without its __bool__ call
                if batch is not None and batch.preempted:  # every row gave its blocks back (to transfers): pick again
                    self._end_runs(batch.preempted, len(step_end) - 1)
                    continue
                # an empty engine can always take the head of its queue, unless blocks wait to be sent or to be
                # filled by a transfer on its way (its arrival wakes the engine)
                if sched.has_work() and not handoff.sending and not handoff.receiving:
                    raise RuntimeError(f"replica {self.index}: work queued but nothing schedulable")
                self.wakeup = env.event()
                self.clock = max(self.clock, (yield self.wakeup))
                self.wakeup = None
                continue
            step = len(step_end)
            # a pipelined engine runs a bulk run only while it has the stages to itself until the next arrival (a decode
            # pool's hand-offs could cut it short after the stages were booked: not there)
            if batch.decode_only and self.bulk and (self.pipeline is None or (
                    self.on_reserve is None and self.arrivals_known and self.pipeline.alone(self))):
                yield from self._decode_runs(batch.shape.num_seqs, batch.shape.sum_context, step, timeouts)
                continue
            clock = self._step_end(batch, draft_s)
            step_end.append(clock)
            if not batch.decodes:
                self.prompt_steps.append(step)
            self.busy_s += clock - self.clock
            if batch.preempted:
                self._end_runs(batch.preempted, step - 1)
            if not self.ahead or clock >= next_arrival():
                wait = clock - env.now
                yield env.timeout(wait if wait > 0.0 else 0.0)  # max(0.0, wait) without the call
            self._close(self._complete(batch, step, clock), step, clock)
            if self.settles and not timeouts:  # the decodes alone may follow at once, as a run
                yield from self._decode_runs(0, 0, step + 1, timeouts, settled=False)

    def _close(self, finished: list[Request], last: int, clock: float) -> None:
        """An event ends at `clock` with step `last`: the engine's clock, the requests that finished, a KV sample."""
        self.clock = clock
        sched = self.scheduler
        for r in finished:
            self.runs.extend((r.id, r.run_start, last))
            r.run_start = -1
            r.finish_s = clock
            if self.on_finish:
                self.on_finish(r, clock)
        # fromlist: half the time of extend's generic path, once per event
        self.samples.fromlist(sched.kv_sample(clock))

    def _decode_runs(self, b: int, s: int, step: int, timeouts: bool, settled: bool = True):
        """SimPy process body: runs of identical decode steps of `b` rows and `s` tokens of context from step `step`,
        each up to the next arrival (or queue expiry) as one event, cut short at the step in flight if interrupted.
        Where nothing but the book's arrivals reaches the engine (Replica.settles; no queue timeouts), the next run
        follows at once while the scheduler takes the decodes alone again (`schedule_decodes`: their blocks granted):
        a finish, a sending, or an arrival async scheduling does not see yet needs no pass through the engine loop,
        and each run is accounted for (its KV sample, busy time) as if it had had one. `settled` False: the step that
        ended was the engine loop's; the scheduler is asked first (`b`, `s` unused)."""
        sched, env = self.scheduler, self.env
        settles = self.settles and not timeouts
        while True:
            if not settled:  # the engine loop's pass would schedule the decodes alone: settled here, or it forms the step
                if not settles:
                    return
                if self.async_scheduling:  # as the engine loop notes what async scheduling sees (`run`)
                    step_end = self.step_end
                    sched.visible_until = step_end[-2] if sched.running and len(step_end) > 1 else math.inf
                if (shape := sched.schedule_decodes()) is None:
                    return
                b, s = shape
            settled = False
            k, clock, arrival = self._price_run(b, s, timeouts)
            # before SimPy delivers the arrival: the sendings' events saw none (ahead: nothing cuts the run short)
            passed = k - self._close_sends(step, k) if self.passing >= 0 else 0
            if not self.ahead or clock >= arrival:  # an arrival (or anything, without ahead) may cut it short
                self.in_run = k > 1
                wait = clock - env.now
                try:
                    yield env.timeout(wait if wait > 0.0 else 0.0)  # max(0.0, wait) without the call
                except simpy.Interrupt as stop:
                    k, clock = self._cut_run(step, k, stop.cause)
                    yield env.timeout(max(0.0, clock - env.now))
                self.in_run = False
            self.busy_s += clock - self.clock
            self._close(sched.advance_decode(k - passed), step + k - 1, clock)
            step += k

    def _price_run(self, b: int, s: int, timeouts: bool) -> tuple[int, float, float]:
        """A run of identical decode steps from the engine's clock up to the next arrival, queue expiry or sending,
        its steps' ends written. Returns (steps, their end, the next arrival)."""
        # the replica's callables from locals: Python 3.11 specializes no method load of an instance's callable
        sched, decode_time, next_arrival, run_decodes = self.scheduler, self.decode_time, self.next_arrival, \
            self.run_decodes
        arrival = next_arrival()
        if sched.waiting and sched.waiting[-1].arrival_s > sched.visible_until:  # seen after this step: one step,
            # whatever the horizon (a lone step passes no sending, and no wake cuts it: in_run is for runs of more)
            self.passing, self.run_horizon = -1, arrival
            k, clock = run_decodes(b, s, self.clock, 1, arrival, self.step_end)
            return k, clock, arrival
        horizon = min(arrival, sched.next_expiry()) if timeouts else arrival
        self.passing, sends, step_s = -1, self.sends, 0.0
        if sends is not None:  # the next sending after this clock: the clock only moves on, and the index with it
            i, clock, n = self.next_send, self.clock, len(sends)
            while i < n and sends[i] <= clock:  # bisect_right(sends, clock), from where it was
                i += 1
            self.next_send = i
            if i < n and sends[i] < horizon:
                if self.ahead and not timeouts and not sched.waiting and sched.decodes_settled():
                    step_s = decode_time(b, s)
                    # the run goes on past the sendings (_close_sends), unless a run cut at one could be MAX_BULK_STEPS
                    self.passing = i if (horizon - self.clock) / step_s < MAX_BULK_STEPS else -1
                if self.passing < 0:
                    horizon = sends[i]
        self.run_horizon = horizon
        # steps only get slower as contexts grow, so this many reach the next arrival (inf: none, or one so far off, a
        # queue delay of 1e308 s, that the quotient overflows)
        steps = (horizon - self.clock) / (step_s or decode_time(b, s))
        k_max = int(steps) + 1 if steps < MAX_BULK_STEPS else MAX_BULK_STEPS
        k_max = sched.decode_horizon(k_max if k_max > 1 else 1)  # max(k_max, 1) without the call
        k, clock = run_decodes(b, s, self.clock, k_max, horizon, self.step_end)
        if self.passing >= 0 and (k < 2 or self.step_end[-2] < sends[self.passing]):  # it passed none: ends at one
            self.passing = -1
        return k, clock, arrival

    def _close_sends(self, first: int, k: int) -> int:
        """A run of k steps from step `first` priced past the sendings before its end (`_price_run`): each event a run
        cut at a sending would have ended with is closed as that run's was (its busy time, its steps' blocks and
        counters, a KV sample), bit for bit. Returns the steps after the last such event, for advance_decode."""
        sends, ends, sched = self.sends, self.step_end, self.scheduler
        i, start, last = self.passing, first, first + k - 1
        while i < len(sends):
            end = bisect_left(ends, sends[i], start, last)  # the step in flight at the sending
            if end >= last:  # the run's own last step: its own event
                break
            clock = ends[end]
            self.busy_s += clock - self.clock
            sched.pass_decodes(end - start + 1)
            self._close((), end, clock)
            start = end + 1
            i = bisect_right(sends, clock, i)
        return last - start + 1

    def _step_end(self, batch, draft_s: float) -> float:
        """When one step from the engine's clock ends: after its price, or on a pipelined replica when it leaves the
        last stage (the stages may be busy with other engines' steps)."""
        if self.pipeline is None:
            return self.clock + self.pricer.step_s(batch.shape, draft_s)
        # from the engine's clock, as a bulk run's steps are: env.now may differ from it in the last bit
        return self.pipeline.passage(self.clock, self.pricer.step_stages(batch.shape, draft_s))

    def _complete(self, batch, step: int, clock: float) -> list[Request]:
        """The scheduler's side of a step that ended at `clock`: drafts accepted, first tokens, hand-offs. Returns
        the requests that finished."""
        sched, spec = self.scheduler, self.speculation
        if spec:
            prompts = [(r, r.num_generated) for r, _ in batch.prefill]
            accepted = spec.accept(batch.decode)
            started, finished = sched.complete_step(batch, accepted=accepted)
            self.token_log.append((clock, batch.decode, accepted, [r for r, n in prompts if r.num_generated > n]))
            if len(self.token_log) >= TOKEN_LOG_STEPS:
                self.settle_token_times()
        else:
            started, finished = sched.complete_step(batch)
        for r in started:
            r.run_start = step
            if r.first_token_s is None:
                r.first_token_s = clock
        for r in batch.received:
            self.handoff_gaps.append(clock - r.first_token_s)
        if sched.handoff.outbox:
            self.on_handoff(self, sched.handoff.take())
        return finished

    def settle_token_times(self) -> None:
        """Speculative decoding: append the logged steps' token times to their requests, in step order, in one
        numpy pass instead of a list extend per row and step (each decode row got its accepted drafts and one token
        of its own; a prompt that ended, its first token)."""
        if not self.token_log:
            return
        rows: list[Request] = []
        accepted: list[int] = []
        ends, sizes = [], []
        for end, decoded, acc, prompts in self.token_log:
            rows += decoded
            rows += prompts
            accepted += map(acc.get, decoded, repeat(0))  # the drafter never accepts more than a row drafted
            accepted += repeat(0, len(prompts))
            ends.append(end)
            sizes.append(len(decoded) + len(prompts))
        self.token_log = []
        tokens = np.asarray(accepted, np.int64) + 1
        times = np.repeat(np.repeat(np.asarray(ends), sizes), tokens)
        owner = np.repeat(np.arange(len(rows)), tokens)
        if not len(owner):  # steps that only computed prompt chunks
            return
        key = np.fromiter(map(id, rows), np.int64, len(rows))[owner]  # one key per request: its identity
        order = np.argsort(key, kind="stable")  # each request's tokens together, in step order
        key, owner, times = key[order], owner[order], times[order].tolist()
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]).tolist() + [len(times)]
        for lo, hi in zip(starts, starts[1:]):
            rows[owner[lo]].token_times.extend(times[lo:hi])

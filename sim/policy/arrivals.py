"""The arrival book: which request of a workload is sent when, for any clock. The simulator (SimPy), the executor's
replay (the wall clock, between engine steps) and the HTTP replay client (asyncio) each drive one: they ask when the
next request is due, take what is due by now, and say when a request they sent ended.

A workload's first turns arrive at their times. A conversation's later turn (RequestSpec.after) arrives its think
time after the turn before it ends, or is rejected unsent with it (sim.policy.conversation). A closed loop's units
(RequestSpec.users: requests, or conversations) go in order to the first user free, each sent its think time after
that user's unit before it ended. With `max_concurrency`, a request whose time comes while that many are in flight
waits at the client and is sent when one ends; its arrival is then when it was sent. Users and the client's limit
are one gate (sim.policy.client). At one instant a slot frees before it is taken, and first turns come before later
ones: the book orders what is due by (time, kind, request id), whatever order the clock learned of it.

With a client's transport (workload.client: RequestSpec.in_s, front_s, out_s, close_s) a request reaches a front end
(a server process) its in_s after it was sent, waits there for the requests sent before it, and reaches the engine
front_s after the front end took it (Send.arrival_s is then the engine's arrival); its end reaches the client its
out_s + close_s after the engine's last token: a user, a slot or a conversation's next turn goes on from there. A clock whose
transport is real (the HTTP replay client) builds the book with `transport=False`. Warm-up requests
(RequestSpec.warmup) go first; the others start once every one of them ended, their times counted from then. With
`slide` (aiperf's rate under a concurrency limit) a request waiting for a slot holds the schedule back: the requests
after it keep their gaps from its sending, not their times.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from sim.config.workload import RequestSpec
from sim.policy.client import ClientGate
from sim.policy.conversation import Conversations


@dataclass(slots=True)  # not frozen: made once per request, and a frozen one sets each field through a call
class Send:
    """One request of the workload (`index` into its specs) reaching the engine at `arrival_s`, after `client_wait_s`
    at the client and `in_s` from its sending (the client's transport); `unsent`: a later turn whose conversation
    ended before it, rejected at `arrival_s` without being sent."""

    index: int
    arrival_s: float
    client_wait_s: float = 0.0
    unsent: bool = False
    in_s: float = 0.0


class ArrivalBook:
    """The workload's sends, kept in time order as requests end (see the module docstring)."""

    def __init__(self, specs: list[RequestSpec], max_concurrency: int | None = None, slide: bool = False,
                 transport: bool = True, frontends: int = 1):
        self.specs = specs
        self.turns = Conversations(specs)
        users = next((s.users for s in specs if s.users), 0)  # a closed loop's, on each of its units
        self.by_user = users > 0
        limit = users or max_concurrency
        self.gate: ClientGate | None = ClientGate(limit) if limit else None
        self.transport = transport and any(s.in_s or s.front_s or s.out_s or s.close_s for s in specs)
        self.frontends = [(0.0, f) for f in range(frontends)]  # heap (free from, front end): one request at a time
        self.warming = sum(s.warmup for s in specs)  # warm-up requests not yet ended: the others wait for them
        self.slide = slide and self.gate is not None and not self.by_user
        self.held = False  # slide: a request waits for a slot, and the schedule with it
        self.shift = 0.0  # added to the workload's first turns: when the warm-ups ended, and slide's lag
        self.known = not self.turns.any and self.gate is None and not self.warming  # every arrival known at start
        self.index = {} if self.known else {s.id: i for i, s in enumerate(specs)}
        self.first = [i for i, s in enumerate(specs) if s.after < 0 and not s.users]  # in time order
        self.nxt = 0
        self.later: list[tuple[float, int, int]] = []  # heap (time, spec id, index): turns and units known since
        self.ends: list[tuple[float, int, bool]] = []  # heap (time, spec id, finished): ends not yet taken in
        self.transit: list[tuple[float, int, int, float, float]] = []  # heap (engine arrival, spec id, index, client
        # wait, sending to the engine)
        self.next_at = self.next_s()  # a known book's next_s, kept as it changes: read without a call (`reader`)
        units = [i for i, s in enumerate(specs) if s.users]
        self.unoffered = [i for i in units if not specs[i].warmup] if self.warming else []  # until the warm-ups end
        if self.by_user:  # each user takes a unit and thinks before sending it; the rest wait for a user
            self._offer([i for i in units if specs[i].warmup] if self.warming else units, 0.0)

    def _offer(self, units: list[int], at: float) -> None:
        """A closed loop's units, in order, to its users: those a user takes are sent their think time after `at`."""
        for i in units:
            if self.gate.offer(i):
                heapq.heappush(self.later, (at + self.specs[i].think_s, self.specs[i].id, i))

    def send_all(self) -> list[float]:
        """A book whose every arrival is known, with a client's transport: send every request now, in order (each
        reaches the engine through the front ends just as if sent at its time), so that a clock need not stop at the
        sendings. Returns their times, in order."""
        assert self.known and self.transport, "only a book whose every sending is known can send them ahead"
        sent = [self.specs[i].arrival_s for i in self.first]
        for i, at in zip(self.first, sent):
            self._send(i, at, 0.0, [])
        self.nxt = len(self.first)
        self.next_at = self.next_s()
        return sent

    def _first_s(self) -> float:
        """When the next first turn is due (inf: none, or it waits for the warm-ups or for a slot ahead of it)."""
        if self.nxt >= len(self.first):
            return math.inf
        spec = self.specs[self.first[self.nxt]]
        if spec.warmup or self.known:  # known: no warm-up or slot holds it back, nothing shifts it
            return spec.arrival_s
        return math.inf if self.warming or self.held else spec.arrival_s + self.shift

    def reader(self) -> Callable[[], float]:
        """`next_s` as a callable a replica asks at every run of decode steps: a known book's kept time read by C
        calls (partial, getattr), not a Python frame."""
        return partial(getattr, self, "next_at") if self.known else self.next_s

    def next_s(self) -> float:
        """When the next known request is due (inf: none known now; an end not yet taken in counts as due)."""
        if self.known:  # nothing comes later or ends into it: the first turns and those on their way alone
            t = self.specs[self.first[self.nxt]].arrival_s if self.nxt < len(self.first) else math.inf  # _first_s
            transit = self.transit
            return transit[0][0] if transit and transit[0][0] < t else t
        t = self._first_s()
        for heap in (self.later, self.ends, self.transit):
            if heap and heap[0][0] < t:
                t = heap[0][0]
        return t

    def pending(self) -> bool:
        """Whether requests are still to be sent (some may wait for a turn to end, or at the client for a slot)."""
        return (self.nxt < len(self.first) or bool(self.later) or bool(self.ends) or bool(self.transit)
                or bool(self.turns.next_turn) or bool(self.unoffered)
                or (self.gate is not None and bool(self.gate.waiting)))

    def follows(self, spec_id: int) -> bool:
        """Whether a later turn waits for this request to end (its prompt then holds this one's tokens)."""
        return spec_id in self.turns.next_turn

    def ended(self, spec_id: int, at: float, finished: bool) -> None:
        """A request sent ended at `at`: its last token (`finished`), or when its rejection became known, at the engine.
        Taken in at the next `due`, once the client knows (after the request's out_s and close_s); every end of a
        workload with later turns, a gate or warm-ups must be told."""
        if not self.known:
            if self.transport:
                spec = self.specs[self.index[spec_id]]
                at = at + spec.out_s + spec.close_s
            heapq.heappush(self.ends, (at, spec_id, finished))

    def due(self, now: float) -> list[Send]:
        """Everything due by `now`, in time order: requests reaching the engine, and later turns rejected unsent."""
        out: list[Send] = []
        if self.known:
            return self._due_known(now, out)
        first = self.first
        while True:
            t_first = self._first_s()
            t_later = self.later[0][0] if self.later else math.inf
            t_end = self.ends[0][0] if self.ends else math.inf
            t_transit = self.transit[0][0] if self.transit else math.inf
            if t_end <= now and t_end <= t_first and t_end <= t_later and t_end <= t_transit:
                self._end(*heapq.heappop(self.ends), out)
            elif t_first <= now and t_first <= t_later and t_first <= t_transit:
                i = first[self.nxt]
                self.nxt += 1
                self._arrive(i, t_first, out)
            elif t_later <= now and t_later <= t_transit:
                t, _, i = heapq.heappop(self.later)
                if self.by_user:  # a unit (or a turn of one) already holds its user
                    self._send(i, t, 0.0, out)
                else:
                    self._arrive(i, t, out)
            elif t_transit <= now:
                t, _, i, wait, way_in = heapq.heappop(self.transit)
                out.append(Send(i, t, wait, in_s=way_in))
            else:
                return out

    def _due_known(self, now: float, out: list[Send]) -> list[Send]:
        """`due` of a book whose every arrival is known: its first turns and those on their way alone (no turn, end,
        gate or warm-up), in the same order."""
        first, specs, transit = self.first, self.specs, self.transit
        while True:
            t_first = specs[first[self.nxt]].arrival_s if self.nxt < len(first) else math.inf  # _first_s
            t_transit = transit[0][0] if transit else math.inf
            if t_first <= now and t_first <= t_transit:
                i = first[self.nxt]
                self.nxt += 1
                self._send(i, t_first, 0.0, out)  # _arrive without a gate
            elif t_transit <= now:
                _, _, i, wait, way_in = heapq.heappop(transit)
                out.append(Send(i, t_transit, wait, False, way_in))  # by position: once per request
            else:
                self.next_at = t_transit if t_transit < t_first else t_first  # next_s, as of now
                return out

    def _send(self, i: int, at: float, wait: float, out: list[Send]) -> None:
        """Request i leaves the client at `at`: it reaches the engine now, or (a transport) through the first front end
        free, in the order requests were sent."""
        if not self.transport:
            out.append(Send(i, at, wait))
            return
        spec = self.specs[i]
        free, f = heapq.heappop(self.frontends)
        done = at + spec.in_s
        if free > done:  # max() without the call: once per request
            done = free
        done += spec.front_s
        heapq.heappush(self.frontends, (done, f))
        heapq.heappush(self.transit, (done, spec.id, i, wait, done - at))

    def _arrive(self, i: int, at: float, out: list[Send]) -> None:
        if self.gate is None or self.gate.offer((i, at)):
            self._send(i, at, 0.0, out)
        else:  # it waits at the client for a request in flight to end
            self.held = self.slide

    def _end(self, at: float, spec_id: int, finished: bool, out: list[Send]) -> None:
        """The turn after it (if any) arrives after its think time, or ends now unsent; the request waiting longest
        at the client (if any) is sent now; a closed loop's unit that ended frees its user for the next unit; the last
        warm-up to end starts the workload."""
        spec, gone = self.turns.ended(spec_id, finished)
        if spec is not None:
            heapq.heappush(self.later, (at + spec.think_s, spec.id, self.index[spec.id]))
        out.extend(Send(self.index[g.id], at, unsent=True) for g in gone)
        if self.warming and self.specs[self.index[spec_id]].warmup:
            self.warming -= 1
            self.shift = at if not self.warming else self.shift
        if self.gate is not None and not (spec is not None and self.by_user):
            self._release(at, out)
        if not self.warming and self.unoffered:
            units, self.unoffered = self.unoffered, []
            self._offer(units, at)

    def _release(self, at: float, out: list[Send]) -> None:
        """A slot freed at `at`: the request (or unit) waiting longest takes it."""
        waiting = self.gate.release()
        if waiting is None:
            return
        if self.by_user:
            heapq.heappush(self.later, (at + self.specs[waiting].think_s, self.specs[waiting].id, waiting))
        else:
            i, arrival = waiting
            if self.held:  # slide: the schedule goes on from this sending
                self.shift += at - arrival
                self.held = False
            self._send(i, at, at - arrival, out)

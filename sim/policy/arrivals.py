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
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from sim.config.workload import RequestSpec
from sim.policy.client import ClientGate
from sim.policy.conversation import Conversations


@dataclass(frozen=True, slots=True)
class Send:
    """One request of the workload (`index` into its specs) sent at `arrival_s`, after `client_wait_s` at the client;
    `unsent`: a later turn whose conversation ended before it, rejected at `arrival_s` without being sent."""

    index: int
    arrival_s: float
    client_wait_s: float = 0.0
    unsent: bool = False


class ArrivalBook:
    """The workload's sends, kept in time order as requests end (see the module docstring)."""

    def __init__(self, specs: list[RequestSpec], max_concurrency: int | None = None):
        self.specs = specs
        self.turns = Conversations(specs)
        users = next((s.users for s in specs if s.users), 0)  # a closed loop's, on each of its units
        self.by_user = users > 0
        limit = users or max_concurrency
        self.gate: ClientGate | None = ClientGate(limit) if limit else None
        self.known = not self.turns.any and self.gate is None  # every arrival time known from the start
        self.index = {} if self.known else {s.id: i for i, s in enumerate(specs)}
        self.first = [i for i, s in enumerate(specs) if s.after < 0 and not s.users]  # in time order
        self.nxt = 0
        self.later: list[tuple[float, int, int]] = []  # heap (time, spec id, index): turns and units known since
        self.ends: list[tuple[float, int, bool]] = []  # heap (time, spec id, finished): ends not yet taken in
        if self.by_user:  # each user takes a unit and thinks before sending it; the rest wait for a user
            for i, spec in enumerate(specs):
                if spec.users and self.gate.offer(i):
                    heapq.heappush(self.later, (spec.think_s, spec.id, i))

    def next_s(self) -> float:
        """When the next known request is due (inf: none known now; an end not yet taken in counts as due)."""
        t = self.specs[self.first[self.nxt]].arrival_s if self.nxt < len(self.first) else math.inf
        if self.later and self.later[0][0] < t:
            t = self.later[0][0]
        return min(t, self.ends[0][0]) if self.ends else t

    def pending(self) -> bool:
        """Whether requests are still to be sent (some may wait for a turn to end, or at the client for a slot)."""
        return (self.nxt < len(self.first) or bool(self.later) or bool(self.ends) or bool(self.turns.next_turn)
                or (self.gate is not None and bool(self.gate.waiting)))

    def follows(self, spec_id: int) -> bool:
        """Whether a later turn waits for this request to end (its prompt then holds this one's tokens)."""
        return spec_id in self.turns.next_turn

    def ended(self, spec_id: int, at: float, finished: bool) -> None:
        """A request sent ended at `at`: its last token (`finished`), or when its rejection became known. Taken in
        at the next `due`; every end of a workload with later turns or a gate must be told."""
        if not self.known:
            heapq.heappush(self.ends, (at, spec_id, finished))

    def due(self, now: float) -> list[Send]:
        """Everything due by `now`, in time order: requests to send, and later turns rejected unsent."""
        out: list[Send] = []
        first, specs = self.first, self.specs
        while True:
            t_first = specs[first[self.nxt]].arrival_s if self.nxt < len(first) else math.inf
            t_later = self.later[0][0] if self.later else math.inf
            t_end = self.ends[0][0] if self.ends else math.inf
            if t_end <= now and t_end <= t_first and t_end <= t_later:
                self._end(*heapq.heappop(self.ends), out)
            elif t_first <= now and t_first <= t_later:
                i = first[self.nxt]
                self.nxt += 1
                self._arrive(i, t_first, out)
            elif t_later <= now:
                t, _, i = heapq.heappop(self.later)
                if self.by_user:  # a unit (or a turn of one) already holds its user
                    out.append(Send(i, t))
                else:
                    self._arrive(i, t, out)
            else:
                return out

    def _arrive(self, i: int, at: float, out: list[Send]) -> None:
        if self.gate is None or self.gate.offer((i, at)):
            out.append(Send(i, at))  # else it waits at the client for a request in flight to end

    def _end(self, at: float, spec_id: int, finished: bool, out: list[Send]) -> None:
        """The turn after it (if any) arrives after its think time, or ends now unsent; the request waiting longest
        at the client (if any) is sent now; a closed loop's unit that ended frees its user for the next unit."""
        spec, gone = self.turns.ended(spec_id, finished)
        if spec is not None:
            heapq.heappush(self.later, (at + spec.think_s, spec.id, self.index[spec.id]))
        out.extend(Send(self.index[g.id], at, unsent=True) for g in gone)
        if self.gate is None or (spec is not None and self.by_user):
            return
        waiting = self.gate.release()
        if waiting is None:
            return
        if self.by_user:
            heapq.heappush(self.later, (at + self.specs[waiting].think_s, self.specs[waiting].id, waiting))
        else:
            i, arrival = waiting
            out.append(Send(i, at, at - arrival))

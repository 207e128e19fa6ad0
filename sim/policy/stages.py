"""Load stages on any clock (workload.load_stages): a stage after the first is held back until every request of the
stage before it has ended, completed or rejected, then each of its requests is sent its delay later (the gap between
stages and its time within its stage), as inference-perf waits for a stage's last response before it starts the
next. Kept by the arrival book the simulator, the executor's replay and the endpoint replay drive (`arrival_book`)."""
from __future__ import annotations

import heapq
from collections import Counter

from sim.config.workload import RequestSpec
from sim.policy.arrivals import ArrivalBook, Send


class StagedArrivalBook(ArrivalBook):
    """An arrival book whose requests of stage k >= 1 wait for the end of every request of stage k - 1."""

    def __init__(self, specs: list[RequestSpec], max_concurrency: int | None = None, **book):
        super().__init__(specs, max_concurrency, **book)
        self.known = False  # a later stage's times come from the ends of the one before it
        self.index = {s.id: i for i, s in enumerate(specs)}
        self.first = [i for i in self.first if specs[i].stage <= 0]
        self.stage_held: dict[int, list[int]] = {}
        for i, s in enumerate(specs):
            if s.stage > 0:
                self.stage_held.setdefault(s.stage, []).append(i)
        self.left = Counter(s.stage for s in specs)  # per stage: its requests not yet ended

    def pending(self) -> bool:
        return super().pending() or bool(self.stage_held)

    def _end(self, at: float, spec_id: int, finished: bool, out: list[Send]) -> None:
        super()._end(at, spec_id, finished, out)
        stage = self.specs[self.index[spec_id]].stage
        self.left[stage] -= 1
        if self.left[stage] == 0:
            for i in self.stage_held.pop(stage + 1, ()):  # the next stage starts: each request its delay from now
                heapq.heappush(self.later, (at + self.specs[i].stage_delay_s, self.specs[i].id, i))


def arrival_book(specs: list[RequestSpec], max_concurrency: int | None = None, **book) -> ArrivalBook:
    """The arrival book of a workload's requests (`book`: ArrivalBook's client options): with load stages after the
    first, one that holds each stage back until the one before it has ended."""
    if any(s.stage > 0 for s in specs):
        return StagedArrivalBook(specs, max_concurrency, **book)
    return ArrivalBook(specs, max_concurrency, **book)

"""The load generator's own limit on requests in flight (workload.max_concurrency: vLLM's benchmark
`--max-concurrency`, an asyncio semaphore around each request): a request whose time comes while that many are in
flight waits at the client, first come first served, and is sent when one of them ends. Kept by the arrival book
(sim.policy.arrivals), which every clock drives."""
from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class ClientGate(Generic[T]):
    """At most `limit` requests in flight; the rest wait in arrival order."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.waiting: deque[T] = deque()

    def offer(self, item: T) -> bool:
        """A request's time came: True if it is sent now (it takes a slot), else it waits."""
        if self.in_flight < self.limit:
            self.in_flight += 1
            return True
        self.waiting.append(item)
        return False

    def release(self) -> T | None:
        """A request in flight ended: the one waiting longest takes its slot (returned, to send now), or the slot
        frees."""
        if self.waiting:
            return self.waiting.popleft()
        self.in_flight -= 1
        return None

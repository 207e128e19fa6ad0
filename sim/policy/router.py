"""Global routers: which replica gets an arriving request (Vidur/Splitwise style)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Routable(Protocol):
    @property
    def num_outstanding(self) -> int: ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self.next = 0

    def pick(self, replicas: Sequence[Routable]) -> int:
        i = self.next % len(replicas)
        self.next += 1
        return i


class LeastOutstandingRouter:
    """Send to the replica with the fewest requests waiting or running (ties: lowest index)."""

    def pick(self, replicas: Sequence[Routable]) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].num_outstanding)


def make_router(name: str) -> RoundRobinRouter | LeastOutstandingRouter:
    return {"round_robin": RoundRobinRouter, "least_outstanding": LeastOutstandingRouter}[name]()

"""Global routers: which replica gets an arriving request (Vidur/Splitwise style, SGLang's / vLLM's router's
cache-aware policy, and the vLLM production stack's session affinity)."""
from __future__ import annotations

from bisect import bisect
from collections.abc import Sequence
from typing import Protocol, get_args

from sim.config.scenario import RouterName
from sim.policy.request import Request

ROUTERS = get_args(RouterName)
RING_POINTS = 160  # points per replica on the session router's hash ring (as ketama-style rings use)


class Routable(Protocol):
    @property
    def num_outstanding(self) -> int: ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self.next = 0

    def pick(self, replicas: Sequence[Routable], req: Request | None = None) -> int:
        i = self.next % len(replicas)
        self.next += 1
        return i


class LeastOutstandingRouter:
    """Send to the replica with the fewest requests waiting or running (ties: lowest index)."""

    def pick(self, replicas: Sequence[Routable], req: Request | None = None) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].num_outstanding)


class CacheAwareRouter:
    """SGLang's and vLLM's router's `cache_aware` policy, with their defaults: to the replica whose KV cache holds
    the longest prefix of the request's prompt when that is over `cache_threshold` of it (ties: fewest outstanding),
    else to the least loaded; and to the least loaded whenever the busiest replica has more than
    `balance_abs_threshold` requests over the idlest and more than `balance_rel_threshold` times as many. The
    routers mirror the replicas' caches in a radix tree of what they sent; here each replica's cache is read."""

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def pick(self, replicas: Sequence[Routable], req: Request | None = None) -> int:
        loads = [r.num_outstanding for r in replicas]
        least = min(range(len(loads)), key=loads.__getitem__)
        lo, hi = loads[least], max(loads)
        if req is None or not req.block_hashes or (hi - lo > self.balance_abs_threshold
                                                   and hi > self.balance_rel_threshold * lo):
            return least
        best, best_tokens = least, 0
        for i, r in enumerate(replicas):
            kv = getattr(r, "scheduler", r).kv  # a simulated replica, or an engine's scheduler
            if not kv.prefix_caching:
                continue
            tokens = kv.cached_prefix(req)[0] * kv.block_size
            if tokens > best_tokens or (tokens == best_tokens and tokens and loads[i] < loads[best]):
                best, best_tokens = i, tokens
        return best if best_tokens > self.cache_threshold * req.prompt_len else least


class SessionRouter:
    """The vLLM production stack's `session` routing: every turn of a conversation to one replica, found by
    consistent hashing of the conversation on a ring of the replicas (what stays where when replicas come and go);
    a request of no conversation to the least loaded. The load follows the conversations, not the replicas' queues."""

    def __init__(self) -> None:
        self.ring: list[tuple[int, int]] = []

    def pick(self, replicas: Sequence[Routable], req: Request | None = None) -> int:
        if req is None or req.conversation < 0:
            return min(range(len(replicas)), key=lambda i: replicas[i].num_outstanding)
        if len(self.ring) != RING_POINTS * len(replicas):
            self.ring = sorted((_mix(i * RING_POINTS + p), i) for i in range(len(replicas)) for p in range(RING_POINTS))
        k = bisect(self.ring, (_mix(~req.conversation), -1))
        return self.ring[k % len(self.ring)][1]


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of an int, the same in every process (unlike hash(str))."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def make_router(name: str) -> RoundRobinRouter | LeastOutstandingRouter | CacheAwareRouter | SessionRouter:
    return {"round_robin": RoundRobinRouter, "least_outstanding": LeastOutstandingRouter,
            "cache_aware": CacheAwareRouter, "session": SessionRouter}[name]()

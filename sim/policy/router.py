"""Global routers: which replica gets an arriving request (Vidur/Splitwise style, and SGLang's / vLLM's router's
cache-aware policy)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sim.policy.request import Request

ROUTERS = ("round_robin", "least_outstanding", "cache_aware")


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


def make_router(name: str) -> RoundRobinRouter | LeastOutstandingRouter | CacheAwareRouter:
    return {"round_robin": RoundRobinRouter, "least_outstanding": LeastOutstandingRouter,
            "cache_aware": CacheAwareRouter}[name]()

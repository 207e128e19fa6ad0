"""Block hashes for prefix caching: what a request's prompt shares with others, block by block.

A workload describes shared content (workload.shared_prefix: prompts that begin with one of a few prefixes); the
hash of a full block names the prompt's content up to and including it, so two requests' blocks of one hash hold the
same K/V. The simulator and the executor take a request's hashes from here alike (the executor builds the prompt's
token ids to match: executor/prompts.py), so both see the same hits.
"""
from __future__ import annotations

from sim.config.workload import RequestSpec
from sim.policy.request import Request


class PrefixHashes:
    """Per request spec, the hashes of its prompt's full blocks of shared content (an empty tuple when none); the
    tuples of requests that share a prefix are shared too (a workload of 20k requests holds a few of them)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._made: dict[tuple[int, int], tuple] = {}

    def __call__(self, spec: RequestSpec) -> tuple:
        if spec.prefix_id < 0:
            return ()
        n = min(spec.prefix_len, spec.prompt_len) // self.block_size
        key = (spec.prefix_id, n)
        hashes = self._made.get(key)
        if hashes is None:
            # the prefix's content up to block j is its id and j (every request of the workload has one prefix_len)
            hashes = self._made[key] = tuple(hash((spec.prefix_id, j)) for j in range(n))
        return hashes


def request_maker(enable_prefix_caching: bool, block_size: int):
    """RequestSpec -> the scheduler's Request, with its block hashes where the plan caches prefixes."""
    hashes = PrefixHashes(block_size) if enable_prefix_caching else None

    def make(spec: RequestSpec) -> Request:
        req = Request(spec.id, spec.arrival_s, spec.prompt_len, spec.output_len)
        if hashes is not None:
            req.block_hashes = hashes(spec)
        return req
    return make

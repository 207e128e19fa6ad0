"""DecodeSet.block_horizon (sim/policy/decode_set.py): the largest number of lockstep decode steps whose block needs
fit the free blocks, against a step-by-step count on random members (lazily synced: members joined at different
steps)."""
from __future__ import annotations

import random

import pytest

from sim.policy.decode_set import DecodeSet
from sim.policy.request import Request


def stepwise_horizon(members: list[Request], steps: int, bs: int, k: int, num_free: int) -> int:
    """k' = 1, 2, ... while the needs fit: a member whose blocks hold `room` more tokens needs one `room` steps from
    now and every block_size steps after."""
    needs = []
    for r in members:
        room = len(r.block_table) * bs - (r.num_computed + steps - r.sync_step)
        needs += list(range(room, k, bs))
    best = 1
    for kk in range(2, k + 1):
        if sum(1 for n in needs if n <= kk - 1) > num_free:
            break
        best = kk
    return best


@pytest.mark.parametrize("seed", range(40))
def test_block_horizon_matches_a_step_by_step_count(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    ds, free = DecodeSet(bs), list(range(100_000))
    members = []
    for i in range(rng.randint(1, 40)):
        k = rng.randint(1, 6)  # a decode run as advance_decode takes it: the run's blocks first
        assert ds.grant_blocks(ds.steps + k - 1, free) is None
        ds.advance(k)
        for r in ds.pop_finished():
            members.remove(r)
        computed = rng.randint(1, 300)
        r = Request(i, 0.0, computed, rng.randint(2, 400))
        r.num_computed = computed
        r.block_table = list(range(-(-computed // bs) + rng.randint(0, 1)))  # full, or a block spare
        ds.join(r, len(r.block_table) * bs)
        members.append(r)
    k, num_free = rng.randint(1, 200), rng.randint(0, 60)
    k = min(k, ds.next_finish() - ds.steps) if members else k
    assert ds.block_horizon(k, num_free) == stepwise_horizon(members, ds.steps, bs, k, num_free)

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
    ds = DecodeSet(bs)
    members = []
    for i in range(rng.randint(1, 40)):
        ds.advance(rng.randint(0, 5))
        computed = rng.randint(1, 300)
        r = Request(i, 0.0, computed, 10_000)
        r.num_computed = computed
        r.block_table = list(range(-(-computed // bs) + rng.randint(0, 1)))  # full, or a block spare
        ds.join(r, None)
        members.append(r)
    ds.advance(rng.randint(0, 3 * bs))
    for r in members:  # as grant_blocks keeps them: every member holds the blocks its tokens so far need
        need = -(-(r.num_computed + ds.steps - r.sync_step) // bs)
        r.block_table += [0] * max(0, need - len(r.block_table))
    k, num_free = rng.randint(1, 200), rng.randint(0, 60)
    assert ds.block_horizon(k, num_free) == stepwise_horizon(members, ds.steps, bs, k, num_free)

"""The simulator's per-event shortcuts change no bit of a run: decode runs that follow each other between arrivals
without a pass through the engine loop (Replica._decode_runs, Scheduler.schedule_decodes), and a prefix-caching
allocator's plain free queue until its first block is registered (FreeBlockQueue, lazy)."""
from __future__ import annotations

import pytest

from sim.policy.block_manager import FreeBlockQueue, PrefixCachingAllocator
from sim.policy.request import Request
from sim.simulator.cluster import simulate
from tests.helpers import plan_of, scenario
from tests.test_sim_ahead import trace


@pytest.mark.parametrize("overrides", [
    {"engine": "vllm", "kv_cache": {"num_blocks": 260}},  # short of blocks: runs stop, rows are preempted
    {"engine": "vllm", "workload": {"shared_prefix": {"prefix_len": 256, "num_prefixes": 2}}},  # prefixes hit
    {"engine": "sglang", "kv_cache": {"num_blocks": 400}},  # prompts alone, a synchronous engine
])
def test_decode_runs_between_arrivals_change_nothing(overrides):
    data = scenario(**overrides)
    data["workload"] = {**data["workload"], "num_requests": 120, "arrival": {"process": "poisson", "rate": 8.0}}
    plan = plan_of(data)
    fast = simulate(plan)
    assert trace(fast) == trace(simulate(plan, watch=lambda r: False))  # a watch: every run passes the engine loop
    if "num_blocks" in overrides.get("kv_cache", {}) and overrides["engine"] == "vllm":
        assert sum(r.num_preemptions for r in fast.requests) > 0, "no preemption: the short-of-blocks path is untested"


@pytest.mark.parametrize("shared", [False, True])
def test_a_lazy_free_queue_hands_out_the_blocks_a_tracked_one_does(shared, monkeypatch):
    data = scenario(engine="vllm", kv_cache={"num_blocks": 400})
    data["workload"] = {**data["workload"], "num_requests": 100}
    if shared:
        data["workload"]["shared_prefix"] = {"prefix_len": 200, "num_prefixes": 3}
    plan = plan_of(data)
    handed: list[list[int]] = []
    take = FreeBlockQueue.take

    def recording_take(self, n):
        out = take(self, n)
        handed.append(list(out))
        return out

    monkeypatch.setattr(FreeBlockQueue, "take", recording_take)
    lazy = trace(simulate(plan))
    lazy_handed, handed[:] = list(handed), []
    init = FreeBlockQueue.__init__
    monkeypatch.setattr(FreeBlockQueue, "__init__", lambda self, kv, blocks, lazy=False: init(self, kv, blocks))
    assert trace(simulate(plan)) == lazy
    assert handed == lazy_handed and handed


def test_a_lazy_free_queue_starts_counting_at_the_first_registration():
    kv = PrefixCachingAllocator(num_blocks=8, block_size=4)
    a, b = Request(0, 0.0, 8, 4), Request(1, 0.0, 8, 4, block_hashes=(11, 12))
    kv.allocate(a, 8)
    kv.allocate(b, 8)
    assert not kv.free_blocks.tracking and a.block_table == [0, 1] and b.block_table == [2, 3]
    kv.free(a)  # back at the end of the queue, last block first
    assert list(kv.free_blocks) == [4, 5, 6, 7, 1, 0]
    b.num_computed = 8
    kv.register(b)
    assert kv.free_blocks.tracking and kv.ref == [0, 0, 1, 1, 0, 0, 0, 0]
    assert list(kv.free_blocks) == [4, 5, 6, 7, 1, 0] and len(kv.free_blocks) == 6
    kv.free(b)
    c = Request(2, 0.0, 9, 4, block_hashes=(11, 12))
    assert kv.cached_prefix(c) == (2, 2)  # both of b's blocks found, free
    kv.take_prefix(c, 2)
    assert c.block_table == [2, 3] and list(kv.free_blocks) == [4, 5, 6, 7, 1, 0]

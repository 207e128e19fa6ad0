"""The hybrid KV allocator (sim/policy/hybrid_allocator.py): vLLM's KV cache groups by attention kind, block counts
computed by hand, every block owned once and counted under preemption, swap, speculative slots and prefix caching
(hypothesis' stateful testing, as tests/test_kv_invariants.py does for the paged allocator), a decode run's block
horizon safe, and bulk decode steps equal to stepping one by one."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim.config.kv_groups import KVGroups, KVKind
from sim.config.plan import scheduler_config
from sim.policy.hybrid_allocator import HybridBlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler
from tests.helpers import run, scenario, token_times
from tests.test_sim import check_conservation


def groups(*kinds: tuple[str, int, int], group_size: int = 2, block_size: int = 4) -> KVGroups:
    """Groups of (kind, window, groups) with `group_size` layers each, 1-byte pages."""
    return KVGroups(tuple(KVKind(kind, window, n * group_size, n) for kind, window, n in kinds), group_size,
                    block_size, 1.0, 1.0, 0.0, 10 ** 6)


GPT_OSS = groups(("sliding_window", 8, 1), ("full", 0, 1))  # a window of 8 tokens, 2 blocks
LLAMA4 = groups(("chunked_local", 8, 3), ("full", 0, 1))
QWEN3_NEXT = groups(("linear", 0, 3), ("full", 0, 1))
SLIDING_ONLY = groups(("sliding_window", 6, 1))
ALL = {"gpt-oss": GPT_OSS, "llama4": LLAMA4, "qwen3-next": QWEN3_NEXT, "sliding-only": SLIDING_ONLY}


def caching(g: KVGroups, prefix: bool) -> KVGroups:
    """The groups as kv_groups makes them with prefix caching: a linear group's blocks span block_size tokens."""
    return dataclasses.replace(g, linear_block_tokens=g.block_size) if prefix else g


def held(kv: HybridBlockAllocator, r: Request) -> list[int]:
    return kv.blocks_of(r) if r.group_tables else []


def check_hybrid(kv: HybridBlockAllocator, holders: list[Request]) -> None:
    """Each block owned once; owned + free = all; each kind's count of blocks in use its tables'; a table's first
    `dropped` entries freed and the rest held, one block per group."""
    owned = [b for r in holders for b in held(kv, r)]
    if not kv.prefix_caching:
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert sorted(owned + list(kv.free_blocks)) == list(range(kv.num_blocks)), "blocks leaked or invented"
    else:  # shared blocks: each counted by its references
        counts = {b: owned.count(b) for b in set(owned)}
        assert all(kv.ref[b] == n for b, n in counts.items()), "a reference count is off"
        assert sorted(set(owned) | set(kv.free_blocks)) == list(range(kv.num_blocks))
        assert not set(owned) & set(kv.free_blocks), "a block in use is free"
        assert kv.shared_refs == len(owned) - len(counts)
    assert kv.num_used + kv.num_free == kv.num_blocks
    by_kind = [0] * len(kv.kinds)
    for b in set(owned):
        by_kind[kv.kind_of[b]] += 1
    assert by_kind == kv.used, (by_kind, kv.used)
    for r in holders:
        for (mode, _, n), table, dropped in zip(kv.kinds, r.group_tables, r.group_dropped):
            assert all(e is None for e in table[:dropped])
            live = [e for e in table[dropped:] if e is not None]
            assert all(len(e) == n for e in live)
            # a window's entries past the freed ones are held; a linear group's a state, and one a step past a boundary
            assert len(live) == len(table) - dropped if not mode.startswith("state") else len(live) <= 2
    host = [b for r in holders for b in r.host_block_table]
    assert sorted(host + kv.free_host_blocks) == list(range(kv.num_swap_blocks)), "host blocks leaked"


def filled(kv: HybridBlockAllocator, holders: list[Request]) -> int:
    """Token slots holding K/V, request by request (what filled_tokens keeps as sums)."""
    total = 0
    for r in holders:
        for k, (mode, _, n) in enumerate(kv.kinds):
            if r.group_tables:
                total += n * (kv.block_size * kv.live(r, k) if mode.startswith("state") else
                              r.num_computed - r.group_dropped[k] * kv.block_size)
    return total - kv.shared_refs * kv.block_size if kv.prefix_caching else total


# -- block counts by hand ---------------------------------------------------------------------------------------------
def test_a_prompt_in_one_step_holds_every_block_then_the_window_alone():
    kv = HybridBlockAllocator(groups(("sliding_window", 128, 1), ("full", 0, 1), block_size=16), 1000)
    r = Request(0, 0.0, 1000, 10)
    kv.allocate(r, 1000)  # nothing computed: both groups hold the whole prompt while it is computed
    assert kv.used == [63, 63]
    r.num_computed = 1000
    kv.allocate(r, 1001)  # the first decode step frees the blocks before token 1000 - 128 + 1 = 873
    assert kv.used == [63 - 873 // 16, 63] == [9, 63] and r.group_dropped == [54, 0]


def test_a_chunked_prompt_holds_its_window_and_one_chunk():
    kv = HybridBlockAllocator(groups(("sliding_window", 128, 1), ("full", 0, 1), block_size=16), 1000)
    r = Request(0, 0.0, 1024, 10)
    peak = 0
    for computed in range(0, 1024, 256):
        r.num_computed = computed
        kv.allocate(r, computed + 256)
        peak = max(peak, kv.used[0])
    # the window's blocks before a chunk (cdiv(127, 16) + 1 = 9, 8 at a block boundary) and the chunk's 16
    assert peak == 8 + 16 and kv.used[1] == 64
    assert kv.blocks_for(1024) == 64 + min(64, -(-(127 + 1) // 16) + 1)  # vLLM's max_memory_usage, T = 1


def test_chunked_local_attention_frees_the_chunks_before_the_current_one():
    kv = HybridBlockAllocator(groups(("chunked_local", 8192, 3), ("full", 0, 1), block_size=16), 5000)
    r = Request(0, 0.0, 9000, 10)
    kv.allocate(r, 9000)
    r.num_computed = 9000
    kv.allocate(r, 9001)  # tokens 8192.. attend chunk 2: its 9001 - 8192 = 809 tokens, 51 blocks in each group
    assert kv.used == [3 * (563 - 512), 563] and r.group_dropped == [512, 0]


def test_a_linear_attention_group_holds_one_state_block_a_sequence():
    kv = HybridBlockAllocator(groups(("linear", 0, 3), ("full", 0, 1), block_size=272), 100)
    r = Request(0, 0.0, 1000, 10)
    kv.allocate(r, 1000)
    assert kv.used == [3, 4]  # 3 states + cdiv(1000, 272)
    r.num_computed = 5000
    kv.allocate(r, 5001)
    assert kv.used == [3, 19]  # the states stay one block each, flat in the context


def test_prefix_caching_keeps_a_linear_state_at_each_chunks_boundary():
    """vLLM's mamba "align" mode, by hand (4-token blocks, 3 linear groups and 1 full): a 10-token prompt's first
    chunk stops at the block boundary 8, where its state block is kept and registered; a prompt that begins with the
    same 8 tokens takes the full group's 2 blocks and that state, and computes from token 8."""
    kv = HybridBlockAllocator(caching(QWEN3_NEXT, True), 40, prefix_caching=True)
    a = Request(0, 0.0, 10, 4)
    a.block_hashes = (11, 12)
    assert kv.align_chunk(a, 0, 16) == 8  # the chunk across the last boundary (8) stops there
    kv.allocate(a, 8)
    assert kv.used == [3, 2] and [e is None for e in a.group_tables[0]] == [True, False]
    a.num_computed = 8
    kv.register(a)
    assert kv.align_chunk(a, 8, 2) == 2  # the tail after it runs whole
    kv.allocate(a, 10)
    assert kv.used == [6, 3]  # the state at 8 is kept for this step, the new one beside it
    a.num_computed = 10
    kv.allocate(a, 11)  # the next step frees the state at 8 (it stays cached, free)
    assert kv.used == [3, 3]
    b = Request(1, 0.0, 12, 4)
    b.block_hashes = (11, 12, 13)
    hit, free = kv.cached_prefix(b)
    assert (hit, free) == (2, 3)  # 2 blocks: the full group's (held by a) and the 3 state blocks, free but cached
    kv.take_prefix(b, hit)
    assert b.num_computed == 8 and kv.used == [6, 3] and b.group_tables[0][0] is None
    assert kv.align_chunk(b, 0, 6) == 4 and kv.align_chunk(b, 8, 16) == 4  # 6 of 12 stops at 4; from 8 to 12


# -- invariants under any sequence of steps ---------------------------------------------------------------------------
class HybridSchedulerMachine(RuleBasedStateMachine):
    """The scheduler over a hybrid allocator, as an engine drives it under KV pressure (recompute or swap preemption,
    chunked prefill, speculative slots, prefix caching of shared prompt beginnings), runs of decode steps taken at
    once as the simulator takes them: every block owned once, and every request ends finished or rejected."""

    @initialize(model=st.sampled_from(list(ALL)), num_blocks=st.integers(12, 60), chunked=st.booleans(),
                preemption=st.sampled_from(["recompute", "swap"]), gamma=st.sampled_from([0, 0, 3]),
                prefix=st.booleans(), eager=st.booleans())
    def setup(self, model, num_blocks, chunked, preemption, gamma, prefix, eager):
        g = ALL[model]
        linear = any(k.kind == "linear" for k in g.kinds)
        gamma, chunked = (0, chunked or prefix) if linear else (gamma, chunked)  # vLLM: align mode needs chunks
        cfg = scheduler_config(64, max_num_seqs=4, max_num_batched_tokens=16 if chunked else 64,
                               enable_chunked_prefill=chunked, preemption=preemption, num_speculative_tokens=gamma)
        self.kv = HybridBlockAllocator(caching(g, prefix), num_blocks,
                                       num_swap_blocks=num_blocks if preemption == "swap" else 0,
                                       step_tokens=cfg.prefill_chunk_size, prefix_caching=prefix)
        self.sched = make_scheduler(cfg, self.kv, eager=eager)
        self.reqs: list[Request] = []
        self.gamma, self.prefix = gamma, prefix

    @rule(prompt=st.integers(0, 40), output=st.integers(0, 30), shared=st.integers(0, 2))
    def arrive(self, prompt, output, shared):
        r = Request(len(self.reqs), 0.0, prompt, output)
        if self.prefix:  # prompts that begin alike: one of two prefixes, then their own blocks
            n = max(0, prompt) // self.kv.block_size
            r.block_hashes = tuple(hash((shared, j)) if j < 4 else hash((r.id, j)) for j in range(n))
        self.reqs.append(r)
        assert self.sched.add(r) or (r.status is Status.REJECTED and r.reject_reason)

    @precondition(lambda self: hasattr(self, "sched") and self.sched.has_work())
    @rule(stop=st.booleans(), accept=st.integers(0, 3), draft=st.integers(0, 3), run=st.integers(1, 12))
    def step(self, stop, accept, draft, run):
        sched = self.sched
        if self.gamma and sched.drafting:
            for r in sched.decoding.members:
                r.num_draft = min(draft, self.gamma, max(0, r.remaining_tokens - 1))
        batch = sched.schedule()
        assert batch, "work queued but nothing schedulable"
        if batch.decode_only and not stop:  # a run of identical decode steps, as the simulator takes it
            sched.advance_decode(sched.decode_horizon(run))
            return
        stopped = batch.decode[:1] if stop and batch.decode else []
        accepted = {r: min(accept, r.num_draft) for r in batch.decode if r.num_draft}
        sched.complete_step(batch, stopped, accepted)

    @invariant()
    def blocks_add_up(self):
        if hasattr(self, "sched"):
            self.sched.sync_all()
            check_hybrid(self.kv, self.reqs)
            assert self.sched.num_kv_tokens == filled(self.kv, self.reqs) <= self.kv.num_used * self.kv.block_size

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):
            if not self.sched.has_work():
                break
            batch = self.sched.schedule()
            assert batch
            self.sched.complete_step(batch)
        assert not self.sched.has_work()
        for r in self.reqs:
            assert r.status is Status.FINISHED or (r.status is Status.REJECTED and r.reject_reason), r
            assert not r.group_tables and not r.host_block_table
        check_hybrid(self.kv, self.reqs)
        assert self.kv.num_free == self.kv.num_blocks and self.kv.used == [0] * len(self.kv.kinds)


TestHybridScheduler = HybridSchedulerMachine.TestCase
TestHybridScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(120))
def test_random_walks_end_with_every_block_back(seed):
    """Seeded walks of the same operations, longer than the machine's: a prompt's next chunk once found its blocks
    too few because the count was read before the blocks leaving its window were freed, preempting itself forever."""
    rng = random.Random(seed)
    g = rng.choice(list(ALL.values()))
    linear = any(k.kind == "linear" for k in g.kinds)
    chunked, preemption = rng.random() < 0.5, rng.choice(["recompute", "swap"])
    gamma = 0 if linear else rng.choice([0, 0, 3])
    prefix = rng.random() < 0.5
    chunked = chunked or (linear and prefix)
    cfg = scheduler_config(64, max_num_seqs=4, max_num_batched_tokens=16 if chunked else 64,
                           enable_chunked_prefill=chunked, preemption=preemption, num_speculative_tokens=gamma)
    blocks = rng.randint(12, 60)
    kv = HybridBlockAllocator(caching(g, prefix), blocks, num_swap_blocks=blocks if preemption == "swap" else 0,
                              step_tokens=cfg.prefill_chunk_size, prefix_caching=prefix)
    sched, reqs = make_scheduler(cfg, kv, eager=rng.random() < 0.5), []
    for _ in range(60):
        if rng.random() < 0.4:
            r = Request(len(reqs), 0.0, rng.randint(1, 40), rng.randint(1, 30))
            if prefix:
                shared = rng.randint(0, 2)
                r.block_hashes = tuple(hash((shared, j)) if j < 4 else hash((r.id, j))
                                       for j in range(r.prompt_len // kv.block_size))
            reqs.append(r)
            sched.add(r)
        if not sched.has_work():
            continue
        if gamma and sched.drafting:
            for r in sched.decoding.members:
                r.num_draft = min(rng.randint(0, 3), gamma, max(0, r.remaining_tokens - 1))
        batch = sched.schedule()
        if batch.decode_only and rng.random() < 0.5:
            sched.advance_decode(sched.decode_horizon(rng.randint(1, 12)))
        else:
            sched.complete_step(batch, [], {r: min(rng.randint(0, 3), r.num_draft) for r in batch.decode
                                            if r.num_draft})
        sched.sync_all()
        check_hybrid(kv, reqs)
        assert sched.num_kv_tokens == filled(kv, reqs)
    for _ in range(2_000):
        if not sched.has_work():
            break
        sched.complete_step(sched.schedule())
    assert not sched.has_work() and kv.num_free == kv.num_blocks
    check_hybrid(kv, reqs)
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in reqs)


@pytest.mark.parametrize("seed", range(30))
def test_a_decode_runs_block_horizon_never_runs_the_pool_dry(seed):
    """However far the horizon says a run can go, granting its steps one by one finds every block it needs."""
    rng = random.Random(seed)
    g = rng.choice(list(ALL.values()))
    cfg = scheduler_config(256, max_num_seqs=16, max_num_batched_tokens=256)
    kv = HybridBlockAllocator(g, rng.randint(40, 400), step_tokens=256)
    sched = make_scheduler(cfg, kv, eager=False)
    for i in range(rng.randint(1, 16)):
        sched.add(Request(i, 0.0, rng.randint(1, 60), rng.randint(20, 150)))
    for _ in range(rng.randint(1, 20)):
        batch = sched.schedule()
        if batch.decode_only:
            horizon = sched.decode_horizon(rng.randint(1, 200))
            sched.advance_decode(horizon)  # raises where the horizon overreached
        elif batch:
            sched.complete_step(batch)
    check_hybrid(kv, list(sched.running))


# -- the simulator: bulk decode runs equal stepping one by one ---------------------------------------------------------
MIXED = {"seed": 3, "arrival": {"process": "poisson", "rate": 6.0}, "num_requests": 120,
         "prompt_len": {"dist": "lognormal", "median": 300, "sigma": 1.0, "max": 3000},
         "output_len": {"dist": "lognormal", "median": 200, "sigma": 0.8, "max": 1500}}
HYBRIDS = {
    "gpt-oss-tight-swap": ("gpt-oss-20b", {"kv_cache": {"num_blocks": 500, "preemption": "swap", "swap_space_gib": 1}}),
    "gpt-oss-chunked-prefix": ("gpt-oss-20b", {"kv_cache": {"num_blocks": 900, "enable_prefix_caching": True},
                                               "serving": {"enable_chunked_prefill": True,
                                                           "max_num_batched_tokens": 512},
                                               "workload": {**MIXED, "shared_prefix": {"prefix_len": 600,
                                                                                       "num_prefixes": 3}}}),
    "llama4-tight": ("Llama-4-Scout", {"kv_cache": {"num_blocks": 2000}, "parallel": {"tensor_parallel_size": 4}}),
    "qwen3-next-tight": ("Qwen3-Next-80B-A3B", {"kv_cache": {"num_blocks": 120},
                                                "parallel": {"tensor_parallel_size": 2}}),
    "qwen3-next-prefix": ("Qwen3-Next-80B-A3B", {"kv_cache": {"num_blocks": 200, "enable_prefix_caching": True},
                                                 "serving": {"enable_chunked_prefill": True,
                                                             "max_num_batched_tokens": 2048},
                                                 "parallel": {"tensor_parallel_size": 2},
                                                 "workload": {**MIXED, "shared_prefix": {"prefix_len": 1200,
                                                                                         "num_prefixes": 2}}}),
}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_bulk_decode_steps_equal_stepping_one_by_one(name):
    model, extra = HYBRIDS[name]
    data = scenario(model=model, hardware="H200", **{"workload": MIXED, "serving": {"max_model_len": 8192}, **extra})
    m_bulk, res_bulk, rec_bulk = run(data, bulk=True)
    m_step, res_step, rec_step = run(data, bulk=False)
    check_conservation(m_bulk, res_bulk, rec_bulk)
    check_conservation(m_step, res_step, rec_step)
    for a, b in zip(token_times(res_bulk), token_times(res_step)):
        assert np.array_equal(a, b)
    for key in ("mean_utilization", "reserved_unused_fraction"):
        assert m_bulk["kv_cache"].pop(key) == pytest.approx(m_step["kv_cache"].pop(key), rel=0.05, abs=0.01)
    assert m_bulk == m_step
    assert m_step["kv_cache"]["preemptions"] > 0 or "prefix" in name
    if "prefix" in name:
        assert m_step["kv_cache"]["prefix_cache_hit_rate"] > 0.2

"""KV allocator invariants under hypothesis' stateful testing, in the shared policy code the executor runs too:
after every operation no block is leaked or owned twice and free + used = total, on the device and in swap.

Two machines: the BlockAllocator driven directly (allocate / append / trim / free / swap out / swap in), and
the Scheduler driven as an engine drives it (requests arrive, steps run, some stop early, drafts are accepted or
not) under KV pressure with recompute or swap preemption, where every request must also end finished or
rejected with a reason.
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler


def check_allocator(kv: BlockAllocator, holders: list[Request]) -> None:
    """Device and host blocks: each owned once, owned + free = all of them."""
    owned = [b for r in holders for b in r.block_table]
    assert len(owned) == len(set(owned)), "a device block is owned twice"
    assert sorted(owned + kv.free_blocks) == list(range(kv.num_blocks)), "device blocks leaked or invented"
    host = [b for r in holders for b in r.host_block_table]
    assert len(host) == len(set(host)), "a host block is owned twice"
    assert sorted(host + kv.free_host_blocks) == list(range(kv.num_swap_blocks)), "host blocks leaked"
    assert kv.num_used + kv.num_free == kv.num_blocks


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator alone: any sequence of the operations the scheduler uses."""

    @initialize(num_blocks=st.integers(1, 40), block_size=st.integers(1, 8), swap=st.integers(0, 40))
    def setup(self, num_blocks, block_size, swap):
        self.kv = BlockAllocator(num_blocks, block_size, num_swap_blocks=swap)
        self.reqs = [Request(i, 0.0, 1, 1) for i in range(6)]
        self.tokens = {r: 0 for r in self.reqs}  # tokens each request's blocks hold room for

    @rule(i=st.integers(0, 5), grow=st.integers(1, 40))
    def allocate(self, i, grow):
        r = self.reqs[i]
        if r.host_block_table:
            return
        n = self.tokens[r] + grow
        if self.kv.can_allocate(r, n):
            self.kv.allocate(r, n)
            self.tokens[r] = n

    @rule(i=st.integers(0, 5))
    def append_block(self, i):
        r = self.reqs[i]
        if self.kv.num_free and not r.host_block_table:
            self.kv.append_block(r)
            self.tokens[r] = len(r.block_table) * self.kv.block_size

    @rule(i=st.integers(0, 5), keep=st.integers(0, 40))
    def trim(self, i, keep):
        r = self.reqs[i]
        if r.host_block_table:  # a swapped-out request holds no device blocks to trim
            return
        self.kv.trim(r, keep)
        self.tokens[r] = min(self.tokens[r], len(r.block_table) * self.kv.block_size)

    @rule(i=st.integers(0, 5))
    def free(self, i):
        r = self.reqs[i]
        if r.host_block_table:
            return
        self.kv.free(r)
        self.tokens[r] = 0

    @rule(i=st.integers(0, 5))
    def swap_out(self, i):
        r = self.reqs[i]
        if r.block_table and not r.host_block_table and self.kv.can_swap_out(r):
            pairs = self.kv.swap_out(r)
            assert len(pairs) == len(r.host_block_table) and not r.block_table

    @rule(i=st.integers(0, 5))
    def swap_in(self, i):
        r = self.reqs[i]
        if r.host_block_table and self.kv.can_allocate(r, self.tokens[r]):
            held = len(r.host_block_table)
            pairs = self.kv.swap_in(r, self.tokens[r])
            assert len(pairs) == held and not r.host_block_table

    @invariant()
    def blocks_add_up(self):
        if hasattr(self, "kv"):
            check_allocator(self.kv, self.reqs)


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler as an engine drives it, under KV pressure: every request ends finished or rejected."""

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([2, 4]), chunked=st.booleans(),
                preemption=st.sampled_from(["recompute", "swap"]), gamma=st.sampled_from([0, 0, 3]),
                static=st.booleans())
    def setup(self, num_blocks, block_size, chunked, preemption, gamma, static):
        static = static and not chunked and not gamma
        cfg = scheduler_config(64, max_num_seqs=4, max_num_batched_tokens=32 if chunked else 64,
                               enable_chunked_prefill=chunked, preemption=preemption,
                               num_speculative_tokens=gamma, batching="static" if static else "continuous",
                               batch_size=3)
        kv = BlockAllocator(num_blocks, block_size, num_swap_blocks=num_blocks if preemption == "swap" else 0)
        self.sched = make_scheduler(cfg, kv)
        self.reqs: list[Request] = []
        self.gamma = gamma

    @rule(prompt=st.integers(0, 40), output=st.integers(0, 20))
    def arrive(self, prompt, output):
        r = Request(len(self.reqs), 0.0, prompt, output)
        self.reqs.append(r)
        accepted = self.sched.add(r)
        assert accepted or (r.status is Status.REJECTED and r.reject_reason)

    @precondition(lambda self: hasattr(self, "sched") and self.sched.has_work())
    @rule(stop=st.booleans(), accept=st.integers(0, 3), draft=st.integers(0, 3))
    def step(self, stop, accept, draft):
        sched = self.sched
        if self.gamma and sched.drafting:
            for r in sched.decoding.members:
                r.num_draft = min(draft, self.gamma, max(0, r.remaining_tokens - 1))
        batch = sched.schedule()
        assert batch, "work queued but nothing schedulable"
        stopped = batch.decode[:1] if stop and batch.decode else []
        accepted = {r: min(accept, r.num_draft) for r in batch.decode if r.num_draft}
        sched.complete_step(batch, stopped, accepted)

    def check(self) -> None:
        check_allocator(self.sched.kv, self.reqs)

    @invariant()
    def blocks_add_up(self):
        if hasattr(self, "sched"):
            self.sched.sync_all()
            self.check()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):  # drain: every request must end, finished or rejected with a reason
            if not self.sched.has_work():
                break
            batch = self.sched.schedule()
            assert batch
            self.sched.complete_step(batch)
        assert not self.sched.has_work()
        for r in self.reqs:
            assert r.status is Status.FINISHED or (r.status is Status.REJECTED and r.reject_reason), r
            assert not r.block_table and not r.host_block_table
        self.check()
        assert self.sched.kv.num_free == self.sched.kv.num_blocks


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_member_that_rejoined_runs_dry_on_its_live_entry():
    """Found by TestScheduler: a request preempted and readmitted leaves a stale calendar entry that sorts ahead of its
    live one; when the blocks run dry at that step, the live entry is the one dropped, so the queue still drains."""
    m = SchedulerMachine()
    m.setup(num_blocks=4, block_size=4, chunked=False, preemption="recompute", gamma=0, static=False)
    for prompt, output in [(1, 2), (2, 4), (10, 4), (1, 2)]:
        m.arrive(prompt=prompt, output=output)
    m.teardown()

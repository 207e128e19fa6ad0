"""The requests in decode phase, advanced lazily.

Every step of a decode batch adds one token to every member, so members' counters need not be
touched per step: a member stores the step count at which its counters were last brought up to date,
and the set knows when something happens to it: it finishes (a heap), or it fills its last KV block
(a calendar of steps: members step in lockstep, so a block is due every block_size steps). The
simulator then pays per event, not per token; the executor syncs members after every step.
"""
from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from sim.policy.request import Request

_NEVER = 1 << 62  # a step no run reaches: the calendar heap's sentinel


class DecodeSet:
    def __init__(self, block_size: int | None):
        self.block_size = block_size  # None: blocks are reserved up front, members never need more
        self.steps = 0
        self.members: dict[Request, None] = {}
        self.sum_computed = 0  # Σ num_computed over members, as of `steps`
        # heap of (step, tag, member): when each member finishes (a stale tag: it left); read by the scheduler's hot path
        self.finishes: list[tuple[int, int, Request]] = []
        self.due: dict[int, list[tuple[int, Request]]] = {}  # step → (tag, member) needing a block then
        # heap of _due's steps (DecodeSet's own): grant_blocks visits only those; a sentinel past any step ends its loop
        self.due_steps: list[int] = [_NEVER]
        self.cursor = 0  # every step before this one has had its blocks handed out
        self._tags = itertools.count()

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, r: Request) -> bool:
        return r in self.members

    def join(self, r: Request, block_capacity: int | None) -> None:
        """Add a request whose counters are current; `block_capacity`: tokens its blocks hold."""
        tag = self._enter(r)
        if block_capacity is not None and self.block_size:
            self._book(self.steps + block_capacity - r.num_computed, [(tag, r)])

    def _enter(self, r: Request) -> int:
        """Make r a member as of now, its finish on the heap; returns its tag."""
        r.sync_step = self.steps
        r.decode_tag = tag = next(self._tags)
        self.members[r] = None
        self.sum_computed += r.num_computed
        heapq.heappush(self.finishes, (self.steps + r.max_tokens - r.num_generated, tag, r))  # + remaining_tokens
        return tag

    def sync(self, r: Request) -> None:
        d = self.steps - r.sync_step
        if d:
            r.num_computed += d
            r.num_generated += d
            r.sync_step = self.steps

    def leave(self, r: Request) -> None:
        self.sync(r)
        del self.members[r]
        self.sum_computed -= r.num_computed
        r.decode_tag = -1  # invalidates its heap entries

    def advance(self, k: int) -> None:
        self.steps += k
        self.sum_computed += k * len(self.members)

    def pop_finished(self) -> list[Request]:
        """Members that have produced all their tokens by now; they leave the set."""
        out = []
        while self.finishes and self.finishes[0][0] <= self.steps:
            _, tag, r = heapq.heappop(self.finishes)
            if r.decode_tag == tag:
                self.leave(r)
                out.append(r)
        return out

    def next_finish(self) -> float:
        while self.finishes and self.finishes[0][2].decode_tag != self.finishes[0][1]:
            heapq.heappop(self.finishes)
        return self.finishes[0][0] if self.finishes else math.inf

    def regrant(self, r: Request, kv) -> bool:
        """Give a member its block after the calendar ran dry and others were preempted for it; False if still none
        is free."""
        if not kv.free_blocks:
            return False
        self.sync(r)
        kv.append_block(r)
        self.push_block_need(r, len(r.block_table) * kv.block_size)
        return True

    def push_block_need(self, r: Request, block_capacity: int) -> None:
        """Record when a (synced) member next fills its blocks."""
        self._book(self.steps + block_capacity - r.num_computed, [(r.decode_tag, r)])

    def grant_blocks(self, upto: int, free_blocks: list[int]) -> Request | None:
        """Hand a block from `free_blocks` to each member that needs one at a step ≤ `upto`, in
        (step, join) order. Returns the first member left without one when the list runs dry."""
        heap = self.due_steps
        if heap[0] > upto:  # nothing due by then (a third of the calls): the cursor alone moves
            if upto >= self.cursor:
                self.cursor = upto + 1
            return None
        due, bs, cursor = self.due, self.block_size, self.cursor
        # free_blocks.pop() loaded at each call: Python 3.11 specializes a method load, not a bound method's read
        pop_step, move_step = heapq.heappop, heapq.heapreplace
        while (step := heap[0]) <= upto:  # the sentinel ends it
            if step < cursor:  # booked behind the steps already handed out: never due (as it never was)
                pop_step(heap)
                continue
            bucket = due.pop(step)
            nxt = step + bs
            if len(bucket) == 1:  # one member due (the usual case): no sort, a stale entry just dropped
                tag, r = bucket[0]
                if r.decode_tag != tag:
                    pop_step(heap)
                    continue
                try:  # the list's own check that a block is left: no count kept (a free queue's is asked in Python)
                    r.block_table.append(free_blocks.pop())
                except IndexError:
                    pop_step(heap)
                    return self._run_dry(step, bucket, r)
                later = due.get(nxt)  # _book, inline, of a bucket known not empty
                if later is None:
                    due[nxt] = bucket
                    move_step(heap, nxt)  # the step's heap entry becomes its next period's: one call, not two
                else:
                    later += bucket
                    pop_step(heap)
                continue
            bucket.sort()
            stale = False
            for tag, r in bucket:
                if r.decode_tag != tag:
                    stale = True
                    continue
                try:
                    r.block_table.append(free_blocks.pop())
                except IndexError:
                    pop_step(heap)
                    return self._run_dry(step, bucket, r)
            if stale:
                bucket = [e for e in bucket if e[1].decode_tag == e[0]]
            later = due.get(nxt)  # _book, inline: once per step with a block due
            if later is not None:
                later += bucket
                pop_step(heap)
            elif bucket:
                due[nxt] = bucket
                move_step(heap, nxt)
            else:
                pop_step(heap)
        if upto >= cursor:
            self.cursor = upto + 1
        return None

    def _run_dry(self, step: int, bucket: list, r: Request) -> Request:
        """grant_blocks ran out of blocks at `step`, member r of its (sorted) bucket next: the members before r got
        theirs (their next need booked), those after r keep theirs due at `step`, r's own entry is dropped. r's live
        entry is found by its tag too: a stale entry of r's from before it left and rejoined may sort ahead of it."""
        i = next(j for j, (tag, m) in enumerate(bucket) if m is r and tag == r.decode_tag)
        self._book(step, bucket[i + 1:])
        self._book(step + self.block_size, [e for e in bucket[:i] if e[1].decode_tag == e[0]])
        self.cursor = step
        return r

    def _book(self, step: int, entries: list) -> None:
        """Calendar entries (tag, member) due at `step`, after those booked there before."""
        if entries:
            bucket = self.due.get(step)
            if bucket is None:
                self.due[step] = entries
                heapq.heappush(self.due_steps, step)
            else:
                bucket.extend(entries)

    def block_horizon(self, k: int, num_free: int) -> int:
        """Largest k' ≤ k such that the blocks members need during steps 2..k' fit in `num_free`."""
        bs = self.block_size
        if num_free >= len(self.members) * ((k - 1) // bs + 1):
            return k
        steps = self.steps
        # steps from now to each member's next need: its one live entry in the calendar
        firsts = np.array([s for s, bucket in self.due.items() for tag, r in bucket if r.decode_tag == tag],
                          np.int64) - steps
        lo, hi = 1, k
        while lo < hi:  # blocks needed by step kk: Σ over members needing one by then of 1 + (kk − 1 − f) // bs
            mid = (lo + hi + 1) // 2
            if int(np.maximum((mid - 1 - firsts) // bs + 1, 0).sum()) <= num_free:
                lo = mid
            else:
                hi = mid - 1
        return lo


class HybridDecodeSet(DecodeSet):
    """The decode set over a hybrid model's allocator (sim/policy/hybrid_allocator.py): a member's calendar entry is
    the next step at which any of its blocks change, a new block for each group at a block boundary or a window's
    first block freed, and the allocator makes the change."""

    def __init__(self, kv):
        super().__init__(kv.block_size)
        self.kv = kv

    def join(self, r: Request, block_capacity: int | None) -> None:
        """Add a request whose counters are current (its blocks come from the allocator's tables)."""
        tag = self._enter(r)
        c = r.num_computed
        later = 0 if self.kv.changes_now(r, c) else self.kv.next_event(r, c) - c
        # one joining while a step is scheduled (swapped in, handed over) got its blocks for that step already
        self.due.setdefault(max(self.steps + later, self.cursor), []).append((tag, r))

    def regrant(self, r: Request, kv) -> bool:
        self.sync(r)
        c = r.num_computed
        if not kv.grow(r, c, c + 1):
            return False
        self.due.setdefault(self.steps + kv.next_event(r, c) - c, []).append((r.decode_tag, r))
        return True

    def grant_blocks(self, upto: int, free_blocks) -> Request | None:
        """Make each member's block changes due at a step ≤ `upto`, in (step, join) order: free what left its windows,
        take the blocks a boundary needs. Returns the first member left without them when the pool runs dry."""
        due, kv = self.due, self.kv
        while self.cursor <= upto:
            step = self.cursor
            bucket = due.pop(step, None)
            if bucket:
                if len(bucket) > 1:
                    bucket.sort()
                for i, (tag, r) in enumerate(bucket):
                    if r.decode_tag != tag:
                        continue
                    c = r.num_computed + step - r.sync_step
                    nxt = kv.decode_step(r, c)
                    if nxt < 0:
                        if i + 1 < len(bucket):
                            due[step] = bucket[i + 1:]
                        return r
                    due.setdefault(step + nxt - c, []).append((tag, r))
                kv.note_peak()  # blocks come and go within a run of steps: its peak is a step's, as one by one
            self.cursor += 1
        return None

    def until_blocks_free(self, k: int) -> int:
        """Steps from now, at most k, to the first at which a member frees blocks out of its window: a request
        waiting for blocks could start there, so a run of identical steps stops before it."""
        kv, steps = self.kv, self.steps
        for r in self.members:
            c = r.num_computed + steps - r.sync_step
            k = min(k, kv.next_drop(r, c) - c)
        return max(k, 1)

    def block_horizon(self, k: int, num_free: int) -> int:
        """Largest k' ≤ k such that the blocks members may need during steps 2..k' fit in `num_free`: at each of a
        member's block boundaries one block per group that grows, a kind whose old blocks are freed (windows, a
        linear state with prefix caching) at most what it holds at most more than now (frees not counted: a safe
        bound)."""
        kv, bs = self.kv, self.block_size
        if num_free >= len(self.members) * kv.n_growing * ((k - 1) // bs + 1):
            return k
        steps, grow = self.steps, kv.grow_kind
        windowed = [(i, n, kv.most_live(mode, window)) for i, (mode, window, n) in enumerate(kv.kinds)
                    if mode in ("sliding_window", "chunked_local", "state_align")]
        firsts, caps = [], []
        for r in self.members:
            firsts.append(len(r.group_tables[grow]) * bs - r.num_computed - steps + r.sync_step)
            caps.append([most - kv.live(r, i) + 1 for i, _, most in windowed])
        f = np.array(firsts, np.int64)
        cap = np.array(caps, np.int64).reshape(len(firsts), len(windowed))
        weights = np.array([n for _, n, _ in windowed], np.int64)

        def need(kk: int) -> int:
            a = np.maximum((kk - 1 - f) // bs + 1, 0)
            return int(kv.n_full * a.sum() + (np.minimum(a[:, None], cap) * weights).sum())

        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= num_free:
                lo = mid
            else:
                hi = mid - 1
        return lo

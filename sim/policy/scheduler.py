"""Continuous (in-flight) batching, the scheduler both clocks run: which requests run in the next engine step.

Follows vLLM (FCFS, prefill-first, recompute/swap preemption from the tail, optional chunked prefill with a per-step
token budget) with TGI's waiting_served_ratio gate. The queues, timeouts and the bookkeeping after a step are
`BaseScheduler`'s; speculative decoding's per-step KV slots are `SpeculativeSlots`' (a decode row carries its last
token and the drafts proposed for it, `request.num_draft`, set by the drafter before the step; afterwards the caller
says how many were accepted); disaggregated serving's hand-off queues are the `HandOff` the scheduler is given.
Static batching is `StaticScheduler`; `make_scheduler` picks one.
"""
from __future__ import annotations

from sim.config.plan import SchedulerConfig
from sim.policy.base_scheduler import BaseScheduler
from sim.policy.batch import BatchShape, ScheduledBatch, prefill_shape, verify_shape
from sim.policy.block_manager import BlockAllocator
from sim.policy.decode_set import DecodeSet
from sim.policy.handoff import HandOff
from sim.policy.request import Request, Status
from sim.policy.speculative_slots import SpeculativeSlots
from sim.policy.static_scheduler import StaticScheduler

# an Enum member read off its class takes the generic lookup in Python 3.11 (no specialization): once per request
RUNNING = Status.RUNNING

__all__ = ["BatchShape", "ScheduledBatch", "Scheduler", "StaticScheduler", "make_scheduler"]


class Scheduler(BaseScheduler):
    """Continuous (in-flight) batching over a paged or contiguous KV allocator; `handoff`: a disaggregated
    instance's hand-off queues (a prefill instance's names the decode pool it hands to)."""

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True, handoff: HandOff | None = None):
        spec = SpeculativeSlots(cfg, kv) if cfg.num_speculative_tokens > 0 else None
        # speculative rows advance by different amounts: no lockstep block calendar, blocks reserved per step
        super().__init__(cfg, kv, eager, DecodeSet(None) if kv.contiguous or spec else kv.make_decode_set(), handoff)
        self.spec = spec
        self.speculative = spec is not None
        self.window_frees = 0  # the allocator's count of window frees when this step was scheduled
        self.hands_off = self.handoff.decode_pool is not None
        # decode rows step alike, their blocks from the calendar: no speculative rows, no hybrid groups' windows
        self.lockstep = not (self.speculative or kv.hybrid)

    # -- disaggregated decode instance ------------------------------------------------------------
    def add_prefilled(self, req: Request) -> bool:
        """Decode instance: queue a request prefilled elsewhere (its first token out, its KV still there), or
        reject it with a reason if it can never be served here."""
        return self._queue_unless(req, self.decode_reject_reason(req), self.handoff.queue)

    def reserve_transfers(self) -> list[Request]:
        """Decode instance: reserve blocks for queued hand-offs within max_num_seqs (`HandOff.reserve`)."""
        return self.handoff.reserve(self.cfg.max_num_seqs - len(self.running) - self.handoff.holding)

    # -- one step -------------------------------------------------------------------------------
    def _schedule(self) -> ScheduledBatch:
        if self.kv.hybrid:
            self.window_frees = self.kv.window_frees
        budget, chunked = self.cfg.max_num_batched_tokens, self.cfg.enable_chunked_prefill
        if self.cfg.mixed_batches:  # the decodes first, prompts (or their chunks) in what is left of the budget
            preempted = self._grow_decodes(budget)
            if self._decodes_alone(preempted):
                self.steps_since_admission += 1
                return self._decode_batch()
            budget -= self._decode_tokens()
            prefill = self._continue_prefills(budget, preempted) if self.prefilling else []
            if prefill:
                budget -= sum(n for _, n in prefill)
            # nothing swapped out or received (the usual step): nothing to resume, without the call
            swapped_in, received = self._resume(budget, preempted) if self.swapped or self.handoff.ready else ([], [])
            budget -= len(swapped_in) + len(received)
            admitted = [] if preempted or self.swapped else self._admit(budget, chunked)
            self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
            return self._batch(prefill + admitted, True, preempted, swapped_in, received)
        preempted: list[Request] = []
        if not self.swapped:  # a step that prefills runs prompts alone (SGLang; vLLM V0 without chunked prefill)
            prefill = self._continue_prefills(budget, preempted) if self.prefilling else []
            if prefill:
                budget -= sum(n for _, n in prefill)
            admitted = self._admit(budget, chunked=chunked) if not preempted else []
            if prefill or admitted:
                self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
                return self._batch(prefill + admitted, False, preempted, [])
        preempted += self._grow_decodes(budget)
        swapped_in, received = self._resume(budget - self._decode_tokens(), preempted)
        self.steps_since_admission += 1
        return self._batch([], True, preempted, swapped_in, received)

    def _decodes_alone(self, preempted: list[Request]) -> bool:
        """Whether a mixed step holds the decodes and nothing else, settled without the general path: nothing
        preempted, prefilling, swapped, received or admissible (no request waiting, or the first one not seen yet)."""
        waiting = self.waiting
        return not (preempted or self.prefilling or self.swapped or self.handoff.ready or self.speculative) and (
            not waiting or waiting[0].arrival_s > self.visible_until) and bool(self.decoding.members)

    def decodes_settled(self) -> bool:
        """Nothing waits, is swapped out, prefilled, received or drafted, and no window frees blocks: every step
        until a request arrives is the decodes alone (`_decodes_alone`)."""
        return self.lockstep and not self.waiting and self._decodes_alone(())

    def schedule_decodes(self) -> tuple[int, int] | None:
        """schedule() of a step of the decodes alone (`_decodes_alone`), settled without a batch where no row can be
        short of a block (the due ones fit in the free list), nor a hybrid model's windows free any: the rows' blocks
        granted, (rows, tokens of context). None where `schedule` must form the step (nothing changed then)."""
        dec, kv, waiting = self.decoding, self.kv, self.waiting
        # _decodes_alone(()), inline: asked after every run of decode steps
        if not self.lockstep or self.prefilling or self.swapped or self.handoff.ready or not dec.members \
                or (waiting and waiting[0].arrival_s <= self.visible_until):
            return None
        steps = dec.steps
        due = dec.due.get(steps, ()) if steps >= dec.cursor else ()  # due_at(steps), without its call
        if due:
            if len(due) > kv.free_count():
                return None
            dec.grant_blocks(steps, kv.free_blocks)
            kv.note_peak()
        elif dec.cursor <= steps:  # none due: no block changes hands, the peak stands; the step handed out
            dec.cursor = steps + 1
        self.steps_since_admission += 1
        b = len(dec.members)
        return b, dec.sum_computed + b

    def _decode_batch(self) -> ScheduledBatch:
        """_batch of a step of the decodes alone (one token each, attending to its whole context)."""
        members = self.decoding.members
        b = len(members)
        ctx = self.decoding.sum_computed + b
        return ScheduledBatch(BatchShape(b, b, ctx, ctx, b, 0, 0, 0, 0, 0), list(members) if self.eager else [],
                              [], True, True, [], [], [], [], [])

    def _resume(self, budget: int, preempted: list[Request]) -> tuple[list[Request], list[Request]]:
        """Within `budget` tokens, swapped-out requests back in, then hand-offs whose KV has arrived (none in a step
        that preempted)."""
        if preempted:
            return [], []
        swapped_in = self._swap_in(budget) if self.swapped else []
        return swapped_in, self._join_received(budget - len(swapped_in)) if self.handoff.ready else []

    @property
    def drafting(self) -> bool:
        """Whether decode rows take drafts this step: speculative decoding is on and the batch is not above
        speculative_disable_by_batch_size (a big batch is compute-bound: drafts would cost more than they
        save), and the step will decode: without chunked prefill a step that admits prompts runs them alone,
        and drafts made for it would be thrown away. Drafters ask before proposing; the scheduler cuts drafts
        when it is False."""
        cfg = self.cfg
        return self._may_draft() and (cfg.mixed_batches or bool(self.swapped) or (
            not self.prefilling and not self._admissible(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill)))

    def _may_draft(self) -> bool:
        """Speculative decoding is on and the batch is not above speculative_disable_by_batch_size (within a
        step that decodes, all that `drafting` asks)."""
        return self.speculative and self.spec.may_draft(len(self.decoding))

    def _decode_tokens(self) -> int:
        """Tokens the decode rows compute this step."""
        if not self.speculative:
            return len(self.decoding.members)
        return self.spec.decode_tokens(self.decoding.members)

    def _grow_decodes(self, budget: int) -> list[Request]:
        """Give a new block to every decoding request that fills its last one this step; when none is
        free, preempt from the end of the running order (possibly the request itself)."""
        if self.speculative:
            return self._reserve_verify_slots(budget)
        preempted: list[Request] = []
        dec, free = self.decoding, self.kv.free_blocks
        while (r := dec.grant_blocks(dec.steps, free)) is not None:
            while True:
                victim = next(reversed(self.running))
                self._preempt(victim)
                preempted.append(victim)
                if victim is r or dec.regrant(r, self.kv):
                    break
        return preempted

    def _reserve_verify_slots(self, budget: int) -> list[Request]:
        """Speculative decoding: every row computes its last token; what is left of the budget (nothing, when not
        drafting) is for drafts. This step decodes, so whether a prompt would run alone (`drafting`'s other
        question) is settled. Short of blocks, preempt from the end of the running order."""
        members = self.decoding.members
        budget = budget - len(members) if self._may_draft() else 0
        return self.spec.reserve(members, budget, lambda r, c, preempted: self._make_room(r, c, self.running,
                                                                                           preempted))

    def _make_room(self, r: Request, num_tokens: int, pool: dict, preempted: list[Request]) -> bool:
        """Allocate KV for `num_tokens` of r's tokens, preempting from the end of `pool` (possibly r itself)
        while blocks are short. False if r was preempted."""
        while not self.kv.can_allocate(r, num_tokens):
            victim = next(reversed(pool))
            self._preempt(victim)
            preempted.append(victim)
            if victim is r:
                return False
        self.kv.allocate(r, num_tokens)
        return True

    def _continue_prefills(self, budget: int, preempted: list[Request]) -> list[tuple[Request, int]]:
        """Next chunks of partly computed prompts; short of blocks, the newest prefill is preempted."""
        out: list[tuple[Request, int]] = []
        for r in list(self.prefilling):
            if r not in self.prefilling:
                continue
            n = min(r.num_uncomputed, self.cfg.prefill_chunk_size, budget)
            if n <= 0:
                break
            n = self.kv.align_chunk(r, r.num_computed, n)
            if n and self._make_room(r, r.num_computed + n, self.prefilling, preempted):
                out.append((r, n))
                budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        """Take `req` off the device: swap its blocks to host memory, or free them to recompute later."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.num_draft = 0
        self._stop_running(req)
        if self.cfg.preemption == "swap" and req.num_generated and self.kv.can_swap_out(req):
            req.status = Status.SWAPPED
            req.swap_pairs = self.kv.swap_out(req)
            self.swapped.append(req)
            return
        self.kv.free(req)
        req.num_computed = 0  # recompute: the prompt and the outputs so far are prefilled again
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _swap_in(self, budget: int) -> list[Request]:
        out = []
        while self.swapped and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            r = self.swapped[0]
            if not self.kv.can_allocate(r, r.num_computed + 1):
                break
            self.swapped.popleft()
            r.swap_pairs = self.kv.swap_in(r, r.num_computed + 1)
            r.status = Status.RUNNING
            self.running[r] = None
            self.decoding.join(r, self._block_capacity(r))
            out.append(r)
            budget -= 1
        return out

    def _join_received(self, budget: int) -> list[Request]:
        """Requests whose KV has arrived join the decodes (their blocks were reserved with the transfer)."""
        out = self.handoff.take_ready(budget)
        for r in out:
            r.status = Status.RUNNING
            self.running[r] = None
            self.decoding.join(r, self._block_capacity(r))
        return out

    def _admit(self, budget: int, chunked: bool) -> list[tuple[Request, int]]:
        """New requests from the head of the queue (FCFS) that fit the seq limit, budget and free blocks."""
        picks = self._admissible(budget, chunked)
        if self.prefix_caching:  # every cached prefix held before any new block is handed out (which could evict it)
            for r, _ in picks:
                if not r.block_table:
                    self.kv.take_prefix(r, self.kv.cached_prefix(r)[0] if r.block_hashes else 0)
        for r, n in picks:
            self.waiting.popleft()
            if self.reservation is not None:
                self.reservation.take(r)
            self.kv.allocate(r, r.num_computed + n)
            r.status = RUNNING
            self.running[r] = None
            self.prefilling[r] = None
        return picks

    def _admissible(self, budget: int, chunked: bool) -> list[tuple[Request, int]]:
        """What `_admit` would take now (the queue and the KV cache left as they are)."""
        if not self.waiting:
            return []
        cfg = self.cfg
        picks: list[tuple[Request, int]] = []
        free = self.kv.free_count() - self.kv.watermark_blocks
        h = self.handoff  # HandOff.holding, inline: asked at every step with requests waiting
        slots = cfg.max_num_seqs - len(self.running) - len(h.receiving) - len(h.ready)
        visible, reserve = self.visible_until, self.reservation
        room = reserve.room() if reserve is not None else 0
        kv = self.kv
        aligns = kv.hybrid  # only a hybrid model's chunks are cut to its blocks
        for r in self.waiting:
            if len(picks) >= slots or budget <= 0 or r.arrival_s > visible:
                break
            if reserve is not None:  # its whole length must fit beside the running requests' (no eviction)
                room -= reserve.whole(r)
                if room < 0:
                    break
            computed, held, revive = r.num_computed, len(r.block_table), 0
            if self.prefix_caching and not held:  # its cached prefix: blocks others hold, or free ones revived
                if r.block_hashes:  # a prompt without hashes has none
                    held, revive = self.kv.cached_prefix(r)
                computed = held * self.kv.block_size
            uncomputed = r.prompt_len + r.num_generated - computed  # num_tokens, inline: a property's call costs more
            n = uncomputed
            if chunked:  # min(uncomputed, chunk, budget) without the call: asked at every step a request waits
                if cfg.prefill_chunk_size < n:
                    n = cfg.prefill_chunk_size
                if budget < n:
                    n = budget
            if aligns:
                n = kv.align_chunk(r, computed, n)
            need = revive + kv.admit_blocks(computed, computed + n, held)
            if n > budget or need > free or not n:
                break
            free -= need
            budget -= n
            picks.append((r, n))
        if not picks or (cfg.waiting_served_ratio is not None and not self._gate_open(len(picks))):  # no gate: open
            return []
        return picks

    def _gate_open(self, num_admissible: int) -> bool:
        """TGI: pause the running batch for a prefill only if enough requests wait, or they waited long."""
        ratio, max_wait = self.cfg.waiting_served_ratio, self.cfg.max_waiting_tokens
        if not self.running or ratio is None:
            return True
        if max_wait is not None and self.steps_since_admission >= max_wait:
            return True
        return num_admissible >= int(len(self.running) * ratio)

    def _batch(self, prefill, decodes, preempted, swapped_in, received=()) -> ScheduledBatch:
        tokens, ctx, pairs, sampled = prefill_shape(prefill) if prefill else (0, 0, 0, 0)
        b = len(self.decoding.members) if decodes else 0
        verify = 0
        if decodes and self.speculative:
            d_tokens, d_ctx, d_pairs, d_sampled, verify = verify_shape(self.decoding.members)
        else:  # one token each, attending to its whole context
            d_tokens = d_sampled = b
            d_ctx = d_pairs = self.decoding.sum_computed + b if decodes else 0
        swap_out = [p for r in preempted if r.status is Status.SWAPPED for p in r.swap_pairs] if preempted else []
        swap_in = [p for r in swapped_in for p in r.swap_pairs] if swapped_in else []
        if received:
            swapped_in = swapped_in + received
        shape = BatchShape(b + len(prefill), d_tokens + tokens, d_ctx + ctx, d_pairs + pairs, d_sampled + sampled,
                           len(swap_out) + len(swap_in), len(prefill), verify, tokens, ctx)
        decode_only = decodes and not prefill and not preempted and not swapped_in and not self.prefilling \
            and not self.speculative  # speculative rows advance unevenly: no run of identical steps
        # the simulator never reads plain decode rows: skip the O(batch) copy there
        rows = list(self.decoding.members) if decodes and (self.eager or self.speculative) else []
        return ScheduledBatch(shape, rows, prefill, decodes, decode_only, preempted, swapped_in, list(received),
                              swap_out, swap_in)

    # -- after the step -------------------------------------------------------------------------
    def _advance_verified(self, batch: ScheduledBatch, accepted: dict[Request, int] | None,
                          finished: list[Request]) -> None:
        """Every speculative decode row got one token and its accepted drafts."""
        done, added = self.spec.advance(batch.decode, accepted or {})
        self.decoding.sum_computed += added
        for r in done:
            self.decoding.leave(r)
            finished.append(self._finish(r))

    def _first_token(self, r: Request) -> None:
        """A request whose prompt is done: a prefill instance hands it off (its blocks kept to send), else it
        decodes from the next step."""
        if self.hands_off:
            del self.running[r]
            self.handoff.send(r)
        else:
            self.decoding.join(r, self._block_capacity(r))

    # -- many identical decode steps at once (simulator only) ----------------------------------
    def decode_horizon(self, k_max: int) -> int:
        """How many decode steps, the scheduled one included, would be scheduled identically (absent
        arrivals): until a request finishes, a block allocation could fail, or the TGI wait limit trips."""
        dec = self.decoding
        top = dec.finishes[0] if dec.finishes else None
        # next_finish's answer without its call where the heap's top is live (as it is but after a preemption)
        k = (top[0] if top is not None and top[2].decode_tag == top[1] else dec.next_finish()) - dec.steps
        if k_max <= k:  # min() without the call: asked at every run of decode steps
            k = k_max
        max_wait = self.cfg.max_waiting_tokens
        if self.waiting and max_wait is not None and self.cfg.waiting_served_ratio is not None \
                and self.steps_since_admission - 1 < max_wait:
            k = min(k, max_wait - (self.steps_since_admission - 1))
        if k > 1 and dec.block_size:
            free = self.kv.free_count()
            # block_horizon's own first answer, without its call where it holds: blocks for every row at every
            # boundary of the run (a hybrid model's rows may take several a boundary: its call)
            if self.kv.hybrid or free < len(dec.members) * ((k - 1) // dec.block_size + 1):
                k = dec.block_horizon(k, free)
        if k > 1 and self.kv.hybrid and (self.waiting or self.swapped or self.handoff.incoming):
            # blocks leaving a window could start what waits for them: this step's (maybe after it was turned
            # away), or a later one's
            k = 1 if self.kv.window_frees != self.window_frees else dec.until_blocks_free(k)
        return k if k > 1 else 1



def make_scheduler(cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True,
                   decode_pool: Scheduler | None = None) -> BaseScheduler:
    """The scheduler for `cfg.batching`; `decode_pool`: a disaggregated prefill instance's (continuous batching), the
    policy of the decode instances it hands to."""
    if cfg.batching == "static":
        return StaticScheduler(cfg, kv, eager)
    return Scheduler(cfg, kv, eager, HandOff(kv, decode_pool))

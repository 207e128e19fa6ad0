"""Schedulers: which requests run in the next engine step. Plain Python, no SimPy, no torch.

The simulator's replica and the executor's engine call the same objects; only the clock differs.
Continuous batching follows vLLM (FCFS, prefill-first, recompute/swap preemption from the tail,
optional chunked prefill with a per-step token budget) with TGI's waiting_served_ratio gate;
static batching keeps a batch until its longest request ends, finished rows computing padding.
Speculative decoding (num_speculative_tokens > 0): a decoding request's row carries its last token and
the drafts proposed for it (request.num_draft, set by the drafter before the step); the step reserves KV
for all of them, and afterwards the caller says how many drafts were accepted; the slots of rejected
ones are given back.
Disaggregated serving: a prefill instance's scheduler (`decode_pool`) hands a request whose prompt is done to the
caller instead of decoding it, keeping its blocks until the caller has sent its KV (`take_handoffs`, `release`); a
decode instance's scheduler queues handed-off requests (`add_prefilled`), reserves their blocks when it has room
(`reserve_transfers`: the caller copies the KV in) and, once `received`, decodes them like a swapped-in request.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from sim.config.plan import SchedulerConfig
from sim.policy.block_manager import BlockAllocator
from sim.policy.decode_set import DecodeSet
from sim.policy.request import Request, Status


@dataclass(slots=True)
class BatchShape:
    """What one engine step computes, as the cost model sees it (padded rows included)."""

    num_seqs: int
    num_new_tokens: int
    sum_context: int  # tokens in the KV cache after the step, over all sequences
    attn_pairs: int  # (query, key) pairs attention computes, causal within each prompt
    num_sampled: int  # sequences whose logits are computed (a prompt chunk that ends mid-prompt has none)
    swap_blocks: int = 0
    num_prefill: int = 0  # rows computing a prompt chunk; the rest decode (one token, or a verify row's few)
    num_verify: int = 0  # decode rows carrying drafts (speculative verify rows)
    prefill_tokens: int = 0  # new tokens of the prompt-chunk rows
    prefill_context: int = 0  # context of the prompt-chunk rows after the step (of sum_context)


@dataclass(slots=True)
class ScheduledBatch:
    """One engine step: every decoding request steps one token (if `decodes`), plus prompt chunks.

    Decoding requests' counters are kept lazily by the DecodeSet; `rows()` brings them up to date.
    """

    shape: BatchShape
    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decodes: bool = True  # this step decodes every decoding request (False: a prefill-only step)
    decode_only: bool = False  # nothing but decodes: the next steps repeat it until something changes
    preempted: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)  # and received (disaggregated): their first decode
    received: list[Request] = field(default_factory=list)  # of swapped_in, those whose KV came from a prefill pool
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block copies, first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) block copies, first
    padding: list[Request] = field(default_factory=list)  # static batching: finished rows still computed

    def __bool__(self) -> bool:
        return self.shape.num_seqs > 0

    def rows(self) -> list[tuple[Request, int, int]]:
        """(request, new tokens, context length after the step) per real sequence, decodes first (a
        decode row: its last token and its drafts). The counters of decode rows must be current."""
        return [(r, 1 + r.num_draft, r.num_computed + 1 + r.num_draft) for r in self.decode] + \
               [(r, n, r.num_computed + n) for r, n in self.prefill]


def _prefill_shape(prefill: list[tuple[Request, int]]) -> tuple[int, int, int, int]:
    """(new tokens, context after, attention pairs, sampled rows) of prompt chunks."""
    tokens = ctx = pairs = sampled = 0
    for r, n in prefill:
        c = r.num_computed + n
        tokens += n
        ctx += c
        pairs += n * (c - n) + n * (n + 1) // 2  # each new token attends to everything before it
        sampled += c == r.num_tokens
    return tokens, ctx, pairs, sampled


def _verify_shape(rows) -> tuple[int, int, int, int, int]:
    """_prefill_shape of speculative decode rows (each computes its last token and its drafts), except that
    every one of those positions needs logits (to check the draft after it); and how many rows draft."""
    tokens, ctx, pairs, _ = _prefill_shape([(r, 1 + r.num_draft) for r in rows])
    return tokens, ctx, pairs, tokens, sum(1 for r in rows if r.num_draft)


class Scheduler:
    """Continuous (in-flight) batching over a paged or contiguous KV allocator.

    `eager=False` (the simulator) leaves decoding requests' counters stale between events, so a step
    costs O(events), not O(batch); the executor keeps them current.
    """

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True,
                 decode_pool: "Scheduler | None" = None):
        self.cfg = cfg
        self.kv = kv
        self.eager = eager
        # a prefill instance: prompts done are handed to a decode instance of this pool (its policy: any instance's),
        # whose limits an arrival must fit too
        self.decode_pool = decode_pool
        self.sending: dict[Request, list[int]] = {}  # handed off, KV not yet sent: the blocks it still holds
        self.outbox: list[Request] = []  # handed off since the caller last took them
        self.incoming: deque[Request] = deque()  # prefilled elsewhere, waiting for blocks here
        self.receiving: dict[Request, None] = {}  # blocks reserved, KV on its way
        self.ready: deque[Request] = deque()  # KV arrived, joins the decodes at the next decode step
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # admission order: preemption takes from the end
        self.prefilling: dict[Request, None] = {}  # running, prompt not fully computed (chunked)
        self.swapped: deque[Request] = deque()
        self.speculative = cfg.num_speculative_tokens > 0
        # speculative rows advance by different amounts: no lockstep block calendar, blocks reserved per step
        self.decoding = DecodeSet(None if kv.contiguous or self.speculative else kv.block_size)
        self.steps_since_admission = 0
        self.num_preemptions = 0
        self.prefix_caching = kv.prefix_caching

    # -- arrivals -------------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason if it can never be served."""
        total = req.prompt_len + req.max_tokens
        refused = self.decode_pool.decode_reject_reason(req) if self.decode_pool is not None else None
        reason = None
        if req.prompt_len < 1 or req.max_tokens < 1:
            reason = "prompt and output need at least one token each"
        elif total > self.cfg.max_model_len:
            reason = "prompt_len + max_tokens exceeds max_model_len"
        elif refused:  # turned away now, not after its prompt is computed for nothing
            reason = refused
        elif self.kv.blocks_for(total - 1) > self.kv.num_blocks - self.kv.watermark_blocks:
            reason = "needs more KV cache than the whole cache"
        elif self.cfg.max_queue_len is not None and len(self.waiting) >= self.cfg.max_queue_len:
            reason = "queue full (max_queue_len)"
        if reason:
            req.status, req.reject_reason = Status.REJECTED, reason
            return False
        self.waiting.append(req)
        return True

    def expire(self, now: float) -> list[Request]:
        """Reject the waiting requests that have not started within max_queue_delay_s of arriving (either clock
        calls this before each step with its time); returns them."""
        delay = self.cfg.max_queue_delay_s
        if delay is None or not self.waiting:
            return []
        gone = [r for r in self.waiting if not r.num_preemptions and r.arrival_s + delay <= now]
        if gone:
            dropped = set(gone)
            self.waiting = deque(r for r in self.waiting if r not in dropped)
            for r in gone:
                r.status, r.reject_reason = Status.REJECTED, "queue timeout (max_queue_delay_s)"
        return gone

    def next_expiry(self) -> float:
        """When the first waiting request will time out (inf if none can)."""
        delay = self.cfg.max_queue_delay_s
        if delay is None:
            return float("inf")
        return min((r.arrival_s + delay for r in self.waiting if not r.num_preemptions), default=float("inf"))

    def has_work(self) -> bool:
        """Whether a step could run now (a request still arriving from a prefill instance cannot)."""
        return bool(self.waiting or self.running or self.swapped or self.ready)

    @property
    def num_outstanding(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.incoming) + \
            len(self.receiving) + len(self.ready)

    def abort(self, req: Request, reason: str | None) -> None:
        """Take a request out wherever it waits or runs, its blocks freed (an online server's client went away, or
        matched a stop string): finished with finish_reason "stop" (`reason` None) or rejected with `reason`. Call
        between steps."""
        if req in self.running:
            if req in self.decoding:
                self.decoding.leave(req)
            del self.running[req]
            self.prefilling.pop(req, None)
        elif req in self.swapped:
            self.swapped.remove(req)
            self.kv.free_host_blocks.extend(reversed(req.host_block_table))
            req.host_block_table = ()
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.num_draft = 0
        if reason is None:
            req.status, req.finish_reason = Status.FINISHED, "stop"
        else:
            req.status, req.reject_reason = Status.REJECTED, reason

    # -- disaggregated hand-off -------------------------------------------------------------------
    def take_handoffs(self) -> list[Request]:
        """Prefill instance: the requests handed off since the last call (their blocks in `sending`)."""
        out, self.outbox = self.outbox, []
        return out

    def release(self, req: Request) -> None:
        """Prefill instance: `req`'s KV has been sent; its blocks are free again."""
        self.kv.release(self.sending.pop(req))

    def decode_reject_reason(self, req: Request) -> str | None:
        """Decode instance: why a request prefilled elsewhere could never be served here (None: it could)."""
        if req.prompt_len + req.max_tokens > self.cfg.max_model_len:
            return "prompt_len + max_tokens exceeds the decode pool's max_model_len"
        if self.kv.blocks_for(req.prompt_len + req.max_tokens - 1) > self.kv.num_blocks - self.kv.watermark_blocks:
            return "needs more KV cache than the decode instance's whole cache"
        return None

    def add_prefilled(self, req: Request) -> bool:
        """Decode instance: queue a request prefilled elsewhere (its first token out, its KV still there), or
        reject it with a reason if it can never be served here."""
        reason = self.decode_reject_reason(req)
        if reason:
            req.status, req.reject_reason = Status.REJECTED, reason
            return False
        req.status = Status.TRANSFERRING
        self.incoming.append(req)
        return True

    def reserve_transfers(self) -> list[Request]:
        """Decode instance: reserve blocks for queued hand-offs (FCFS, within max_num_seqs and the free blocks above
        the watermark); the caller copies each one's KV into its block_table and then calls `received`."""
        out: list[Request] = []
        free = self.kv.num_free - self.kv.watermark_blocks
        slots = self.cfg.max_num_seqs - len(self.running) - len(self.receiving) - len(self.ready)
        while self.incoming and len(out) < slots:
            r = self.incoming[0]
            need = self.kv.extra_blocks(r, r.num_computed + 1)
            if need > free:
                break
            self.incoming.popleft()
            self.kv.allocate(r, r.num_computed + 1)  # the prompt's KV and the first output token's
            free -= need
            self.receiving[r] = None
            out.append(r)
        if out:
            self.kv.note_peak()
        return out

    def received(self, req: Request) -> None:
        """Decode instance: `req`'s KV is in its blocks; it decodes from the next decode step."""
        del self.receiving[req]
        self.ready.append(req)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose K/V is in the cache now (a prefix shared by several requests counted once)."""
        tokens = self.decoding.sum_computed
        if self.prefilling:
            tokens += sum(r.num_computed for r in self.prefilling)
        if self.prefix_caching:  # shares of a handed-off prompt's blocks (not counted here) may be among them
            return max(0, tokens - self.kv.shared_refs * self.kv.block_size)
        return tokens

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick the next step's batch; allocates its KV blocks and may preempt."""
        batch = self._schedule()
        self.kv.note_peak()
        return batch

    def _schedule(self) -> ScheduledBatch:
        budget = self.cfg.max_num_batched_tokens
        if self.cfg.enable_chunked_prefill:
            preempted = self._grow_decodes(budget)
            budget -= self._decode_tokens()
            prefill = self._continue_prefills(budget, preempted)
            budget -= sum(n for _, n in prefill)
            swapped_in = [] if preempted else self._swap_in(budget)
            budget -= len(swapped_in)
            received = [] if preempted else self._join_received(budget)
            budget -= len(received)
            admitted = [] if preempted or self.swapped else self._admit(budget, chunked=True)
            self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
            return self._batch(prefill + admitted, True, preempted, swapped_in, received)
        if not self.swapped:
            admitted = self._admit(budget, chunked=False)
            if admitted:
                self.steps_since_admission = 0
                return self._batch(admitted, False, [], [])
        preempted = self._grow_decodes(budget)
        swapped_in = [] if preempted else self._swap_in(budget - self._decode_tokens())
        received = [] if preempted else self._join_received(budget - self._decode_tokens() - len(swapped_in))
        self.steps_since_admission += 1
        return self._batch([], True, preempted, swapped_in, received)

    @property
    def drafting(self) -> bool:
        """Whether decode rows take drafts this step: speculative decoding is on and the batch is not above
        speculative_disable_by_batch_size (a big batch is compute-bound: drafts would cost more than they
        save), and the step will decode: without chunked prefill a step that admits prompts runs them alone,
        and drafts made for it would be thrown away. Drafters ask before proposing; the scheduler cuts drafts
        when it is False."""
        cfg = self.cfg
        return self._may_draft() and (cfg.enable_chunked_prefill or bool(self.swapped)
                                      or not self._admissible(cfg.max_num_batched_tokens, chunked=False))

    def _may_draft(self) -> bool:
        """Speculative decoding is on and the batch is not above speculative_disable_by_batch_size (within a
        step that decodes, all that `drafting` asks)."""
        off = self.cfg.speculative_disable_by_batch_size
        return self.speculative and (off is None or len(self.decoding) <= off)

    def _decode_tokens(self) -> int:
        """Tokens the decode rows compute this step."""
        if not self.speculative:
            return len(self.decoding)
        return sum(1 + r.num_draft for r in self.decoding.members)

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
                if victim is r:
                    break
                if free:
                    dec.sync(r)
                    self.kv.append_block(r)
                    dec.push_block_need(r, len(r.block_table) * self.kv.block_size)
                    break
        return preempted

    def _reserve_verify_slots(self, budget: int) -> list[Request]:
        """Speculative decoding: KV slots for each decoding request's last token and its drafts (drafts
        are cut to its remaining output, max_model_len and the step's token budget); short of blocks,
        preempt from the end of the running order (possibly the request itself)."""
        preempted: list[Request] = []
        members = self.decoding.members
        # every row computes its last token; what is left of the budget (nothing, when not drafting) is for drafts;
        # this step decodes, so whether a prompt would run alone (`drafting`'s other question) is settled
        budget = budget - len(members) if self._may_draft() else 0
        gamma, max_len, kv = self.cfg.num_speculative_tokens, self.cfg.max_model_len, self.kv
        for r in list(members):
            if preempted and r not in members:
                continue  # preempted for an earlier row
            d = r.num_draft
            if d:
                d = r.num_draft = max(0, min(d, gamma, r.remaining_tokens - 1, max_len - r.num_tokens, budget))
                budget -= d
            c = r.num_computed + 1 + d
            if kv.extra_blocks(r, c):  # most rows need a block only every few steps
                self._make_room(r, c, self.running, preempted)
        return preempted

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
            if self._make_room(r, r.num_computed + n, self.prefilling, preempted):
                out.append((r, n))
                budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        """Take `req` off the device: swap its blocks to host memory, or free them to recompute later."""
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.num_draft = 0
        if req in self.decoding:
            self.decoding.leave(req)
        del self.running[req]
        self.prefilling.pop(req, None)
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
        out = []
        while self.ready and budget > 0:
            r = self.ready.popleft()
            r.status = Status.RUNNING
            self.running[r] = None
            self.decoding.join(r, self._block_capacity(r))
            out.append(r)
            budget -= 1
        return out

    def _admit(self, budget: int, chunked: bool) -> list[tuple[Request, int]]:
        """New requests from the head of the queue (FCFS) that fit the seq limit, budget and free blocks."""
        picks = self._admissible(budget, chunked)
        if self.prefix_caching:  # every cached prefix held before any new block is handed out (which could evict it)
            for r, _ in picks:
                if not r.block_table:
                    self.kv.take_prefix(r, self.kv.cached_prefix(r)[0])
        for r, n in picks:
            self.waiting.popleft()
            self.kv.allocate(r, r.num_computed + n)
            r.status = Status.RUNNING
            self.running[r] = None
            self.prefilling[r] = None
        return picks

    def _admissible(self, budget: int, chunked: bool) -> list[tuple[Request, int]]:
        """What `_admit` would take now (the queue and the KV cache left as they are)."""
        if not self.waiting:
            return []
        cfg = self.cfg
        picks: list[tuple[Request, int]] = []
        free = self.kv.num_free - self.kv.watermark_blocks
        slots = cfg.max_num_seqs - len(self.running) - len(self.receiving) - len(self.ready)
        for r in self.waiting:
            if len(picks) >= slots or budget <= 0:
                break
            computed, held, revive = r.num_computed, len(r.block_table), 0
            if self.prefix_caching and not held:  # its cached prefix: blocks others hold, or free ones revived
                held, revive = self.kv.cached_prefix(r)
                computed = held * self.kv.block_size
            uncomputed = r.num_tokens - computed
            n = min(uncomputed, cfg.prefill_chunk_size, budget) if chunked else uncomputed
            need = revive + max(0, self.kv.blocks_for(computed + n) - held)
            if n > budget or need > free:
                break
            free -= need
            budget -= n
            picks.append((r, n))
        if not picks or not self._gate_open(len(picks)):
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

    def _block_capacity(self, r: Request) -> int | None:
        return None if self.kv.contiguous else len(r.block_table) * self.kv.block_size

    def _batch(self, prefill, decodes, preempted, swapped_in, received=()) -> ScheduledBatch:
        tokens, ctx, pairs, sampled = _prefill_shape(prefill)
        b = len(self.decoding) if decodes else 0
        verify = 0
        if decodes and self.speculative:
            d_tokens, d_ctx, d_pairs, d_sampled, verify = _verify_shape(self.decoding.members)
        else:  # one token each, attending to its whole context
            d_tokens = d_sampled = b
            d_ctx = d_pairs = self.decoding.sum_computed + b if decodes else 0
        swap_out = [p for r in preempted if r.status is Status.SWAPPED for p in r.swap_pairs]
        swap_in = [p for r in swapped_in for p in r.swap_pairs]
        if received:
            swapped_in = swapped_in + received
        shape = BatchShape(b + len(prefill), d_tokens + tokens, d_ctx + ctx, d_pairs + pairs, d_sampled + sampled,
                           len(swap_out) + len(swap_in), len(prefill), verify, tokens, ctx)
        decode_only = decodes and not prefill and not preempted and not swapped_in and not self.prefilling \
            and not self.speculative  # speculative rows advance unevenly: no run of identical steps
        # the simulator never reads plain decode rows: skip the O(batch) copy there
        rows = list(self.decoding.members) if decodes and (self.eager or self.speculative) else []
        return ScheduledBatch(shape, rows, prefill, decodes, decode_only, preempted, swapped_in, list(received),
                              swap_out=swap_out, swap_in=swap_in)

    # -- after the step -------------------------------------------------------------------------
    def complete_step(self, batch: ScheduledBatch, stopped: Collection[Request] = (),
                      accepted: dict[Request, int] | None = None) -> tuple[list[Request], list[Request]]:
        """Account for a finished step. Returns (requests that got their first token of a run — prompt
        done or swapped in —, requests that finished). Every decode row got one token, plus, with
        speculative decoding, its `accepted` drafts (none if absent).
        `stopped`: requests the executor saw emit EOS this step."""
        dec = self.decoding
        started, finished = list(batch.swapped_in), []
        if batch.decodes and self.speculative:
            for r in self._advance_verified(batch.decode, accepted or {}):
                dec.leave(r)
                finished.append(self._finish(r))
        elif batch.decodes:
            dec.advance(1)
        for r, n in batch.prefill:
            r.num_computed += n
            if self.prefix_caching:
                self.kv.register(r)
            if r.num_computed < r.num_tokens:
                continue  # a prompt chunk: no token yet
            self.prefilling.pop(r, None)
            r.num_generated += 1
            started.append(r)
            if r.num_generated >= r.max_tokens or r in stopped:
                finished.append(self._finish(r))
            elif self.decode_pool is not None:
                self._hand_off(r)
            else:
                dec.join(r, self._block_capacity(r))
        for r in dec.pop_finished():
            finished.append(self._finish(r))
        for r in stopped:
            if r in dec:
                dec.leave(r)
                finished.append(self._finish(r))
        if self.eager:
            self.sync_all()
        return started, finished

    def _advance_verified(self, rows: list[Request], accepted: dict[Request, int]) -> list[Request]:
        """Speculative rows: each got its accepted drafts plus one token; the KV of rejected drafts is
        dropped (their blocks freed). Returns the rows that reached max_tokens."""
        done = []
        get, kv = accepted.get, self.kv
        added = 0
        for r in rows:
            d = r.num_draft
            n = 1
            if d:
                a = min(get(r, 0), d)
                r.num_verify_steps += 1
                r.num_drafted += d
                r.num_accepted += a
                r.num_rejections += a < d
                r.num_draft = 0
                n += a
            r.num_computed += n
            r.num_generated += n
            added += n
            kv.trim(r, r.num_computed + 1)  # the next step's last token still needs its slot
            if r.num_generated >= r.max_tokens:
                done.append(r)
        self.decoding.sum_computed += added
        return done

    def _hand_off(self, r: Request) -> None:
        """A prefill instance's request with its first token: off to a decode instance, its blocks kept to send."""
        del self.running[r]
        r.status = Status.TRANSFERRING
        self.sending[r], r.block_table = r.block_table, []
        self.outbox.append(r)

    def _finish(self, r: Request) -> Request:
        r.finish_reason = "length" if r.num_generated >= r.max_tokens else "stop"
        r.status = Status.FINISHED
        del self.running[r]
        if len(r.block_hashes) > r.num_registered:  # a conversation's turn: its answer's blocks, for the next turn
            self.kv.register(r, r.num_tokens - 1)
        self.kv.free(r)
        return r

    def sync_all(self) -> None:
        """Bring every decoding request's counters up to date."""
        for r in self.decoding.members:
            self.decoding.sync(r)

    # -- many identical decode steps at once (simulator only) ----------------------------------
    def decode_horizon(self, k_max: int) -> int:
        """How many decode steps, the scheduled one included, would be scheduled identically (absent
        arrivals): until a request finishes, a block allocation could fail, or the TGI wait limit trips."""
        dec = self.decoding
        k = min(k_max, dec.next_finish() - dec.steps)
        max_wait = self.cfg.max_waiting_tokens
        if self.waiting and max_wait is not None and self.cfg.waiting_served_ratio is not None \
                and self.steps_since_admission - 1 < max_wait:
            k = min(k, max_wait - (self.steps_since_admission - 1))
        if k > 1 and dec.block_size:
            k = dec.block_horizon(k, self.kv.num_free)
        return max(k, 1)

    def advance_decode(self, k: int) -> list[Request]:
        """Apply the remaining k - 1 steps of a decode-only run (k ≤ decode_horizon) and account for all
        k; returns the requests that finished."""
        dec = self.decoding
        if dec.grant_blocks(dec.steps + k - 1, self.kv.free_blocks) is not None:
            raise RuntimeError("advance_decode beyond decode_horizon: out of KV blocks")
        self.kv.note_peak()
        dec.advance(k)
        self.steps_since_admission += k - 1
        finished = [self._finish(r) for r in dec.pop_finished()]
        if self.eager:
            self.sync_all()
        return finished


class StaticScheduler(Scheduler):
    """Static batching: a batch of up to batch_size requests runs until its longest request ends.
    Prompts are prefilled unpadded (varlen), but finished rows keep computing a padding token every
    step and keep their memory (each row reserves the batch's longest prompt + output up front)."""

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True):
        super().__init__(cfg, kv, eager)
        self.decoding = DecodeSet(None)  # rows reserve their memory up front
        self.rows = 0
        self.sum_context = 0  # over all rows, padding rows included

    def _release_if_done(self) -> None:
        if self.running and not self.decoding:  # every row is done: release the batch
            for r in self.running:
                self.kv.free(r)
            self.running = {}

    def complete_step(self, batch, stopped=(), accepted=None):
        out = super().complete_step(batch, stopped, accepted)
        self._release_if_done()
        return out

    def _schedule(self) -> ScheduledBatch:
        if not self.running:
            return self._form_batch()
        b = self.rows
        self.sum_context += b
        shape = BatchShape(b, b, self.sum_context, self.sum_context, b)
        rows, padding = [], []
        if self.eager:
            rows = list(self.decoding.members)
            padding = [r for r in self.running if r not in self.decoding]
        return ScheduledBatch(shape, rows, [], True, True, padding=padding)

    def _form_batch(self) -> ScheduledBatch:
        picks: list[Request] = []
        max_prompt = max_out = 0
        for r in self.waiting:
            if len(picks) == self.cfg.batch_size:
                break
            p, o = max(max_prompt, r.prompt_len), max(max_out, r.max_tokens)
            if (len(picks) + 1) * self.kv.blocks_for(p + o - 1) > self.kv.num_free:
                break
            picks.append(r)
            max_prompt, max_out = p, o
        if not picks:
            return ScheduledBatch(BatchShape(0, 0, 0, 0, 0))
        for r in picks:
            self.waiting.popleft()
            self.kv.allocate(r, max_prompt + max_out - 1)
            r.status = Status.RUNNING
            self.running[r] = None
        prefill = [(r, r.prompt_len) for r in picks]
        tokens, ctx, pairs, sampled = _prefill_shape(prefill)
        self.rows, self.sum_context = len(picks), ctx
        return ScheduledBatch(BatchShape(len(picks), tokens, ctx, pairs, sampled, num_prefill=len(picks),
                                         prefill_tokens=tokens, prefill_context=ctx), [], prefill,
                              False)

    def _finish(self, r: Request) -> Request:
        r.finish_reason = "length" if r.num_generated >= r.max_tokens else "stop"
        r.status = Status.FINISHED  # keeps its row and its memory until the whole batch ends
        return r

    def decode_horizon(self, k_max: int) -> int:
        return max(1, min(k_max, self.decoding.next_finish() - self.decoding.steps))

    def advance_decode(self, k: int) -> list[Request]:
        self.sum_context += (k - 1) * self.rows
        finished = super().advance_decode(k)
        self._release_if_done()
        return finished


def make_scheduler(cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True,
                   decode_pool: Scheduler | None = None) -> Scheduler:
    """The scheduler for `cfg.batching`; `decode_pool`: a disaggregated prefill instance's (continuous batching), the
    policy of the decode instances it hands to."""
    if cfg.batching == "static":
        return StaticScheduler(cfg, kv, eager)
    return Scheduler(cfg, kv, eager, decode_pool)

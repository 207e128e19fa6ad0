"""What every batching policy shares: the waiting queue and the checks a request must pass to join it, queue
timeouts, aborts, and the bookkeeping after a step (prompts done, decode rows advanced, rows finished), including runs
of identical decode steps. A policy (`Scheduler`: continuous batching; `StaticScheduler`) forms each step's batch
(`_schedule`) and may say what finishing a row means (`_finish`) and what follows a step (`_after_steps`).

Plain Python, no SimPy, no torch: the simulator's replica and the executor's engine call the same objects; only the
clock differs. `eager=False` (the simulator) leaves decoding requests' counters stale between events, so a step costs
O(events), not O(batch); the executor keeps them current.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection

from sim.config.plan import SchedulerConfig
from sim.policy.batch import ScheduledBatch
from sim.policy.block_manager import BlockAllocator
from sim.policy.decode_set import DecodeSet
from sim.policy.handoff import HandOff
from sim.policy.request import Request, Status
from sim.policy.reservation import OutputReservation

# an Enum member read off its class takes the generic lookup in Python 3.11 (no specialization): once per request
FINISHED = Status.FINISHED


class BaseScheduler:
    """The queues and per-step bookkeeping of a scheduler over a paged or contiguous KV allocator."""

    speculative = False

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator, eager: bool, decoding: DecodeSet,
                 handoff: HandOff | None = None):
        self.cfg = cfg
        self.kv = kv
        self.eager = eager
        self.decoding = decoding
        self.handoff = handoff if handoff is not None else HandOff(kv)
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # admission order: preemption takes from the end
        self.prefilling: dict[Request, None] = {}  # running, prompt not fully computed (chunked)
        self.swapped: deque[Request] = deque()
        self.steps_since_admission = 0
        self.num_preemptions = 0
        self.prefix_caching = kv.prefix_caching
        # requests that arrived after this are not seen yet: an async engine (vLLM's async scheduling, SGLang's and
        # TRT-LLM's overlap schedulers) fixes a step's batch while the step before it runs
        self.visible_until = float("inf")
        self.reservation = OutputReservation(kv) if cfg.reserve_output else None  # TRT-LLM's no-evict admission
        # whether the policy has an _after_steps, as an instance flag: Python 3.11 specializes an instance attribute's
        # read, not a class attribute's through an instance (asked after every step and run)
        self.after_steps = self._after_steps is not None

    # -- arrivals -------------------------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue a request, or reject it with a reason if it can never be served."""
        reason = self._reject_reason(req)
        if reason is None:  # the usual case, queued without _queue_unless's call: once per request
            self.waiting.append(req)
            return True
        return self._queue_unless(req, reason, self.waiting.append)

    @staticmethod
    def _queue_unless(req: Request, reason: str | None, queue) -> bool:
        """Reject `req` with `reason`, or (None) hand it to `queue`; whether it was queued."""
        if reason:
            req.status, req.reject_reason = Status.REJECTED, reason
            return False
        queue(req)
        return True

    def _reject_reason(self, req: Request) -> str | None:
        """Why `req` can never be served here (None: it can)."""
        total = req.prompt_len + req.max_tokens
        pool = self.handoff.decode_pool
        if req.prompt_len < 1 or req.max_tokens < 1:
            return "prompt and output need at least one token each"
        if total > self.cfg.max_model_len:
            return "prompt_len + max_tokens exceeds max_model_len"
        refused = pool.decode_reject_reason(req) if pool is not None else None
        if refused:  # turned away now, not after its prompt is computed for nothing
            return refused
        if self.kv.blocks_for(total - 1) > self.kv.num_blocks - self.kv.watermark_blocks:
            return "needs more KV cache than the whole cache"
        if self.cfg.max_queue_len is not None and len(self.waiting) >= self.cfg.max_queue_len:
            return "queue full (max_queue_len)"
        return None

    def decode_reject_reason(self, req: Request) -> str | None:
        """Decode instance: why a request prefilled elsewhere could never be served here (None: it could)."""
        if req.prompt_len + req.max_tokens > self.cfg.max_model_len:
            return "prompt_len + max_tokens exceeds the decode pool's max_model_len"
        if self.kv.blocks_for(req.prompt_len + req.max_tokens - 1) > self.kv.num_blocks - self.kv.watermark_blocks:
            return "needs more KV cache than the decode instance's whole cache"
        return None

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
        return bool(self.waiting or self.running or self.swapped or self.handoff.ready)  # ready: see HandOff

    @property
    def num_outstanding(self) -> int:
        """Requests queued, running, swapped out or handed to this instance, not yet done."""
        h = self.handoff  # its three queues inline: routers ask at every arrival
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(h.incoming) + len(h.receiving) + \
            len(h.ready)

    @property
    def drafting(self) -> bool:
        """Whether decode rows take drafts this step (speculative decoding only)."""
        return False

    def abort(self, req: Request, reason: str | None) -> None:
        """Take a request out wherever it waits or runs, its blocks freed (an online server's client went away, or
        matched a stop string): finished with finish_reason "stop" (`reason` None) or rejected with `reason`. Call
        between steps."""
        if req in self.running:
            self._stop_running(req)
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

    def _stop_running(self, req: Request) -> None:
        """Take a running request out of the running set (and the decodes, the prefills, the reservation)."""
        if req in self.decoding:
            self.decoding.leave(req)
        del self.running[req]
        self.prefilling.pop(req, None)
        if self.reservation is not None:
            self.reservation.release(req)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose K/V is in the cache now (a prefix shared by several requests counted once); a hybrid model's
        token slots holding K/V over all its groups."""
        return self.kv_tokens()

    def kv_sample(self, clock: float) -> list:
        """The row both clocks record after each event: (time, running, KV blocks used, KV tokens stored, waiting);
        report.json's kv_cache figures are taken over these rows (sim/report/outputs.py kv_usage)."""
        kv = self.kv
        # kv_tokens' usual case (nothing prefilling, no hybrid groups, no block shared) without its call
        tokens = self.kv_tokens() if self.prefilling or kv.hybrid or kv.shared_refs else self.decoding.sum_computed
        return [clock, len(self.running), kv.used_blocks(), tokens, len(self.waiting)]

    def kv_tokens(self) -> int:
        """num_kv_tokens as a method: kv_sample asks at every event, and a property's call costs more."""
        tokens = self.decoding.sum_computed
        if self.prefilling:
            tokens += sum(r.num_computed for r in self.prefilling)
        if self.kv.hybrid:  # every request holding blocks: the hand-offs whose blocks are reserved too
            h = self.handoff
            return self.kv.filled_tokens(tokens + sum(r.num_computed for q in (h.receiving, h.ready) for r in q))
        if self.prefix_caching and self.kv.shared_refs:  # shares of a handed-off prompt's blocks may be among them
            tokens -= self.kv.shared_refs * self.kv.block_size
            return tokens if tokens > 0 else 0  # max(0, tokens) without the call: asked at every event
        return tokens

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick the next step's batch; allocates its KV blocks and may preempt."""
        batch = self._schedule()
        self.kv.note_peak()
        return batch

    def _schedule(self) -> ScheduledBatch:
        raise NotImplementedError

    def schedule_decodes(self) -> tuple[int, int] | None:
        """schedule() of a step of the decodes alone, where settled without forming a batch: their blocks granted,
        the step's (rows, tokens of context). None where the policy forms the step (nothing changed then)."""
        return None

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
            self._advance_verified(batch, accepted, finished)
        elif batch.decodes:
            dec.advance(1)
        for r, n in batch.prefill:
            r.num_computed += n
            if self.prefix_caching and r.block_hashes:  # a prompt without hashes registers nothing
                self.kv.register(r)
            if r.num_computed < r.prompt_len + r.num_generated:  # num_tokens, inline: a property's call costs more
                continue  # a prompt chunk: no token yet
            self.prefilling.pop(r, None)
            r.num_generated += 1
            started.append(r)
            if r.num_generated >= r.max_tokens or r in stopped:
                finished.append(self._finish(r))
            else:
                self._first_token(r)
        for r in dec.pop_finished():
            finished.append(self._finish(r))
        for r in stopped:
            if r in dec:
                dec.leave(r)
                finished.append(self._finish(r))
        if self.eager:
            self.sync_all()
        if self.after_steps:
            self._after_steps(0)
        return started, finished

    def _advance_verified(self, batch: ScheduledBatch, accepted: dict[Request, int] | None,
                          finished: list[Request]) -> None:
        """Speculative decode rows: each got one token and its accepted drafts (speculative policies only)."""
        raise NotImplementedError

    def _first_token(self, r: Request) -> None:
        """A request whose prompt is done and that goes on: it decodes from the next step."""
        self.decoding.join(r, self._block_capacity(r))

    def _block_capacity(self, r: Request) -> int | None:
        return None if self.kv.contiguous else len(r.block_table) * self.kv.block_size

    def _finish(self, r: Request) -> Request:
        """A request is done: its blocks are freed (a conversation's turn registers its answer's blocks first)."""
        r.finish_reason = "length" if r.num_generated >= r.max_tokens else "stop"
        r.status = FINISHED
        del self.running[r]
        if self.reservation is not None:
            self.reservation.release(r)
        if len(r.block_hashes) > r.num_registered:  # a conversation's turn: its answer's blocks, for the next turn
            self.kv.register(r, r.num_tokens - 1)
        self.kv.free(r)
        return r

    # a policy's work after a step and `extra` more decode steps of a run were accounted for: a method
    # _after_steps(extra), or None (no call on the hot path)
    _after_steps = None

    def sync_all(self) -> None:
        """Bring every decoding request's counters up to date."""
        for r in self.decoding.members:
            self.decoding.sync(r)

    # -- many identical decode steps at once (simulator only) ----------------------------------
    def decode_horizon(self, k_max: int) -> int:
        """How many decode steps, the scheduled one included, would be scheduled identically (absent
        arrivals): until a request finishes."""
        return max(1, min(k_max, self.decoding.next_finish() - self.decoding.steps))

    def decodes_settled(self) -> bool:
        """Whether each step from the next one on, until a request arrives, is the decodes alone as `schedule_decodes`
        settles it (their blocks granted, nothing else changing), so that `pass_decodes` may account for steps."""
        return False

    def pass_decodes(self, n: int) -> None:
        """n steps of a run of decodes alone that goes on (no request finishes in them; `decodes_settled`) accounted
        for as advance_decode and the next step's schedule_decodes would: their blocks granted, the counters
        advanced. The allocator's peak is left to the run's advance_decode (blocks only grow in a run)."""
        dec = self.decoding
        if dec.grant_blocks(dec.steps + n - 1, self.kv.free_blocks) is not None:
            raise RuntimeError("pass_decodes beyond decode_horizon: out of KV blocks")
        dec.advance(n)
        self.steps_since_admission += n

    def advance_decode(self, k: int) -> list[Request]:
        """Apply the remaining k - 1 steps of a decode-only run (k ≤ decode_horizon) and account for all
        k; returns the requests that finished."""
        dec = self.decoding
        # a step of the run whose blocks are not handed out yet (a lone step's were, and the peak noted, when it was
        # scheduled; the first after passed sendings' were not): no calls otherwise
        if dec.steps + k > dec.cursor:
            if dec.grant_blocks(dec.steps + k - 1, self.kv.free_blocks) is not None:
                raise RuntimeError("advance_decode beyond decode_horizon: out of KV blocks")
            self.kv.note_peak()
        dec.steps += k  # dec.advance(k), inline: once per run of decode steps
        dec.sum_computed += k * len(dec.members)
        self.steps_since_admission += k - 1
        # most runs end with none: pop_finished's first test, without its call
        done = dec.pop_finished() if dec.finishes and dec.finishes[0][0] <= dec.steps else ()
        finished = [self._finish(r) for r in done] if done else []
        if self.eager:
            self.sync_all()
        if self.after_steps:
            self._after_steps(k - 1)
        return finished

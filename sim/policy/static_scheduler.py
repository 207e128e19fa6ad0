"""Static batching: a batch of up to batch_size requests runs until its longest request ends.

Prompts are prefilled unpadded (varlen), but finished rows keep computing a padding token every step and keep their
memory (each row reserves the batch's longest prompt + output up front).
"""
from __future__ import annotations

from sim.config.plan import SchedulerConfig
from sim.policy.base_scheduler import BaseScheduler
from sim.policy.batch import BatchShape, ScheduledBatch, prefill_shape
from sim.policy.block_manager import BlockAllocator
from sim.policy.decode_set import DecodeSet
from sim.policy.request import Request, Status


class StaticScheduler(BaseScheduler):
    """Static batching over the shared queue and step bookkeeping: a new batch only when the last one is done."""

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator, eager: bool = True):
        super().__init__(cfg, kv, eager, DecodeSet(None))  # rows reserve their memory up front
        self.rows = 0
        self.sum_context = 0  # over all rows, padding rows included

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
        """The next batch: FCFS while every row fits the batch's longest prompt + output in the free blocks."""
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
        tokens, ctx, pairs, sampled = prefill_shape(prefill)
        self.rows, self.sum_context = len(picks), ctx
        return ScheduledBatch(BatchShape(len(picks), tokens, ctx, pairs, sampled, num_prefill=len(picks),
                                         prefill_tokens=tokens, prefill_context=ctx), [], prefill,
                              False)

    def _finish(self, r: Request) -> Request:
        """A row is done but keeps its place and its memory until the whole batch ends."""
        r.finish_reason = "length" if r.num_generated >= r.max_tokens else "stop"
        r.status = Status.FINISHED
        return r

    def _after_steps(self, extra: int) -> None:
        """Padding rows count in the context of the `extra` decode steps too; a batch whose rows are all done is
        released."""
        self.sum_context += extra * self.rows
        if self.running and not self.decoding:
            for r in self.running:
                self.kv.free(r)
            self.running = {}

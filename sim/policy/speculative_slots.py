"""Speculative decoding's KV slots, reserved per step: a decode row computes its last token and the drafts proposed
for it, so the step reserves a slot for each; after verification the slots of rejected drafts are given back.
Such rows advance unevenly, which is why they bypass the decode set's lock-step block calendar."""
from __future__ import annotations

from collections.abc import Callable, Collection

from sim.config.plan import SchedulerConfig
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request


class SpeculativeSlots:
    """Draft limits and KV reservation for speculative decode rows (num_speculative_tokens > 0)."""

    __slots__ = ("kv", "gamma", "max_model_len", "disable_by_batch_size")

    def __init__(self, cfg: SchedulerConfig, kv: BlockAllocator):
        self.kv = kv
        self.gamma = cfg.num_speculative_tokens
        self.max_model_len = cfg.max_model_len
        self.disable_by_batch_size = cfg.speculative_disable_by_batch_size

    def may_draft(self, num_decoding: int) -> bool:
        """Whether a batch of `num_decoding` rows takes drafts (a big batch is compute-bound: drafts would cost more
        than they save)."""
        off = self.disable_by_batch_size
        return off is None or num_decoding <= off

    @staticmethod
    def decode_tokens(rows: Collection[Request]) -> int:
        """Tokens the decode rows compute this step: each its last token and its drafts."""
        return sum(1 + r.num_draft for r in rows)

    def reserve(self, members: Collection[Request], budget: int,
                make_room: Callable[[Request, int, list[Request]], bool]) -> list[Request]:
        """KV slots for each decoding request's last token and its drafts, the drafts cut to its remaining output,
        max_model_len and `budget` tokens; `make_room` allocates, preempting (into its list) while blocks are short.
        Returns the preempted requests."""
        preempted: list[Request] = []
        gamma, max_len, kv = self.gamma, self.max_model_len, self.kv
        for r in list(members):
            if preempted and r not in members:
                continue  # preempted for an earlier row
            d = r.num_draft
            if d:
                d = r.num_draft = max(0, min(d, gamma, r.remaining_tokens - 1, max_len - r.num_tokens, budget))
                budget -= d
            c = r.num_computed + 1 + d
            if kv.extra_blocks(r, c):  # most rows need a block only every few steps
                make_room(r, c, preempted)
        return preempted

    def advance(self, rows: list[Request], accepted: dict[Request, int]) -> tuple[list[Request], int]:
        """Each row got its accepted drafts plus one token; the KV of rejected drafts is dropped (their blocks freed).
        Returns the rows that reached max_tokens and the tokens added over all rows."""
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
        return done, added

"""A step's batch: what the scheduler hands the engine (`ScheduledBatch`) and its shape as cost models see it
(`BatchShape`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sim.policy.request import Request


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


def prefill_shape(prefill: list[tuple[Request, int]]) -> tuple[int, int, int, int]:
    """(new tokens, context after, attention pairs, sampled rows) of prompt chunks."""
    tokens = ctx = pairs = sampled = 0
    for r, n in prefill:
        c = r.num_computed + n
        tokens += n
        ctx += c
        pairs += n * (c - n) + n * (n + 1) // 2  # each new token attends to everything before it
        sampled += c == r.num_tokens
    return tokens, ctx, pairs, sampled


def verify_shape(rows) -> tuple[int, int, int, int, int]:
    """prefill_shape of speculative decode rows (each computes its last token and its drafts), except that
    every one of those positions needs logits (to check the draft after it); and how many rows draft."""
    tokens, ctx, pairs, _ = prefill_shape([(r, 1 + r.num_draft) for r in rows])
    return tokens, ctx, pairs, tokens, sum(1 for r in rows if r.num_draft)

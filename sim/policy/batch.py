"""A step's batch: what the scheduler hands the engine (`ScheduledBatch`) and its shape as cost models see it
(`BatchShape`; from a recorded step's rows: `shape_of`, `record_shape`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sim.policy.request import Request


@dataclass(eq=False, repr=False, slots=True)
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


@dataclass(eq=False, repr=False, slots=True)
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
        sampled += c == r.prompt_len + r.num_generated  # num_tokens, inline: a property's call costs more
    return tokens, ctx, pairs, sampled


def verify_shape(rows) -> tuple[int, int, int, int, int]:
    """prefill_shape of speculative decode rows (each computes its last token and its drafts), except that
    every one of those positions needs logits (to check the draft after it); and how many rows draft."""
    tokens, ctx, pairs, _ = prefill_shape([(r, 1 + r.num_draft) for r in rows])
    return tokens, ctx, pairs, tokens, sum(1 for r in rows if r.num_draft)


def shape_of(new_tokens: list[int], context_lens: list[int], sampled: int | None = None,
             num_prefill: int | None = None) -> BatchShape:
    """The aggregate shape of a step given per-sequence new tokens and context lengths (after the step).
    `num_prefill`: sequences computing a prompt chunk (the executor's trace records it; its rows come after
    the decode rows, and a decode row of several tokens verifies drafts); if unknown, those with more than
    one new token, and none verifies."""
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(new_tokens, context_lens))
    verify = 0
    if num_prefill is None:
        prefill = [i for i, n in enumerate(new_tokens) if n > 1]
    else:
        verify = sum(1 for n in new_tokens[:len(new_tokens) - num_prefill] if n > 1)
        prefill = range(len(new_tokens) - num_prefill, len(new_tokens))
    return BatchShape(len(new_tokens), sum(new_tokens), sum(context_lens), pairs,
                      len(new_tokens) if sampled is None else sampled, num_prefill=len(prefill), num_verify=verify,
                      prefill_tokens=sum(new_tokens[i] for i in prefill),
                      prefill_context=sum(context_lens[i] for i in prefill))


def record_shape(record: dict) -> BatchShape:
    """The shape of a step the executor recorded: a steps.jsonl record, a StepRecord's to_json() or a profile's
    sample (new_tokens and context_lens per sequence; num_sampled and num_prefill where recorded)."""
    return shape_of(record["new_tokens"], record["context_lens"], record.get("num_sampled"), record.get("num_prefill"))

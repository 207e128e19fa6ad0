"""A request's serving state, shared by the simulator and the executor.

One object per request (a simulated day holds 500k of them, and the hot paths read their counters), declared as the
records of the parts that keep it, each a class of the chain `Request` ends: what the client sent (`ClientRequest`),
the KV allocator's blocks (`KVBlocks`), the scheduler's counters (`SchedulingState`) and the times the clocks record
for the report (`TokenTrace`). A part writes only its own record's fields. Only `Request` is made: the parts have
no `__init__` of their own (each would be a generated function of every field so far, compiled at import).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    TRANSFERRING = "transferring"  # disaggregated: prefilled, its KV on the way to (or waiting for) a decode instance
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(init=False, eq=False, repr=False, slots=True)
class ClientRequest:
    """What the client sent: the workload's request, and how it reached the server."""

    id: int
    arrival_s: float
    prompt_len: int
    max_tokens: int
    conversation: int = -1  # workload.conversation: which one it is a turn of (the session router's key)
    client_wait_s: float = 0.0  # workload.max_concurrency: how long it waited at the client before it was sent
    # workload.client: sending to the engine's queue (arrival_s is when it got there; set by the clock that sent it),
    # a token's emission to the client, its last token to the stream's close; a warm-up request is left out of the
    # report
    client_in_s: float = 0.0
    client_out_s: float = 0.0
    client_close_s: float = 0.0
    warmup: bool = False


@dataclass(init=False, eq=False, repr=False, slots=True)
class KVBlocks(ClientRequest):
    """The KV allocator's record (sim/policy/block_manager.py): where the request's K/V lives."""

    block_table: list[int] = field(default_factory=list)
    # assigned, never appended to: an empty tuple until then saves two lists a request (a simulated day holds 500k)
    host_block_table: list[int] | tuple = ()  # where its KV waits while swapped out
    swap_pairs: list[tuple[int, int]] | tuple = ()  # block copies of the current step
    # prefix caching: one hash per full block of the prompt (its content so far), and how many are registered
    block_hashes: tuple = ()
    num_registered: int = 0
    # a hybrid model's blocks (sim/policy/hybrid_allocator.py): per attention kind, a table of bundles (one block per
    # group of that kind, None where freed out of the window), and how many of each table's first entries are None
    group_tables: list | tuple = ()
    group_dropped: list | tuple = ()


@dataclass(init=False, eq=False, repr=False, slots=True)
class SchedulingState(KVBlocks):
    """The scheduler's record (sim/policy/*scheduler.py, decode_set.py, speculative_slots.py).

    Known tokens are the prompt plus the outputs so far; `num_computed` of them have K/V in the cache.
    A step computes some of the rest; when none are left the step samples one output token.
    """

    status: Status = Status.WAITING
    num_computed: int = 0
    num_generated: int = 0
    num_preemptions: int = 0
    reject_reason: str | None = None
    finish_reason: str | None = None
    sync_step: int = 0  # the decode set's lazy counters (sim/policy/decode_set.py)
    decode_tag: int = -1
    # speculative decoding: drafts proposed for the next step, and totals over the request's life
    num_draft: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0  # steps that verified at least one draft
    num_rejections: int = 0  # of those, the steps where a draft was rejected (the rest accepted all)


@dataclass(init=False, eq=False, repr=False, slots=True)
class TokenTrace(SchedulingState):
    """What the clocks record for the report: where it ran and when its tokens came."""

    replica: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    run_start: int = -1  # the simulator: the decode step its current run of tokens started at


@dataclass(eq=False, repr=False, slots=True)
class Request(TokenTrace):
    """One request as the scheduler and KV allocator see it (token counts, not token ids)."""

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_generated

    @property
    def is_done(self) -> bool:
        return self.status in (Status.FINISHED, Status.REJECTED)

"""Disaggregated serving's hand-off: the queues a request passes through between a prefill and a decode instance.

A prefill instance's scheduler hands a request whose prompt is done to the caller instead of decoding it, keeping its
blocks until the caller has sent its KV (`take`, `release`); a decode instance's scheduler queues handed-off requests
(`Scheduler.add_prefilled`), reserves their blocks when it has room (`Scheduler.reserve_transfers`: the caller copies
the KV in) and, once `received`, decodes them like a swapped-in request. A colocated scheduler's queues stay empty.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status


class DecodePolicy(Protocol):
    """What a prefill instance asks of the decode instances' policy (a scheduler's)."""

    def decode_reject_reason(self, req: Request) -> str | None: ...


class HandOff:
    """The five hand-off queues of one instance; `decode_pool` (a prefill instance's): the policy of the decode
    instances it hands to, whose limits an arrival must fit too."""

    __slots__ = ("kv", "decode_pool", "sending", "outbox", "incoming", "receiving", "ready")

    def __init__(self, kv: BlockAllocator, decode_pool: DecodePolicy | None = None):
        self.kv = kv
        self.decode_pool = decode_pool
        self.sending: dict[Request, list[int]] = {}  # handed off, KV not yet sent: the blocks it still holds
        self.outbox: list[Request] = []  # handed off since the caller last took them
        self.incoming: deque[Request] = deque()  # prefilled elsewhere, waiting for blocks here
        self.receiving: dict[Request, None] = {}  # blocks reserved, KV on its way
        self.ready: deque[Request] = deque()  # KV arrived, joins the decodes at the next decode step

    @property
    def holding(self) -> int:
        """Requests that hold a sequence slot here but do not decode yet (KV reserved or arrived)."""
        return len(self.receiving) + len(self.ready)

    # -- prefill instance ---------------------------------------------------------------------------
    def send(self, r: Request) -> None:
        """A request with its first token goes to a decode instance; its blocks are kept until its KV is sent."""
        r.status = Status.TRANSFERRING
        self.sending[r] = self.kv.detach(r)
        self.outbox.append(r)

    def take(self) -> list[Request]:
        """The requests handed off since the last call (their blocks in `sending`)."""
        out, self.outbox = self.outbox, []
        return out

    def release(self, r: Request) -> None:
        """`r`'s KV has been sent; its blocks are free again."""
        self.kv.release(self.sending.pop(r))

    # -- decode instance ----------------------------------------------------------------------------
    def queue(self, r: Request) -> None:
        """A request prefilled elsewhere (its first token out, its KV still there) waits for blocks here."""
        r.status = Status.TRANSFERRING
        self.incoming.append(r)

    def reserve(self, slots: int) -> list[Request]:
        """Reserve blocks for queued hand-offs (FCFS, at most `slots` of them, within the free blocks above the
        watermark); the caller copies each one's KV into its block_table and then calls `received`."""
        out: list[Request] = []
        kv = self.kv
        free = kv.num_free - kv.watermark_blocks
        while self.incoming and len(out) < slots:
            r = self.incoming[0]
            need = kv.extra_blocks(r, r.num_computed + 1)
            if need > free:
                break
            self.incoming.popleft()
            kv.allocate(r, r.num_computed + 1)  # the prompt's KV and the first output token's
            free -= need
            self.receiving[r] = None
            out.append(r)
        if out:
            kv.note_peak()
        return out

    def received(self, r: Request) -> None:
        """`r`'s KV is in its blocks; it decodes from the next decode step."""
        del self.receiving[r]
        self.ready.append(r)

    def take_ready(self, budget: int) -> list[Request]:
        """Up to `budget` requests whose KV has arrived, in arrival order, to join the decodes."""
        out = []
        while self.ready and len(out) < budget:
            out.append(self.ready.popleft())
        return out

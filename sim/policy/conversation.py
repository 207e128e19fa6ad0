"""A conversation's later turns (workload.conversation): each arrives its think time after the turn before it ends,
or is rejected with it. Kept by the arrival book (sim.policy.arrivals)."""
from __future__ import annotations

from sim.config.workload import RequestSpec
from sim.policy.request import Request, Status

CONVERSATION_ENDED = "an earlier turn of its conversation was rejected"


class Conversations:
    """Which request each later turn follows, until it is sent."""

    def __init__(self, specs: list[RequestSpec]):
        self.next_turn = {s.after: s for s in specs if s.after >= 0}  # a turn's id -> the turn after it, until sent
        self.any = bool(self.next_turn)  # some request follows another

    def ended(self, req_id: int, finished: bool) -> tuple[RequestSpec | None, list[RequestSpec]]:
        """Request `req_id` ended, `finished` or rejected: (the turn that now follows it, sent its think_s after
        `ended_at(req, now)`; or None: its conversation, if any, is over) and the turns that end with it unsent, in
        order (a rejected turn ends its conversation)."""
        spec = self.next_turn.pop(req_id, None)
        if finished:
            return spec, []
        gone = []
        while spec is not None:
            gone.append(spec)
            spec = self.next_turn.pop(spec.id, None)
        return None, gone


def ended_at(req: Request, now: float) -> float:
    """When a request that ended at or before `now` ended: its last token, or (rejected) `now`, when that became
    known."""
    return req.finish_s if req.status is Status.FINISHED else now


def reject_unsent(req: Request, now: float) -> None:
    """A turn whose conversation ended before it was sent: rejected at `now`, when that became known."""
    req.arrival_s = now
    req.status, req.reject_reason = Status.REJECTED, CONVERSATION_ENDED

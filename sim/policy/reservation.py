"""TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy (serving.reserve_output): a request is admitted only if the KV
blocks of its whole length — prompt and every output token it may ask for — fit beside what the requests running
already hold to the end of theirs, so no running request is ever preempted for blocks. vLLM and SGLang admit on the
prompt's blocks alone and preempt when the decodes outgrow the cache."""
from __future__ import annotations

from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request


class OutputReservation:
    """The blocks the running requests will hold at their longest, kept as they start and end."""

    def __init__(self, kv: BlockAllocator):
        self.kv = kv
        self.held: dict[Request, int] = {}
        self.total = 0

    def whole(self, r: Request) -> int:
        """The blocks `r` holds at its longest: its prompt and every token it may generate."""
        return self.kv.blocks_for(r.prompt_len + r.max_tokens)

    def room(self) -> int:
        """Blocks no running request will ever need (the watermark kept free)."""
        return self.kv.num_blocks - self.kv.watermark_blocks - self.total

    def take(self, r: Request) -> None:
        """`r` starts running: its whole length is reserved."""
        if r not in self.held:
            need = self.held[r] = self.whole(r)
            self.total += need

    def release(self, r: Request) -> None:
        """`r` stopped running (finished, rejected, preempted): its reservation is free again."""
        self.total -= self.held.pop(r, 0)

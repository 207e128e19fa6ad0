"""The price of one engine step: its time and where it goes, in named seconds that every cost source fills."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class StepCost:
    """One step's seconds by kind of work. `total_s` is the step's time as its cost source sums it (in the source's
    own order of float operations, so that it equals the source's `step_time` bit for bit); the parts add up to it
    within rounding."""

    total_s: float
    linear_s: float = 0.0  # the decoder layers' non-attention work: QKV/O/MLP projections, norms, rotary, activation,
    # residual adds (not the embedding or the LM head)
    attention_s: float = 0.0  # attention over the KV cache: prompt chunks and decodes
    communication_s: float = 0.0  # collectives of tensor and pipeline parallelism
    lm_head_s: float = 0.0  # embedding lookup, final norm and the LM head over the rows that sample
    overhead_s: float = 0.0  # the host's share: scheduling, input preparation, sampling, launches
    draft_s: float = 0.0  # speculative decoding's drafter
    swap_s: float = 0.0  # KV blocks copied between device and host memory

    def parts(self) -> dict[str, float]:
        """The named parts, without the total."""
        return {name: getattr(self, name) for name in PARTS}

    def to_json(self) -> dict[str, float]:
        return {"total_s": self.total_s, **self.parts()}


PARTS = tuple(f.name for f in fields(StepCost) if f.name != "total_s")

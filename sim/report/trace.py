"""What metrics and plots need from one replica's run, whichever clock ran it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplicaTrace:
    """What metrics and plots need from one replica (the executor fills the same)."""

    step_end: list[float]
    step_decodes_all: list[bool]
    samples: list[tuple[float, int, int, int, int]]
    num_blocks: int
    block_size: int
    num_preemptions: int
    peak_blocks: int

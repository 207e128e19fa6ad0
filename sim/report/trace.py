"""What metrics and plots need from one replica's run, whichever clock ran it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False, repr=False)
class ReplicaTrace:
    """What metrics and plots need from one replica (the executor fills the same)."""

    step_end: np.ndarray  # each step's end time
    step_decodes_all: np.ndarray  # per step: it decoded every running request
    samples: np.ndarray  # (events, 5): time, running, KV blocks used, KV tokens stored, waiting
    num_blocks: int
    block_size: int
    num_preemptions: int
    peak_blocks: int
    # the simulator's runs of steps, (runs, 3): request id, first step, last step (none from the executor, which
    # keeps every token's time)
    runs: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    # a pipelined replica's stages: the time each computed (the same list on each of its virtual engines)
    pipeline_busy_s: list | None = None
    pool: str | None = None  # disaggregated: "prefill" or "decode"
    busy_s: float = 0.0  # time spent in steps
    # disaggregated decode instance: each handed-off request's gap from its first token (in the prefill pool) to
    # its second (here)
    handoff_gaps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # prefix caching: tokens of the requests admitted (prompt, and outputs so far after a preemption), those found cached
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # a hybrid model's KV groups: the most blocks each attention kind's groups held at once
    peak_blocks_by_kind: dict | None = None

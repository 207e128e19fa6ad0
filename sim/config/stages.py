"""Load stages (workload.load_stages): rates one after another in one run, as inference-perf's `load.stages` sends
them. Each stage's send times, which stage each request belongs to, and how long after the stage before it ended it
is sent (the arrival book holds a stage back until every request of the one before it has ended)."""
from __future__ import annotations

import numpy as np

from sim.config.workload import LoadStagesConfig


def stage_times(process: str, rate: float, duration_s: float, rng) -> np.ndarray:
    """The send times of one stage from its start: int(rate x duration_s) of them, in order. `poisson_fixed_count`
    is inference-perf's ConstantLoadTimer (exponential gaps scaled to sum to duration_s: the first a gap after the
    start, the last at its end); `poisson` the gaps as drawn; `constant` i / rate."""
    n = int(rate * duration_s)
    if process == "constant":
        return np.arange(n) / rate
    gaps = rng.exponential(1.0 / rate, n)
    if process == "poisson_fixed_count":
        gaps *= duration_s / gaps.sum()
    return np.cumsum(gaps)


def stage_arrivals(cfg: LoadStagesConfig, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every request of the stages, in send order: (the earliest each could be sent: the stages before it answered
    the moment their last request was sent; its stage; its delay after the stage before it ended: the gap and its
    time within its stage, 0 in the first stage)."""
    arrival, stage, delay = [], [], []
    start = 0.0
    for k, st in enumerate(cfg.stages):
        t = stage_times(cfg.process, st.rate, st.duration_s, rng)
        wait = cfg.gap_s if k else 0.0
        arrival.append(start + wait + t)
        delay.append(wait + t if k else np.zeros(len(t)))
        stage.append(np.full(len(t), k, np.int64))
        start += wait + float(t[-1])
    return np.concatenate(arrival), np.concatenate(stage), np.concatenate(delay)


def stage_bounds(cfg: LoadStagesConfig) -> list[tuple[int, int]]:
    """Each stage's requests as a range of request ids [first, end): the ids follow the send order, stage by stage."""
    edges = np.concatenate(([0], np.cumsum(cfg.counts()))).tolist()
    return list(zip(edges[:-1], edges[1:]))

"""The price of one engine step: its time and where it goes, in named seconds that every cost source fills; the
interface every cost source implements (`StepCostModel`), and the capability of pricing a pipeline's stages."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import add
from typing import Protocol

from sim.policy.batch import BatchShape


@dataclass(eq=False, repr=False, slots=True)
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
    experts_s: float = 0.0  # a mixture of experts' routed experts (their all-to-all is communication)

    def parts(self) -> dict[str, float]:
        """The named parts, without the total."""
        return {name: getattr(self, name) for name in PARTS}

    def to_json(self) -> dict[str, float]:
        """The total and the parts, for a report or a command's output."""
        return {"total_s": self.total_s, **self.parts()}

    def scaled(self, factor: float) -> StepCost:
        """Every second `factor` times as long (a verify step's forward: the speculative verify cost ratio)."""
        return StepCost(self.total_s * factor, *(getattr(self, name) * factor for name in PARTS))

    def with_draft(self, draft_s: float) -> StepCost:
        """The step with its drafter's time on top (the drafter runs before the forward)."""
        parts = self.parts()
        parts["draft_s"] += draft_s
        return StepCost(draft_s + self.total_s, **parts)


PARTS = tuple(f.name for f in fields(StepCost) if f.name != "total_s")


class StepCostModel(Protocol):
    def step_time(self, shape: BatchShape) -> float:
        """Seconds for one engine step over this batch shape."""

    def step_cost(self, shape: BatchShape) -> StepCost:
        """The same step's seconds by part; its total_s equals step_time(shape) exactly."""

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        """Seconds for a step in which each of `num_seqs` sequences decodes one token, with
        `sum_context` tokens in their caches after the step. Must equal step_time of that shape
        exactly: the simulator takes many such steps at once."""

    def decode_run(self, num_seqs: int, sum_context: int, clock: float, k_max: int, until: float,
                   step_end: list[float]) -> tuple[int, float]:
        """Take up to `k_max` decode steps from `clock`, appending each step's end time to `step_end`;
        stop after the step that reaches `until`. Returns (steps taken, clock)."""


def priced_run(advance: Callable, price: Callable, num_seqs: int, sum_context: int, clock: float, k_max: int,
               until: float, step_end: list[float]) -> tuple[int, float]:
    """The run loop of decode steps priced one call each: `price(num_seqs, sum_context)` is a step's price and
    `advance(clock, price)` the clock after it (operator.add for seconds; a pipeline's passage for its stages).
    Takes up to `k_max` steps, stopping after the one that reaches `until`. Returns (steps taken, clock)."""
    k = 0
    while k < k_max:
        clock = advance(clock, price(num_seqs, sum_context))
        step_end.append(clock)
        sum_context += num_seqs
        k += 1
        if clock >= until:
            break
    return k, clock


def decode_run(cost: StepCostModel, num_seqs: int, sum_context: int, clock: float, k_max: int, until: float,
               step_end: list[float]) -> tuple[int, float]:
    """StepCostModel.decode_run for any cost model, one decode_time call per step."""
    return priced_run(add, cost.decode_time, num_seqs, sum_context, clock, k_max, until, step_end)


def window_reads_s(windows: tuple[tuple[int, float], ...], context: int, rows: int) -> float:
    """Seconds `rows` decode rows of `context` tokens in all read in windowed layers, (window, seconds per K/V token)
    each: every token of the context, or at most the window a row (sim/cost/blocks.py: window_reads)."""
    t = 0
    for window, per_token in windows:
        cap = rows * window
        t += (context if context < cap else cap) * per_token
    return t


def affine_decode_run(base: float, per_kv: float, num_seqs: int, sum_context: int, clock: float, k_max: int,
                      until: float, step_end: list[float], windows: tuple[tuple[int, float], ...] = ()
                      ) -> tuple[int, float]:
    """decode_run for a model whose decode step is `base + context * per_kv`, plus `window_reads_s(windows, ...)`
    where it has windowed layers: decode_time's float operations with its per-batch part hoisted, so the same step
    ends, without allocating per step. The loop of any such run; one of rows without windows, the run every decode
    run of the simulator takes, GPUCostModel.decode_run takes inline (no call per run)."""
    s, append = sum_context, step_end.append
    for k in range(1, k_max + 1):
        clock += base + s * per_kv + window_reads_s(windows, s, num_seqs)
        append(clock)
        if clock >= until:
            return k, clock
        s += num_seqs
    return k_max, clock


# A pipelined step's stages: (each stage's seconds, the send between consecutive stages, the return of the sampling
# rows' hidden states to stage 0).
Stages = tuple[list[float], float, float]


class PricesStages(ABC):
    """A cost model that prices each pipeline stage of a step itself (a profile composed over stages); the pricer
    splits a step evenly over the stages of any other. Declared by subclassing."""

    @abstractmethod
    def pipeline_stages(self, shape: BatchShape, step_s: float | None = None) -> Stages:
        """The step's stages. `step_s`: the replica's time for the step, if more than step_time (drafting, verify
        cost): the difference goes to stage 0."""

    def decode_stages(self, num_seqs: int, sum_context: int) -> Stages:
        """The stages of a step of decodes alone (decode_time's shape)."""
        return self.pipeline_stages(BatchShape(num_seqs, num_seqs, sum_context, sum_context, num_seqs))

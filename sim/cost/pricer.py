"""The whole price of one engine step, as the simulator charges it and calibration re-scores it: the cost model's
time for the batch shape, a verify step's forward times speculative decoding's verify cost ratio, the drafter's time
on top, and on a pipelined replica the step's stages. One path for both: a step (the scheduler's, or one the executor
recorded: `record_s`, `record_cost`) → BatchShape → StepPricer → StepCost."""
from __future__ import annotations

from sim.cost.step import PricesStages, Stages, StepCost, StepCostModel
from sim.policy.batch import BatchShape, record_shape


def equal_stages(step_s: float, tokens: int, num_stages: int, send_s_per_token: float,
                 send_latency_s: float) -> Stages:
    """A step priced as a whole over `num_stages` stages: each holds an equal share of it, and the activations of
    its `tokens` cross the link between consecutive stages."""
    return [step_s / num_stages] * num_stages, tokens * send_s_per_token + send_latency_s, 0.0


class StepPricer:
    """A replica's step prices (sim/cost/build.py: make_pricer builds it from the plan; `StepPricer(cost)` prices a cost
    model's steps alone, as calibration measures it). `cost`: the plan's cost model, profile_scale applied; on a
    pipelined replica (`num_stages` > 1) a cost model that prices stages itself
    (step.PricesStages) gives each stage its own time, any other's step is split evenly, its activations sent at
    `send_s_per_token` + `send_latency_s`."""

    __slots__ = ("cost", "verify_cost_ratio", "num_stages", "send_s_per_token", "send_latency_s", "_staged")

    def __init__(self, cost: StepCostModel, verify_cost_ratio: float = 1.0, num_stages: int = 1,
                 send_s_per_token: float = 0.0, send_latency_s: float = 0.0):
        self.cost = cost
        self.verify_cost_ratio = verify_cost_ratio
        self.num_stages = num_stages
        self.send_s_per_token = send_s_per_token
        self.send_latency_s = send_latency_s
        self._staged = cost if isinstance(cost, PricesStages) else None

    @property
    def prices_stages(self) -> bool:
        """Whether the cost model prices each pipeline stage itself."""
        return self._staged is not None

    def _forward(self, shape: BatchShape, step_s: float) -> float:
        # a step whose decode rows verify drafts runs a costlier forward than the cost model's (measured per drafter)
        return step_s * self.verify_cost_ratio if shape.num_verify else step_s

    def step_s(self, shape: BatchShape, draft_s: float = 0.0) -> float:
        """Seconds of one step over this batch shape, the drafter's `draft_s` before it."""
        t = self.cost.step_time(shape)
        return draft_s + (t * self.verify_cost_ratio if shape.num_verify else t)  # _forward, inline: the hot path

    def step_cost(self, shape: BatchShape, draft_s: float = 0.0) -> StepCost:
        """The same step by part; its total_s equals step_s(shape, draft_s) exactly."""
        c = self.cost.step_cost(shape)
        return (c.scaled(self.verify_cost_ratio) if shape.num_verify else c).with_draft(draft_s)

    def record_s(self, record: dict) -> float:
        """step_s of a step the executor recorded (sim/policy/batch.py: record_shape), drafting excluded (it is not a
        model step)."""
        return self.step_s(record_shape(record))

    def record_cost(self, record: dict) -> StepCost:
        """step_cost of a step the executor recorded, drafting excluded."""
        return self.step_cost(record_shape(record))

    def step_stages(self, shape: BatchShape, draft_s: float = 0.0) -> Stages:
        """stages(shape, step_s(shape, draft_s)): a pipelined step's stages, drafting and a verify step's extra
        forward time on stage 0."""
        if self._staged is not None and not draft_s and not shape.num_verify:
            return self._staged.pipeline_stages(shape)  # the step's time is its stages' own: nothing to add
        return self.stages(shape, self.step_s(shape, draft_s))

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        """StepCostModel.decode_time: a step of decodes alone (no drafts, nothing verified)."""
        return self.cost.decode_time(num_seqs, sum_context)

    def decode_run(self, num_seqs: int, sum_context: int, clock: float, k_max: int, until: float,
                   step_end) -> tuple[int, float]:
        """StepCostModel.decode_run: a run of identical decode steps, without allocating per step."""
        return self.cost.decode_run(num_seqs, sum_context, clock, k_max, until, step_end)

    def stages(self, shape: BatchShape, step_s: float) -> Stages:
        """A pipelined step's stages, `step_s` (step_s()'s answer) being its time as a whole."""
        if self._staged is not None:
            return self._staged.pipeline_stages(shape, step_s)
        return equal_stages(step_s, shape.num_new_tokens, self.num_stages, self.send_s_per_token, self.send_latency_s)

    def decode_stages(self, num_seqs: int, sum_context: int) -> Stages:
        """The stages of a step of decodes alone (decode_time's)."""
        if self._staged is not None:
            return self._staged.decode_stages(num_seqs, sum_context)
        return equal_stages(self.cost.decode_time(num_seqs, sum_context), num_seqs, self.num_stages,
                            self.send_s_per_token, self.send_latency_s)

    def stages_busy_s(self, shape: BatchShape) -> float:
        """The seconds a step keeps its stages busy (their own times, no sends), drafting excluded: a pipelined
        step's price where the cost model prices stages (prices_stages)."""
        return self._forward(shape, sum(self._staged.pipeline_stages(shape)[0]))

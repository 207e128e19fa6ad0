"""Tensor- and pipeline-parallel steps priced from a one-device fitted profile: the step's forward split over the
devices, its host work (scheduling, input preparation, sampling) left on the driver, plus the communication the
profile measured on the machine (executor/distributed/comm_bench.py).

The profile's `fit` prices a whole step on one device and its `fit.forward` the part in the model runner; their
difference is the host work. Tensor parallelism over n ranks (Megatron, as executor/distributed/tensor_parallel.py
runs it): host + forward / n + the step message's broadcast + two all-reduces a layer of the tokens' hidden states
(the last layer's of the sampling rows only) + the gather of the sampled rows' vocabulary slices. Pipeline
parallelism over p stages (executor/distributed/pipeline.py): stage k runs its share of the layers — the forward's
per-token and attention terms by layer count, its few-token (weight-streaming) term by the share of the weights
it holds, the step's fixed cost in full (every stage runs a forward) — and stage 0 also the host work and the LM head (the sampled-rows term and the head's weights); the residual
stream crosses between stages and the sampling rows' hidden states come back. A step alone takes the sum of it all
(`step_time`); the simulator's pipeline (sim/simulator/pipeline.py) holds each stage for its own time
(`pipeline_stages`), so batches in flight overlap as they do on the executor.
"""
from __future__ import annotations

from sim.config.models import ModelSpec
from sim.config.sharding import stage_layers, vocab_shard
from sim.cost.comm import MeasuredCollectives
from sim.cost.fitted import FittedCostModel, parts_of
from sim.cost.step import PricesStages, Stages, StepCost, decode_run
from sim.policy.batch import BatchShape

# terms of the forward fit that scale with the layers a device runs; the few-token kink (streaming the weights) by
# the weights it holds; the step's fixed cost in full on every stage (each runs a forward of its own: measured on
# the executor's 2-stage SmolLM2, stage 1 ran 1.38x a share of it, 0.98-1.03x the whole); the sampled rows: the LM head
LAYER_TERMS = ("new_tokens", "ramp_tokens", "decode_seqs", "prefill_seqs", "has_prefill", "batched_prefill",
               "has_verify", "attn_pairs", "kv_tokens", "prefill_kv")
WEIGHT_TERMS = ("few_tokens",)
STAGE_TERMS = ("step",)


class ParallelFittedCostModel(PricesStages):
    """A fitted profile's step costs for a replica of `tensor_parallel_size` x `pipeline_parallel_size` devices
    (one of them > 1, as the executor runs them)."""

    def __init__(self, total: FittedCostModel, forward: FittedCostModel, comm: MeasuredCollectives, model: ModelSpec,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        self.total, self.forward, self.comm = total, forward, comm
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        self.token_bytes = model.hidden_size * model.act_bytes
        self.logit_row_bytes = vocab_shard(model.vocab_size, self.tp) * 4  # a rank's vocabulary slice, fp32
        self.num_layers = model.num_layers
        layers = stage_layers(model.num_layers, self.pp)
        weights = [n * model.params_per_layer for n in layers]
        weights[0] += model.embedding_params  # the LM head lives with the embedding on stage 0
        self.layer_share = [n / model.num_layers for n in layers]
        self.weight_share = [w / sum(weights) for w in weights]
        self.model = model

    def _terms(self, shape: BatchShape) -> tuple[dict[str, float], float]:
        """The forward fit's terms for this shape (FittedCostModel.terms) and the host time."""
        terms = self.forward.terms(shape)
        host = max(0.0, self.total.step_time(shape) - sum(terms.values()))
        return terms, host

    def _tensor_parallel(self, shape: BatchShape) -> tuple[float, dict[str, float], float, float]:
        """(step time, the forward's terms, host time, communication)."""
        terms, host = self._terms(shape)
        c, n, tokens = self.comm, self.tp, shape.num_new_tokens
        rows = shape.num_sampled if shape.num_sampled else tokens  # the last layer runs the sampling rows only
        comm = (c.message_s(0) + (2 * self.num_layers - 2) * c.all_reduce_s(tokens * self.token_bytes, n)
                + 2 * c.all_reduce_s(rows * self.token_bytes, n))
        if shape.num_sampled:
            comm += c.gather_s(shape.num_sampled * self.logit_row_bytes, n)
        return host + sum(terms.values()) / n + comm, terms, host, comm

    def _stages(self, shape: BatchShape, step_s: float | None = None) -> tuple[Stages, dict[str, float], float]:
        """(the stages, the forward's terms, host time)."""
        terms, host = self._terms(shape)
        layer = sum(t for f, t in terms.items() if f in LAYER_TERMS)
        weight = sum(t for f, t in terms.items() if f in WEIGHT_TERMS)
        fixed = sum(t for f, t in terms.items() if f in STAGE_TERMS)
        stages = [ls * layer + ws * weight + fixed for ls, ws in zip(self.layer_share, self.weight_share)]
        stages[0] += host + terms["sampled"]
        send = self.comm.send_s(shape.num_new_tokens * self.token_bytes)
        back = self.comm.send_s(shape.num_sampled * self.token_bytes) if shape.num_sampled else 0.0
        if step_s is not None:
            stages[0] += max(0.0, step_s - (sum(stages) + (self.pp - 1) * send + back))
        return (stages, send, back), terms, host

    def pipeline_stages(self, shape: BatchShape, step_s: float | None = None) -> Stages:
        """(each stage's time, the send between consecutive stages, the return of the sampling rows' hidden states
        to stage 0). `step_s`: the replica's time for the step, if more than step_time (drafting, verify cost):
        the difference goes to stage 0."""
        return self._stages(shape, step_s)[0]

    def step_time(self, shape: BatchShape) -> float:
        if self.pp > 1:
            stages, send, back = self.pipeline_stages(shape)
            return sum(stages) + (self.pp - 1) * send + back
        return self._tensor_parallel(shape)[0]

    def step_cost(self, shape: BatchShape) -> StepCost:
        """step_time by part: the host work (the whole step's fit less the forward's) is overhead, the collectives
        and the stages' sends communication, and the forward's terms their parts as in the fitted model
        (sim/cost/fitted.py: PART_OF), a share of each on each device; a pipeline runs the step's fixed cost on
        every stage."""
        if self.pp > 1:
            (stages, send, back), terms, host = self._stages(shape)
            parts = parts_of(terms)
            parts["overhead_s"] += host + (self.pp - 1) * sum(t for f, t in terms.items() if f in STAGE_TERMS)
            return StepCost(sum(stages) + (self.pp - 1) * send + back, communication_s=(self.pp - 1) * send + back,
                            **parts)
        total, terms, host, comm = self._tensor_parallel(shape)
        parts = {part: t / self.tp for part, t in parts_of(terms).items()}
        parts["overhead_s"] += host
        return StepCost(total, communication_s=comm, **parts)

    def scaled(self, factor: float) -> "ParallelFittedCostModel":
        """Every cost, communication included, `factor` times as long (the machine slower or faster than profiled)."""
        if factor == 1.0:
            return self
        return ParallelFittedCostModel(self.total.scaled(factor), self.forward.scaled(factor),
                                       self.comm.scaled(factor), self.model, self.tp, self.pp)

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        return self.step_time(BatchShape(num_seqs, num_seqs, sum_context, sum_context, num_seqs))

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        return decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end)

"""A step of a mixture-of-experts, latent-attention or data-parallel replica (sim/config/expert_parallel.py says how
its devices split the model), priced part by part by the roofline or the measured kernels (sim/cost/moe_kernels.py).

One step of the replica's engine carries every data-parallel rank's rows; each rank runs 1 / DP of its tokens,
sequences, sampling rows and context on its tensor-parallel devices, in parallel with the others. Per device:
- linear (attention projections, dense MLPs, shared experts, router) and the LM head over the rank's tokens;
- routed experts on the busiest device: without expert parallelism each device holds a 1 / TP slice of every expert
  and runs its rank's T / DP tokens × k choices over the experts they touch (E·(1−(1−k/E)^T) expected, uniform
  routing); with it each holds E / EP whole experts and receives the replica's T × k / EP routed rows times the
  load imbalance, over its share of the touched experts; the busiest expert's rows (mean × imbalance) set the GEMMs'
  compute, each touched expert's weights are read once;
- attention over the rank's prompt chunks and decode rows (sim/cost/moe_kernels.py: MLA decompressed in prefill,
  absorbed in decode);
- communication: tensor parallelism's two all-reduces a layer of the rank's hidden states and the logits gather; with
  expert parallelism across data-parallel ranks a dispatch and a combine all-to-all per MoE layer, each device
  sending its 1 / EP of the replica's routed rows (the busiest receiving imbalance × the mean). Within one DP rank
  (EP = TP) every device already holds every token: each runs its own experts on them and the layer's all-reduce
  combines them, as with sliced experts (vLLM's path without data parallelism);
- the host's overhead per step and per sequence of a rank (the ranks' hosts run side by side).

A decode step is base(batch) + context × cost per KV token, so runs of decode steps stay exact and allocation-free.
"""
from __future__ import annotations

from sim.config import moe
from sim.config.engines import EngineProfile
from sim.config.models import ModelSpec
from sim.cost import routing
from sim.cost.comm import Collectives
from sim.cost.engine import HostCost, padded_tokens
from sim.cost.step import StepCost, affine_decode_run
from sim.policy.batch import BatchShape


class MoECostModel:
    """Step costs of a replica of `data_parallel_size` ranks × `tensor_parallel_size` devices, experts sliced over TP
    or, with `expert_parallel`, whole over all of them; `parts` prices one device's share (RooflineParts or
    KernelParts)."""

    def __init__(self, model: ModelSpec, parts, collectives: Collectives, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, expert_parallel: bool = False, load_imbalance: float = 1.0,
                 step_overhead_s: float = 0.0, per_seq_overhead_s: float = 0.0, prefill_overhead_s: float = 0.0,
                 block_bytes: float = 0.0, host_bandwidth: float = 1.0, engine: EngineProfile | None = None,
                 eager_collectives: Collectives | None = None):
        self.model, self.parts, self.collectives, self.engine = model, parts, collectives, engine
        self.eager_collectives = eager_collectives or collectives  # the engine's all-reduce outside a CUDA graph
        self.tp, self.dp, self.expert_parallel = tensor_parallel_size, data_parallel_size, expert_parallel
        self.ep = tensor_parallel_size * data_parallel_size if expert_parallel else 1
        self.imbalance = load_imbalance
        self.host = HostCost(step_overhead_s, per_seq_overhead_s, prefill_overhead_s,
                             engine is not None and engine.async_scheduling)
        self.s_per_swap_block = block_bytes / host_bandwidth
        self.n_moe = moe.moe_layers(model)
        self.token_bytes = model.hidden_size * model.act_bytes
        self._token_cache: dict[tuple[int, int], tuple] = {}
        self._decode_cache: dict[int, tuple[float, float]] = {}

    # -- the experts' load and the communication -------------------------------------------------------------------
    def expert_load(self, tokens: int) -> tuple[float, float, float]:
        """(routed rows, experts touched, the busiest expert's rows) on the busiest device of a step of `tokens`."""
        m = self.model
        if not self.n_moe or not tokens:
            return 0.0, 0.0, 0.0
        e, k = m.num_experts, m.num_experts_per_tok
        if self.expert_parallel:  # the replica's tokens meet in the experts; EP devices share them
            touched = routing.distinct_experts(e, k, tokens) / self.ep
            return tokens * k / self.ep * self.imbalance, touched, routing.busiest_expert_tokens(e, k, tokens,
                                                                                             self.imbalance)
        t = tokens / self.dp  # a rank's own tokens through its own slices of every expert
        return t * k, routing.distinct_experts(e, k, t), routing.busiest_expert_tokens(e, k, t, self.imbalance)

    def communication_s(self, tokens: int, sampled: int, graph: bool = True) -> float:
        """Tensor parallelism's all-reduces and logits gather over a rank's rows; expert parallelism's all-to-alls;
        `graph`: the step replays a CUDA graph (else the engine's all-reduce runs eagerly)."""
        c, m, t = self.collectives if graph else self.eager_collectives, self.model, 0.0
        if self.tp > 1:
            t = 2 * m.num_layers * c.all_reduce_s(tokens / self.dp * self.token_bytes, self.tp)
            if sampled:
                t += c.gather_s(sampled / self.dp * m.vocab_size * 4, self.tp)
        if self.expert_parallel and self.dp > 1 and tokens:
            routed = tokens * m.num_experts_per_tok / self.ep * self.imbalance * self.token_bytes
            t += 2 * self.n_moe * c.all_to_all_s(routed, self.ep)  # dispatch and combine
        return t

    # -- a step ------------------------------------------------------------------------------------------------------
    def _by_tokens(self, tokens: int, sampled: int, graph: bool = True) -> tuple[float, float, float, float]:
        """(linear, LM head, experts, communication): the parts that depend on the step's tokens and sampling rows
        (and whether it replays a CUDA graph) alone, cached (a run's steps repeat few of them)."""
        key = (tokens, sampled, graph)
        got = self._token_cache.get(key)
        if got is None:
            linear, head = self.parts.linear_s(tokens / self.dp, sampled / self.dp)
            got = (linear, head, self.parts.experts_s(*self.expert_load(tokens)),
                   self.communication_s(tokens, sampled, graph))
            if len(self._token_cache) < 65536:  # bounded for long runs of odd shapes
                self._token_cache[key] = got
        return got

    def _fixed(self, tokens: int, seqs: int, sampled: int, prefill: int, prefill_pairs: int,
               prefill_context: int) -> tuple:
        """(linear, LM head, experts, attention but the decode rows' KV, communication, overhead) of a step."""
        dp = self.dp
        graph = self.engine is None or self.engine.in_graph(tokens, prefill == 0)
        linear, head, experts, comm = self._by_tokens(padded_tokens(self.engine, tokens, prefill == 0), sampled, graph)
        attention = self.parts.attention_fixed_s(prefill / dp, prefill_pairs / dp, prefill_context / dp,
                                                 seqs > prefill, (seqs - prefill) / dp)
        overhead = self.host.visible_s(seqs / dp, prefill > 0, ((linear + head) + experts) + comm)
        return linear, head, experts, attention, comm, overhead

    @staticmethod
    def _base(parts: tuple) -> float:
        linear, head, experts, attention, comm, overhead = parts
        return ((((linear + head) + experts) + attention) + comm) + overhead

    def _per_kv(self, decode_rows: int) -> float:
        """Decode attention's seconds per context token of the replica's decode rows (a rank reads 1 / DP of them)."""
        return self.parts.per_kv_token_s(decode_rows / self.dp) / self.dp

    def _shape_parts(self, shape: BatchShape) -> tuple[tuple, float, int, float]:
        decode_ctx = shape.sum_context - shape.prefill_context
        fixed = self._fixed(shape.num_new_tokens, shape.num_seqs, shape.num_sampled, shape.num_prefill,
                            max(0, shape.attn_pairs - decode_ctx), shape.prefill_context)
        return fixed, shape.swap_blocks * self.s_per_swap_block, decode_ctx, \
            self._per_kv(shape.num_seqs - shape.num_prefill)

    def step_time(self, shape: BatchShape) -> float:
        fixed, swap, decode_ctx, per_kv = self._shape_parts(shape)
        return (self._base(fixed) + swap) + decode_ctx * per_kv

    def step_cost(self, shape: BatchShape) -> StepCost:
        fixed, swap, decode_ctx, per_kv = self._shape_parts(shape)
        linear, head, experts, attention, comm, overhead = fixed
        return StepCost((self._base(fixed) + swap) + decode_ctx * per_kv, linear_s=linear,
                        attention_s=attention + decode_ctx * per_kv, communication_s=comm, lm_head_s=head,
                        overhead_s=overhead, swap_s=swap, experts_s=experts)

    def _decode_base(self, num_seqs: int) -> tuple[float, float]:
        """(a decode step of `num_seqs` rows without its context term, seconds per context token), cached."""
        got = self._decode_cache.get(num_seqs)
        if got is None:
            got = self._decode_cache[num_seqs] = (self._base(self._fixed(num_seqs, num_seqs, num_seqs, 0, 0, 0))
                                                  + 0.0, self._per_kv(num_seqs))
        return got

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        base, per_kv = self._decode_base(num_seqs)
        return base + sum_context * per_kv

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        base, per_kv = self._decode_base(num_seqs)
        return affine_decode_run(base, per_kv, num_seqs, sum_context, clock, k_max, until, step_end)

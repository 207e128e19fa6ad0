"""A step's cost on a GPU from measured kernels: the kernel model (sim/cost/kernels.py) for every GEMM, elementwise
pass and attention call of the step on one device of its tensor-parallel group, measured NCCL collectives
(sim/cost/nccl.py) for its communication, and a host overhead per step and per sequence.

- linear: per decoder layer the QKV, O, gate/up and down GEMMs at M = the step's new tokens, the two RMSNorms, rotary,
  the gated activation and a residual add;
- attention: per layer, prompt chunks at their FLOPs, a floor per chunk and a cost per key; decode rows at their KV
  bytes, and a floor per layer when the step decodes;
- LM head: the embedding lookup, the final norm and the vocabulary GEMM of the sampled rows (vocab-parallel);
- communication (TP > 1): two all-reduces of the step's hidden states a layer (a reduce-scatter and an all-gather with
  sequence parallelism: the same time), and the sampled rows' logits gathered;
- overhead: the host's scheduling, input preparation and sampling: `step_overhead_s` + `per_seq_overhead_s` per
  sequence. Default: vLLM's, as BLIS fitted it to real vLLM runs on H100s (126 µs a step, 4.4 µs a request:
  inference-sim/inference-sim defaults.yaml, trained_physics_coefficients β₇ and β₆, Apache-2.0).

`Refinement` scales each part and replaces the overheads: what a profile of the same device measured end to end
(`infersim profile --device cuda`, or an endpoint's observed timings) refines the kernel model with. Decode steps price
as base(batch) + context × per-token KV cost, so runs of them stay exact and allocation-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.config.engines import EngineProfile
from sim.config.models import ModelSpec
from sim.config.sharding import shard, vocab_shard
from sim.cost.comm import Collectives
from sim.cost.engine import HostCost, launch_floor_s, padded_tokens, with_launches
from sim.cost.kernels import DeviceKernels, GemmFit, layer_gemms, layer_passes, pass_time
from sim.cost.parallel import stage_layers
from sim.cost.roofline import DEQUANT_OVERHEAD
from sim.cost.step import PricesStages, Stages, StepCost, affine_decode_run, decode_run
from sim.policy.batch import BatchShape

VLLM_STEP_OVERHEAD_S = 126e-6
VLLM_PER_SEQ_OVERHEAD_S = 4.4e-6


@dataclass(frozen=True)
class Refinement:
    """Multipliers of the kernel model's parts and the host overheads, as measured steps of a whole engine fit them
    (1 and vLLM's overheads: the kernels as measured)."""

    linear: float = 1.0
    attention: float = 1.0
    lm_head: float = 1.0
    communication: float = 1.0
    step_overhead_s: float = VLLM_STEP_OVERHEAD_S
    per_seq_overhead_s: float = VLLM_PER_SEQ_OVERHEAD_S
    prefill_overhead_s: float = 0.0  # a step that carries a prompt chunk (an engine's eager path, say)


class KernelCostModel(PricesStages):
    """Step costs of one replica of `tensor_parallel_size` x `pipeline_parallel_size` devices whose kernels were
    measured. A pipeline stage runs its share of the layers (and their collectives); the host's overhead and the
    embedding go to stage 0, the LM head to the last stage (vLLM's layout); the hidden states of the step's tokens
    cross between stages and the sampled tokens come back to stage 0."""

    def __init__(self, model: ModelSpec, kernels: DeviceKernels, hw, collectives: Collectives,
                 kv_bytes_per_token_layer: float, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 refinement: Refinement = Refinement(), block_bytes: float = 0.0,
                 engine: EngineProfile | None = None, eager_collectives: Collectives | None = None):
        self.model, self.kernels, self.refinement, self.engine = model, kernels, refinement, engine
        self.host = HostCost(refinement.step_overhead_s, refinement.per_seq_overhead_s, refinement.prefill_overhead_s,
                             engine is not None and engine.async_scheduling)
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        self.layers = model.num_layers
        self.gemm, self.weight_bytes, self.compute_scale = self._linear_kernel(model, kernels, hw)
        self.lm_gemm = kernels.gemm["fp16"]
        self.act_bytes = model.act_bytes
        self.s_per_swap_block = block_bytes / hw.host_bandwidth
        att, r = kernels.attention, refinement
        self.sharding = shard(model, tensor_parallel_size)
        heads = self.sharding.heads
        self.attention_terms = None
        if kernels.attention_fit is not None:  # the engine's own attention kernels, in the form their data supports
            self._fitted_attention(kernels.attention_fit, r.attention * self.layers, model, kv_bytes_per_token_layer)
        else:
            self.s_per_prefill_pair = r.attention * self.layers * 4 * heads * model.head_size / att["prefill_flops"]
            self.s_per_prefill_seq = r.attention * self.layers * att["prefill_floor_s"]
            self.s_per_prefill_key = r.attention * self.layers * att["prefill_s_per_key"]
            self.s_decode_floor = r.attention * self.layers * att["decode_floor_s"]
            # decode attention reads the KV at one rate while its rows x KV heads fit in a wave of the multiprocessors
            # (the kernel splits the keys to fill them), at another past it
            kv_bytes = r.attention * self.layers * kv_bytes_per_token_layer
            self.s_per_kv_token = kv_bytes / att["decode_bandwidth"]
            self.s_per_kv_token_one_wave = kv_bytes / att["decode_bandwidth_one_wave"]
            self.one_wave_rows = att["sms"] // self.sharding.kv_heads
        self.collectives = collectives
        # the engine's collectives in a step run eagerly (its all-reduce outside a CUDA graph costs its launch)
        self.eager_collectives = eager_collectives or collectives
        self.layer_share = [n / self.layers for n in stage_layers(self.layers, self.pp)]
        # one decoder layer's GEMMs (N, K) and elementwise passes (fit, bytes a token): the same for every step
        shape = (model.hidden_size, model.num_heads, model.num_kv_heads, model.head_size, model.intermediate_size,
                 tensor_parallel_size, 1)
        self._layer_gemms = [(n, k) for _, _, n, k in layer_gemms(*shape)]
        passes = layer_passes(*shape, act_bytes=self.act_bytes)
        if engine is not None and engine.release.fused_add_norm:  # the residual add inside each norm's kernel
            add = passes.pop("add")
            passes["input_norm"] += add // 3 * 2
            passes["post_norm"] += add // 3 * 2
        self._layer_passes = [(kernels.passes[op], b) for op, b in passes.items()]
        # kernels a step launches: per layer its GEMMs, passes, attention and all-reduces; the embedding, final norm,
        # LM head and sampling
        self.kernels_per_step = self.layers * (len(self._layer_gemms) + len(passes) + 1 + (2 if self.tp > 1 else 0)) + 4
        self._linear: dict[int, float] = {}
        self._head: dict[tuple[int, int], float] = {}
        self._comm: dict[tuple[int, int, bool], float] = {}
        self._decode_base: dict[int, float] = {}
        self._fixed_parts: dict[tuple[int, ...], tuple] = {}

    def _fitted_attention(self, fit, scale: float, model: ModelSpec, kv_bytes_per_token_layer: float) -> None:
        """Attention priced by an engine's AttentionFit (sim/cost/kernels.py) on this shard, all layers (`scale`): a
        floor once per step, a cost per prompt chunk, per causal pair and per key of its context, per decode row, and
        per KV token the decode rows read (falling as their rows x KV heads fill the GPU)."""
        t = self.attention_terms = fit.terms(self.sharding.heads, self.sharding.kv_heads, model.head_size,
                                             kv_bytes_per_token_layer)
        self.attention_scale = scale
        self.s_per_prefill_pair, self.s_per_prefill_seq = scale * t.s_per_prefill_pair, scale * t.s_per_prefill_seq
        self.s_per_prefill_key = scale * t.s_per_prefill_key
        self.s_decode_floor, self.s_prefill_floor = scale * t.decode_floor_s, scale * t.prefill_floor_s
        self.s_per_decode_row = scale * t.s_per_decode_row

    def attention_floor_s(self, seqs: int, prefill: int) -> float:
        """The attention a step pays whatever its context: a floor per layer when it decodes (an engine's fitted
        kernel: one call for prompts and decodes alike, the larger floor, and a cost per decode row)."""
        if self.attention_terms is None:
            return self.s_decode_floor if seqs > prefill else 0.0
        floor = self.s_decode_floor if seqs > prefill else 0.0
        if prefill and self.s_prefill_floor > floor:
            floor = self.s_prefill_floor
        return floor + (seqs - prefill) * self.s_per_decode_row

    @staticmethod
    def _linear_kernel(model: ModelSpec, kernels: DeviceKernels, hw) -> tuple[GemmFit, float, float]:
        """The decoder GEMMs' fit, bytes per weight and FLOP-rate multiplier: fp8 tensor cores where weights and
        device have them, 2:4 sparse tensor cores at twice the rate, weight-only quantization paying to dequantize."""
        dtype = model.matmul_dtype(hw.peak_flops)
        sparse = model.sparsity == "2:4" and hw.sparse_tensor_cores
        scale = (2.0 if sparse else 1.0) / (1 + DEQUANT_OVERHEAD if model.dequantizes(hw.peak_flops) else 1.0)
        if dtype == "fp8":
            gemm = kernels.gemm.get("fp8")
            if gemm is None:  # fp8 tensor cores not measured here: the 16-bit fit at the datasheet's ratio
                gemm, scale = kernels.gemm["fp16"], scale * hw.flops("fp8") / hw.flops("fp16")
        else:
            gemm = kernels.gemm["fp16"]
            if dtype == "fp32":
                scale *= hw.flops("fp32") / hw.flops("fp16")
        return gemm, model.bytes_per_linear_param(sparse), scale

    # -- the parts, cached by the step's few integers ---------------------------------------------------------------
    def linear_s(self, tokens: int) -> float:
        """The decoder layers' GEMMs and elementwise passes over `tokens` new tokens."""
        t = self._linear.get(tokens)
        if t is None:
            gemm, wb, ab, scale = self.gemm, self.weight_bytes, self.act_bytes, self.compute_scale
            per_layer = sum(gemm.time(tokens, n, k, wb, ab, scale) for n, k in self._layer_gemms)
            # integer bytes: per token x tokens is the same count the layer's passes move
            per_layer += sum(pass_time(fit, per_token * tokens) for fit, per_token in self._layer_passes)
            t = self._linear[tokens] = self.refinement.linear * self.layers * per_layer if tokens else 0.0
        return t

    def lm_head_s(self, tokens: int, sampled: int) -> float:
        """Embedding lookup of the new tokens; final norm and the vocabulary GEMM (this device's slice) of the
        sampled rows."""
        key = (tokens, sampled)
        t = self._head.get(key)
        if t is None:
            m, p = self.model, self.kernels.passes
            t = pass_time(p["add"], 2 * tokens * m.hidden_size * self.act_bytes) if tokens else 0.0
            if sampled:
                t += pass_time(p["input_norm"], 2 * sampled * m.hidden_size * self.act_bytes)
                t += self.lm_gemm.time(sampled, vocab_shard(m.vocab_size, self.tp), m.hidden_size, self.act_bytes,
                                       self.act_bytes)
            t = self._head[key] = self.refinement.lm_head * t
        return t

    def communication_s(self, tokens: int, sampled: int, graph: bool = True) -> float:
        """Tensor parallelism: two all-reduces of the tokens' hidden states a layer, the sampled rows' fp32 logits
        gathered; `graph`: the step replays a CUDA graph (else the engine's all-reduce runs eagerly)."""
        if self.tp == 1:
            return 0.0
        key = (tokens, sampled, graph)
        t = self._comm.get(key)
        if t is None:
            c, m = self.collectives if graph else self.eager_collectives, self.model
            t = 2 * self.layers * c.all_reduce_s(tokens * m.hidden_size * self.act_bytes, self.tp)
            if sampled:
                t += c.gather_s(sampled * m.vocab_size * 4, self.tp)
            t = self._comm[key] = self.refinement.communication * t
        return t

    def overhead_s(self, seqs: int, prefill: bool = False, device_s: float = 0.0) -> float:
        """The host's scheduling and sampling the step's time shows beside `device_s` of the device's work (async
        scheduling hides it under that: sim/cost/engine.py)."""
        return self.host.visible_s(seqs, prefill, device_s)

    # -- a step -----------------------------------------------------------------------------------------------------
    def step_cost(self, shape: BatchShape) -> StepCost:
        if self.pp == 1:
            return self.step_cost_one_device(shape)
        c = self.step_cost_one_device(shape)
        _, send, back, total = self._stages_of(*self._parts(shape))
        c.communication_s += (self.pp - 1) * send + back
        c.total_s = total
        return c

    def step_cost_one_device(self, shape: BatchShape) -> StepCost:
        """The step as if one tensor-parallel group ran every layer (a pipeline splits it into stages)."""
        f, attention_fixed, decode_ctx = self._parts(shape)
        base, _, per_kv, linear, head, comm, overhead, swap = f[:8]
        total = (base + attention_fixed) + decode_ctx * per_kv
        if f[12]:  # an eager step: its launches may outlast the device's work (shown with the host's)
            waited = with_launches(total, f[12], f[8])
            overhead, total = overhead + (waited - total), waited
        return StepCost(total, linear, attention_fixed + decode_ctx * per_kv, comm, head, overhead, 0.0, swap)

    def _parts(self, shape: BatchShape) -> tuple[tuple, float, int]:
        """(_fixed's parts, attention but the decode rows' KV reads, the decode rows' context) of the step on one
        device of the TP group. Attention but the KV reads: the decode floor; prompt chunks (and verify rows' extra
        queries) at their FLOPs, chunks also a floor each and a cost per key."""
        key = (shape.num_new_tokens, shape.num_sampled, shape.num_seqs, shape.num_prefill, shape.swap_blocks)
        f = self._fixed_parts.get(key) or self._fixed(key)
        decode_ctx = shape.sum_context - shape.prefill_context
        extra_pairs = shape.attn_pairs - decode_ctx  # max(0, ...) below, without the call
        return f, f[1] + ((extra_pairs if extra_pairs > 0 else 0) * self.s_per_prefill_pair
                          + (shape.num_prefill * self.s_per_prefill_seq + shape.prefill_context * self.s_per_prefill_key)
                          ), decode_ctx

    def _fixed(self, key: tuple[int, int, int, int, int]) -> tuple:
        """What a step's counts `key` (new tokens, sampled rows, sequences, prompt rows, swap blocks) decide, cached
        by them: (linear + LM head + communication + overhead + swap, in that order of sums; the decode attention's
        floor, seconds per KV token the decode rows read; linear, LM head, communication, overhead, swap; on a
        pipeline overhead + swap, the send between stages, the return to stage 0 and the sends' total, (stages − 1) x
        send)."""
        tokens, sampled, seqs, prefill, swap_blocks = key
        graphed = padded_tokens(self.engine, tokens, prefill == 0)
        in_graph = self.engine is None or self.engine.in_graph(tokens, prefill == 0)
        linear, head, comm = self.linear_s(graphed), self.lm_head_s(tokens, sampled), \
            self.communication_s(graphed, sampled, in_graph)
        overhead = self.overhead_s(seqs, prefill > 0, (linear + head) + comm)
        swap = swap_blocks * self.s_per_swap_block
        floor = self.attention_floor_s(seqs, prefill)
        send = back = 0.0
        if self.pp > 1:
            send = self.collectives.send_s(tokens * self.model.hidden_size * self.act_bytes)
            back = self.collectives.send_s(sampled * 8) if sampled else 0.0
        f = self._fixed_parts[key] = ((((linear + head) + comm) + overhead) + swap, floor,
                                      self.per_kv_token_s(seqs - prefill), linear, head, comm, overhead, swap,
                                      overhead + swap, send, back, (self.pp - 1) * send,
                                      launch_floor_s(self.engine, tokens, prefill == 0, self.kernels_per_step))
        return f

    def per_kv_token_s(self, decode_rows: int) -> float:
        """Decode attention's seconds per KV token read, all layers, for a step of `decode_rows` decode rows."""
        if self.attention_terms is not None:
            return self.attention_scale * self.attention_terms.per_kv_token_s(decode_rows)
        return self.s_per_kv_token_one_wave if decode_rows <= self.one_wave_rows else self.s_per_kv_token

    def step_time(self, shape: BatchShape) -> float:
        if self.pp > 1:
            return self._stages_of(*self._parts(shape))[3]
        # step_cost's total without building it: the simulator's hot path
        f, attention_fixed, decode_ctx = self._parts(shape)
        # the context term last: a decode step is base(batch) + context x per-token cost, as decode_run takes it
        t = (f[0] + attention_fixed) + decode_ctx * f[2]
        return with_launches(t, f[12], f[8]) if f[12] else t

    def pipeline_stages(self, shape: BatchShape, step_s: float | None = None) -> Stages:
        stages, send, back, total = self._stages_of(*self._parts(shape))
        if step_s is not None:
            stages[0] += max(0.0, step_s - total)
        return stages, send, back

    def _stages_of(self, fixed: tuple, attention_fixed: float, decode_ctx: int) -> tuple:
        """(the stages' times, the send between stages, the return to stage 0, the step's time) of a step from its
        _parts."""
        _, _, per_kv, linear, head, comm, _, _, overhead_swap, send, back, hops, _ = fixed
        layered = linear + (attention_fixed + decode_ctx * per_kv) + comm
        stages = [layered * share for share in self.layer_share]  # share x layered: the same product
        stages[0] += overhead_swap
        stages[-1] += head
        return stages, send, back, sum(stages) + hops + back

    def decode_stages(self, num_seqs: int, sum_context: int) -> Stages:
        """pipeline_stages of a step of decodes alone, without building its shape."""
        key = (num_seqs, num_seqs, num_seqs, 0, 0)
        f = self._fixed_parts.get(key) or self._fixed(key)
        # the attention of such a step but its KV reads is the floor: the prompt chunks' terms add 0.0
        stages, send, back, _ = self._stages_of(f, f[1], sum_context)
        return stages, send, back

    def _base(self, num_seqs: int) -> float:
        """A decode step of `num_seqs` rows without its context term."""
        t = self._decode_base.get(num_seqs)
        if t is None:  # _fixed's sums for a step of decodes alone, in the same order: decode_time == step_time
            graphed = padded_tokens(self.engine, num_seqs, True)
            in_graph = self.engine is None or self.engine.in_graph(num_seqs, True)
            device = (self.linear_s(graphed) + self.lm_head_s(num_seqs, num_seqs)) + \
                self.communication_s(graphed, num_seqs, in_graph)
            t = self._decode_base[num_seqs] = ((device + self.overhead_s(num_seqs, False, device)) + 0.0) \
                + self.attention_floor_s(num_seqs, 0)
        return t

    def _eager_decode(self, num_seqs: int) -> bool:
        """Whether a step of `num_seqs` decodes runs eagerly (its launches may set its time: no affine run)."""
        return self.engine is not None and not self.engine.in_graph(num_seqs, True)

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        if self.pp > 1 or self._eager_decode(num_seqs):
            return self.step_time(BatchShape(num_seqs, num_seqs, sum_context, sum_context, num_seqs))
        return self._base(num_seqs) + sum_context * self.per_kv_token_s(num_seqs)

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        if self.pp > 1 or self._eager_decode(num_seqs):
            return decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end)
        return affine_decode_run(self._base(num_seqs), self.per_kv_token_s(num_seqs), num_seqs, sum_context, clock,
                                 k_max, until, step_end)

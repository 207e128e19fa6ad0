"""A step's cost on a GPU from measured kernels: the kernel model (sim/cost/kernels.py) for every GEMM, elementwise
pass and attention call each block of the model (sim/cost/blocks.py) runs on one device of a replica, measured
collectives (sim/cost/nccl.py) for its communication, and the host's overhead per step and per sequence.

- linear: per block the GEMMs at M = the step's new tokens (one device's shard) and the elementwise passes;
- experts (a mixture of experts): every MoE layer's grouped gate/up and down GEMMs on the busiest device, each
  touched expert's weights read once, the busiest expert's rows setting the compute (sim/cost/routing.py);
- attention, per kind of layer: prompt chunks at their FLOPs, a floor per chunk and a cost per key; decode rows at
  the K/V they read (all of their context in full attention, at most the window in sliding-window and chunked
  layers), and a floor per layer when the step decodes; a linear-attention layer's fixed state read and written per
  decode row and per prompt chunk, its recurrence per prompt token;
- LM head: the embedding lookup, the final norm and the vocabulary GEMM of the sampled rows (vocab-parallel);
- communication: two all-reduces of the hidden states a layer (TP > 1) and the sampled rows' logits gathered; across
  data-parallel ranks a MoE layer's dispatch and combine (all-to-alls with expert parallelism, else an all-gather and
  a reduce-scatter);
- overhead: the host's scheduling, input preparation and sampling: `step_overhead_s` + `per_seq_overhead_s` per
  sequence. Default: vLLM's, as BLIS fitted it to real vLLM runs on H100s (126 µs a step, 4.4 µs a request:
  inference-sim/inference-sim defaults.yaml, trained_physics_coefficients β₇ and β₆, Apache-2.0).

A replica's data-parallel ranks run 1 / DP of the step's tokens, sequences, sampling rows and context each, side by
side (sim/config/expert_parallel.py), each padding its share to its own CUDA graph. `Refinement` scales each part and replaces the overheads: what a profile of the
same device measured end to end refines the kernel model with. Decode steps price as base(batch) + context × the
per-token KV cost (plus, for windowed layers, the window-bounded reads), so runs of them stay exact and
allocation-free.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sim.config.engines import EngineProfile
from sim.config.sharding import stage_layers, vocab_shard
from sim.cost.blocks import PASS_FITS, AttentionGroup, StepBlocks, prompt_keys, prompt_pairs
from sim.cost.comm import Collectives
from sim.cost.engine import HostCost, launch_floor_s, padded_tokens, with_launches
from sim.cost.kernels import AttentionTerms, DeviceKernels, GemmFit, grouped_gemm_time, pass_time
from sim.cost.roofline import DEQUANT_OVERHEAD
from sim.cost.step import (
    PricesStages,
    Stages,
    StepCost,
    affine_decode_run,
    decode_run,
    window_reads_s,
)
from sim.policy.batch import BatchShape

VLLM_STEP_OVERHEAD_S = 126e-6
VLLM_PER_SEQ_OVERHEAD_S = 4.4e-6
MANY_ROWS = 1 << 20  # a prompt chunk's state read and write: at the rate of a full GPU


@dataclass(frozen=True, repr=False)
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


def linear_kernel(model, kernels: DeviceKernels, hw) -> tuple[GemmFit, float, float]:
    """The decoder GEMMs' fit, bytes per weight and FLOP-rate multiplier: fp8 (or NVFP4) tensor cores where weights
    and device have them, 2:4 sparse tensor cores at twice the rate, weight-only quantization paying to dequantize."""
    dtype = model.matmul_dtype(hw.peak_flops)
    sparse = model.sparsity == "2:4" and hw.sparse_tensor_cores
    scale = (2.0 if sparse else 1.0) / (1 + DEQUANT_OVERHEAD if model.dequantizes(hw.peak_flops) else 1.0)
    if dtype in ("fp8", "fp4"):
        gemm = kernels.gemm.get(dtype)
        if gemm is None:  # those tensor cores not measured here: the 16-bit fit at the datasheet's ratio
            gemm, scale = kernels.gemm["fp16"], scale * hw.flops(dtype) / hw.flops("fp16")
    else:
        gemm = kernels.gemm["fp16"]
        if dtype == "fp32":
            scale *= hw.flops("fp32") / hw.flops("fp16")
    return gemm, model.bytes_per_linear_param(sparse), scale


def expert_kernel(model, kernels: DeviceKernels, hw, gemm: GemmFit, compute_scale: float
                  ) -> tuple[GemmFit, float, float]:
    """The routed experts' grouped GEMM fit, bytes per weight and FLOP-rate multiplier. Experts of their own dtype
    (gpt-oss's MXFP4) run the engine's measured kernel for it where AIConfigurator timed one (Hopper dequantizes
    MXFP4 to bf16 in its Triton kernel: `grouped_mxfp4`), else stream their weights at their bytes and multiply at
    the 16-bit rate, paying to dequantize; the others the grouped fit at the linear layers' FLOP ratio (fp8), or the
    dense GEMM fit where no grouped GEMM was measured."""
    sparse = model.sparsity == "2:4" and hw.sparse_tensor_cores
    if model.expert_weight_dtype is not None and model.expert_weight_dtype != model.weight_dtype:
        measured = kernels.grouped_mxfp4 if model.expert_weight_dtype == "mxfp4" else None
        if measured is not None:
            return measured, model.bytes_per_expert_param(sparse), 1.0
        fit = kernels.grouped or kernels.gemm["fp16"]
        return fit, model.bytes_per_expert_param(sparse), 1.0 / (1 + DEQUANT_OVERHEAD)
    grouped = kernels.grouped
    if grouped is None:
        return gemm, model.bytes_per_expert_param(sparse), compute_scale
    ratio = gemm.flops / kernels.gemm["fp16"].flops
    return GemmFit(grouped.floor_s, grouped.bandwidth, grouped.flops * ratio, grouped.sharpness, grouped.m_half), \
        model.bytes_per_expert_param(sparse), compute_scale


@dataclass(eq=False, repr=False)
class KVReads:
    """Seconds per K/V token a step's decode rows read in a group of layers (all of them, one device), by the rows:
    at one rate while the rows × KV heads fit in a wave of the multiprocessors (the kernel splits the keys to fill
    them), at another past it; or by an engine's fitted kernel (`terms`), whose rate rises as the rows fill the GPU."""

    one_wave_s: float
    past_wave_s: float
    one_wave_rows: float
    terms: AttentionTerms | None = None
    scale: float = 1.0

    def per_token_s(self, rows: float) -> float:
        if self.terms is not None:
            return self.scale * self.terms.per_kv_token_s(rows)
        return self.one_wave_s if rows <= self.one_wave_rows else self.past_wave_s


@dataclass(eq=False, repr=False)
class GroupAttention:
    """One attention group's coefficients in a step (all of its layers on one device): per (query, key) pair, prompt
    chunk and key of a chunk's context; the floors a step pays when it decodes and when it carries a prompt, per
    decode row; per K/V token its decode rows read."""

    group: AttentionGroup
    s_per_prefill_pair: float
    s_per_prefill_seq: float
    s_per_prefill_key: float
    decode_floor_s: float
    prefill_floor_s: float
    s_per_decode_row: float
    reads: KVReads


def group_attention(kernels: DeviceKernels, g: AttentionGroup, scale: float) -> GroupAttention:
    """A group's attention on this device, `scale` times one layer's (its layers, refined): the engine's own kernels
    where measured (AttentionFit; MLA's were not), else the default fit (`attention`)."""
    att, fit = kernels.attention, kernels.attention_fit
    if fit is not None and g.kind != "mla":
        t = fit.terms(g.heads, g.kv_heads, g.head_dim, g.kv_bytes_per_token)
        return GroupAttention(g, scale * t.s_per_prefill_pair, scale * t.s_per_prefill_seq,
                              scale * t.s_per_prefill_key, scale * t.decode_floor_s, scale * t.prefill_floor_s,
                              scale * t.s_per_decode_row, KVReads(0.0, 0.0, 0.0, t, scale))
    kv_bytes = scale * g.kv_bytes_per_token
    past, one = kv_bytes / att["decode_bandwidth"], kv_bytes / att["decode_bandwidth_one_wave"]
    if g.kind == "mla":  # absorbed decode: as much compute as bytes at many heads
        pair = scale * g.prefill_flops_per_pair / att["prefill_flops"]
        flops = scale * g.decode_flops_per_key / att["prefill_flops"]
        past, one = max(past, flops), max(one, flops)
    else:
        pair = scale * 4 * g.heads * g.head_dim / att["prefill_flops"]
    return GroupAttention(g, pair, scale * att["prefill_floor_s"], scale * att["prefill_s_per_key"],
                          scale * att["decode_floor_s"], 0.0, 0.0, KVReads(one, past, att["sms"] // g.kv_heads))


@dataclass(eq=False, repr=False)
class StateAttention:
    """Linear-attention layers (Gated DeltaNet) on one device, all of them: a decode row reads and writes each layer's
    fixed state (priced as a decode-attention call reading twice the state's bytes), a prompt chunk the same once,
    and each prompt token runs the recurrence at the attention kernels' FLOP rate. Gated DeltaNet's kernels were not
    measured: the decode attention fit carries over."""

    s_per_prefill_token: float
    s_per_prefill_seq: float
    rows: GroupAttention  # the state update as a decode-attention call: per row, per state byte

    def decode_rows_s(self, rows: float) -> float:
        """The decode rows' state updates, all linear layers."""
        if not rows:
            return 0.0
        r = self.rows
        return rows * (r.s_per_decode_row + 2 * r.group.state_bytes * r.reads.per_token_s(rows))


def state_attention(kernels: DeviceKernels, g: AttentionGroup, scale: float) -> StateAttention:
    """The linear layers' attention in a step (`scale`: their layers, refined)."""
    as_reads = AttentionGroup("linear", 0, g.layers, g.heads, g.kv_heads, 128, 1.0, 0.0, 0.0, g.state_bytes)
    rows = group_attention(kernels, as_reads, scale)
    per_byte = rows.reads.per_token_s(MANY_ROWS)
    flops = kernels.attention["prefill_flops"]
    return StateAttention(scale * g.state_flops_per_token / flops, 2 * g.state_bytes * per_byte, rows)


class KernelCostModel(PricesStages):
    """Step costs of one replica (`blocks`: its model on one device of one data-parallel rank) whose device's kernels
    were measured. A pipeline stage runs its share of the layers (and their collectives); the host's overhead and the
    embedding go to stage 0, the LM head to the last stage (vLLM's layout); the hidden states of the step's tokens
    cross between stages and the sampled tokens come back to stage 0."""

    def __init__(self, blocks: StepBlocks, kernels: DeviceKernels, hw, collectives: Collectives,
                 pipeline_parallel_size: int = 1, refinement: Refinement = Refinement(), block_bytes: float = 0.0,
                 engine: EngineProfile | None = None, eager_collectives: Collectives | None = None):
        m = blocks.model
        self.blocks, self.model, self.kernels, self.refinement, self.engine = blocks, m, kernels, refinement, engine
        self.host = HostCost(refinement.step_overhead_s, refinement.per_seq_overhead_s, refinement.prefill_overhead_s,
                             engine is not None and engine.async_scheduling)
        self.tp, self.pp, self.dp = blocks.sharding.tp, pipeline_parallel_size, blocks.expert_layout.data_parallel_size
        self.layers = m.num_layers
        self.gemm, self.weight_bytes, self.compute_scale = linear_kernel(m, kernels, hw)
        self.expert_gemm, self.expert_bytes, self.expert_scale = expert_kernel(m, kernels, hw, self.gemm,
                                                                               self.compute_scale)
        self.lm_gemm = kernels.gemm["fp16"]
        self.act_bytes = m.act_bytes
        self.token_bytes = m.hidden_size * m.act_bytes
        self.s_per_swap_block = block_bytes / hw.host_bandwidth
        self.collectives = collectives
        # the engine's collectives in a step run eagerly (its all-reduce outside a CUDA graph costs its launch)
        self.eager_collectives = eager_collectives or collectives
        self.layer_share = [n / self.layers for n in stage_layers(self.layers, self.pp)]
        # each distinct block's layers, GEMMs (N, K) and elementwise passes (fit, bytes a token): the same every step
        self._layer_ops = [(b.count, b.gemms, [(kernels.passes[PASS_FITS[op]], per_token) for op, per_token in b.passes])
                           for b in blocks.blocks]
        # kernels a step launches: per layer its GEMMs, passes, attention, experts and all-reduces; the embedding,
        # final norm, LM head and sampling
        self.kernels_per_step = sum(b.count * blocks.kernels_per_layer(b) for b in blocks.blocks) + 4
        self._attention(kernels, blocks, refinement.attention)
        self._linear: dict[float, float] = {}
        self._head: dict[tuple, float] = {}
        self._comm: dict[tuple, float] = {}
        self._decode_base: dict[int, float] = {}
        self._decode_affine: dict[int, tuple[float, float] | None] = {}  # by rows: (base, per KV token), None: eager
        self._fixed_parts: dict[tuple[int, ...], tuple] = {}

    def _attention(self, kernels: DeviceKernels, blocks: StepBlocks, refined: float) -> None:
        """Each attention group's coefficients, a data-parallel rank's share of the step's prompts and decode rows:
        full attention's (the hot path's fields), the windowed groups' and the linear layers'."""
        dp = self.dp
        groups = [group_attention(kernels, g, refined * g.layers) for g in blocks.groups if g.kind != "linear"]
        if dp > 1:  # each rank attends its share of the rows
            groups = [replace_rows(a, dp) for a in groups]
        linear = [g for g in blocks.groups if g.kind == "linear"]
        self.state = state_attention(kernels, linear[0], refined * linear[0].layers) if linear else None
        if self.state is not None and dp > 1:
            self.state = StateAttention(self.state.s_per_prefill_token / dp, self.state.s_per_prefill_seq / dp,
                                        self.state.rows)
        full = groups[0] if groups and groups[0].group.kind in ("full", "mla") else None
        self.windows = tuple(a for a in groups if a.group.windowed)
        self.bounded = bool(self.windows) or self.state is not None
        self.s_per_prefill_pair = full.s_per_prefill_pair if full else 0.0
        self.s_per_prefill_seq = full.s_per_prefill_seq if full else 0.0
        self.s_per_prefill_key = full.s_per_prefill_key if full else 0.0
        self.full_reads = full.reads if full else KVReads(0.0, 0.0, 0.0)
        floors = groups + ([self.state.rows] if self.state is not None else [])
        self.s_decode_floor = sum(a.decode_floor_s for a in floors)
        self.s_prefill_floor = sum(a.prefill_floor_s for a in floors)
        self.s_per_decode_row = sum(a.s_per_decode_row for a in groups)

    def attention_floor_s(self, seqs: int, prefill: int) -> float:
        """The attention a step pays whatever its context: a floor per layer when it decodes (an engine's fitted
        kernel: one call for prompts and decodes alike, the larger floor, and a cost per decode row), and the
        linear layers' state updates of its decode rows."""
        floor = self.s_decode_floor if seqs > prefill else 0.0
        if prefill and self.s_prefill_floor > floor:
            floor = self.s_prefill_floor
        floor = floor + (seqs - prefill) * self.s_per_decode_row
        return floor + self.state.decode_rows_s((seqs - prefill) / self.dp) if self.state is not None else floor

    # -- the parts, cached by the step's few integers ---------------------------------------------------------------
    def linear_s(self, tokens: float) -> float:
        """Every block's GEMMs and elementwise passes over `tokens` new tokens (but the routed experts)."""
        t = self._linear.get(tokens)
        if t is None:
            r = self.refinement.linear
            t = self._linear[tokens] = sum(r * count * self._layer_s(gemms, passes, tokens)
                                           for count, gemms, passes in self._layer_ops) if tokens else 0.0
        return t

    def _layer_s(self, gemms, passes, tokens: float) -> float:
        gemm, wb, ab, scale = self.gemm, self.weight_bytes, self.act_bytes, self.compute_scale
        per_layer = sum(gemm.time(tokens, n, k, wb, ab, scale) for n, k in gemms)
        # integer bytes: per token x tokens is the same count the layer's passes move
        per_layer += sum(pass_time(fit, per_token * tokens) for fit, per_token in passes)
        return per_layer

    def experts_s(self, tokens: float) -> float:
        """Every MoE layer's routed experts on the busiest device: its grouped gate/up and down GEMMs."""
        b = self.blocks
        if not b.moe_layers:
            return 0.0
        rows, touched, busiest = b.experts.of(tokens)
        if touched == 0:
            return 0.0
        return b.moe_layers * sum(grouped_gemm_time(self.expert_gemm, rows, touched, busiest, n, k, self.expert_bytes,
                                                    self.act_bytes, self.expert_scale) for n, k in b.expert_gemms)

    def lm_head_s(self, tokens: float, sampled: float) -> float:
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
        """Tensor parallelism: two all-reduces of a rank's hidden states a layer, the sampled rows' fp32 logits
        gathered; data-parallel ranks: the MoE layers' exchanges (sim/cost/blocks.py); `graph`: the step replays a
        CUDA graph (else the engine's all-reduce runs eagerly)."""
        if self.tp == 1 and not self.blocks.dispatches:
            return 0.0
        key = (tokens, sampled, graph)
        t = self._comm.get(key)
        if t is None:
            c, dp, t = self.collectives if graph else self.eager_collectives, self.dp, 0.0
            if self.tp > 1:
                t = 2 * self.layers * c.all_reduce_s(tokens * self.token_bytes if dp == 1 else
                                                     tokens / dp * self.token_bytes, self.tp)
                if sampled:
                    t += c.gather_s(sampled * self.model.vocab_size * 4 if dp == 1 else
                                    sampled / dp * self.model.vocab_size * 4, self.tp)
            if self.blocks.dispatches:
                t += self.blocks.dispatch_s(c, tokens)
            t = self._comm[key] = self.refinement.communication * t
        return t

    def overhead_s(self, seqs: float, prefill: bool = False, device_s: float = 0.0) -> float:
        """The host's scheduling and sampling the step's time shows beside `device_s` of the device's work (async
        scheduling hides it under that: sim/cost/engine.py)."""
        return self.host.visible_s(seqs, prefill, device_s)

    def per_kv_token_s(self, decode_rows: int) -> float:
        """Full attention's seconds per KV token a step of `decode_rows` decode rows reads (a rank reads 1 / DP)."""
        if self.dp == 1:
            return self.full_reads.per_token_s(decode_rows)
        return self.full_reads.per_token_s(decode_rows / self.dp) / self.dp

    def window_rates(self, decode_rows: int) -> tuple[tuple[int, float], ...]:
        """(window, seconds per K/V token read) of each windowed group in a step of `decode_rows` decode rows."""
        dp = self.dp
        return tuple((a.group.window, a.reads.per_token_s(decode_rows / dp) / dp if dp > 1
                      else a.reads.per_token_s(decode_rows)) for a in self.windows)

    def _device_parts(self, tokens: int, sampled: int, decode_only: bool) -> tuple[float, float, float, float]:
        """(linear, LM head, experts, communication) of a step's tokens: the layers over the CUDA graph's padded size,
        a data-parallel rank's share (each rank replays its own graphs, padding its own share)."""
        dp = self.dp
        rank = self.rank_tokens(tokens)
        graphed = padded_tokens(self.engine, tokens, decode_only) if dp == 1 else \
            padded_tokens(self.engine, rank, decode_only) * dp
        in_graph = self.engine is None or self.engine.in_graph(rank, decode_only)
        linear = self.linear_s(graphed if dp == 1 else graphed / dp)
        head = self.lm_head_s(tokens, sampled) if dp == 1 else self.lm_head_s(tokens / dp, sampled / dp)
        return linear, head, self.experts_s(graphed), self.communication_s(graphed, sampled, in_graph)

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
        f, attention_fixed, decode_ctx, windowed = self._parts(shape)
        base, _, per_kv, linear, head, comm, overhead, swap = f[:8]
        total = ((base + attention_fixed) + decode_ctx * per_kv) + windowed
        if f[12]:  # an eager step: its launches may outlast the device's work (shown with the host's)
            waited = with_launches(total, f[12], f[8])
            overhead, total = overhead + (waited - total), waited
        return StepCost(total, linear, (attention_fixed + decode_ctx * per_kv) + windowed, comm, head, overhead, 0.0,
                        swap, f[14])

    def _parts(self, shape: BatchShape) -> tuple[tuple, float, int, float]:
        """(_fixed's parts, attention but the decode rows' KV reads, the decode rows' context, the windowed layers'
        decode reads) of the step on one device of the TP group. Attention but the KV reads: the floors; prompt
        chunks (and verify rows' extra queries) at their FLOPs, chunks also a cost each and per key."""
        key = (shape.num_new_tokens, shape.num_sampled, shape.num_seqs, shape.num_prefill, shape.swap_blocks)
        f = self._fixed_parts.get(key) or self._fixed(key)
        decode_ctx = shape.sum_context - shape.prefill_context
        extra_pairs = shape.attn_pairs - decode_ctx  # max(0, ...) below, without the call
        attention_fixed = f[1] + ((extra_pairs if extra_pairs > 0 else 0) * self.s_per_prefill_pair
                                  + (shape.num_prefill * self.s_per_prefill_seq
                                     + shape.prefill_context * self.s_per_prefill_key))
        if not self.bounded:
            return f, attention_fixed, decode_ctx, 0.0
        attention_fixed += self._bounded_prompt_s(shape, extra_pairs if extra_pairs > 0 else 0)
        return f, attention_fixed, decode_ctx, window_reads_s(f[13], decode_ctx, shape.num_seqs - shape.num_prefill)

    def _bounded_prompt_s(self, shape: BatchShape, pairs: int) -> float:
        """The prompt chunks' attention in windowed layers (each query attends at most its window) and linear layers
        (the recurrence over each token, the state read and written once a chunk)."""
        queries = shape.num_new_tokens - (shape.num_seqs - shape.num_prefill)  # beyond one a decode row
        t = 0.0
        for a in self.windows:
            g = a.group
            t += prompt_pairs(g, pairs, queries) * a.s_per_prefill_pair + (
                shape.num_prefill * a.s_per_prefill_seq
                + prompt_keys(g, shape.prefill_context, shape.num_prefill, shape.prefill_tokens) * a.s_per_prefill_key)
        if self.state is not None:
            t += shape.prefill_tokens * self.state.s_per_prefill_token + shape.num_prefill * self.state.s_per_prefill_seq
        return t

    def _fixed(self, key: tuple[int, int, int, int, int]) -> tuple:
        """What a step's counts `key` (new tokens, sampled rows, sequences, prompt rows, swap blocks) decide, cached
        by them: (linear + LM head + experts + communication + overhead + swap, in that order of sums; the attention
        floors, seconds per KV token the decode rows read; linear, LM head, communication, overhead, swap; on a
        pipeline overhead + swap, the send between stages, the return to stage 0 and the sends' total, (stages − 1) x
        send; the launches of an eager step; the windowed groups' (window, seconds per KV token); experts)."""
        tokens, sampled, seqs, prefill, swap_blocks = key
        linear, head, experts, comm = self._device_parts(tokens, sampled, prefill == 0)
        device = ((linear + head) + experts) + comm
        overhead = self.overhead_s(seqs if self.dp == 1 else seqs / self.dp, prefill > 0, device)
        swap = swap_blocks * self.s_per_swap_block
        send = back = 0.0
        if self.pp > 1:
            send = self.collectives.send_s(tokens * self.token_bytes)
            back = self.collectives.send_s(sampled * 8) if sampled else 0.0
        rows = seqs - prefill
        f = self._fixed_parts[key] = ((device + overhead) + swap, self.attention_floor_s(seqs, prefill),
                                      self.per_kv_token_s(rows), linear, head, comm, overhead, swap, overhead + swap,
                                      send, back, (self.pp - 1) * send,
                                      launch_floor_s(self.engine, self.rank_tokens(tokens), prefill == 0,
                                                     self.kernels_per_step),
                                      self.window_rates(rows) if self.windows else (), experts)
        return f

    def step_time(self, shape: BatchShape) -> float:
        if self.pp > 1:
            return self._stages_of(*self._parts(shape))[3]
        # step_cost's total without building it: the simulator's hot path
        f, attention_fixed, decode_ctx, windowed = self._parts(shape)
        # the context term last: a decode step is base(batch) + context x per-token cost, as decode_run takes it
        t = ((f[0] + attention_fixed) + decode_ctx * f[2]) + windowed
        return with_launches(t, f[12], f[8]) if f[12] else t

    def pipeline_stages(self, shape: BatchShape, step_s: float | None = None) -> Stages:
        stages, send, back, total = self._stages_of(*self._parts(shape))
        if step_s is not None:
            stages[0] += max(0.0, step_s - total)
        return stages, send, back

    def _stages_of(self, fixed: tuple, attention_fixed: float, decode_ctx: int, windowed: float) -> tuple:
        """(the stages' times, the send between stages, the return to stage 0, the step's time) of a step from its
        _parts."""
        _, _, per_kv, linear, head, comm, _, _, overhead_swap, send, back, hops = fixed[:12]
        layered = linear + ((attention_fixed + decode_ctx * per_kv) + windowed) + comm
        stages = [layered * share for share in self.layer_share]  # share x layered: the same product
        stages[0] += overhead_swap
        stages[-1] += head
        return stages, send, back, sum(stages) + hops + back

    def decode_stages(self, num_seqs: int, sum_context: int) -> Stages:
        """pipeline_stages of a step of decodes alone, without building its shape."""
        key = (num_seqs, num_seqs, num_seqs, 0, 0)
        f = self._fixed_parts.get(key) or self._fixed(key)
        # the attention of such a step but its KV reads is the floor: the prompt chunks' terms add 0.0
        stages, send, back, _ = self._stages_of(f, f[1], sum_context, window_reads_s(f[13], sum_context, num_seqs))
        return stages, send, back

    def _base(self, num_seqs: int) -> float:
        """A decode step of `num_seqs` rows without its context term."""
        t = self._decode_base.get(num_seqs)
        if t is None:  # _fixed's sums for a step of decodes alone, in the same order: decode_time == step_time
            linear, head, experts, comm = self._device_parts(num_seqs, num_seqs, True)
            device = ((linear + head) + experts) + comm
            seqs = num_seqs if self.dp == 1 else num_seqs / self.dp
            t = self._decode_base[num_seqs] = ((device + self.overhead_s(seqs, False, device)) + 0.0) \
                + self.attention_floor_s(num_seqs, 0)
        return t

    def _eager_decode(self, num_seqs: int) -> bool:
        """Whether a step of `num_seqs` decodes runs eagerly (its launches may set its time: no affine run)."""
        return self.engine is not None and not self.engine.in_graph(self.rank_tokens(num_seqs), True)

    def rank_tokens(self, tokens: int) -> int:
        """The new tokens of a step's busiest data-parallel rank (the step's own with one rank)."""
        return tokens if self.dp == 1 else -(-tokens // self.dp)

    def _affine(self, num_seqs: int) -> tuple[float, float] | None:
        """A decode step of `num_seqs` rows as (base, seconds per KV token): `base + context * per_kv` (None: not
        affine, a pipelined or eager step), cached by rows (the simulator asks at every run of decode steps)."""
        try:
            return self._decode_affine[num_seqs]
        except KeyError:
            c = None if self.pp > 1 or self._eager_decode(num_seqs) else (self._base(num_seqs),
                                                                           self.per_kv_token_s(num_seqs))
            self._decode_affine[num_seqs] = c
            return c

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        c = self._decode_affine.get(num_seqs, False)  # _affine's cache read inline: asked at every run of steps
        if c is False:
            c = self._affine(num_seqs)
        if c is None:
            return self.step_time(BatchShape(num_seqs, num_seqs, sum_context, sum_context, num_seqs))
        t = c[0] + sum_context * c[1]
        return t + window_reads_s(self.window_rates(num_seqs), sum_context, num_seqs) if self.windows else t

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        c = self._decode_affine.get(num_seqs, False)  # as decode_time
        if c is False:
            c = self._affine(num_seqs)
        if c is None:
            return decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end)
        base, per_kv = c
        if self.windows or num_seqs <= 0:  # (no rows: a range cannot step by 0)
            return affine_decode_run(base, per_kv, num_seqs, sum_context, clock, k_max, until, step_end,
                                     self.window_rates(num_seqs) if self.windows else ())
        # affine_decode_run without windows, inline (a call per run of decode steps saved): decode_time's float
        # operations, the per-batch part hoisted; step_end.append() loaded at each step: Python 3.11 specializes a
        # method load, not a bound method's read
        if k_max == 1:  # a lone step (an arrival async scheduling does not see yet): no range
            clock += base + sum_context * per_kv
            step_end.append(clock)
            return 1, clock
        # each step's context a float counted up (exact below 2**53, as int * float converts it): float operations
        # Python 3.11 specializes, and no int object made per step
        s, rows = float(sum_context), float(num_seqs)
        for k in range(1, k_max + 1):
            clock += base + s * per_kv
            step_end.append(clock)
            if clock >= until:
                return k, clock
            s += rows
        return k_max, clock


def replace_rows(a: GroupAttention, dp: int) -> GroupAttention:
    """A group's coefficients for one of `dp` data-parallel ranks: 1 / DP of the step's prompts and decode rows."""
    return replace(a, s_per_prefill_pair=a.s_per_prefill_pair / dp, s_per_prefill_seq=a.s_per_prefill_seq / dp,
                   s_per_prefill_key=a.s_per_prefill_key / dp, s_per_decode_row=a.s_per_decode_row / dp)

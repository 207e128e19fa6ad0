"""What one device of a mixture-of-experts (or latent-attention, or data-parallel) replica spends on each part of a
step, priced two ways: from the datasheet (`RooflineParts`) and from the measured GPU kernels (`KernelParts`). The
step's structure — which device's share of which tokens — is sim/cost/moe.py's; these price the shares.

Both take per device of a data-parallel rank: `tokens` new tokens and `sampled` sampling rows (linear layers, the LM
head), the routed rows, touched experts and busiest expert's rows of the busiest device (experts), and its prompt
chunks and decode rows (attention).
- Linear: attention projections (MLA: q_a, q_b, kv_a, kv_b, o; q_a and kv_a whole on every rank, as vLLM replicates
  them), the dense layers' MLPs, the shared experts and the router; everything but the routed experts.
- Experts: every MoE layer's gate/up and down over the experts the device holds, each expert's weights read once if
  a token touched it, the compute set by the busiest expert.
- Attention: prompt chunks at their FLOPs (MLA: decompressed, heads × (qk_nope + qk_rope + v) per key), decode rows
  at max(KV bytes, FLOPs) per key (MLA: absorbed, each head meeting the latent and rotary key, 2·kv_lora_rank +
  qk_rope_head_dim per key).
"""
from __future__ import annotations

from sim.config import moe
from sim.config.hardware import HardwareSpec
from sim.config.models import BYTES_PER_PARAM, ModelSpec
from sim.config.sharding import shard
from sim.cost.gpu import linear_kernel
from sim.cost.kernels import DeviceKernels, GemmFit, grouped_gemm_time, layer_gemms, layer_passes, pass_time
from sim.cost.roofline import DEQUANT_OVERHEAD


def attention_flops_per_key(m: ModelSpec, decode: bool) -> int:
    """FLOPs of one (query, key) pair on all heads of one layer: QKᵀ and PV."""
    if moe.uses_mla(m) and decode:  # absorbed: queries meet the latent and the rotary key
        return 2 * m.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    return 2 * m.num_heads * (moe.qk_head_dim(m) + moe.v_head_dim(m))


def expert_slices(tp: int, expert_parallel: bool) -> int:
    """Devices each routed expert is sliced over: the tensor-parallel ranks, or none with expert parallelism."""
    return 1 if expert_parallel else tp


class RooflineParts:
    """max(FLOPs / achieved peak, bytes / achieved bandwidth) per part, as sim/cost/roofline.py prices a dense step."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, compute_efficiency: float, memory_efficiency: float,
                 tensor_parallel_size: int, sequence_parallel: bool, expert_parallel: bool):
        m, n = model, tensor_parallel_size
        act = BYTES_PER_PARAM[m.act_dtype]
        flops = hw.flops(m.act_dtype) * compute_efficiency
        bw = hw.memory_bandwidth * memory_efficiency
        sparse = m.sparsity == "2:4" and hw.sparse_tensor_cores
        linear_flops = hw.flops(m.matmul_dtype(hw.peak_flops)) * compute_efficiency * (2 if sparse else 1)
        dequant = 1 + DEQUANT_OVERHEAD if m.dequantizes(hw.peak_flops) else 1.0
        b = m.bytes_per_linear_param(sparse)
        p = moe.decoder_params(m)
        self.s_per_dense_token = 2 * p.dense / linear_flops / n * dequant
        self.s_per_logit_row = 2 * m.hidden_size * m.vocab_size / flops / n
        self.s_dense_weights = (p.dense * b + m.embedding_params * act) / bw / n
        self.s_lm_head_weights = m.embedding_params * act / bw / n
        self.s_per_act_token = 8 * m.num_layers * m.hidden_size * act / bw / (n if sequence_parallel else 1)
        slices, layers = expert_slices(n, expert_parallel), moe.moe_layers(m)
        self.s_per_expert_row = layers * 2 * moe.expert_params(m) / linear_flops / slices * dequant
        self.s_per_expert_weights = layers * moe.expert_params(m) * b / bw / slices
        self.s_per_prefill_pair = m.num_layers * attention_flops_per_key(m, False) / flops / n
        self.s_per_decode_key = m.num_layers * attention_flops_per_key(m, True) / flops / n
        self.s_per_kv_token = moe.kv_bytes_per_device_token(m, shard(m, n)) / bw

    def linear_s(self, tokens: float, sampled: float) -> tuple[float, float]:
        """(decoder layers but the routed experts, LM head): their max(compute, weight stream), the LM head's share
        its logits' FLOPs when compute-bound, its bytes when streaming."""
        compute = tokens * self.s_per_dense_token + sampled * self.s_per_logit_row
        stream = self.s_dense_weights + tokens * self.s_per_act_token
        head = sampled * self.s_per_logit_row if compute >= stream else self.s_lm_head_weights
        return max(compute, stream) - head, head

    def experts_s(self, rows: float, touched: float, busiest: float) -> float:
        """Every MoE layer's routed experts on the busiest device."""
        if touched == 0:
            return 0.0
        return max(touched * busiest * self.s_per_expert_row, touched * self.s_per_expert_weights)

    def attention_fixed_s(self, prefill_seqs: float, prefill_pairs: float, prefill_context: float,
                          decoding: bool, decode_rows: float = 0.0) -> float:
        """Prompt chunks' attention: max(FLOPs, KV read)."""
        return max(prefill_pairs * self.s_per_prefill_pair, prefill_context * self.s_per_kv_token)

    def per_kv_token_s(self, decode_rows: float) -> float:
        """A decode row's attention per token of its context."""
        return max(self.s_per_decode_key, self.s_per_kv_token)


class KernelParts:
    """The measured GPU kernels (sim/cost/kernels.py): GEMMs, elementwise passes, attention, grouped expert GEMMs."""

    def __init__(self, model: ModelSpec, kernels: DeviceKernels, hw: HardwareSpec, kv_bytes_per_token_layer: float,
                 tensor_parallel_size: int, expert_parallel: bool):
        m, n = model, tensor_parallel_size
        self.model, self.kernels, self.tp = m, kernels, n
        self.gemm, self.weight_bytes, self.compute_scale = linear_kernel(m, kernels, hw)
        self.grouped = _grouped_fit(kernels, self.gemm)
        self.act_bytes = m.act_bytes
        self.n_moe = moe.moe_layers(m)
        self.shapes = self._dense_gemms()
        slices = expert_slices(n, expert_parallel)
        width = moe.expert_width(m) // slices
        self.expert_shapes = [(2 * width, m.hidden_size), (m.hidden_size, width)]  # gate/up, down: (N, K)
        att = kernels.attention
        self.s_per_prefill_pair = m.num_layers * attention_flops_per_key(m, False) / n / att["prefill_flops"]
        self.s_per_prefill_seq = m.num_layers * att["prefill_floor_s"]
        self.s_per_prefill_key = m.num_layers * att["prefill_s_per_key"]
        self.s_decode_floor = m.num_layers * att["decode_floor_s"]
        kv_bytes = m.num_layers * kv_bytes_per_token_layer
        flops_per_key = m.num_layers * attention_flops_per_key(m, True) / n / att["prefill_flops"]
        self.s_per_kv_token = max(kv_bytes / att["decode_bandwidth"], flops_per_key)
        self.s_per_kv_token_one_wave = max(kv_bytes / att["decode_bandwidth_one_wave"], flops_per_key)
        heads = 1 if moe.uses_mla(m) else max(1, m.num_kv_heads // n)  # MLA: one latent serves every head
        self.one_wave_rows = att["sms"] // heads
        self.attention_terms = None
        if kernels.attention_fit is not None and not moe.uses_mla(m):  # the engine's own kernels (no MLA measured)
            s = shard(m, n)
            t = self.attention_terms = kernels.attention_fit.terms(s.heads, s.kv_heads, m.head_size,
                                                                   kv_bytes_per_token_layer)
            self.attention_scale = scale = m.num_layers
            self.s_per_prefill_pair, self.s_per_prefill_seq = scale * t.s_per_prefill_pair, scale * t.s_per_prefill_seq
            self.s_per_prefill_key = scale * t.s_per_prefill_key
            self.s_decode_floor, self.s_prefill_floor = scale * t.decode_floor_s, scale * t.prefill_floor_s
            self.s_per_decode_row = scale * t.s_per_decode_row

    def _dense_gemms(self) -> list[tuple[int, int, int]]:
        """(layers, N, K) of every GEMM but the routed experts, on one device."""
        m, n = self.model, self.tp
        if moe.uses_mla(m):
            qk, heads = moe.qk_head_dim(m), m.num_heads // n
            q = [(m.q_lora_rank, m.hidden_size), (heads * qk, m.q_lora_rank)] if m.q_lora_rank else \
                [(heads * qk, m.hidden_size)]
            attn = [*q, (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size),
                    (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), (m.hidden_size, heads * m.v_head_dim)]
        else:  # qkv and o, as a dense layer's
            attn = [(nn, kk) for _, _, nn, kk in layer_gemms(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_size,
                                                             m.intermediate_size, n, 1)[:2]]
        out = [(m.num_layers, nn, kk) for nn, kk in attn]
        dense_layers = m.num_layers - self.n_moe
        if dense_layers:
            out += [(dense_layers, 2 * m.intermediate_size // n, m.hidden_size),
                    (dense_layers, m.hidden_size, m.intermediate_size // n)]
        shared = moe.shared_width(m) // n
        if self.n_moe and shared:
            out += [(self.n_moe, 2 * shared, m.hidden_size), (self.n_moe, m.hidden_size, shared)]
        if self.n_moe:
            out.append((self.n_moe, m.num_experts, m.hidden_size))  # the router, whole on every rank
        return out

    def linear_s(self, tokens: float, sampled: float) -> tuple[float, float]:
        """(decoder GEMMs but the routed experts and their elementwise passes, LM head)."""
        if not tokens:
            return 0.0, 0.0
        m, g = self.model, self.gemm
        t = sum(layers * g.time(tokens, nn, kk, self.weight_bytes, self.act_bytes, self.compute_scale)
                for layers, nn, kk in self.shapes)
        inter = moe.expert_width(m) * m.num_experts_per_tok if self.n_moe else m.intermediate_size
        passes = layer_passes(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_size, inter, self.tp, tokens,
                              act_bytes=self.act_bytes)
        t += m.num_layers * sum(pass_time(self.kernels.passes[op], b) for op, b in passes.items())
        p = self.kernels.passes
        head = pass_time(p["add"], 2 * tokens * m.hidden_size * self.act_bytes)
        if sampled:
            head += pass_time(p["input_norm"], 2 * sampled * m.hidden_size * self.act_bytes)
            head += self.kernels.gemm["fp16"].time(sampled, -(-m.vocab_size // self.tp), m.hidden_size,
                                                   self.act_bytes, self.act_bytes)
        return t, head

    def experts_s(self, rows: float, touched: float, busiest: float) -> float:
        """Every MoE layer's grouped gate/up and down GEMMs on the busiest device."""
        if touched == 0:
            return 0.0
        return self.n_moe * sum(grouped_gemm_time(self.grouped, rows, touched, busiest, nn, kk, self.weight_bytes,
                                                  self.act_bytes, self.compute_scale) for nn, kk in self.expert_shapes)

    def attention_fixed_s(self, prefill_seqs: float, prefill_pairs: float, prefill_context: float,
                          decoding: bool, decode_rows: float = 0.0) -> float:
        """Prompt chunks at their FLOPs, a floor each and a cost per key; a floor a layer when the step decodes (an
        engine's fitted kernel: one call for both, the larger floor, and a cost per decode row)."""
        floor = self.s_decode_floor if decoding else 0.0
        if self.attention_terms is not None:
            if prefill_seqs and self.s_prefill_floor > floor:
                floor = self.s_prefill_floor
            floor += decode_rows * self.s_per_decode_row
        return floor + (prefill_pairs * self.s_per_prefill_pair + prefill_seqs * self.s_per_prefill_seq
                        + prefill_context * self.s_per_prefill_key)

    def per_kv_token_s(self, decode_rows: float) -> float:
        if self.attention_terms is not None:
            return self.attention_scale * self.attention_terms.per_kv_token_s(decode_rows)
        return self.s_per_kv_token_one_wave if decode_rows <= self.one_wave_rows else self.s_per_kv_token


def _grouped_fit(kernels: DeviceKernels, gemm: GemmFit) -> GemmFit:
    """The device's grouped expert GEMM fit, at the fp8 rate where its linear layers multiply in fp8 (the 16-bit fit's
    FLOP ratio carried over); the dense GEMM fit where no grouped GEMM was measured or carried over."""
    grouped = kernels.grouped
    if grouped is None:
        return gemm
    ratio = gemm.flops / kernels.gemm["fp16"].flops
    return GemmFit(grouped.floor_s, grouped.bandwidth, grouped.flops * ratio, grouped.sharpness, grouped.m_half)

"""The roofline step-cost model: the batch shape of one engine step → seconds, from the model's and the device's
numbers alone (the interface: sim/cost/step.py), over the blocks one device of the replica computes
(sim/cost/blocks.py).

The vocabulary shared with the executor's traces is the batch shape: per sequence, the new tokens it
computes this step and its context length (tokens in the KV cache after the step).
"""
from __future__ import annotations

from sim.config.hardware import HardwareSpec
from sim.config.moe import expert_params
from sim.cost.blocks import StepBlocks, kv_reads, prompt_pairs, window_reads
from sim.cost.comm import Interconnect, TensorParallelComm
from sim.cost.step import StepCost, decode_run
from sim.policy.batch import BatchShape

# Weight-only quantized matmuls (int8/int4, fp8 without fp8 tensor cores, MXFP4 experts on Hopper) dequantize each
# weight tile before the 16-bit multiply: ~15% over the dense kernel where they are compute-bound (Marlin / AWQ
# kernels at large batch), nothing where they stream weights (the fewer bytes are the gain there).
DEQUANT_OVERHEAD = 0.15
QUANTIZED = ("int8", "int4", "fp8", "mxfp4", "nvfp4")


class RooflineCostModel:
    """Per operator group, time = max(FLOPs / achieved peak, bytes / achieved bandwidth); summed, plus
    a fixed per-step and a per-sequence overhead.

    - linear layers (every block's projections, dense MLPs, shared experts, router): 2·params FLOPs per token; all
      weights and the lm_head read once per step; lm_head FLOPs only for sequences that sample this step;
    - routed experts: each MoE layer's touched experts' weights read once, the busiest expert's rows computed
      (sim/cost/routing.py), at the experts' own dtype (MXFP4 streamed at 4.25 bits, multiplied after dequantizing);
    - attention: FLOPs per (query, key) pair, causal within a prompt, against the K/V read; full attention reads
      each row's whole context, windowed layers at most the window a row, linear-attention layers their fixed state
      (read and written once a row), their recurrence at its FLOPs a prompt token; GQA-aware, MLA absorbed in decode;
    - tensor parallelism over n devices: FLOPs, weight and K/V reads split n ways (K/V by KV heads, a copy per
      device when there are fewer KV heads than devices), plus two all-reduces of the step's hidden states per
      layer, 2(n−1)/n · bytes / link bandwidth + 2(n−1) · link latency each over a ring (2 latencies through a
      switch), and the sampled rows' logits gathered from the vocab-parallel lm_head. Sequence parallelism splits the
      norm and residual traffic too (its reduce-scatter + all-gather move what the all-reduce did);
    - data-parallel ranks each run 1 / DP of the step's tokens, sequences and context side by side and meet in the
      MoE layers: with expert parallelism a dispatch and a combine all-to-all a MoE layer, without it an all-gather
      and a reduce-scatter of every token, the experts sliced over all TP × DP devices.
    """

    def __init__(self, blocks: StepBlocks, hw: HardwareSpec, compute_efficiency: float = 0.6,
                 memory_efficiency: float = 0.8, step_overhead_s: float = 2e-3, per_seq_overhead_s: float = 2e-5,
                 block_bytes: float = 0.0, sequence_parallel: bool = False):
        model, n = blocks.model, blocks.sharding.tp
        self.blocks, self.dp = blocks, blocks.expert_layout.data_parallel_size
        act_bytes = model.act_bytes
        flops = hw.flops(model.act_dtype) * compute_efficiency
        bw = hw.memory_bandwidth * memory_efficiency
        # the linear layers: fp8 (or NVFP4) tensor cores where weights and hardware have them, 2:4 sparse tensor cores
        # at twice the rate, and weight-only quantization paying to dequantize the weights it streams
        sparse = model.sparsity == "2:4" and hw.sparse_tensor_cores
        linear_flops = hw.flops(model.matmul_dtype(hw.peak_flops)) * compute_efficiency * (2 if sparse else 1)
        dequant = 1 + DEQUANT_OVERHEAD if model.dequantizes(hw.peak_flops) else 1.0
        dense = model.decoder_parts.dense  # every block's weights but the routed experts
        self.s_per_linear_token = 2 * dense / linear_flops / n * dequant
        self.s_per_logit_row = 2 * model.hidden_size * model.vocab_size / flops / n
        # decoder weights and the lm_head matrix are read once per step (embedding lookups are tiny)
        self.s_weights = (dense * model.bytes_per_linear_param(sparse) + model.embedding_params * act_bytes) / bw / n
        self.s_lm_head_weights = model.embedding_params * act_bytes / bw / n  # their share in step_cost's parts
        self.s_per_act_token = 8 * model.num_layers * model.hidden_size * act_bytes / bw / (n if sequence_parallel
                                                                                            else 1)
        self._experts(blocks, hw, linear_flops, bw, sparse)
        self._attention(blocks, flops, bw)
        self.step_overhead_s = step_overhead_s
        self.per_seq_overhead_s = per_seq_overhead_s
        self.s_per_swap_block = block_bytes / hw.host_bandwidth
        # communication per step (sim/cost/comm.py): 2 all-reduces a layer of each token's hidden state, and the
        # logits gather; a MoE's all-to-alls across data-parallel ranks
        self.link = Interconnect.of(hw)
        self.comm = TensorParallelComm.of(model, self.link, n)
        self.parallel = n > 1 or blocks.dispatches

    def _experts(self, blocks: StepBlocks, hw: HardwareSpec, linear_flops: float, bw: float, sparse: bool) -> None:
        """Every MoE layer's routed experts on the busiest device: each expert's FLOPs a row and bytes."""
        m = blocks.model
        self.moe = bool(blocks.moe_layers)
        if not self.moe:
            return
        own = m.expert_weight_dtype is not None and m.expert_weight_dtype != m.weight_dtype
        dequant = 1 + DEQUANT_OVERHEAD if (m.expert_weight_dtype in QUANTIZED if own else
                                           m.dequantizes(hw.peak_flops)) else 1.0
        slices, params = blocks.expert_layout.expert_slices, expert_params(m)
        self.s_per_expert_row = blocks.moe_layers * 2 * params / linear_flops / slices * dequant
        self.s_per_expert_weights = blocks.moe_layers * params * m.bytes_per_expert_param(sparse) / bw / slices

    def _attention(self, blocks: StepBlocks, flops: float, bw: float) -> None:
        """Full attention's seconds per (query, key) pair, per decode key and per K/V token read; the windowed and
        linear groups' coefficients (`bounded`), each a data-parallel rank's share."""
        m, n, dp = blocks.model, blocks.sharding.tp, self.dp
        full = blocks.full
        self.mla = full is not None and full.kind == "mla"
        layers = full.layers if full is not None else 0
        if self.mla:
            self.s_per_attn_pair = layers * full.prefill_flops_per_pair / flops / dp
            self.s_per_decode_key = layers * full.decode_flops_per_key / flops / dp
        else:
            self.s_per_attn_pair = self.s_per_decode_key = 4 * layers * m.num_heads * m.head_size / flops / n / dp
        self.s_per_kv_token = (full.kv_bytes_per_token * layers if full is not None else 0.0) / bw / dp
        self.bounded = tuple((g, g.layers * g.prefill_flops_per_pair / flops / dp,
                              g.layers * (g.kv_bytes_per_token or 2 * g.state_bytes) / bw / dp,
                              g.layers * g.state_flops_per_token / flops / dp) for g in blocks.bounded)

    # -- the parts --------------------------------------------------------------------------------------------------
    def communication_s(self, tokens: int, sampled: int) -> float:
        """Communication in a step of `tokens` new tokens, `sampled` of them sampling: tensor parallelism's
        collectives over a rank's rows, the MoE layers' exchanges across data-parallel ranks."""
        dp = self.dp
        t = 0.0 if self.blocks.sharding.tp == 1 else \
            self.comm.time(tokens, sampled) if dp == 1 else self.comm.time(tokens / dp, sampled / dp)
        return t + self.blocks.dispatch_s(self.link, tokens) if self.moe else t

    def experts_s(self, tokens: int) -> float:
        """The routed experts on the busiest device: max(their compute, their touched weights)."""
        rows, touched, busiest = self.blocks.experts.of(tokens)
        if touched == 0:
            return 0.0
        return max(touched * busiest * self.s_per_expert_row, touched * self.s_per_expert_weights)

    def _linear(self, tokens: float, sampled: float) -> tuple[float, float, float]:
        """(max(compute, weight stream), compute, stream) of the linear layers and the LM head over a rank's rows."""
        compute = tokens * self.s_per_linear_token + sampled * self.s_per_logit_row
        stream = self.s_weights + tokens * self.s_per_act_token
        return max(compute, stream), compute, stream

    def attention_s(self, shape: BatchShape) -> float:
        """max(FLOPs, K/V and state bytes) of the step's attention, a rank's share."""
        if not self.bounded:
            if self.mla:  # vLLM runs MLA's prompt chunks (decompressed) and decode rows (absorbed) as two kernels
                decode_ctx = shape.sum_context - shape.prefill_context
                pairs = shape.attn_pairs - decode_ctx
                prompt = max((pairs if pairs > 0 else 0) * self.s_per_attn_pair,
                             shape.prefill_context * self.s_per_kv_token)
                return prompt + decode_ctx * max(self.s_per_decode_key, self.s_per_kv_token)
            return max(shape.attn_pairs * self.s_per_attn_pair, shape.sum_context * self.s_per_kv_token)
        return self._bounded_attention_s(shape)

    def _bounded_attention_s(self, shape: BatchShape) -> float:
        """attention_s of a model with windowed or linear-attention layers."""
        rows = shape.num_seqs - shape.num_prefill
        decode_ctx = shape.sum_context - shape.prefill_context
        pairs = max(0, shape.attn_pairs - decode_ctx)
        queries = shape.num_new_tokens - rows
        compute = shape.attn_pairs * self.s_per_attn_pair
        memory = shape.sum_context * self.s_per_kv_token
        for g, s_pair, s_read, s_state_token in self.bounded:
            if g.kind == "linear":  # each row's state read and written once; the recurrence over each new token
                compute += shape.num_new_tokens * s_state_token
                memory += shape.num_seqs * s_read
            else:
                compute += (prompt_pairs(g, pairs, queries) + window_reads(g, decode_ctx, rows)) * s_pair
                memory += kv_reads(g, shape) * s_read
        return max(compute, memory)

    def _time(self, tokens: int, seqs: int, sampled: int, attention: float) -> float:
        dp = self.dp
        linear = self._linear(tokens, sampled)[0] if dp == 1 else self._linear(tokens / dp, sampled / dp)[0]
        t = linear + attention + self.step_overhead_s + (seqs if dp == 1 else seqs / dp) * self.per_seq_overhead_s
        if self.moe:
            t = t + self.experts_s(tokens)
        return t + self.communication_s(tokens, sampled) if self.parallel else t

    def step_time(self, shape: BatchShape) -> float:
        return self._time(shape.num_new_tokens, shape.num_seqs, shape.num_sampled, self.attention_s(shape)) \
            + shape.swap_blocks * self.s_per_swap_block

    def step_cost(self, shape: BatchShape) -> StepCost:
        """step_time's terms by part. The linear layers' max(compute, weight stream) goes to the LM head by its
        share: compute-bound, the sampled rows' logits FLOPs; streaming, the embedding's bytes."""
        tokens, seqs, sampled, dp = shape.num_new_tokens, shape.num_seqs, shape.num_sampled, self.dp
        linear, compute, stream = self._linear(tokens, sampled) if dp == 1 else \
            self._linear(tokens / dp, sampled / dp)
        lm_head = (sampled if dp == 1 else sampled / dp) * self.s_per_logit_row if compute >= stream \
            else self.s_lm_head_weights
        attention = self.attention_s(shape)
        per_seq = (seqs if dp == 1 else seqs / dp) * self.per_seq_overhead_s
        t = linear + attention + self.step_overhead_s + per_seq  # step_time's own sum, term by term in its order
        experts = self.experts_s(tokens) if self.moe else 0.0
        if self.moe:
            t = t + experts
        comm = self.communication_s(tokens, sampled) if self.parallel else 0.0
        if self.parallel:
            t = t + comm
        swap = shape.swap_blocks * self.s_per_swap_block
        return StepCost(t + swap, linear_s=linear - lm_head, attention_s=attention, communication_s=comm,
                        lm_head_s=lm_head, overhead_s=self.step_overhead_s + per_seq, swap_s=swap, experts_s=experts)

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        if self.bounded:
            return self._time(num_seqs, num_seqs, num_seqs, self.attention_s(
                BatchShape(num_seqs, num_seqs, sum_context, sum_context, num_seqs)))
        if self.mla:
            return self._time(num_seqs, num_seqs, num_seqs,
                              max(sum_context * self.s_per_decode_key, sum_context * self.s_per_kv_token))
        return self._time(num_seqs, num_seqs, num_seqs, max(sum_context * self.s_per_attn_pair,
                                                            sum_context * self.s_per_kv_token))

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        if self.bounded:  # windows cap the reads: not affine in the context
            return decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end)
        # _time with its per-batch terms hoisted; the same float operations in the same order, and
        # max(s*p, s*q) == s*max(p, q) exactly (rounding is monotonic), so results are bit-identical
        b, dp = num_seqs, self.dp
        linear = self._linear(b, b)[0] if dp == 1 else self._linear(b / dp, b / dp)[0]
        per_ctx = max(self.s_per_decode_key, self.s_per_kv_token)
        overhead, per_seq = self.step_overhead_s, (b if dp == 1 else b / dp) * self.per_seq_overhead_s
        experts = self.experts_s(b) if self.moe else 0.0  # x + 0.0 == x: a dense model's steps stay bit-identical
        comm = self.communication_s(b, b) if self.parallel else 0.0
        s, k, append = sum_context, 0, step_end.append
        while k < k_max:
            clock += linear + s * per_ctx + overhead + per_seq + experts + comm
            append(clock)
            s += b
            k += 1
            if clock >= until:
                break
        return k, clock

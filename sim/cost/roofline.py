"""The roofline step-cost model: the batch shape of one engine step → seconds, from the model's and the device's
numbers alone (the interface: sim/cost/step.py).

The vocabulary shared with the executor's traces is the batch shape: per sequence, the new tokens it
computes this step and its context length (tokens in the KV cache after the step).
"""
from __future__ import annotations

from sim.config.hardware import HardwareSpec
from sim.config.models import ModelSpec
from sim.config.sharding import shard
from sim.cost.comm import Interconnect, TensorParallelComm
from sim.cost.step import StepCost
from sim.policy.batch import BatchShape

# Weight-only quantized matmuls (int8/int4, fp8 without fp8 tensor cores) dequantize each weight tile before the
# 16-bit multiply: ~15% over the dense kernel where they are compute-bound (Marlin / AWQ kernels at large batch),
# nothing where they stream weights (the fewer bytes are the gain there).
DEQUANT_OVERHEAD = 0.15


class RooflineCostModel:
    """Per operator group, time = max(FLOPs / achieved peak, bytes / achieved bandwidth); summed, plus
    a fixed per-step and a per-sequence overhead.

    - linear layers: 2·params FLOPs per token; all weights and the lm_head read once per step;
    - lm_head FLOPs only for sequences that sample this step;
    - attention: 4·layers·heads·head_dim FLOPs per (query, key) pair, causal within a prompt;
      K/V read for the whole context, GQA-aware (2·layers·kv_heads·head_dim·bytes per token);
    - tensor parallelism over n devices: FLOPs, weight and K/V reads split n ways (K/V by KV heads, a copy per
      device when there are fewer KV heads than devices), plus two all-reduces of the step's hidden states per
      layer, 2(n−1)/n · bytes / link bandwidth + 2(n−1) · link latency each over a ring (2 latencies through a
      switch), and the sampled rows' logits gathered from the vocab-parallel lm_head. Sequence parallelism splits the norm and residual traffic too
      (its reduce-scatter + all-gather move what the all-reduce did).
    """

    def __init__(self, model: ModelSpec, hw: HardwareSpec, compute_efficiency: float = 0.6,
                 memory_efficiency: float = 0.8, step_overhead_s: float = 2e-3, per_seq_overhead_s: float = 2e-5,
                 block_bytes: float = 0.0, tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                 kv_bytes_per_token: float | None = None):
        """`kv_bytes_per_token`: what one device reads per token of context over all layers (the plan's; by default
        the model's at this tensor-parallel size)."""
        n = tensor_parallel_size
        act_bytes = model.act_bytes
        flops = hw.flops(model.act_dtype) * compute_efficiency
        bw = hw.memory_bandwidth * memory_efficiency
        # the linear layers: fp8 tensor cores where weights and hardware have them, 2:4 sparse tensor cores at twice
        # the rate, and weight-only quantization paying to dequantize the weights it streams
        sparse = model.sparsity == "2:4" and hw.sparse_tensor_cores
        linear_flops = hw.flops(model.matmul_dtype(hw.peak_flops)) * compute_efficiency * (2 if sparse else 1)
        dequant = 1 + DEQUANT_OVERHEAD if model.dequantizes(hw.peak_flops) else 1.0
        self.s_per_linear_token = 2 * model.linear_params / linear_flops / n * dequant
        self.s_per_logit_row = 2 * model.hidden_size * model.vocab_size / flops / n
        # decoder weights and the lm_head matrix are read once per step (embedding lookups are tiny)
        self.s_weights = (model.linear_params * model.bytes_per_linear_param(sparse)
                          + model.embedding_params * act_bytes) / bw / n
        self.s_lm_head_weights = model.embedding_params * act_bytes / bw / n  # their share in step_cost's parts
        self.s_per_act_token = 8 * model.num_layers * model.hidden_size * act_bytes / bw / (n if sequence_parallel else 1)
        self.s_per_attn_pair = 4 * model.num_layers * model.num_heads * model.head_size / flops / n
        if kv_bytes_per_token is None:
            kv_bytes_per_token = shard(model, n).kv_bytes(model.kv_bytes_per_token)
        self.s_per_kv_token = kv_bytes_per_token / bw
        self.step_overhead_s = step_overhead_s
        self.per_seq_overhead_s = per_seq_overhead_s
        self.s_per_swap_block = block_bytes / hw.host_bandwidth
        # communication per step (sim/cost/comm.py): 2 all-reduces a layer of each token's hidden state, and the
        # logits gather
        self.comm = TensorParallelComm.of(model, Interconnect.of(hw), n)
        self.parallel = n > 1

    def comm_time(self, tokens: int, sampled: int) -> float:
        """Tensor parallelism's communication in a step of `tokens` new tokens, `sampled` of them sampling."""
        return self.comm.time(tokens, sampled)

    def _time(self, tokens: int, seqs: int, sampled: int, attn_pairs: int, kv_tokens: int) -> float:
        linear = max(tokens * self.s_per_linear_token + sampled * self.s_per_logit_row,
                     self.s_weights + tokens * self.s_per_act_token)
        attention = max(attn_pairs * self.s_per_attn_pair, kv_tokens * self.s_per_kv_token)
        t = linear + attention + self.step_overhead_s + seqs * self.per_seq_overhead_s
        return t + self.comm_time(tokens, sampled) if self.parallel else t

    def step_time(self, shape: BatchShape) -> float:
        return self._time(shape.num_new_tokens, shape.num_seqs, shape.num_sampled, shape.attn_pairs,
                          shape.sum_context) + shape.swap_blocks * self.s_per_swap_block

    def step_cost(self, shape: BatchShape) -> StepCost:
        """step_time's terms by part. The linear layers' max(compute, weight stream) goes to the LM head by its
        share: compute-bound, the sampled rows' logits FLOPs; streaming, the embedding's bytes."""
        tokens, seqs, sampled = shape.num_new_tokens, shape.num_seqs, shape.num_sampled
        decoder, logits = tokens * self.s_per_linear_token, sampled * self.s_per_logit_row
        compute, stream = decoder + logits, self.s_weights + tokens * self.s_per_act_token
        linear = max(compute, stream)
        lm_head = logits if compute >= stream else self.s_lm_head_weights
        attention = max(shape.attn_pairs * self.s_per_attn_pair, shape.sum_context * self.s_per_kv_token)
        overhead = self.step_overhead_s + seqs * self.per_seq_overhead_s
        # step_time's own sum, term by term in its order
        t = linear + attention + self.step_overhead_s + seqs * self.per_seq_overhead_s
        comm = self.comm_time(tokens, sampled) if self.parallel else 0.0
        if self.parallel:
            t = t + comm
        swap = shape.swap_blocks * self.s_per_swap_block
        return StepCost(t + swap, linear_s=linear - lm_head, attention_s=attention, communication_s=comm,
                        lm_head_s=lm_head, overhead_s=overhead, swap_s=swap)

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        return self._time(num_seqs, num_seqs, num_seqs, sum_context, sum_context)

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        # _time with its per-batch terms hoisted; the same float operations in the same order, and
        # max(s*p, s*q) == s*max(p, q) exactly (rounding is monotonic), so results are bit-identical
        b = num_seqs
        linear = max(b * self.s_per_linear_token + b * self.s_per_logit_row,
                     self.s_weights + b * self.s_per_act_token)
        per_ctx = max(self.s_per_attn_pair, self.s_per_kv_token)
        overhead, per_seq = self.step_overhead_s, b * self.per_seq_overhead_s
        s, k, append = sum_context, 0, step_end.append
        comm = self.comm_time(b, b) if self.parallel else 0.0  # x + 0.0 == x: single devices stay bit-identical
        while k < k_max:
            clock += linear + s * per_ctx + overhead + per_seq + comm
            append(clock)
            s += b
            k += 1
            if clock >= until:
                break
        return k, clock

"""A replica's data- and expert-parallel layout (vLLM's `--data-parallel-size`, `--enable-expert-parallel`): what
one device holds and how a replica of data-parallel ranks is simulated.

- Weights on one device. Attention, the dense layers' MLPs and the shared experts are sharded over the tensor
  parallel ranks (Megatron); the router, the norms and MLA's down-projections (q_a, kv_a: ReplicatedLinear in vLLM)
  are whole on every rank; the embedding and LM head are vocabulary-parallel. Routed experts are spread over all of
  the replica's TP × DP devices: with expert parallelism whole, E / EP on each (EP size = TP × DP); without it every
  expert is sliced over them like a dense MLP (vLLM's FusedMoEParallelConfig.make flattens TP across DP in the MoE
  layers: tp_size = DP × TP, ep_size 1; at DP 1 that is the TP ranks).
- Data parallelism. Each of the replica's DP ranks (TP devices each) holds its own sequences and KV cache and runs
  attention on them; in every MoE layer their tokens meet, with or without expert parallelism (vLLM's FusedMoE
  gathers the DP ranks' hidden states and router logits before the experts and reduce-scatters the outputs back
  whenever DP > 1). The simulator runs a replica's DP ranks as one engine over DP times a rank's batch
  (DP × max_num_seqs, DP × max_num_batched_tokens, DP × a rank's KV blocks) whose steps the cost model prices with
  every rank's share of the batch (1 / DP of its tokens, sequences and context) running in parallel and the experts
  over the replica's tokens: the ranks are taken as balanced, which vLLM's DP load balancer aims for, and a sequence
  never needs more than one rank's KV.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sim.config import moe
from sim.config.errors import ConfigError
from sim.config.models import BYTES_PER_PARAM

if TYPE_CHECKING:
    from sim.config.models import ModelSpec
    from sim.config.scenario import ParallelConfig


@dataclass(eq=False, repr=False)
class ExpertLayout:
    """How a replica's devices split a model: TP ranks within a DP rank, DP ranks, experts whole over EP ranks."""

    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    all2all_backend: str = "all_to_all"  # EP's dispatch/combine across DP ranks (sim/config/engines.py)

    @property
    def exchanges(self) -> bool:
        """Whether a MoE model's layers exchange tokens across DP ranks with experts held whole: where
        all2all_backend prices the step."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def one_copy_per_rank(self) -> bool:
        """Whether the all-to-all sends a token once to each rank holding any of its experts, which hands it on to
        them (DeepEP's normal kernels), rather than once per expert (DeepEP's low-latency kernels)."""
        return self.all2all_backend == "deepep_high_throughput"

    @property
    def gathers(self) -> bool:
        """Whether a MoE layer's exchange across DP ranks gathers every token's hidden state and reduce-scatters
        the outputs (without EP, or EP on the allgather_reducescatter backend) instead of an all-to-all of the
        routed rows."""
        return not self.enable_expert_parallel or self.all2all_backend == "allgather_reducescatter"

    @property
    def ep_size(self) -> int:
        """Devices the routed experts are spread over whole (1: each expert sliced over TP × DP instead)."""
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def expert_devices(self) -> int:
        """Devices the routed experts are spread over, whole or sliced: every device of the replica (TP × DP)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_slices(self) -> int:
        """Devices each routed expert is sliced over: none with expert parallelism, else every device of the replica
        (vLLM flattens TP across the DP ranks in its MoE layers)."""
        return 1 if self.enable_expert_parallel else self.expert_devices

    def weight_bytes(self, model: ModelSpec, sparse_kernels: bool) -> float:
        """Weight bytes on one device (2:4 weights compressed only where `sparse_kernels` run them)."""
        tp = self.tensor_parallel_size
        if not (moe.has_experts(model) or moe.uses_mla(model)):
            return model.weight_bytes_on(sparse_kernels) / tp
        p = moe.decoder_params(model)
        latent = model.num_layers * moe.replicated_attention_params(model)
        replicated, sharded = p.router + p.norms + latent, p.attention - latent + p.dense_mlp + p.shared
        experts = p.routed / self.expert_devices  # E / EP whole experts or 1 / (TP × DP) of each: the same bytes
        lm_head = 0 if model.tie_word_embeddings else model.embedding_params
        embedding = (model.embedding_params + lm_head) * BYTES_PER_PARAM[model.act_dtype] / tp
        if model.expert_weight_dtype is not None:  # gpt-oss: MXFP4 experts, bf16 attention and router
            return (replicated + sharded / tp) * model.bytes_per_linear_param(sparse_kernels) + \
                experts * model.bytes_per_expert_param(sparse_kernels) + embedding
        return (replicated + sharded / tp + experts) * model.bytes_per_linear_param(sparse_kernels) + embedding

    def replica_engine(self, scheduler, num_blocks: int, swap_blocks: int) -> tuple:
        """(scheduler knobs, KV blocks, swap blocks) of the one engine that simulates the replica's DP ranks: DP
        times a rank's sequences, step budget and blocks (a prompt chunk stays a rank's)."""
        dp = self.data_parallel_size
        if dp == 1:
            return scheduler, num_blocks, swap_blocks
        return (replace(scheduler, max_num_seqs=dp * scheduler.max_num_seqs,
                        max_num_batched_tokens=dp * scheduler.max_num_batched_tokens), dp * num_blocks,
                dp * swap_blocks)


def expert_layout(model: ModelSpec, parallel: ParallelConfig, engine_backend: str) -> ExpertLayout:
    """The layout a scenario's parallel section asks for, checked against the model: one line naming the key. EP's
    dispatch/combine is the section's all2all_backend, else the engine's (`engine_backend`)."""
    layout = ExpertLayout(parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel,
                          parallel.all2all_backend or engine_backend)
    if layout.data_parallel_size > 1 and parallel.pipeline_parallel_size > 1:
        raise ConfigError("data-parallel ranks with pipeline stages are not modelled; allowed: data_parallel_size 1 "
                          "with pipeline_parallel_size > 1", "parallel.data_parallel_size")
    if layout.enable_expert_parallel:
        if not model.num_experts:
            raise ConfigError(f"{model.name} is dense (no routed experts); allowed: false, or a mixture-of-experts "
                              "model", "parallel.enable_expert_parallel")
        ep = layout.ep_size
        if model.num_experts % ep:
            ok = [d for d in range(1, min(model.num_experts, 64) + 1) if model.num_experts % d == 0]
            raise ConfigError(f"expert-parallel size {ep} (tensor_parallel_size {layout.tensor_parallel_size} × "
                              f"data_parallel_size {layout.data_parallel_size}) does not divide the "
                              f"{model.num_experts} experts of {model.name}; allowed: TP × DP among "
                              f"{', '.join(map(str, ok))}", "parallel.data_parallel_size"
                              if layout.data_parallel_size > 1 else "parallel.tensor_parallel_size")
    elif layout.data_parallel_size > 1 and model.num_experts:
        _check_sliced_over_ranks(model, layout)
    return layout


def _check_sliced_over_ranks(model: ModelSpec, layout: ExpertLayout) -> None:
    """Without expert parallelism TP × DP must divide a routed expert's width (vLLM's FusedMoE divides it by the
    flattened tp_size)."""
    width, n = moe.expert_width(model), layout.expert_slices
    if width % n:
        ok = [d for d in range(1, 65) if width % d == 0]
        whole = ", or enable_expert_parallel: true" if model.num_experts % n == 0 else ""
        raise ConfigError(f"without enable_expert_parallel each routed expert is sliced over tensor_parallel_size "
                          f"{layout.tensor_parallel_size} × data_parallel_size {layout.data_parallel_size} = {n} "
                          f"devices, which does not divide the experts' width {width} of {model.name}; allowed: TP × "
                          f"DP among {', '.join(map(str, ok))}{whole}", "parallel.data_parallel_size")


def does_not_fit_a_rank(model: ModelSpec, layout: ExpertLayout, weight_bytes: float, usable: float) -> ConfigError:
    """The error of a data-parallel replica whose every rank cannot hold what each rank holds whole: the attention
    and dense layers (a mixture of experts' routed experts are spread over all the replica's devices)."""
    tp, dp = layout.tensor_parallel_size, layout.data_parallel_size
    held = f"{model.name}'s attention and dense layers (experts over all {tp * dp})" if model.num_experts \
        else f"all of {model.name}"
    return ConfigError(f"each of the {dp} data-parallel ranks holds {held} on its {tp} device(s): "
                       f"{weight_bytes / 2**30:.1f} GiB of weights a device, {usable / 2**30:.1f} GiB usable; allowed: "
                       "a larger tensor_parallel_size, quantized weights or a bigger device",
                       "parallel.data_parallel_size")

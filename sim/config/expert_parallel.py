"""A replica's data- and expert-parallel layout (vLLM's `--data-parallel-size`, `--enable-expert-parallel`): what
one device holds and how a replica of data-parallel ranks is simulated.

- Weights on one device. Attention, the dense layers' MLPs and the shared experts are sharded over the tensor
  parallel ranks (Megatron); the router, the norms and MLA's down-projections (q_a, kv_a: ReplicatedLinear in vLLM)
  are whole on every rank; the embedding and LM head are vocabulary-parallel. Routed experts: without expert
  parallelism every expert is sliced over the tensor-parallel ranks like a dense MLP; with it, whole experts are
  spread over the replica's tensor × data parallel devices (EP size = TP × DP), E / EP on each.
- Data parallelism. Each of the replica's DP ranks (TP devices each) holds its own sequences and KV cache and runs
  attention on them; with expert parallelism their tokens meet in the MoE layers, without it each rank holds the
  whole model and runs alone. The simulator runs a replica's DP ranks as one engine over DP times a rank's batch
  (DP × max_num_seqs, DP × max_num_batched_tokens, DP × a rank's KV blocks) whose steps the cost model prices with
  every rank's share of the batch (1 / DP of its tokens, sequences and context) running in parallel: the ranks are
  taken as balanced, which vLLM's DP load balancer aims for, and a sequence never needs more than one rank's KV.
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


@dataclass(frozen=True)
class ExpertLayout:
    """How a replica's devices split a model: TP ranks within a DP rank, DP ranks, experts whole over EP ranks."""

    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool

    @property
    def ep_size(self) -> int:
        """Devices the routed experts are spread over whole (1: each expert sliced over TP instead)."""
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def expert_slices(self) -> int:
        """Devices each routed expert is sliced over: the tensor-parallel ranks, or none with expert parallelism."""
        return 1 if self.enable_expert_parallel else self.tensor_parallel_size

    def weight_bytes(self, model: ModelSpec, sparse_kernels: bool) -> float:
        """Weight bytes on one device (2:4 weights compressed only where `sparse_kernels` run them)."""
        tp = self.tensor_parallel_size
        if not (moe.has_experts(model) or moe.uses_mla(model)):
            return model.weight_bytes_on(sparse_kernels) / tp
        p = moe.decoder_params(model)
        latent = model.num_layers * moe.replicated_attention_params(model)
        replicated, sharded = p.router + p.norms + latent, p.attention - latent + p.dense_mlp + p.shared
        experts = p.routed / self.ep_size if self.enable_expert_parallel else p.routed / tp
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


def expert_layout(model: ModelSpec, parallel: ParallelConfig) -> ExpertLayout:
    """The layout a scenario's parallel section asks for, checked against the model: one line naming the key."""
    layout = ExpertLayout(parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel)
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
    return layout


def does_not_fit_a_rank(model: ModelSpec, layout: ExpertLayout, weight_bytes: float, usable: float) -> ConfigError:
    """The error of a data-parallel replica without expert parallelism whose every rank would hold the whole model."""
    return ConfigError(f"without enable_expert_parallel each of the {layout.data_parallel_size} data-parallel ranks "
                       f"holds all of {model.name} over its {layout.tensor_parallel_size} device(s): "
                       f"{weight_bytes / 2**30:.1f} GiB of weights a device, {usable / 2**30:.1f} GiB usable; allowed: "
                       "enable_expert_parallel: true (experts spread over TP × DP devices), a larger "
                       "tensor_parallel_size, or data_parallel_size 1", "parallel.data_parallel_size")

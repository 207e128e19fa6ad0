"""The memory budget of one device of a replica: its weights, the peak activations of a step, and the KV cache the
rest holds, as blocks (and the host blocks swap preemption may use)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.config.errors import ConfigError
from sim.config.expert_parallel import ExpertLayout, does_not_fit_a_rank
from sim.config.hardware import HardwareSpec
from sim.config.limits import MAX_TOTAL_BLOCKS
from sim.config.models import ModelSpec
from sim.config.moe import kv_bytes_per_device_token
from sim.config.scenario import KVCacheConfig
from sim.config.sharding import Sharding

if TYPE_CHECKING:
    from sim.config.kv_groups import KVGroups


@dataclass(eq=False, repr=False)
class MemoryBudget:
    """Bytes on one device of a replica, and the KV blocks they leave."""

    weight_bytes: float
    activation_bytes: float
    kv_cache_bytes: float
    kv_bytes_per_token: float  # the device's share of the KV heads, over its stage's layers
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    kv_groups: KVGroups | None = None  # a hybrid model's block groups (None: one group of every layer)


@dataclass(eq=False, repr=False)
class Layout:
    """What a replica is split into: its tensor-parallel sharding, pipeline stages, batches in flight, and how many
    replicas there are."""

    sharding: Sharding
    sequence_parallel: bool
    pipeline_parallel_size: int
    virtual_engines: int
    stage_layers: int  # the largest stage's share of the layers, which sizes every device
    replicas: int
    expert: ExpertLayout  # data-parallel ranks, and experts whole over TP x DP devices or sliced over TP


def activation_bytes(model: ModelSpec, step_tokens: int, max_num_seqs: int, tp: int, sp: bool) -> float:
    """Peak activations of one forward over the step budget on one device (the MLP's columns, and with sequence
    parallelism the hidden-sized regions, split by TP), plus fp32 logits for every sequence (vocab-parallel)."""
    return step_tokens * (4 * model.hidden_size / (tp if sp else 1) + 2 * model.intermediate_size / tp) \
        * model.act_bytes + max_num_seqs * model.vocab_size * 4 / tp


def memory_budget(model: ModelSpec, hw: HardwareSpec, kv: KVCacheConfig, layout: Layout, step_tokens: int,
                  max_num_seqs: int, max_model_len: int, of_free: bool = False) -> MemoryBudget:
    """The budget of one device, or a ConfigError saying what does not fit and what would. `of_free`: the KV cache
    takes gpu_memory_utilization of what weights and activations leave (TensorRT-LLM's free_gpu_memory_fraction),
    not of the whole device (vLLM's)."""
    tp, pp = layout.sharding.tp, layout.pipeline_parallel_size
    activation = activation_bytes(model, step_tokens, max_num_seqs, tp, layout.sequence_parallel)
    usable = hw.memory_bytes * (1.0 if of_free else kv.gpu_memory_utilization)
    model_bytes = model.weight_bytes_on(hw.sparse_tensor_cores)  # 2:4 weights compressed only where kernels run them
    weight_bytes = layout.expert.weight_bytes(model, hw.sparse_tensor_cores)
    if pp > 1:
        weight_bytes = weight_bytes * layout.stage_layers / model.num_layers
    kv_bytes = usable - weight_bytes - activation
    if of_free:
        kv_bytes *= kv.gpu_memory_utilization
    if kv_bytes <= 0:
        if layout.expert.data_parallel_size > 1:
            raise does_not_fit_a_rank(model, layout.expert, weight_bytes, usable)
        need = -(-model_bytes // max(usable - activation, 1.0))
        more = f"a tensor_parallel_size of {int(need)} or more, " if need <= 64 else ""
        raise ConfigError(f"model {model.name} ({weight_bytes / 2**30:.1f} GiB of weights + "
                          f"{activation / 2**30:.1f} GiB activations per device at tensor_parallel_size {tp}) does not "
                          f"fit in {hw.name} ({usable / 2**30:.1f} GiB usable at gpu_memory_utilization "
                          f"{kv.gpu_memory_utilization}); allowed: {more}a bigger device, quantized weights "
                          "(weight_dtype int8/int4), or a higher gpu_memory_utilization", "hardware")
    block_size = max_model_len if kv.allocator == "contiguous" else kv.block_size
    per_device = kv_bytes_per_device_token(model, layout.sharding)
    kv_bytes_per_token = per_device * layout.stage_layers / model.num_layers
    groups = hybrid_groups(model, kv, layout, max_model_len)
    if groups is not None:
        num_blocks, swap_blocks = kv_blocks(kv, layout, kv_bytes, groups.block_bytes, groups.block_size,
                                            max_model_len, groups.peak_blocks(max_model_len, step_tokens))
        return MemoryBudget(weight_bytes, activation, kv_bytes, kv_bytes_per_token, groups.block_size, num_blocks,
                            swap_blocks, groups)
    num_blocks, swap_blocks = kv_blocks(kv, layout, kv_bytes, block_size * kv_bytes_per_token, block_size,
                                        max_model_len)
    return MemoryBudget(weight_bytes, activation, kv_bytes, kv_bytes_per_token, block_size, num_blocks, swap_blocks)


def hybrid_groups(model: ModelSpec, kv: KVCacheConfig, layout: Layout, max_model_len: int) -> KVGroups | None:
    """A hybrid model's KV cache groups on one device (None for a model of full attention), or the ConfigError of
    what vLLM's hybrid KV cache manager does not serve."""
    if not model.hybrid:
        return None
    if kv.allocator == "contiguous":
        raise ConfigError(f"{model.name}'s sliding-window, chunked or linear-attention layers need paged blocks in "
                          "groups by kind (vLLM's hybrid KV cache manager); allowed: paged", "kv_cache.allocator")
    from sim.config.kv_groups import kv_groups  # hybrid models alone: most runs never load it

    try:
        return kv_groups(model, layout.sharding, kv.block_size, max_model_len, kv.enable_prefix_caching,
                         layout.stage_layers)
    except ValueError as e:
        raise ConfigError(str(e), "parallel.tensor_parallel_size" if "tensor_parallel_size" in str(e) else "model") \
            from None


def kv_blocks(kv: KVCacheConfig, layout: Layout, kv_bytes: float, block_bytes: float, block_size: int,
              max_model_len: int, seq_blocks: int | None = None) -> tuple[int, int]:
    """(device blocks, host swap blocks) per batch in flight that `kv_bytes` hold, checked against the scenario's
    num_blocks, one sequence of max_model_len (`seq_blocks` of them; default its tokens in blocks), and the
    simulator's bound on blocks in all."""
    engines = layout.virtual_engines
    num_blocks = kv.num_blocks or int(kv_bytes // block_bytes) // engines
    if num_blocks * engines * block_bytes > kv_bytes:
        raise ConfigError(f"{num_blocks} blocks need {num_blocks * block_bytes / 2**30:.2f} GiB; only "
                          f"{kv_bytes / 2**30:.2f} GiB are left after weights and activations; allowed: at most "
                          f"{int(kv_bytes // block_bytes) // engines}", "kv_cache.num_blocks")
    short = num_blocks * block_size < max_model_len if seq_blocks is None else num_blocks < seq_blocks
    if num_blocks == 0 or (kv.num_blocks is None and short):
        raise ConfigError(f"the KV cache ({kv_bytes / 2**30:.2f} GiB) cannot hold one sequence of max_model_len "
                          f"{max_model_len} tokens; allowed: a smaller max_model_len, a bigger device or "
                          "quantized weights", "serving.max_model_len")
    swap_blocks = int(kv.swap_space_gib * 2**30 // block_bytes) // engines if kv.preemption == "swap" else 0
    if (num_blocks + swap_blocks) * layout.replicas * engines * layout.expert.data_parallel_size > MAX_TOTAL_BLOCKS:
        raise ConfigError(f"{num_blocks:,} KV blocks and {swap_blocks:,} swap blocks per replica x {layout.replicas} "
                          f"replicas; allowed: at most {MAX_TOTAL_BLOCKS:,} blocks in all (set kv_cache.num_blocks, a "
                          "bigger block_size or a smaller swap_space_gib)",
                          "kv_cache.num_blocks" if kv.num_blocks else
                          "kv_cache.swap_space_gib" if swap_blocks > num_blocks else "hardware")
    return num_blocks, swap_blocks

"""One `build` for the seam: the policy objects a resolved plan runs, on either clock."""
from __future__ import annotations

from sim.config.plan import Plan
from sim.config.sharding import shard
from sim.policy.block_manager import BlockAllocator, PrefixCachingAllocator
from sim.policy.router import make_router
from sim.policy.scheduler import Scheduler, make_scheduler

__all__ = ["make_allocator", "make_policy", "make_router", "model_allocator"]


def make_allocator(plan: Plan) -> BlockAllocator:
    """The plan's KV block allocator (paged, with or without prefix caching, or one max-length block per
    sequence; a hybrid model's groups by attention kind)."""
    if plan.kv_groups is not None:
        from sim.policy.hybrid_allocator import HybridBlockAllocator  # hybrid models alone: most runs never load it

        return HybridBlockAllocator(plan.kv_groups, plan.num_blocks, plan.kv_watermark, plan.num_swap_blocks,
                                    plan.scheduler.prefill_chunk_size, plan.enable_prefix_caching)
    if plan.enable_prefix_caching:
        return PrefixCachingAllocator(plan.num_blocks, plan.block_size, watermark=plan.kv_watermark,
                                      num_swap_blocks=plan.num_swap_blocks)
    return BlockAllocator(plan.num_blocks, plan.block_size, watermark=plan.kv_watermark,
                          num_swap_blocks=plan.num_swap_blocks, contiguous=plan.kv_allocator == "contiguous")


def model_allocator(model, num_blocks: int, block_size: int, max_model_len: int, step_tokens: int,
                    prefix_caching: bool = False, num_swap_blocks: int = 0) -> BlockAllocator:
    """The allocator a plan would make for `model` (a ModelSpec) on one device without a scenario (the profile
    sweep's engines, tests): a hybrid model's groups by attention kind (`step_tokens`: the most tokens of a sequence
    one step computes), else paged blocks, with or without prefix caching."""
    if model.hybrid:
        from sim.config.kv_groups import kv_groups
        from sim.policy.hybrid_allocator import HybridBlockAllocator

        groups = kv_groups(model, shard(model, 1), block_size, max_model_len, prefix_caching, model.num_layers)
        return HybridBlockAllocator(groups, num_blocks, 0.0, num_swap_blocks, step_tokens, prefix_caching)
    if prefix_caching:
        return PrefixCachingAllocator(num_blocks, block_size, num_swap_blocks=num_swap_blocks)
    return BlockAllocator(num_blocks, block_size, num_swap_blocks=num_swap_blocks)


def make_policy(plan: Plan, eager: bool = True, hand_off: Plan | None = None) -> Scheduler:
    """The scheduler + KV allocator pair one replica runs (the simulator's replica and the executor's engine);
    `hand_off`: the decode pool of a disaggregated prefill instance, which hands requests on to it after their prompt
    and turns away on arrival what it could never hold."""
    decode_pool = make_policy(hand_off) if hand_off is not None else None
    return make_scheduler(plan.scheduler, make_allocator(plan), eager=eager, decode_pool=decode_pool)

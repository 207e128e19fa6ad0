"""One `build` for the seam: the policy objects a resolved plan runs, on either clock."""
from __future__ import annotations

from sim.config.plan import Plan
from sim.policy.block_manager import BlockAllocator, PrefixCachingAllocator
from sim.policy.hybrid_allocator import HybridBlockAllocator
from sim.policy.router import make_router
from sim.policy.scheduler import Scheduler, make_scheduler

__all__ = ["make_allocator", "make_policy", "make_router"]


def make_allocator(plan: Plan) -> BlockAllocator:
    """The plan's KV block allocator (paged, with or without prefix caching, or one max-length block per
    sequence; a hybrid model's groups by attention kind)."""
    if plan.kv_groups is not None:
        return HybridBlockAllocator(plan.kv_groups, plan.num_blocks, plan.kv_watermark, plan.num_swap_blocks,
                                    plan.scheduler.prefill_chunk_size, plan.enable_prefix_caching)
    if plan.enable_prefix_caching:
        return PrefixCachingAllocator(plan.num_blocks, plan.block_size, watermark=plan.kv_watermark,
                                      num_swap_blocks=plan.num_swap_blocks)
    return BlockAllocator(plan.num_blocks, plan.block_size, watermark=plan.kv_watermark,
                          num_swap_blocks=plan.num_swap_blocks, contiguous=plan.kv_allocator == "contiguous")


def make_policy(plan: Plan, eager: bool = True, hand_off: Plan | None = None) -> Scheduler:
    """The scheduler + KV allocator pair one replica runs (the simulator's replica and the executor's engine);
    `hand_off`: the decode pool of a disaggregated prefill instance, which hands requests on to it after their prompt
    and turns away on arrival what it could never hold."""
    decode_pool = make_policy(hand_off) if hand_off is not None else None
    return make_scheduler(plan.scheduler, make_allocator(plan), eager=eager, decode_pool=decode_pool)

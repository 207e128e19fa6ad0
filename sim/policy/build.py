"""One `build` for the seam: the policy objects a resolved plan runs, on either clock."""
from __future__ import annotations

from sim.config.plan import Plan
from sim.policy.block_manager import BlockAllocator
from sim.policy.router import make_router
from sim.policy.scheduler import Scheduler, make_scheduler

__all__ = ["make_allocator", "make_policy", "make_router"]


def make_allocator(plan: Plan) -> BlockAllocator:
    """The plan's KV block allocator (paged, or one max-length block per sequence)."""
    return BlockAllocator(plan.num_blocks, plan.block_size, watermark=plan.kv_watermark,
                          num_swap_blocks=plan.num_swap_blocks, contiguous=plan.kv_allocator == "contiguous")


def make_policy(plan: Plan, eager: bool = True, hand_off: bool = False) -> Scheduler:
    """The scheduler + KV allocator pair one replica runs (the simulator's replica and the executor's engine);
    `hand_off`: a disaggregated prefill instance's, which hands requests on after their prompt."""
    return make_scheduler(plan.scheduler, make_allocator(plan), eager=eager, hand_off=hand_off)

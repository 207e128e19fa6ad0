"""Data-parallel ranks of a mixture-of-experts model (vLLM's `--data-parallel-size n`), over the ranks of a process
group (launch.py: gloo on the CPU), with or without expert parallelism, on the all2all backend asked for.

Each rank is a whole engine — its own scheduler, requests, KV cache and attention, dense layers, routers and shared
experts (replicated) — and the ranks meet in the MoE layers, which hold the routed experts spread over them in one of
three forms (a layout as the simulator's: sim/config/expert_parallel.py ExpertLayout, TP 1 a rank):

- without expert parallelism, 1/n of every expert's width on each rank, every rank's tokens gathered (hidden states
  and router logits) before the experts and the partial outputs reduce-scattered after (gathered_moe.py:
  `GatheredMoe` over expert_shares.py's `sliced_experts`);
- with expert parallelism (`--enable-expert-parallel`) on vLLM's default backend, `allgather_reducescatter`: 1/n of
  the experts whole on each rank (rank r: experts r·E/n … (r+1)·E/n − 1), the tokens gathered and the outputs
  reduce-scattered as above, each rank running only the (token, choice) pairs routed to its own experts
  (`GatheredMoe` over `OwnedExperts`);
- with expert parallelism on the `all_to_all` backend: the same experts, a rank's own tokens' rows sent to their
  experts' owners and back by all-to-all (dispatched_moe.py: `DispatchedExperts`).

The ranks step in lockstep: each step they agree whether any has work (an all-reduce), and a rank with nothing to
run takes part in every MoE layer's exchanges with no rows (vLLM's dummy batch), so the collectives always pair up.

`data_parallel_run` serves prompts offline over such a group (request i on rank i mod n, rank 0 being this process)
and returns their greedy tokens — the same as one process running every expert whole (tests/test_data_parallel.py)
— and the bytes each rank's MoE layers moved. Nothing builds these ranks from a scenario's plan yet (`infersim serve`
refuses data_parallel_size > 1); such a caller would pass its plan's enable_expert_parallel and all2all_backend.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from executor.core.build import make_engine
from executor.core.malloc_tuning import keep_freed_memory
from executor.distributed.dispatched_moe import dispatch_experts
from executor.distributed.expert_shares import check_owned, check_sliced
from executor.distributed.gathered_moe import GatheredMoe, Traffic, gather_experts, traffic_of
from executor.distributed.launch import collective, launch
from executor.model.moe import moe_blocks
from sim.config.engines import release
from sim.config.expert_parallel import ExpertLayout

# the all2all backends (sim/config/engines.py's names) whose exchange the executor runs
BACKENDS = ("allgather_reducescatter", "all_to_all")


def data_parallel_layout(world: int, expert_parallel: bool, all2all_backend: str) -> ExpertLayout:
    """The layout of `world` data-parallel ranks of one device each; ValueError (one line) for a backend the
    executor does not run, or one that needs expert parallelism without it."""
    if all2all_backend not in BACKENDS:
        raise ValueError(f"all2all_backend {all2all_backend!r} is not run by the executor's data-parallel ranks; "
                         "allowed: allgather_reducescatter (vLLM's default), all_to_all")
    if all2all_backend != "allgather_reducescatter" and not expert_parallel:
        raise ValueError(f"all2all_backend {all2all_backend} sends routed rows to experts held whole; allowed: with "
                         "expert_parallel, or allgather_reducescatter")
    return ExpertLayout(1, world, expert_parallel, all2all_backend)


def check_data_parallel(model: nn.Module, layout: ExpertLayout) -> None:
    """ValueError (one line) unless the layout's ranks split every MoE block: its experts (expert parallelism) or
    each expert's columns."""
    world = layout.data_parallel_size
    for block in moe_blocks(model):
        if layout.enable_expert_parallel:
            check_owned(block.experts.num_experts, world)
        else:
            check_sliced(block.experts.weights([0])[1].shape[2], world)  # expert 0's: MXFP4 dequantizes it alone


def shard(model: nn.Module, rank: int, layout: ExpertLayout) -> nn.Module:
    """This rank's model (in place): its share of the experts, exchanging tokens by the layout's backend."""
    world = layout.data_parallel_size
    if layout.gathers:
        return gather_experts(model, rank, world, whole=layout.enable_expert_parallel)
    return dispatch_experts(model, rank, world)


def idle_step(model: nn.Module) -> None:
    """A rank with nothing to run this step: every MoE layer's exchanges, in order, with no rows of its own."""
    for block in moe_blocks(model):
        if isinstance(block, GatheredMoe):
            block.idle()
        else:
            block.experts.idle(block.top_k)


def lockstep(engine, model: nn.Module) -> None:
    """Run this rank's engine to completion beside the others: a step each while any rank has work."""
    while True:
        busy = torch.tensor([int(engine.has_work())])
        dist.all_reduce(busy)
        if not busy.item():
            return
        if not engine.has_work() or engine.step() is None:
            idle_step(model)


def _serve_share(model, policy, sampling, eos, prompts: list[list[int]],
                 max_tokens: list[int]) -> tuple[list[list[int]], Traffic]:
    """This rank's requests through its engine in lockstep with the group; their tokens, and the bytes its MoE
    layers' exchanges moved."""
    from sim.policy.request import Request

    engine = make_engine(model, policy, sampling, eos)
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r, p in zip(reqs, prompts):
        engine.add(r, p)
    lockstep(engine, model)
    return [engine.output_ids(r) for r in reqs], traffic_of(model)


def dp_worker(rank: int, model, layout: ExpertLayout, make_policy, sampling, eos, prompts, max_tokens) -> None:
    """A child rank: its share of the experts, its requests, then its outputs and traffic to rank 0."""
    keep_freed_memory()
    shard(model, rank, layout)
    out = _serve_share(model, make_policy(), sampling, eos, prompts, max_tokens)
    dist.gather_object(out, None, dst=0)


class _Handle:  # what launch.collective needs: the group, and whether it broke
    def __init__(self, group):
        self.group, self.broken = group, False


@dataclass(eq=False, repr=False)
class DataParallelRun:
    """What a data-parallel group served: each request's greedy tokens, in request order, and per rank the bytes
    its MoE layers' exchanges moved."""

    outputs: list[list[int]]
    traffic: list[Traffic]


def data_parallel_run(model: nn.Module, world: int, make_policy, prompts: list[list[int]], max_tokens: list[int],
                      sampling=None, eos_token_id: int | None = None, threads: int = 1, timeout_s: float = 120.0,
                      expert_parallel: bool = True, all2all_backend: str | None = None) -> DataParallelRun:
    """The prompts served offline by `world` data-parallel ranks (request i on rank i mod world; `make_policy()`
    makes each rank's scheduler and allocator, a picklable callable), the experts whole over the ranks
    (`expert_parallel`, exchanging tokens by `all2all_backend`: allgather_reducescatter, vLLM's default, or
    all_to_all, the simulator's `infersim` engine's and so the default here) or each sliced over them. ValueError
    (one line) for another backend, or where the ranks cannot split the experts."""
    if all2all_backend is None:  # the simulator's `infersim` engine's for EP (sim/config/engines.py); else one form
        all2all_backend = release("infersim", None).all2all_backend if expert_parallel else "allgather_reducescatter"
    layout = data_parallel_layout(world, expert_parallel, all2all_backend)
    check_data_parallel(model, layout)
    shares = [list(range(r, len(prompts), world)) for r in range(world)]

    def share(r):
        return [prompts[i] for i in shares[r]], [max_tokens[i] for i in shares[r]]

    args = [(model, layout, make_policy, sampling, eos_token_id, *share(r)) for r in range(1, world)]
    with launch(dp_worker, args, threads, timeout_s) as group, collective(_Handle(group)):
        rank0 = shard(copy.deepcopy(model), 0, layout)  # the caller's model keeps every expert
        mine = _serve_share(rank0, make_policy(), sampling, eos_token_id, *share(0))
        gathered: list = [None] * world
        dist.gather_object(mine, gathered, dst=0)
    out: list[list[int]] = [[] for _ in prompts]
    for r, (outs, _) in enumerate(gathered):
        for i, tokens in zip(shares[r], outs):
            out[i] = tokens
    return DataParallelRun(out, [traffic for _, traffic in gathered])


def data_parallel_outputs(model: nn.Module, world: int, make_policy, prompts: list[list[int]], max_tokens: list[int],
                          sampling=None, **options) -> list[list[int]]:
    """Greedy outputs of the prompts served offline by `world` data-parallel ranks, in request order
    (data_parallel_run's, with its keyword `options`)."""
    return data_parallel_run(model, world, make_policy, prompts, max_tokens, sampling, **options).outputs

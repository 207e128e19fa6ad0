"""Data-parallel ranks of a mixture-of-experts model (vLLM's `--data-parallel-size n`), over the ranks of a process
group (launch.py: gloo on the CPU), with or without expert parallelism.

Each rank is a whole engine — its own scheduler, requests, KV cache and attention, dense layers, routers and shared
experts (replicated) — and the ranks meet in the MoE layers, which hold the routed experts spread over them:

- with expert parallelism (`--enable-expert-parallel`), 1/n of the experts whole on each rank (rank r: experts
  r·E/n … (r+1)·E/n − 1), a rank's own tokens dispatched to their experts' owners: each rank routes its tokens, tells
  every expert's owner how many rows it sends for each of its experts (an all-to-all of counts), sends the rows (an
  all-to-all of rows), runs the rows it received through its experts as grouped matmuls, and sends the results back
  (a third all-to-all); it adds each pair's output, scaled by its routing weight, to its own tokens
  (`DispatchedExperts`). vLLM's default all2all backend exchanges EP's tokens as the form below does; these
  all-to-alls are DeepEP's low-latency form (a row per chosen expert).
- without it, 1/n of every expert's width on each rank, every rank's tokens gathered (hidden states and router
  logits) before the experts and the partial outputs reduce-scattered after (gathered_moe.py: `GatheredMoe`).

The ranks step in lockstep: each step they agree whether any has work (an all-reduce), and a rank with nothing to
run takes part in every MoE layer's exchanges with no rows (vLLM's dummy batch), so the collectives always pair up.

`data_parallel_run` serves prompts offline over such a group (request i on rank i mod n, rank 0 being this process)
and returns their greedy tokens — the same as one process running every expert whole (tests/test_data_parallel.py)
— and, without expert parallelism, the bytes each rank's MoE layers moved.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from executor.core.build import make_engine
from executor.core.malloc_tuning import keep_freed_memory
from executor.distributed.gathered_moe import GatheredMoe, Traffic, check_sliced, gather_experts, traffic_of
from executor.distributed.launch import collective, launch
from executor.model.moe import Experts, SparseMoeBlock, sort_by_expert


class DispatchedExperts(nn.Module):
    """A rank's share of a MoE layer's experts (`local`: experts `first` … first + L − 1 of `num_experts`), called as
    Experts is — (x, routing weights, expert ids) of this rank's tokens — and exchanging rows with the other ranks."""

    def __init__(self, local: Experts, num_experts: int, rank: int, world: int):
        super().__init__()
        self.local, self.num_experts, self.rank, self.world = local, num_experts, rank, world
        self.per_rank = num_experts // world

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's choices of weight · expert(x), the experts wherever they live."""
        k, n = experts.shape[1], self.world
        order, counts = sort_by_expert(experts, self.num_experts)
        mine = torch.tensor(counts, dtype=torch.int64).view(n, self.per_rank)
        theirs = torch.empty_like(mine)  # [source rank, my expert]: rows each rank sends for each of my experts
        dist.all_to_all_single(theirs, mine)
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
        received = _exchange(x[order // k], send, recv)
        y = torch.empty_like(received)
        if received.shape[0]:  # rows arrive by source rank, each source's by expert: regrouped for one grouped call
            expert_of = torch.repeat_interleave(torch.arange(self.per_rank).repeat(n), theirs.flatten())
            by_expert = torch.argsort(expert_of, stable=True)
            y[by_expert] = self.local.grouped(received[by_expert], theirs.sum(0).tolist())
        back = _exchange(y, recv, send)
        return torch.zeros_like(x).index_add_(0, order // k, back * weights.flatten()[order, None])


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """all_to_all_single of `rows`: send[r] of them (consecutive) to rank r, recv[r] from rank r; the rows received."""
    out = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), recv, send)
    return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def check_data_parallel(model: nn.Module, world: int, expert_parallel: bool) -> None:
    """ValueError (one line) unless `world` ranks split every MoE block: its experts (expert parallelism) or each
    expert's columns."""
    for block in moe_blocks(model):
        if expert_parallel and block.experts.num_experts % world:
            raise ValueError(f"data_parallel_size {world} does not divide the {block.experts.num_experts} experts; "
                             f"allowed: a data_parallel_size dividing {block.experts.num_experts}")
        if not expert_parallel:
            check_sliced(block.experts.weights([0])[1].shape[2], world)  # expert 0's: MXFP4 dequantizes it alone


def shard_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """The model with each MoE block's experts cut to this rank's share, dispatched across the ranks (in place)."""
    check_data_parallel(model, world, True)
    for block in moe_blocks(model):
        full = block.experts
        per, first = full.num_experts // world, rank * (full.num_experts // world)
        local = Experts(per, full.down_proj.shape[1], full.down_proj.shape[2], full.gate_up_proj_bias is not None,
                        full.act)
        with torch.no_grad():
            for name, p in local.named_parameters():
                p.copy_(getattr(full, name)[first:first + per])
        block.experts = DispatchedExperts(local, full.num_experts, rank, world)
    return model


def shard(model: nn.Module, rank: int, world: int, expert_parallel: bool) -> nn.Module:
    """This rank's model (in place): experts whole and dispatched, or every expert's slice with the tokens gathered."""
    return shard_experts(model, rank, world) if expert_parallel else gather_experts(model, rank, world)


def idle_step(model: nn.Module) -> None:
    """A rank with nothing to run this step: every MoE layer's exchanges, in order, with no rows of its own."""
    for block in moe_blocks(model):
        if isinstance(block, GatheredMoe):
            block.idle()
            continue
        hidden = block.experts.local.down_proj.shape[1]
        block.experts(torch.empty(0, hidden), torch.empty(0, block.top_k), torch.empty(0, block.top_k, dtype=torch.long))


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
    layers' gathers and reduce-scatters moved."""
    from sim.policy.request import Request

    engine = make_engine(model, policy, sampling, eos)
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r, p in zip(reqs, prompts):
        engine.add(r, p)
    lockstep(engine, model)
    return [engine.output_ids(r) for r in reqs], traffic_of(model)


def dp_worker(rank: int, model, world: int, expert_parallel: bool, make_policy, sampling, eos, prompts,
              max_tokens) -> None:
    """A child rank: its share of the experts, its requests, then its outputs and traffic to rank 0."""
    keep_freed_memory()
    shard(model, rank, world, expert_parallel)
    out = _serve_share(model, make_policy(), sampling, eos, prompts, max_tokens)
    dist.gather_object(out, None, dst=0)


class _Handle:  # what launch.collective needs: the group, and whether it broke
    def __init__(self, group):
        self.group, self.broken = group, False


@dataclass(eq=False, repr=False)
class DataParallelRun:
    """What a data-parallel group served: each request's greedy tokens, in request order, and per rank the bytes
    its MoE layers' gathers and reduce-scatters moved (all zero with expert parallelism)."""

    outputs: list[list[int]]
    traffic: list[Traffic]


def data_parallel_run(model: nn.Module, world: int, make_policy, prompts: list[list[int]], max_tokens: list[int],
                      sampling=None, eos_token_id: int | None = None, threads: int = 1, timeout_s: float = 120.0,
                      expert_parallel: bool = True) -> DataParallelRun:
    """The prompts served offline by `world` data-parallel ranks (request i on rank i mod world; `make_policy()`
    makes each rank's scheduler and allocator, a picklable callable), the experts whole over the ranks
    (`expert_parallel`) or each sliced over them. ValueError (one line) where the ranks cannot split the experts."""
    check_data_parallel(model, world, expert_parallel)
    shares = [list(range(r, len(prompts), world)) for r in range(world)]

    def share(r):
        return [prompts[i] for i in shares[r]], [max_tokens[i] for i in shares[r]]

    args = [(model, world, expert_parallel, make_policy, sampling, eos_token_id, *share(r)) for r in range(1, world)]
    with launch(dp_worker, args, threads, timeout_s) as group, collective(_Handle(group)):
        rank0 = shard(copy.deepcopy(model), 0, world, expert_parallel)  # the caller's model keeps every expert
        mine = _serve_share(rank0, make_policy(), sampling, eos_token_id, *share(0))
        gathered: list = [None] * world
        dist.gather_object(mine, gathered, dst=0)
    out: list[list[int]] = [[] for _ in prompts]
    for r, (outs, _) in enumerate(gathered):
        for i, tokens in zip(shares[r], outs):
            out[i] = tokens
    return DataParallelRun(out, [traffic for _, traffic in gathered])


def data_parallel_outputs(model: nn.Module, world: int, make_policy, prompts: list[list[int]], max_tokens: list[int],
                          sampling=None, eos_token_id: int | None = None, threads: int = 1, timeout_s: float = 120.0,
                          expert_parallel: bool = True) -> list[list[int]]:
    """Greedy outputs of the prompts served offline by `world` data-parallel ranks (data_parallel_run's), in request
    order."""
    return data_parallel_run(model, world, make_policy, prompts, max_tokens, sampling, eos_token_id, threads,
                             timeout_s, expert_parallel).outputs

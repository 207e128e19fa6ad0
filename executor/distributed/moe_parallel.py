"""Mixture-of-experts blocks over the ranks of a tensor-parallel group (tensor_parallel.py), vLLM's two layouts.

Tensor-parallel MoE (`config.expert_parallel` off): every rank holds each routed expert's 1/tp slice of the
intermediate columns (gate·up column-parallel, down row-parallel), like the dense MLP, and the router replicated;
the block's partial output is summed by one all-reduce.

Expert parallelism (`config.expert_parallel`, vLLM's enable_expert_parallel; EP size = TP here, the executor runs
no attention data parallelism): rank r holds experts r·E/n .. (r+1)·E/n - 1 whole. The residual stream is the same
on every rank, so each rank dispatches only its share of the tokens (an even split of the rows): it sorts its (token,
choice) pairs by expert, sends each owner its rows with `all_to_all_single` (after one for the counts), runs the
rows it received through its experts as grouped matmuls, and sends the results back the same way; it then adds each
pair's output, scaled by its routing weight, to its own tokens. The block's output, a rank's own tokens' rows and
zeros elsewhere, is summed over the ranks by the same one all-reduce, which so both combines the shares and
replicates the result. A shared expert is sliced over the ranks as in tensor-parallel MoE and joins the same sum.
Every rank runs the router on every token (a [T, H] × [H, E] product), so its expert counts are the step's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from executor.model import LlamaConfig, moe_block
from executor.moe import SparseMoeBlock, grouped_swiglu, sort_by_expert


def check_moe_parallel(config: LlamaConfig, tp: int) -> None:
    """ValueError (one line) unless `tp` ranks split the MoE blocks: the experts evenly (expert parallelism) or each
    expert's columns (tensor parallelism); the shared expert's columns in both."""
    c = config
    if c.expert_parallel and c.num_experts % tp:
        raise ValueError(f"expert parallelism over {tp} ranks does not divide the {c.num_experts} experts; allowed: "
                         f"a tensor_parallel_size dividing {c.num_experts}")
    width = c.moe_intermediate_size or c.intermediate_size
    if not c.expert_parallel and width % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide an expert's {width} columns; allowed: one that "
                         "does, or enable_expert_parallel")
    if c.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the shared expert's "
                         f"{c.shared_expert_intermediate_size} columns")


def moe_shard_fields(config: LlamaConfig, tp: int) -> dict:
    """The MoE fields of one rank's config (its experts or its experts' columns, its shared expert's columns); {}
    for a dense model."""
    c = config
    if not c.num_experts:
        return {}
    width = c.moe_intermediate_size or c.intermediate_size
    return {"moe_intermediate_size": width if c.expert_parallel else width // tp,
            "local_experts": c.num_experts // tp if c.expert_parallel else None,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size // tp}


def swiglu_columns(gate_up: torch.Tensor, down: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's slice of SwiGLU weights, [..., 2I, H] (gate rows, then up) and [..., H, I]: its I/tp columns."""
    width = down.shape[-1]
    i, i0 = width // tp, rank * (width // tp)
    return (torch.cat([gate_up[..., i0:i0 + i, :], gate_up[..., width + i0:width + i0 + i, :]], dim=-2),
            down[..., i0:i0 + i])


def moe_shard_state(block: SparseMoeBlock, expert_parallel: bool, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights of a MoE block, named below the block ("gate.weight", ...)."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    if expert_parallel:
        n = block.num_experts // tp
        gate_up, down = gate_up[rank * n:(rank + 1) * n], down[rank * n:(rank + 1) * n]
    else:
        gate_up, down = swiglu_columns(gate_up, down, tp, rank)
    sd = {"gate.weight": block.gate.weight, "experts.gate_up_proj": gate_up, "experts.down_proj": down}
    if block.shared_expert is not None:
        shared = swiglu_columns(block.shared_expert.gate_up_proj.weight, block.shared_expert.down_proj.weight, tp, rank)
        sd.update({"shared_expert.gate_up_proj.weight": shared[0], "shared_expert.down_proj.weight": shared[1]})
    if block.shared_expert_gate is not None:
        sd["shared_expert_gate.weight"] = block.shared_expert_gate.weight
    return sd


def parallel_moe_block(config: LlamaConfig, comm) -> SparseMoeBlock:
    """A rank's MoE block of its shard config, communicating through `comm` (its all-reduce)."""
    return moe_block(config, ExpertParallelMoe if config.expert_parallel else TensorParallelMoe, comm=comm)


class TensorParallelMoe(SparseMoeBlock):
    """A MoE block whose partial output (its slice of every expert's columns) is summed over the ranks."""

    def __init__(self, *args, comm):
        super().__init__(*args)
        self.comm = comm

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x, fused))


class ExpertParallelMoe(TensorParallelMoe):
    """A MoE block holding whole experts, its share of the tokens dispatched to their experts' ranks and back."""

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' routed output ([T, H], zero in the other ranks' rows)."""
        n, rank, t = dist.get_world_size(), dist.get_rank(), x.shape[0]
        lo, hi = rank * t // n, (rank + 1) * t // n
        order, counts = sort_by_expert(experts[lo:hi], self.num_experts)
        local, k = self.experts.num_experts, experts.shape[1]
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(n)]
        rows = lo + order // k
        # each row travels with its expert's index on the receiving rank (exact in any float type up to 256)
        ids = (experts[lo:hi].flatten()[order] % local).to(x.dtype)
        received, recv = _exchange(torch.cat([x[rows], ids[:, None]], dim=1), send)
        mine = received[:, -1].long()
        by_expert = torch.argsort(mine, stable=True)
        y = torch.empty_like(received[:, :-1])
        y[by_expert] = grouped_swiglu(received[by_expert, :-1].contiguous(),
                                      torch.bincount(mine, minlength=local).tolist(),
                                      self.experts.gate_up_proj, self.experts.down_proj)
        back, _ = _exchange(y, recv, send)
        return torch.zeros_like(x).index_add_(0, rows, back * weights[lo:hi].flatten()[order, None])


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """all_to_all_single of `rows`, send[r] of them (consecutive) to rank r: (the rows received, how many from each
    rank). `recv`: those counts where known (the way back), else exchanged first."""
    if recv is None:
        counts = torch.tensor(send, dtype=torch.int64, device=rows.device)
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts)
        recv = theirs.tolist()
    out = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), recv, send)
    return out, recv

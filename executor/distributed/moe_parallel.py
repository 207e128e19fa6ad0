"""Mixture-of-experts blocks over the ranks of a tensor-parallel group (tensor_parallel.py), vLLM's two layouts.

Tensor-parallel MoE (`config.expert_parallel` off): every rank holds each routed expert's 1/tp slice of the
intermediate columns (gate·up column-parallel, down row-parallel), like the dense MLP, and the router replicated;
the block's partial output is summed by one all-reduce.

Expert parallelism (`config.expert_parallel`, vLLM's enable_expert_parallel; EP size = TP here: data-parallel ranks
are data_parallel.py's): rank r holds experts r·E/n .. (r+1)·E/n - 1 whole. The residual stream is the same
on every rank, so each rank dispatches only its share of the tokens (an even split of the rows): it sorts its (token,
choice) pairs by expert, sends each owner its rows with `all_to_all_single`, runs the rows it received through its
experts as grouped matmuls, and sends the results back the same way; it then adds each pair's output, scaled by its
routing weight, to its own tokens. Every rank routes every token (a [T, H] × [H, E] product), so each knows how many
rows, for which of its experts, every other rank sends it: two all-to-alls a layer, no count exchange, and every
rank's expert counts are the step's. The block's output, a rank's own tokens' rows and zeros elsewhere, is summed
over the ranks by the one all-reduce, which both combines the shares and replicates the result. A shared expert is
sliced over the ranks as in tensor-parallel MoE and joins the same sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from executor.model.llama import LlamaConfig, moe_block
from executor.model.moe import SparseMoeBlock, sort_by_expert


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
        bounds = [r * t // n for r in range(n + 1)]
        local, k = self.experts.num_experts, experts.shape[1]
        lo, hi = bounds[rank], bounds[rank + 1]
        order, counts = sort_by_expert(experts[lo:hi], self.num_experts)
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(n)]
        rows = lo + order // k
        # every rank routed every token, so what each rank sends here, and for which of its experts, is known here
        theirs = [experts[bounds[r]:bounds[r + 1]].flatten() for r in range(n)]
        theirs = [e[e // local == rank].sort().values - rank * local for e in theirs]
        received = _exchange(x[rows], send, [len(e) for e in theirs])
        mine = torch.cat(theirs)
        by_expert = torch.argsort(mine, stable=True)
        y = torch.empty_like(received)
        y[by_expert] = self.experts.grouped(received[by_expert], torch.bincount(mine, minlength=local).tolist())
        back = _exchange(y, [len(e) for e in theirs], send)
        return torch.zeros_like(x).index_add_(0, rows, back * weights[lo:hi].flatten()[order, None])


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """all_to_all_single of `rows`: send[r] of them (consecutive) to rank r, recv[r] from rank r; the rows received."""
    out = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), recv, send)
    return out

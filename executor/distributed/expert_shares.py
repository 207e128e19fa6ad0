"""A data-parallel rank's share of a MoE layer's routed experts, in vLLM's two layouts, each called as Experts is
(hidden states, routing weights and expert ids of some tokens) and returning this rank's part of their output:

- sliced (without expert parallelism: vLLM's FusedMoE flattens TP across DP): 1/n of every expert's intermediate
  columns, cut as tensor-parallel MoE cuts them (moe_parallel.py: swiglu_columns; gpt-oss's clamped SwiGLU is
  elementwise, so its columns split the same), the gate/up biases cut alongside and the down bias kept by rank 0
  alone, so the ranks' sum adds it once (`sliced_experts`);
- owned (expert parallelism): 1/n of the experts whole, rank r experts r·E/n … (r+1)·E/n − 1 (`owned_experts`);
  called on tokens gathered from every rank, it runs only the (token, choice) pairs routed to its experts, the rest
  contributing nothing from this rank (`OwnedExperts`: vLLM's allgather_reducescatter backend).

Either way the ranks' parts summed are one process's output (to fp32 rounding): tests/test_data_parallel.py.
"""
from __future__ import annotations

import torch
from torch import nn

from executor.distributed.moe_parallel import swiglu_columns
from executor.model.moe import Experts, sort_by_expert


def check_sliced(width: int, world: int) -> None:
    """ValueError (one line) unless `world` data-parallel ranks split an expert's `width` columns."""
    if width % world:
        raise ValueError(f"data_parallel_size {world} does not divide an expert's {width} columns (without expert "
                         "parallelism every rank holds a slice of every expert); allowed: a data_parallel_size "
                         f"dividing {width}, or expert parallelism")


def check_owned(num_experts: int, world: int) -> None:
    """ValueError (one line) unless `world` data-parallel ranks split the experts evenly."""
    if num_experts % world:
        raise ValueError(f"data_parallel_size {world} does not divide the {num_experts} experts; allowed: a "
                         f"data_parallel_size dividing {num_experts}")


def sliced_experts(full: Experts, rank: int, world: int) -> Experts:
    """Rank `rank`'s 1/world of every expert's columns of `full` (an MXFP4 block dequantized), its biases with them:
    the gate/up bias cut alike, the down bias on rank 0 only (the ranks' outputs are summed)."""
    gate_up, down = full.weights()
    check_sliced(down.shape[2], world)
    bias = full.gate_up_proj_bias is not None
    local = Experts(full.num_experts, down.shape[1], down.shape[2] // world, bias, full.act)
    gate_up, down = swiglu_columns(gate_up, down, world, rank)
    with torch.no_grad():
        local.gate_up_proj.copy_(gate_up)
        local.down_proj.copy_(down)
        if bias:
            local.gate_up_proj_bias.copy_(_bias_columns(full.gate_up_proj_bias, world, rank))
            local.down_proj_bias.copy_(full.down_proj_bias if rank == 0 else torch.zeros_like(full.down_proj_bias))
    return local


def _bias_columns(bias: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """A rank's slice of a gate/up bias [E, 2I] (gate, then up): its I/world gate and up entries."""
    width = bias.shape[1] // 2
    i, i0 = width // world, rank * (width // world)
    return torch.cat([bias[:, i0:i0 + i], bias[:, width + i0:width + i0 + i]], dim=1)


def owned_experts(full: Experts, rank: int, world: int) -> Experts:
    """Rank `rank`'s 1/world of the experts of `full` whole (experts rank·E/world onwards; an MXFP4 block's
    dequantized), with their biases."""
    check_owned(full.num_experts, world)
    per = full.num_experts // world
    mine = list(range(rank * per, (rank + 1) * per))
    gate_up, down = full.weights(mine)
    bias = full.gate_up_proj_bias is not None
    local = Experts(per, down.shape[1], down.shape[2], bias, full.act)
    with torch.no_grad():
        local.gate_up_proj.copy_(gate_up)
        local.down_proj.copy_(down)
        if bias:
            local.gate_up_proj_bias.copy_(full.gate_up_proj_bias[mine])
            local.down_proj_bias.copy_(full.down_proj_bias[mine])
    return local


class OwnedExperts(nn.Module):
    """A rank's experts held whole (`local`: experts `first` … first + L − 1 of `num_experts`) run on any tokens:
    each token's choices of these experts, the others left to their owners."""

    def __init__(self, local: Experts, num_experts: int, first: int):
        super().__init__()
        self.local, self.num_experts, self.first = local, num_experts, first

    @classmethod
    def of(cls, full: Experts, rank: int, world: int) -> OwnedExperts:
        """Rank `rank`'s share of `full`, the experts cut as owned_experts cuts them."""
        return cls(owned_experts(full, rank, world), full.num_experts, rank * (full.num_experts // world))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's choices among this rank's experts of weight · expert(x): x [T, H], weights and
        expert ids [T, k]; zero rows for tokens that chose none of them."""
        order, counts = sort_by_expert(experts, self.num_experts)
        last = self.first + self.local.num_experts
        start = sum(counts[:self.first])  # the pairs sorted by expert: this rank's are one run of them
        mine = order[start:start + sum(counts[self.first:last])]
        k = experts.shape[1]
        y = self.local.grouped(x[mine // k], counts[self.first:last])
        return torch.zeros_like(x).index_add_(0, mine // k, y * weights.flatten()[mine, None])

"""A data-parallel rank's routed experts on an all-to-all backend (vLLM's `--all2all-backend` other than its default;
the simulator's `all_to_all`, whose bytes are DeepEP low-latency's: a row per chosen expert).

Each rank holds 1/n of the experts whole (expert_shares.py: owned_experts) and dispatches its own tokens' rows to
their experts' owners: it routes its tokens, tells every expert's owner how many rows it sends for each of its
experts (an all-to-all of counts), sends the rows (an all-to-all of rows), runs the rows it received through its
experts as grouped matmuls, and sends the results back (a third all-to-all); it adds each pair's output, scaled by its
routing weight, to its own tokens (`DispatchedExperts`). A rank's rows for its own experts stay with it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from executor.distributed.expert_shares import owned_experts
from executor.distributed.gathered_moe import COUNT_BYTES, Traffic
from executor.model.moe import Experts, moe_blocks, sort_by_expert


class DispatchedExperts(nn.Module):
    """A rank's share of a MoE layer's experts (`local`: experts rank·L … (rank + 1)·L − 1 of `num_experts`), called
    as Experts is — (x, routing weights, expert ids) of this rank's tokens — and exchanging rows with the other ranks
    (`traffic`: the bytes it moved)."""

    def __init__(self, local: Experts, num_experts: int, rank: int, world: int):
        super().__init__()
        self.local, self.num_experts, self.rank, self.world = local, num_experts, rank, world
        self.per_rank = num_experts // world
        self.traffic = Traffic()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's choices of weight · expert(x), the experts wherever they live."""
        k, n = experts.shape[1], self.world
        order, counts = sort_by_expert(experts, self.num_experts)
        mine = torch.tensor(counts, dtype=torch.int64).view(n, self.per_rank)
        theirs = torch.empty_like(mine)  # [source rank, my expert]: rows each rank sends for each of my experts
        dist.all_to_all_single(theirs, mine)
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
        self._count(send, recv, x.shape[1] * x.element_size())
        received = _exchange(x[order // k], send, recv)
        y = torch.empty_like(received)
        if received.shape[0]:  # rows arrive by source rank, each source's by expert: regrouped for one grouped call
            expert_of = torch.repeat_interleave(torch.arange(self.per_rank).repeat(n), theirs.flatten())
            by_expert = torch.argsort(expert_of, stable=True)
            y[by_expert] = self.local.grouped(received[by_expert], theirs.sum(0).tolist())
        back = _exchange(y, recv, send)
        return torch.zeros_like(x).index_add_(0, order // k, back * weights.flatten()[order, None])

    def idle(self, top_k: int) -> None:
        """The layer's exchanges with no tokens of this rank's own (vLLM's dummy batch)."""
        hidden = self.local.down_proj.shape[1]
        self(torch.empty(0, hidden), torch.empty(0, top_k), torch.empty(0, top_k, dtype=torch.long))

    def _count(self, send: list[int], recv: list[int], row_bytes: int) -> None:
        """Add one layer's exchanges to `traffic`: the rows that leave this rank and those that reach it, both
        ways."""
        out, into = sum(send) - send[self.rank], sum(recv) - recv[self.rank]
        tr = self.traffic
        tr.rows += sum(send)
        tr.dispatch_sent += out * row_bytes
        tr.dispatch_received += into * row_bytes
        tr.combine_sent += into * row_bytes
        tr.combine_received += out * row_bytes
        tr.counts_received += (self.world - 1) * self.per_rank * COUNT_BYTES


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """all_to_all_single of `rows`: send[r] of them (consecutive) to rank r, recv[r] from rank r; the rows received."""
    out = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), recv, send)
    return out


def dispatch_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """The model with each MoE block's experts cut to this rank's share, dispatched across the ranks (in place)."""
    for block in moe_blocks(model):
        block.experts = DispatchedExperts(owned_experts(block.experts, rank, world), block.experts.num_experts, rank,
                                          world)
    return model

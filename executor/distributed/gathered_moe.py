"""Data-parallel ranks without expert parallelism (vLLM's `--data-parallel-size n` without `--enable-expert-parallel`):
a MoE layer's tokens gathered from every rank, every expert sliced over the ranks, the outputs reduce-scattered back.

vLLM runs such a group's MoE layers tensor-parallel over all of its devices (FusedMoEParallelConfig.make flattens TP
across DP: tp_size = DP × TP, ep_size 1). So each rank holds 1/n of every routed expert's intermediate width: its
gate and up columns and the matching columns of the down projection, cut as tensor-parallel MoE cuts them
(moe_parallel.py: swiglu_columns; gpt-oss's clamped SwiGLU is elementwise, so its columns split the same), with the
gate/up biases cut alongside and the down bias kept by rank 0 alone, so the sum adds it once. The rest of the model
(attention, dense layers, router, shared experts) stays whole on every rank, which runs its own requests.

A MoE layer (`GatheredMoe`, vLLM's naive dispatch / combine on its default allgather_reducescatter backend): each
rank computes its own tokens' router logits; the ranks all-gather their tokens' hidden states and router logits (one
row of H + E a token, as vLLM gathers the two); every rank routes every gathered token (the rule is row-wise: what
the token's own rank would pick) and runs them all through its slices; the partial outputs are summed over the ranks,
each rank keeping its own tokens' rows (a reduce-scatter); the shared expert then adds its output on the rank's own
tokens. Gathering the logits rather than the routing weights and expert ids moves what vLLM moves and what the
simulator prices (sim/cost/blocks.py: gather_combine_s); tests/test_data_parallel.py compares the two.

gloo has no variable-size all-gather and no reduce-scatter, so both are built from all_to_all_single, which takes a
size per peer. The gather: an all-gather of the ranks' token counts (8 bytes each, each layer: the last layer may run
the sampling rows only), then a rank's rows to every peer (its input repeated n times; n − 1 copies leave it, as in
an all-gather). The reduce-scatter: each peer gets the partial rows of that peer's tokens, and a rank sums the n
partials it receives in rank order (the same order on every rank). Balanced, each rank sends and receives (n − 1)/n
of the rows, a ring reduce-scatter's bytes, in one round of n − 1 messages instead of n − 1 rounds, at the price of a
receive buffer n times its own rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from executor.distributed.moe_parallel import swiglu_columns
from executor.model.moe import Experts, SparseMoeBlock

COUNT_BYTES = 8  # a rank's token count in the counts' all-gather (int64)


@dataclass(eq=False, repr=False)
class Traffic:
    """Bytes one rank's MoE layers moved across the data-parallel ranks, summed over layers and steps, and the
    tokens they gathered (every rank's) summed the same way."""

    tokens: int = 0
    gather_sent: int = 0
    gather_received: int = 0
    scatter_sent: int = 0
    scatter_received: int = 0
    counts_received: int = 0  # the token counts' all-gather (metadata the simulator leaves out)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def check_sliced(width: int, world: int) -> None:
    """ValueError (one line) unless `world` data-parallel ranks split an expert's `width` columns."""
    if width % world:
        raise ValueError(f"data_parallel_size {world} does not divide an expert's {width} columns (without expert "
                         "parallelism every rank holds a slice of every expert); allowed: a data_parallel_size "
                         f"dividing {width}, or expert parallelism")


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


class GatheredMoe(SparseMoeBlock):
    """A data-parallel rank's MoE block without expert parallelism: its slice of every routed expert, every rank's
    tokens gathered before them and the partial outputs reduce-scattered after (`traffic`: the bytes it moved)."""

    def __init__(self, block: SparseMoeBlock, rank: int, world: int):
        nn.Module.__init__(self)  # the block's router, shared expert and settings adopted, its experts sliced
        self.num_experts, self.top_k, self.norm_topk_prob = block.num_experts, block.top_k, block.norm_topk_prob
        self.routing, self.gate = block.routing, block.gate
        self.experts = sliced_experts(block.experts, rank, world)
        self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.register_buffer("counts", torch.zeros(block.num_experts, dtype=torch.int64), persistent=False)
        self.rank, self.world, self.traffic = rank, world, Traffic()

    def routed_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' routed output, the experts run over every rank's tokens (x may have no rows: an idle
        rank's part in the exchanges)."""
        t, hidden = x.shape
        counts = self._token_counts(t)
        rows = self._all_gather(torch.cat([x, self.gate(x).to(x.dtype)], dim=1), counts)
        weights, experts = self.route_logits(rows[:, hidden:])
        first = sum(counts[:self.rank])
        self.counts += torch.bincount(experts[first:first + t].flatten(), minlength=self.num_experts)
        return self._reduce_scatter(self.experts(rows[:, :hidden], weights, experts), counts)

    def idle(self) -> None:
        """The layer's exchanges with no tokens of this rank's own (vLLM's dummy batch)."""
        self.routed_output(self.gate.weight.new_empty(0, self.gate.weight.shape[1]))

    def _token_counts(self, t: int) -> list[int]:
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([t], dtype=torch.int64))
        self.traffic.counts_received += (self.world - 1) * COUNT_BYTES
        return [int(c) for c in counts]

    def _all_gather(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows, in rank order (`counts[r]` from rank r)."""
        n, t, nbytes = self.world, rows.shape[0], rows.shape[1] * rows.element_size()
        out = rows.new_empty(sum(counts), rows.shape[1])
        dist.all_to_all_single(out, rows.repeat(n, 1), counts, [t] * n)
        tr = self.traffic
        tr.tokens += sum(counts)
        tr.gather_sent += (n - 1) * t * nbytes
        tr.gather_received += (sum(counts) - t) * nbytes
        return out

    def _reduce_scatter(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over the ranks of their `rows` (every rank's tokens, in rank order), this rank's rows of it."""
        n, mine, nbytes = self.world, counts[self.rank], rows.shape[1] * rows.element_size()
        out = rows.new_empty(n * mine, rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), [mine] * n, counts)
        self.traffic.scatter_sent += (sum(counts) - mine) * nbytes
        self.traffic.scatter_received += (n - 1) * mine * nbytes
        return out.view(n, mine, rows.shape[1]).sum(0)


def gather_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """The model with each MoE block a GatheredMoe holding this rank's slice of every expert (in place)."""
    parents = [(m, name, child) for m in model.modules() for name, child in m.named_children()
               if isinstance(child, SparseMoeBlock)]
    for parent, name, block in parents:
        setattr(parent, name, GatheredMoe(block, rank, world))
    return model


def traffic_of(model: nn.Module) -> Traffic:
    """The bytes the model's gathered MoE blocks moved, all of them together."""
    total = Traffic()
    for m in model.modules():
        if isinstance(m, GatheredMoe):
            total = total + m.traffic
    return total

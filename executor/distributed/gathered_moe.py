"""A data-parallel rank's MoE layer on vLLM's allgather_reducescatter backend (its default all2all backend, and its
naive dispatch / combine without expert parallelism): every rank's tokens gathered before the experts, the partial
outputs reduce-scattered after.

The rank's share of the routed experts (expert_shares.py) is either 1/n of every expert's columns (without expert
parallelism: vLLM runs such a group's MoE layers tensor-parallel over all of its devices, FusedMoEParallelConfig.make
flattening TP across DP: tp_size = DP × TP, ep_size 1) or 1/n of the experts whole (`--enable-expert-parallel` on the
default backend, vLLM's AgRsAll2AllManager). The rest of the model (attention, dense layers, router, shared experts)
stays whole on every rank, which runs its own requests.

A MoE layer (`GatheredMoe`): each rank computes its own tokens' router logits; the ranks all-gather their tokens'
hidden states and router logits (one row of H + E a token, as vLLM gathers the two); every rank routes every gathered
token (the rule is row-wise: what the token's own rank would pick) and runs them all through its share — its slices
of every expert, or its own experts on the (token, choice) pairs routed to them, the rest contributing zero —; the
partial outputs are summed over the ranks, each rank keeping its own tokens' rows (a reduce-scatter); the shared
expert then adds its output on the rank's own tokens. Gathering the logits rather than the routing weights and expert
ids moves what vLLM moves and what the simulator prices (sim/cost/blocks.py: dispatch_s, gather_combine_s);
tests/test_data_parallel.py compares the two.

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

from executor.distributed.expert_shares import OwnedExperts, sliced_experts
from executor.model.moe import SparseMoeBlock

COUNT_BYTES = 8  # a rank's token count in the counts' all-gather (int64)


@dataclass(eq=False, repr=False)
class Traffic:
    """Bytes one rank's MoE layers moved across the data-parallel ranks, summed over layers and steps: the dispatch
    before the experts (gathered hidden states and router logits, or routed rows sent to their experts' owners) and
    the combine after (partial outputs reduce-scattered, or the experts' rows sent back); the tokens the gathers
    collected (every rank's; gathered forms) and the (token, choice) rows of its own tokens routed (all-to-all form),
    summed the same way."""

    tokens: int = 0
    rows: int = 0
    dispatch_sent: int = 0
    dispatch_received: int = 0
    combine_sent: int = 0
    combine_received: int = 0
    counts_received: int = 0  # the token or row counts' exchange (metadata the simulator leaves out)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class GatheredMoe(SparseMoeBlock):
    """A data-parallel rank's MoE block on the allgather_reducescatter backend: its share of the routed experts
    (`experts`, called as Experts is: sliced_experts or OwnedExperts), every rank's tokens gathered before them and
    the partial outputs reduce-scattered after (`traffic`: the bytes it moved)."""

    def __init__(self, block: SparseMoeBlock, rank: int, world: int, experts: nn.Module):
        nn.Module.__init__(self)  # the block's router, shared expert and settings adopted, its experts this rank's
        self.num_experts, self.top_k, self.norm_topk_prob = block.num_experts, block.top_k, block.norm_topk_prob
        self.routing, self.gate = block.routing, block.gate
        self.experts = experts
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
        tr.dispatch_sent += (n - 1) * t * nbytes
        tr.dispatch_received += (sum(counts) - t) * nbytes
        return out

    def _reduce_scatter(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over the ranks of their `rows` (every rank's tokens, in rank order), this rank's rows of it."""
        n, mine, nbytes = self.world, counts[self.rank], rows.shape[1] * rows.element_size()
        out = rows.new_empty(n * mine, rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), [mine] * n, counts)
        self.traffic.combine_sent += (sum(counts) - mine) * nbytes
        self.traffic.combine_received += (n - 1) * mine * nbytes
        return out.view(n, mine, rows.shape[1]).sum(0)


def gather_experts(model: nn.Module, rank: int, world: int, whole: bool = False) -> nn.Module:
    """The model with each MoE block a GatheredMoe holding this rank's share of the experts (in place): 1/world of
    them whole (`whole`: expert parallelism) or a slice of every one."""
    parents = [(m, name, child) for m in model.modules() for name, child in m.named_children()
               if isinstance(child, SparseMoeBlock)]
    for parent, name, block in parents:
        share = OwnedExperts.of(block.experts, rank, world) if whole else sliced_experts(block.experts, rank, world)
        setattr(parent, name, GatheredMoe(block, rank, world, share))
    return model


def traffic_of(model: nn.Module) -> Traffic:
    """The bytes the model's MoE layers moved across the data-parallel ranks (any module keeping a Traffic), all of
    them together."""
    total = Traffic()
    for m in model.modules():
        if isinstance(getattr(m, "traffic", None), Traffic):
            total = total + m.traffic
    return total

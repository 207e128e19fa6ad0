"""How a step's tokens spread over a mixture of experts' routed experts, under uniform routing with one imbalance
factor: the experts they touch and the rows the busiest expert (and device) computes. The step model prices the
experts from these; the fitted profile's `experts_touched` term counts the same touched experts."""
from __future__ import annotations

import math
from dataclasses import dataclass


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected experts out of `experts` that `tokens` tokens choosing `top_k` each touch, under uniform routing:
    E·(1 − (1 − k/E)^T) (each expert is missed by a token with probability 1 − k/E)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def ranks_touched(experts: int, top_k: int, ranks: int) -> float:
    """Expected ranks, of `ranks` each holding experts / ranks of the experts whole, that one token's top_k distinct
    experts land on under uniform routing: n·(1 − C(E − E/n, k) / C(E, k))."""
    if experts == 0 or ranks <= 1:
        return float(min(ranks, 1))
    return ranks * (1.0 - math.comb(experts - experts // ranks, top_k) / math.comb(experts, top_k))


def tokens_per_expert(experts: int, top_k: int, tokens: float) -> float:
    """Mean tokens a touched expert computes: the T·k choices over the experts touched."""
    touched = distinct_experts(experts, top_k, tokens)
    return tokens * top_k / touched if touched else 0.0


def busiest_expert_tokens(experts: int, top_k: int, tokens: float, imbalance: float = 1.0) -> float:
    """Tokens of the busiest expert: the mean over touched experts times the load-imbalance factor (1: uniform
    routing), at most every token."""
    return min(float(tokens), tokens_per_expert(experts, top_k, tokens) * imbalance)


@dataclass(eq=False, repr=False)
class ExpertLoad:
    """The routed experts' work on the busiest device of a replica, whose data-parallel ranks' tokens meet in every
    MoE layer: without expert parallelism each device holds a slice of every expert and runs all the replica's
    tokens through it; with it each holds `ep_size` -th of the experts whole and receives that share of the
    replica's routed rows, times the imbalance."""

    num_experts: int
    top_k: int
    expert_parallel: bool  # experts whole over `ep_size` devices, else sliced over tensor parallelism
    ep_size: int
    imbalance: float = 1.0  # the busiest expert (or expert-parallel rank) over the mean

    def of(self, tokens: float) -> tuple[float, float, float]:
        """(routed rows, experts touched, the busiest expert's rows) on the busiest device of a step of `tokens`."""
        e, k = self.num_experts, self.top_k
        if not e or not tokens:
            return 0.0, 0.0, 0.0
        if self.expert_parallel:  # the replica's tokens meet in the experts; EP devices share them
            touched = distinct_experts(e, k, tokens) / self.ep_size
            return tokens * k / self.ep_size * self.imbalance, touched, busiest_expert_tokens(e, k, tokens,
                                                                                              self.imbalance)
        return tokens * k, distinct_experts(e, k, tokens), busiest_expert_tokens(e, k, tokens, self.imbalance)

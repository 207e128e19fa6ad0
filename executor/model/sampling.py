"""Turning logits into tokens: greedy, or temperature / top-k / top-p sampling from a seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model import native

SAMPLING_EPS = 1e-5  # temperatures below it sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise top-k / top-p sampling from a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = True  # a workload's output length is the number of tokens to generate

    def __post_init__(self):
        if self.temperature < SAMPLING_EPS:  # logits / 1e-300 overflow to inf: greedy is the limit, as in vLLM
            object.__setattr__(self, "temperature", 0.0)


@dataclass
class RequestSampling:
    """One request's own sampling, beside the engine's (an HTTP request's temperature, top_p, seed): its params, its
    generator (seeded when the request names a seed), and how many tokens it generates before EOS may end it
    (vLLM's min_tokens)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    min_tokens: int = 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, per row of `logits` [N, vocab] (temperature > 0)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token per row of `logits` [N, vocab] (the native kernel where it applies)."""
    if logits.dim() == 2 and logits.numel() and logits.dtype == torch.float32 and native.usable(logits):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of `logits` [N, vocab]."""
    if params.temperature <= 0:
        return greedy(logits)
    return torch.multinomial(target_probs(logits, params), 1, generator=generator).squeeze(-1)

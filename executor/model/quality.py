"""What compression costs in quality: perplexity over held-out text shipped with the project, and greedy agreement
with the full-precision model over a fixed prompt set — measured through the executor's own forward and engine, so
quantized layers, a quantized KV cache and pruned weights are judged as they serve."""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.resources import files

import torch

from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache

HELDOUT = "heldout_prose.txt"  # written for the project, used by nothing else (executor/data/README.md)


def heldout_ids(tokenizer) -> list[int]:
    """The held-out text as token ids (no special tokens)."""
    return tokenizer.encode((files("executor") / "data" / HELDOUT).read_text(), add_special_tokens=False)


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int = 256, block_size: int = 16, kv_dtype: str | None = None) -> float:
    """exp(mean next-token negative log-likelihood) of `ids`, read in windows of `window` tokens, each a fresh
    sequence of one prompt step through the model's paged attention (every window's first token is context only)."""
    p = next(model.parameters())
    blocks = -(-window // block_size)
    cache = _cache(model, blocks, block_size, p, kv_dtype)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        inputs, targets = chunk[:-1], chunk[1:]
        meta = AttentionMetadata.build([len(inputs)], [len(inputs)], [list(range(blocks))], block_size, p.device)
        hidden = model(torch.tensor(inputs, device=p.device), meta.positions(), meta, cache)
        logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(targets, device=p.device)[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def _cache(model, num_blocks: int, block_size: int, param: torch.Tensor, kv_dtype: str | None) -> KVCache:
    if kv_dtype is None:
        return KVCache.for_model(model.config, num_blocks, block_size, param.dtype, param.device)
    return KVCache.for_model(model.config, num_blocks, block_size, param.dtype, param.device, kv_dtype=kv_dtype)


@dataclass
class Agreement:
    """Greedy outputs of a model against the reference's, over the same prompts."""

    token_agreement: float  # of the reference's generated tokens, the share the model produced before diverging
    exact_match: float  # prompts whose whole output equals the reference's
    first_divergence: list[int | None]  # per prompt, the index of the first differing token (None: identical)


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> Agreement:
    """How far `outputs` follow `reference`, prompt by prompt: tokens up to the first difference count (after a
    difference the two continue from different text, so later matches say little)."""
    agreed, total, firsts = 0, 0, []
    for ref, out in zip(reference, outputs, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if first is None and len(out) != len(ref):
            first = min(len(out), len(ref))
        agreed += len(ref) if first is None else first
        total += len(ref)
        firsts.append(first)
    return Agreement(agreed / total if total else 1.0, sum(f is None for f in firsts) / len(firsts), firsts)

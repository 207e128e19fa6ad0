"""Speculative decoding in the executor: drafters propose, the target model verifies in one step.

A drafter looks at a request's tokens and proposes up to k next tokens. The engine puts the request's
last token and its drafts in one row of the next step (the scheduler reserves their KV slots), computes
logits at every one of those positions, and `verify` keeps the longest accepted prefix plus one token
of the target's own. Greedy verification accepts a draft iff it is the target's argmax, so the output is
token for token that of plain greedy decoding. Sampled verification is rejection sampling (Leviathan et
al., 2023; Chen et al., 2023): accept draft x with probability min(1, p(x)/q(x)), else sample from
norm(max(0, p − q)); the emitted tokens are distributed exactly as sampling from the target alone.
"""
from __future__ import annotations

import numpy as np
import torch

from executor.sampling import SamplingParams, greedy, target_probs


class Drafter:
    """What the engine asks of a drafter: `propose_batch`, drafts for every decoding request at once. One
    that drafts each sequence on its own only defines `propose(token_ids, k)`."""

    # tokens the drafter's own model read in its last call to catch up on the requests' tokens (a draft model:
    # a new request's whole prompt, then what was decoded since); 0 for drafters without a model of their own
    fed_tokens: int = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, items: list[tuple[object, list[int], int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """(drafts, q) per (request, its tokens so far, most drafts); q None: each draft is a point mass."""
        return [(self.propose(tokens, k), None) for _, tokens, k in items]


class PromptLookup(Drafter):
    """Prompt lookup decoding (transformers' `prompt_lookup_num_tokens`, vLLM's ngram drafter): find the
    request's last n tokens earlier in its prompt or output, longest n first, and propose what followed
    that match. Costs no model call; it pays off where the output copies the input (summaries, rewrites,
    code edits, extraction)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids` (none when no n-gram matches)."""
        if k <= 0 or len(token_ids) < self.min_ngram + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            # windows that start early enough to have a continuation, i.e. all but the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match: nearest context, likeliest continuation
                return ids[start:start + k].tolist()
        return []


class RandomDrafter(Drafter):
    """Proposes k uniformly random tokens: almost all rejected. Calibration uses it to time verify steps
    of every draft length without depending on how well a real drafter matches the text. With `rate` < 1
    a request drafts only that share of the time (seeded), so verify rows share steps with plain decodes,
    as with prompt lookup."""

    def __init__(self, vocab_size: int, seed: int = 0, rate: float = 1.0):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.vocab_size, self.rate = vocab_size, rate
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or (self.rate < 1.0 and self.rng.random() >= self.rate):
            return []
        return self.rng.integers(0, self.vocab_size, k).tolist()


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a verify row emits: its accepted drafts, then the target's token at the first rejected
    position (or after the last draft, if all were accepted).

    logits: [len(drafts) + 1, vocab], row i is the target's prediction after draft i − 1.
    draft_probs: [len(drafts), vocab], the drafter's distribution at each draft; None for a deterministic
    drafter (prompt lookup: q is a point mass on its draft)."""
    if params.temperature <= 0:
        target = greedy(logits).tolist()
        out = []
        for i, x in enumerate(drafts):
            if x != target[i]:
                break
            out.append(x)
        return out + [target[len(out)]]
    p = target_probs(logits, params)
    out = []
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_x > 0 and u * q_x < float(p[i, x]):  # accept with probability min(1, p(x) / q(x))
            out.append(x)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        row = residual / total if total > 0 else p[i]  # p == q: nothing left to correct, sample p
        return out + [int(torch.multinomial(row, 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool, row i true at i and its ancestors: what each node of a candidate tree attends to
    within its row (node 0 is the root; parents[j] is node j + 1's parent)."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents, start=1):
        mask[j] |= mask[p]
    return mask


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a candidate tree, the root's (0) first."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def verify_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """(emitted tokens, accepted nodes) of a candidate-tree verify row. logits [n + 1, vocab]: row i is the
    target's prediction after node i (0 is the root); tokens[j], parents[j]: node j + 1's token and parent.

    Greedy: follow the child whose token is the target's argmax, then emit the argmax at the last node.
    Sampled (SpecInfer's multi-candidate rule for deterministic drafts): at a node, try its children in
    order, accepting child x with probability p(x) under the target's distribution with the children tried
    before removed and renormalised; if none is accepted, sample from what remains. Each emitted token is
    distributed as sampling from the target alone."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents, start=1):
        children.setdefault(p, []).append(j)
    node, path, out = 0, [], []
    top = greedy(logits).tolist() if params.temperature <= 0 else None
    while True:
        kids = children.get(node, [])
        if top is not None:
            target = top[node]
            nxt = next((c for c in kids if tokens[c - 1] == target), None)
            if nxt is None:
                return out + [target], path
        else:
            p = target_probs(logits[node:node + 1], params)[0]
            nxt = None
            for c in kids:
                x = tokens[c - 1]
                if float(torch.rand((), generator=generator, device=p.device)) < float(p[x]):
                    nxt = c
                    break
                p = p.clone()
                p[x] = 0.0
                total = float(p.sum())
                if total <= 0:
                    break
                p = p / total
            if nxt is None:
                return out + [int(torch.multinomial(p, 1, generator=generator))], path
        path.append(nxt)
        out.append(tokens[nxt - 1])
        node = nxt

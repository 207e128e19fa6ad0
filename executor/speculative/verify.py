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

import torch

from executor.model.sampling import SamplingParams, greedy, target_probs


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

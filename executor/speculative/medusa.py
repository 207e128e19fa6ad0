"""Medusa-1 heads (Cai et al., 2024): K small heads on the frozen target's last hidden state, head d guessing
the token d + 1 places ahead. Their top candidates form a tree that the target verifies in one forward
pass with tree attention (each node sees the context and its own ancestors); the longest path the target
agrees with is kept, plus the target's own next token.

Each head is Medusa's residual block, h + SiLU(W h + b), followed by an LM head. The LM head is the target's
own (frozen, shared by all heads) restricted to a reduced vocabulary — the target's full head would cost K
times ~20% of a decode step on this model; W starts at zero, so an untrained head predicts the next token.
Only the residual blocks are trained and saved (~0.7 MB per head in fp16).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.llama import LlamaModel
from executor.model.weights import load_trained, save_trained
from executor.speculative.drafter import Drafter
from sim.config.scenario import MEDUSA_TOPK as TOPK  # candidates kept per head: the widest a tree may branch
from sim.config.scenario import check_tree

NAME = "medusa"  # medusa.safetensors, medusa.json


def default_medusa_dir() -> Path:
    """The Medusa heads shipped for SmolLM2-135M (`infersim train-medusa` writes them by default)."""
    return Path(__file__).resolve().parents[1] / "data" / "medusa-smollm2-135m"


class MedusaHeads(nn.Module):
    """K heads: logits [K, B, vocab'] over `vocab` for hidden states [B, hidden]."""

    def __init__(self, target: LlamaModel, num_heads: int, vocab: list[int]):
        super().__init__()
        h = target.config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(num_heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.register_buffer("vocab", torch.tensor(vocab, dtype=torch.long), persistent=False)
        # the target's LM-head rows for the vocabulary: a frozen copy, not saved (it is the target's)
        self.register_buffer("head", target.lm_head.weight.detach()[self.vocab].clone(), persistent=False)
        self.meta: dict = {}
        self.to(target.lm_head.weight.device)  # on the target's device, whatever made the heads

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [K', B, vocab'] of the first K' = num_heads heads (default all)."""
        blocks = self.blocks[:num_heads] if num_heads else self.blocks
        return torch.stack([F.linear(hidden + F.silu(b(hidden)), self.head) for b in blocks])

    def save(self, folder: Path, meta: dict) -> None:
        """medusa.safetensors (the residual blocks, fp16) and medusa.json (vocabulary, tree, measurements)."""
        meta = {**meta, "num_heads": self.num_heads, "hidden_size": self.head.shape[1], "vocab": self.vocab.tolist()}
        save_trained(folder, NAME, {k: v.half() for k, v in self.blocks.state_dict().items()}, meta)
        self.meta = meta


def load_medusa(folder: Path, target: LlamaModel) -> MedusaHeads:
    """Heads saved by `infersim train-medusa`, on the target they were trained for."""
    meta, tensors = load_trained(folder, NAME, target.config.hidden_size, "train them with `infersim train-medusa")
    heads = MedusaHeads(target, meta["num_heads"], meta["vocab"])
    heads.blocks.load_state_dict({k: v.float() for k, v in tensors.items()})
    heads.meta = meta
    return heads.eval()


@dataclass
class _Pending:
    base: int  # tokens the request had when its candidates were made (the last one is the tree's root)
    topk: list[list[int]]  # per head, its candidates in rank order


@dataclass
class MedusaDrafter(Drafter):
    """Proposes a candidate tree per decoding request from the heads' top candidates on the hidden state that
    produced the request's last token (the engine hands it over with `observe`). `tree` lists each node as
    the path of candidate ranks from the root, e.g. (0,), (1,), (0, 0); drafts are the nodes' tokens in that
    order and `tree_parents` tells the engine each node's parent (0 is the root, the request's last token).

    It also measures, per depth d, the rank of the token that really followed among head d's candidates
    (counted while the earlier depths were accepted, as the simulator's tree walk draws them): `rank_counts`."""

    heads: MedusaHeads
    tree: list[tuple[int, ...]]
    hidden: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)
    rank_counts: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.tree = [tuple(p) for p in self.tree]
        check_tree(self.tree, self.heads.num_heads, TOPK)
        index = {p: i + 1 for i, p in enumerate(self.tree)}
        self.tree_parents = [index.get(p[:-1], 0) for p in self.tree]
        self.depth = max(len(p) for p in self.tree)  # heads deeper than the tree are not run
        self.rank_counts = [[0] * (TOPK + 1) for _ in range(self.depth)]  # last: not in the top-k

    def observe(self, key, hidden_row: torch.Tensor, num_tokens: int) -> None:
        """The final hidden state of the position that produced the request's last token (its `num_tokens`-th)."""
        self.hidden[key] = (hidden_row.detach(), num_tokens)

    def release(self, key) -> None:
        self.hidden.pop(key, None)
        self.pending.pop(key, None)

    def _measure(self, key, tokens: list[int]) -> None:
        """Ranks of the tokens that followed the last proposal, depth by depth up to the first one a head
        missed or the tokens known so far."""
        p = self.pending.pop(key, None)
        if p is None:
            return
        for d, cands in enumerate(p.topk):
            pos = p.base + d  # head d (0-based) guessed the token at this index
            if pos >= len(tokens):
                break
            rank = cands.index(tokens[pos]) if tokens[pos] in cands else TOPK
            self.rank_counts[d][rank] += 1
            if tuple(cands.index(tokens[i]) if tokens[i] in cands else TOPK
                     for i, cands in zip(range(p.base, pos + 1), p.topk)) not in set(self.tree):
                break  # the walk left the tree here: later depths were never verified

    @torch.inference_mode()
    def propose_batch(self, items):
        listed = {key for key, _, _ in items}
        for key in [k for k in self.hidden if k not in listed]:
            self.release(key)
        out = [([], None) for _ in items]
        ready = []
        for i, (key, tokens, k) in enumerate(items):
            self._measure(key, tokens)
            h = self.hidden.get(key)
            if k > 0 and h is not None and h[1] == len(tokens):
                ready.append(i)
        if not ready:
            return out
        logits = self.heads(torch.stack([self.hidden[items[i][0]][0] for i in ready]), self.depth)  # [K', B, V']
        top = self.heads.vocab[logits.topk(TOPK, dim=-1).indices].tolist()  # [K'][B][TOPK]
        for b, i in enumerate(ready):
            key, tokens, k = items[i]
            cands = [top[d][b] for d in range(self.depth)]
            self.pending[key] = _Pending(len(tokens), cands)
            out[i] = ([cands[len(p) - 1][p[-1]] for p in self.tree[:k]], None)
        return out

    def rank_probs(self) -> list[list[float]] | None:
        """Per depth, the measured chance the following token has each rank (the last entry: none of the
        top-k); None before any measurement."""
        rows = [[c / sum(r) for c in r] if sum(r) else None for r in self.rank_counts]
        return None if rows[0] is None else [r for r in rows if r is not None]

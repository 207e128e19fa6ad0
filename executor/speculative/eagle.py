"""An EAGLE head (Li et al., 2024; DeepSeek-V3's multi-token prediction is the same shape): one decoder layer over
the target's own hidden states, drafting a token per step, chained.

At position i the head reads the target's final hidden state f_i (which predicted token x_{i+1}) and the embedding
of x_{i+1}, fused by a linear layer from their concatenation (each normed first, as DeepSeek's MTP does), runs its
decoder layer (with its own KV cache over the positions before) and predicts x_{i+2} through the target's LM head.
To draft further it feeds its own output in place of the target's hidden state, with the token it just proposed:
k steps give a chain of k drafts, or, expanding the top candidates of some nodes, a small candidate tree that the
target verifies with tree attention as it does Medusa's. The LM head is the target's, restricted to a reduced
vocabulary (the tokens the target emits; its full head would cost ~20% of a decode step per draft on this model);
the target verifies over the full vocabulary, so greedy output is unchanged.

Unlike Medusa's heads, which see only the last hidden state, the head knows the token the target just produced and
attends over the whole sequence: the engine hands it the target's hidden state at every position a step adds
(`observe_positions`: a prompt's every position, a verify row's accepted ones), which it feeds into its own cache
before drafting (its drafts' entries are rewritten then: they were made from its own outputs, not the target's).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.attention import AttentionMetadata
from executor.model.layers import Linear, RMSNorm
from executor.model.llama import LlamaModel
from executor.model.weights import load_own_weights, load_trained, save_trained
from executor.speculative.draft_kv import PagedDraftCache
from executor.speculative.drafter import Drafter
from executor.speculative.verify import tree_mask
from sim.config.scenario import MEDUSA_TOPK as TOPK  # candidates kept per node: the widest a tree may branch
from sim.config.scenario import check_tree

NAME = "eagle"  # eagle.safetensors, eagle.json


def default_eagle_dir() -> Path:
    """The EAGLE head shipped for SmolLM2-135M (`infersim train-eagle` writes it by default)."""
    return Path(__file__).resolve().parents[1] / "data" / "eagle-smollm2-135m"


class EagleHead(nn.Module):
    """fc(enorm(embed(token)) ‖ hnorm(feature)) → one decoder layer (`model`, a one-layer LlamaModel with its own
    positions and KV cache) → norm → the target's LM-head rows for `vocab`. The embedding and those rows are the
    target's (not trained, not saved); the layer starts as a copy of the target's last one."""

    def __init__(self, target: LlamaModel, vocab: list[int]):
        super().__init__()
        c = target.config
        cfg = replace(c, num_layers=1, vocab_size=len(vocab), tie_word_embeddings=False, num_experts=0)
        self.model = LlamaModel(cfg, attn_backend=target.attn_backend)
        self.model.embed_tokens = target.embed_tokens  # shared: same tensor, never trained
        h = c.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.enorm, self.hnorm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.register_buffer("vocab", torch.tensor(vocab, dtype=torch.long), persistent=False)
        with torch.no_grad():
            self.model.lm_head.weight.copy_(target.lm_head.weight.detach()[self.vocab])
            self.model.norm.weight.copy_(target.norm.weight)
            if not c.is_moe(c.num_layers - 1):
                self.model.layers[0].load_state_dict(target.layers[-1].state_dict())
        self.model.lm_head.weight.requires_grad_(False)
        self.meta: dict = {}
        self.to(target.embed_tokens.weight.device, target.embed_tokens.weight.dtype)

    @property
    def config(self):
        return self.model.config

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input [..., hidden] at positions whose next token is `tokens` and hidden state `features`."""
        return self.fc(torch.cat([self.enorm(self.model.embed_tokens(tokens)), self.hnorm(features)], dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary for the layer's outputs `out`."""
        h = self.model.norm(out)
        if torch.is_grad_enabled():  # training: the frozen head's fast CPU paths have no backward through their input
            return F.linear(h, self.model.lm_head.weight)
        return self.model.lm_head(h)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What training changes: the fused linear, the two input norms, the layer and the final norm."""
        skip = ("model.embed_tokens", "model.lm_head")
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(skip)}

    def save(self, folder: Path, meta: dict) -> None:
        """eagle.safetensors (the trained weights, fp16) and eagle.json (vocabulary, tree, measurements)."""
        meta = {**meta, "num_layers": 1, "hidden_size": self.model.config.hidden_size, "vocab": self.vocab.tolist()}
        save_trained(folder, NAME, {k: v.half() for k, v in self.trainable_state_dict().items()}, meta)
        self.meta = meta


def load_eagle(folder: Path, target: LlamaModel) -> EagleHead:
    """A head saved by `infersim train-eagle`, on the target it was trained for."""
    meta, tensors = load_trained(folder, NAME, target.config.hidden_size, "train one with `infersim train-eagle")
    head = EagleHead(target, meta["vocab"])
    load_own_weights(head, {k: v.float() for k, v in tensors.items()}, ("model.embed_tokens", "model.lm_head"),
                     "EAGLE", folder)
    head.meta = meta
    return head.eval()


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    fed: int = 0  # positions whose entries in the head's cache were made from the target's hidden states
    feats: list[torch.Tensor] = field(default_factory=list)  # the target's hidden states from position `fed` on
    pending: tuple | None = None  # (tokens when drafted, candidates per expanded node) until the next call
    usable: bool = True  # False: some position's hidden state never came (a prompt prefix served from a cache)


class EagleDrafter(PagedDraftCache, Drafter):
    """Drafts with an EAGLE head: per decoding request, one batched forward feeds the head the positions the target
    added since its last call (the target's hidden states, the tokens that followed them), whose last output gives
    the first candidates; then one forward per further depth. `tree` lists the drafts as paths of candidate ranks
    (a chain: (0,), (0, 0), ...); `tree_parents` is None for a chain (the engine verifies it as a plain row) and
    each node's parent for a tree. Measures, per depth, the rank of the token that really followed among the
    candidates there (`rank_probs`), as Medusa's drafter does."""

    reads_all_hidden = True  # the engine keeps every position's hidden state for observe_positions

    def __init__(self, head: EagleHead, tree: list[tuple[int, ...]], *, block_size: int = 16, num_blocks: int = 256):
        self.head = head
        self.tree = [tuple(p) for p in tree]
        check_tree(self.tree, max(len(p) for p in self.tree), TOPK)
        chain = all(p == (0,) * len(p) for p in self.tree)
        index = {p: i + 1 for i, p in enumerate(self.tree)}
        self.tree_parents = None if chain else [index.get(p[:-1], 0) for p in self.tree]
        self.depth = max(len(p) for p in self.tree)
        self.rank_counts = [[0] * (TOPK + 1) for _ in range(self.depth)]  # last: not among the candidates
        self.device = head.vocab.device
        self._init_cache(head.config, num_blocks, block_size, head.model.embed_tokens.weight.dtype, self.device)

    def observe_positions(self, key, position: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [m, hidden] at positions position .. position + m - 1 of a request. A
        position before those fed (the request is computed again after a preemption) drops what came after it."""
        seq = self.seqs.setdefault(key, _Seq())
        have = seq.fed + sum(len(f) for f in seq.feats)
        if position < have:
            if position < seq.fed:
                seq.fed, seq.feats = position, []
                seq.usable = seq.usable or position == 0
            else:
                kept = torch.cat(seq.feats)[:position - seq.fed] if seq.feats else None
                seq.feats = [kept] if kept is not None and len(kept) else []
        elif position > have:  # positions the target did not run: the head cannot attend over them
            seq.usable = False
        seq.feats.append(hidden.detach())

    def _ready(self, key, tokens: list[int], k: int) -> _Seq | None:
        """The request's state if the head can draft for it now: it holds the target's hidden state at every
        position up to the last token's, and drafts are wanted."""
        seq = self.seqs.get(key)
        if seq is None:
            return None
        self._measure(seq, tokens)
        n = len(tokens) - 1  # the last token's position: the hidden states cover 0 .. n - 1
        if k <= 0 or not seq.usable or seq.fed + sum(len(f) for f in seq.feats) != n or seq.fed >= n:
            return None
        return seq

    @torch.inference_mode()
    def propose_batch(self, items):
        out = [([], None) for _ in items]
        ready = [(i, s) for i, (key, tokens, k) in enumerate(items) if (s := self._ready(key, tokens, k)) is not None]
        self.fed_tokens = 0
        if not ready:
            return out
        nodes = [self.tree[:items[i][2]] for i, _ in ready]
        root = self._feed(ready, items)
        cands, outs = self._expand(ready, items, nodes, root)
        for j, (i, seq) in enumerate(ready):
            seq.pending = (len(items[i][1]), cands[j])
            out[i] = ([cands[j][p[:-1]][p[-1]] for p in nodes[j]], None)
        return out

    def _feed(self, ready, items) -> torch.Tensor:
        """One forward over every ready request's unfed positions (the target's hidden states, the tokens after
        them); the head's output at each one's last position [B, hidden], which predicts the first draft."""
        ids, feats, query_lens, context_lens = [], [], [], []
        for i, seq in ready:
            tokens = items[i][1]
            n = len(tokens) - 1
            self._reserve(seq, n + len(self.tree))
            ids.extend(tokens[seq.fed + 1:n + 1])
            feats.extend(seq.feats)
            query_lens.append(n - seq.fed)
            context_lens.append(n)
            seq.fed, seq.feats = n, []
        self.fed_tokens = sum(query_lens)
        meta = AttentionMetadata.build(query_lens, context_lens, [s.blocks for _, s in ready], self.block_size,
                                       self.device)
        x = self.head.inputs(torch.tensor(ids, dtype=torch.long, device=self.device), torch.cat(feats))
        hidden = self.head.model(None, meta.positions(), meta, self.kv, hidden=x, final=False)
        return hidden[[meta.cu_query_lens[b + 1] - 1 for b in range(len(ready))]]

    def _expand(self, ready, items, nodes, root: torch.Tensor) -> tuple[list[dict], list[dict]]:
        """The candidates of every node that has children in each request's tree (the root's from `root`), depth by
        depth: each forward runs a request's nodes up to the depth below, with tree masks, after its fed positions
        (ancestors first, each at its root's position + its depth); per request {path: candidate tokens}, and
        {path: head output}."""
        top = self.head.vocab[self.head.logits(root).topk(TOPK, dim=-1).indices].tolist()
        cands = [{(): top[b]} for b in range(len(ready))]
        outs = [{(): root[b]} for b in range(len(ready))]
        for depth in range(2, self.depth + 1):
            live = [b for b in range(len(ready)) if any(len(p) >= depth for p in nodes[b])]
            if not live:
                break
            rows = [[p for p in nodes[b] if len(p) < depth] for b in live]
            n = [len(items[ready[b][0]][1]) - 1 for b in live]  # each root's position
            meta = AttentionMetadata.build([len(r) for r in rows], [m + len(r) for m, r in zip(n, rows)],
                                           [ready[b][1].blocks for b in live], self.block_size, self.device)
            positions = torch.tensor([m - 1 + len(p) for m, r in zip(n, rows) for p in r], dtype=torch.long,
                                     device=self.device)
            for j, r in enumerate(rows):
                if any(p != (0,) * len(p) for p in r):  # a chain is causal as it is
                    index = {p: i + 1 for i, p in enumerate(r)}
                    meta.trees[j] = tree_mask([index.get(p[:-1], 0) for p in r])[1:, 1:]  # the root is context
            ids = [cands[b][p[:-1]][p[-1]] for b, r in zip(live, rows) for p in r]
            feats = torch.stack([outs[b][p[:-1]] for b, r in zip(live, rows) for p in r])
            x = self.head.inputs(torch.tensor(ids, dtype=torch.long, device=self.device), feats)
            hidden = self.head.model(None, positions, meta, self.kv, hidden=x, final=False)
            grow = [(b, p, k) for k, (b, p) in enumerate((b, p) for b, r in zip(live, rows) for p in r)
                    if len(p) == depth - 1 and any(len(q) == depth and q[:-1] == p for q in nodes[b])]
            if grow:
                at = [k for _, _, k in grow]
                top = self.head.vocab[self.head.logits(hidden[at]).topk(TOPK, dim=-1).indices].tolist()
                for (b, p, k), t in zip(grow, top):
                    cands[b][p], outs[b][p] = t, hidden[k]
        return cands, outs

    def _measure(self, seq: _Seq, tokens: list[int]) -> None:
        """Ranks of the tokens that followed the last drafts among the candidates there, depth by depth, while the
        path of those ranks stays in the tree and the tokens are known."""
        if seq.pending is None:
            return
        base, cands = seq.pending
        seq.pending = None
        tree, path = set(self.tree), ()
        for d in range(self.depth):
            if path not in cands or base + d >= len(tokens):
                break
            tok, options = tokens[base + d], cands[path]
            rank = options.index(tok) if tok in options else TOPK
            self.rank_counts[d][rank] += 1
            path += (rank,)
            if path not in tree:
                break  # the walk left the tree here: later depths were never verified

    def rank_probs(self) -> list[list[float]] | None:
        """Per depth, the measured chance the following token has each rank among the head's candidates (the last
        entry: none of them); None before any measurement. A depth no walk reached (the ones above never kept a
        path in the tree) reads as a miss: a row per depth, as the simulator needs, that it never reaches either."""
        miss = [0.0] * TOPK + [1.0]
        rows = [[c / sum(r) for c in r] if sum(r) else miss for r in self.rank_counts]
        return None if not sum(self.rank_counts[0]) else rows


def chain(depth: int) -> list[tuple[int, ...]]:
    """The tree of a chain of `depth` drafts: each depth's first candidate."""
    return [(0,) * d for d in range(1, depth + 1)]

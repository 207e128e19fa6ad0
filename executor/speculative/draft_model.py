"""A small draft model for speculative decoding: a few decoder layers on the target's embeddings, with an
LM head over a reduced vocabulary, proposing several tokens for a whole batch at once.

Why a reduced vocabulary: at 135M parameters the tied 49k-row LM head is ~20% of a decode step, so a
2-layer draft with the full head would cost a quarter of the target per token. Restricting the draft's
head to the tokens the target actually emits (FR-Spec, Zhao et al. 2025) makes it several times cheaper;
the target still verifies over the full vocabulary, so greedy output is unchanged and sampled output keeps
the target's distribution (q is 0 outside the draft vocabulary).

The drafter keeps its own paged KV cache. Per request it remembers which tokens' K/V it holds; after the
target verifies, the accepted drafts' K/V stay valid and the rejected ones are overwritten next time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from executor.model.attention import AttentionMetadata
from executor.model.cuda_graph import DecodeGraphs, capture_or_explain
from executor.model.layers import Linear
from executor.model.llama import LlamaModel
from executor.model.sampling import SamplingParams, target_probs
from executor.model.weights import load_own_weights, load_trained, save_trained
from executor.speculative.draft_kv import PagedDraftCache
from executor.speculative.drafter import Drafter
from sim.config import environment

NAME = "draft"  # draft.safetensors, draft.json


def default_draft_dir() -> Path:
    """Where `infersim distill` saves by default: $INFERSIM_CACHE_DIR (default ~/.cache/infersim)/drafts/."""
    return environment.cache_dir() / "drafts" / "smollm2-135m"


def make_student(teacher: LlamaModel, layers: list[int], vocab: list[int]) -> "DraftModel":
    """A draft model initialised from the teacher: its decoder layers `layers` (copied, in order), its final
    norm, and an LM head whose rows are the teacher's for `vocab`; the input embedding is the teacher's own
    tensor (shared, never trained)."""
    check_layers(teacher, layers)
    student = DraftModel(teacher, len(layers), vocab)
    with torch.no_grad():
        for dst, i in zip(student.model.layers, layers):
            dst.load_state_dict(teacher.layers[i].state_dict())
        student.model.norm.weight.copy_(teacher.norm.weight)
        student.model.lm_head.weight.copy_(teacher.lm_head.weight[student.vocab])
    return student


def check_layers(teacher: LlamaModel, layers: list[int]) -> None:
    if not layers or any(not 0 <= i < teacher.config.num_layers for i in layers):
        raise ValueError(f"draft layers must be teacher layer numbers in 0..{teacher.config.num_layers - 1}, "
                         f"got {layers}")


class DraftModel(torch.nn.Module):
    """A LlamaModel of `num_layers` layers sharing `teacher`'s embedding, whose logits cover `vocab` only."""

    def __init__(self, teacher: LlamaModel, num_layers: int, vocab: list[int]):
        super().__init__()
        cfg = replace(teacher.config, num_layers=num_layers, tie_word_embeddings=False)
        self.model = LlamaModel(cfg, attn_backend=teacher.attn_backend)
        self.model.embed_tokens = teacher.embed_tokens  # shared: same tensor, not saved with the draft
        self.model.lm_head = Linear(cfg.hidden_size, len(vocab), bias=False)
        self.register_buffer("vocab", torch.tensor(vocab, dtype=torch.long), persistent=False)
        self.to(teacher.embed_tokens.weight.device)  # the vocab buffer too: drafts index the teacher's device
        self.meta: dict = {}

    @property
    def config(self):
        return self.model.config

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the shared embedding."""
        return {k: v.detach().contiguous() for k, v in self.model.state_dict().items() if not k.startswith("embed_tokens")}

    def save(self, folder: Path, meta: dict) -> None:
        """Write draft.safetensors and draft.json (vocab, layers, training record) into `folder`."""
        meta = {**meta, "num_layers": self.config.num_layers, "hidden_size": self.config.hidden_size,
                "vocab": self.vocab.tolist()}
        save_trained(folder, NAME, self.trainable_state_dict(), meta)
        self.meta = meta


def load_draft(folder: Path, teacher: LlamaModel) -> DraftModel:
    """A draft saved by `infersim distill`, attached to the teacher it was distilled from."""
    meta, tensors = load_trained(folder, NAME, teacher.config.hidden_size, "make one with `infersim distill")
    draft = DraftModel(teacher, meta["num_layers"], meta["vocab"])
    load_own_weights(draft.model, tensors, ("embed_tokens",), "draft", folder)
    draft.meta = meta
    return draft.eval()


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # the tokens whose K/V the draft cache holds, in order


class DraftModelDrafter(PagedDraftCache, Drafter):
    """Speculative decoding's draft model: each step, one batched forward catches every request up on the
    tokens it has not seen (its accepted drafts and the target's token), then k − 1 batched decode steps
    propose the rest. Greedy drafts are the draft's argmax; sampled ones are drawn from its distribution q
    (the target's temperature / top-k / top-p applied to the draft's logits), which `propose_batch` returns
    for rejection sampling."""

    def __init__(self, draft: DraftModel, sampling: SamplingParams, *, max_num_seqs: int, max_model_len: int,
                 block_size: int = 16, num_blocks: int = 256, use_graphs: bool | None = None):
        self.draft = draft
        self.sampling = sampling
        self.device = draft.vocab.device
        # the draft's own decode steps (all but each step's first) through CUDA graphs, as the target's are: on a
        # GPU k - 1 eager draft passes would cost more than the verify step; True off the GPU: the same static
        # shapes, run eagerly (the tests)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.limits = (max_model_len, max_num_seqs)
        self.graphs: DecodeGraphs | None = None
        self._init_cache(draft.config, num_blocks, block_size, draft.model.embed_tokens.weight.dtype, self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed + 1)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The draft's graph set over its current pool (made again after the pool grows: graphs keep addresses)."""
        if not self.use_graphs:
            return None
        if self.graphs is None or self.graphs.kv_cache is not self.kv:
            if not self.free:
                self._grow()
            self.graphs = DecodeGraphs(self.draft.model, self.kv, *self.limits)
            if self.device.type == "cuda":
                capture_or_explain(self.graphs, scratch_slot=self.free[-1] * self.block_size)
        return self.graphs

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Drafts for one stand-alone sequence (no cache kept between calls)."""
        key = object()
        drafts, _ = self.propose_batch([(key, token_ids, k)])[0]
        self.release(key)
        return drafts

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[object, list[int], int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """(drafts, q) for each (request key, its tokens so far, most drafts k). q is [len(drafts), vocab], the
        distribution each draft was sampled from, or None when greedy. Requests not listed are forgotten."""
        listed = {key for key, _, _ in items}
        for key in [key for key in self.seqs if key not in listed]:
            self.release(key)
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in items]
        active = [i for i, (_, toks, k) in enumerate(items) if k > 0 and toks]
        self.fed_tokens = 0
        if not active:
            return out
        seqs, feeds = [], []
        for i in active:
            key, toks, k = items[i]
            seq = self.seqs.setdefault(key, _Seq())
            same = 0  # the cached K/V that still match the request's tokens (accepted drafts stay valid)
            for a, b in zip(seq.cached, toks):
                if a != b:
                    break
                same += 1
            same = min(same, len(toks) - 1)  # the last token is always fed: its logits give the first draft
            seq.cached = list(toks[:same])
            self._reserve(seq, len(toks) + k - 1)
            seqs.append(seq)
            feeds.append(list(toks[same:]))
        self.fed_tokens = sum(map(len, feeds))
        steps = max(items[i][2] for i in active)
        drafts = [[] for _ in active]
        probs = [[] for _ in active]
        live = list(range(len(active)))
        for step in range(steps):
            if step > 0:
                live = [j for j in live if len(drafts[j]) < items[active[j]][2]]
                feeds = {j: [drafts[j][-1]] for j in live}
            else:
                feeds = dict(enumerate(feeds))
            query_lens = [len(feeds[j]) for j in live]
            context_lens = [len(seqs[j].cached) + len(feeds[j]) for j in live]
            graphs = self._decode_graphs() if step > 0 else None  # after the first, every row feeds one token
            if graphs is not None and graphs.fits(len(live), context_lens):
                hidden = graphs.run([feeds[j][0] for j in live], context_lens, [seqs[j].blocks for j in live])
            else:
                meta = AttentionMetadata.build(query_lens, context_lens, [seqs[j].blocks for j in live],
                                               self.block_size, self.device)
                ids = torch.tensor([t for j in live for t in feeds[j]], dtype=torch.long, device=self.device)
                hidden = self.draft.model(ids, meta.positions(), meta, self.kv, last_of=list(range(len(live))))
            logits = self.draft.model.compute_logits(hidden)
            picked, q = self._pick(logits)
            for n, j in enumerate(live):
                seqs[j].cached.extend(feeds[j])
                drafts[j].append(int(picked[n]))
                if q is not None:
                    probs[j].append(q[n])
        for j, i in enumerate(active):
            out[i] = (drafts[j], torch.stack(probs[j]) if probs[j] else None)
        return out

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next draft token per row (full-vocabulary ids) and, when sampling, q over the full vocabulary."""
        vocab = self.draft.vocab
        if self.sampling.temperature <= 0:
            return vocab[logits.argmax(dim=-1)], None
        full = torch.full((logits.shape[0], self.draft.config.vocab_size), float("-inf"), device=logits.device)
        full[:, vocab] = logits.float()
        q = target_probs(full, self.sampling)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(-1), q

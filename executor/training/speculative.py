"""Drafters trained on the target's own generations: `infersim distill` (a small draft model) and
`infersim train-medusa` (Medusa heads). Both start from the same data:

1. The target (teacher) answers a set of training prompts with the executor (continuous batching, greedy).
   The prompts never include the ones bench/spec_decode.py measures on (paragraphs 0-5 of the shipped text,
   its chat questions).
2. One teacher forward over every prompt + answer gives, at each position, the teacher's top-k next-token
   probabilities: the soft targets. The draft's vocabulary is the tokens of that text plus the teacher's
   top-4 candidates anywhere, by frequency, up to `vocab_size`.
3. Draft model: the student starts as a few of the teacher's layers (copied) on the teacher's embedding,
   with the teacher's LM-head rows for its vocabulary, and is trained with a KL loss to the soft targets (the
   teacher's top-k, renormalised on the draft vocabulary; prompt positions weigh less: drafts are only ever
   made inside answers) until the time budget runs out. Held-out sequences (every 8th) measure how often its
   argmax is the teacher's inside answers — the greedy α of a draft — before and after training.
4. Medusa: the target stays frozen; each head's residual block learns, from the target's final hidden state
   at a position, the target's distribution d + 1 tokens further on. Held-out rank frequencies of the true
   token among each head's candidates pick the candidate tree (the likeliest nodes, sized by the device's
   fitted step cost).
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from executor.core.build import make_engine, run_offline
from executor.core.cpu_load import CpuLoad
from executor.core.prompts import corpus_ids, paragraphs, prompt_ids
from executor.model.layers import apply_rope
from executor.model.llama import LlamaModel
from executor.model.sampling import SamplingParams
from executor.speculative.draft_model import DraftModel, check_layers, default_draft_dir, make_student
from executor.speculative.medusa import TOPK, MedusaHeads, default_medusa_dir
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.scheduler import make_scheduler

HELD_OUT_PARAGRAPHS = 6  # bench/spec_decode.py measures on the first six
INSTRUCTIONS = [
    "Rewrite the following text in modern English, keeping its meaning:",
    "Summarize the following text in two sentences:",
    "Explain the following passage in simple words:",
    "List the main points of this text:",
    "Rewrite this passage so that a child could understand it:",
]
QUESTIONS = [
    "What is photosynthesis?", "How do airplanes stay in the air?", "Give me three tips for learning a language.",
    "What causes earthquakes?", "Describe a good morning routine.", "How does a refrigerator work?",
    "What are the benefits of reading books?", "Write a haiku about autumn.", "How can I save money on groceries?",
    "Explain gravity in simple terms.", "What is the capital of France and why is it famous?",
    "How do I start running as a beginner?", "What is a healthy breakfast?", "Why do cats purr?",
    "Suggest a name for a bakery.", "What is machine learning?", "How do vaccines work?",
    "Give me a recipe for pancakes.", "What are the planets in our solar system?", "How do I write a good email?",
    "What is the water cycle?", "Tell me a fun fact about octopuses.", "How can I sleep better?",
    "What is the difference between a virus and a bacterium?", "Write a short story about a lost dog.",
    "How do I plant tomatoes?", "What are some ways to reduce stress?", "Explain how a rainbow forms.",
    "What should I know before adopting a dog?", "How do computers store information?",
    "What is democracy?", "Give me ideas for a rainy day at home.", "How does the heart pump blood?",
    "What makes a good friend?", "Explain what inflation is.", "How do bees make honey?",
    "Write a thank-you note to a teacher.", "What are renewable energy sources?", "How do I make a paper airplane?",
    "Why do leaves change color in the fall?",
]
TOPICS = [
    "the moon", "volcanoes", "coffee", "bicycles", "the internet", "dinosaurs", "chess", "the ocean", "music",
    "friendship", "recycling", "electric cars", "the Roman Empire", "gardening", "honeybees", "rain forests",
    "the human brain", "soccer", "space travel", "cooking pasta", "public libraries", "smartphones", "deserts",
    "the printing press", "birds", "exercise", "mountains", "trains", "photography", "chocolate", "robots",
    "the French Revolution", "solar power", "penguins", "museums", "time management", "rivers", "painting",
    "the immune system", "pirates", "bread", "lighthouses", "the stock market", "whales", "winter", "maps",
    "kindness", "clocks",
]
TEMPLATES = ["Tell me about {}.", "Write a short paragraph about {}.", "What are three interesting facts about {}?",
             "Explain {} to a ten-year-old."]


@dataclass
class DistillData:
    sequences: list[list[int]]  # prompt + teacher answer, token ids
    top_ids: list[torch.Tensor]  # per sequence [len - 1, k]: teacher's top-k next tokens at each position
    top_probs: list[torch.Tensor]  # their probabilities
    hidden: list[torch.Tensor] | None = None  # per sequence [len - 1, hidden]: the teacher's final hidden states
    prompt_lens: list[int] | None = None  # where each answer starts (drafting happens only there)

    def answer_start(self, i: int) -> int:
        """First position whose next token is part of sequence i's answer."""
        return max(0, self.prompt_lens[i] - 1) if self.prompt_lens else 0


def training_prompts(tokenizer, corpus: list[int]) -> tuple[list[list[int]], list[str]]:
    """Chat prompts (rewrite / summarize / explain paragraphs 6+ of the shipped text, general questions, a
    few requests on each of many topics) and raw windows of the text (what the validation scenarios replay),
    as token ids; and each one's group (its paragraph, topic, ...), which held-out splits keep together."""
    texts, groups = [], []
    for k, p in enumerate(paragraphs()[HELD_OUT_PARAGRAPHS:]):
        texts += [f"{ins}\n\n{p}" for ins in INSTRUCTIONS]
        groups += [f"paragraph {k}"] * len(INSTRUCTIONS)
    texts += QUESTIONS
    groups += [f"question {j}" for j in range(len(QUESTIONS))]
    for topic in TOPICS:
        texts += [t.format(topic) for t in TEMPLATES]
        groups += [f"topic {topic}"] * len(TEMPLATES)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    ids = [tokenizer(c, add_special_tokens=False).input_ids for c in chats]
    windows = [prompt_ids(corpus, 64 + 32 * (i % 6), 1000 + i) for i in range(24)]
    return ids + windows, groups + [f"window {i}" for i in range(24)]


def generate(model: LlamaModel, prompts: list[list[int]], max_new: int, eos: int | None,
             batch: int = 48) -> list[list[int]]:
    """The teacher's greedy answers (stopping at EOS or max_new), served by the executor with continuous
    batching."""
    cfg = scheduler_config(2048, max_num_seqs=batch, max_num_batched_tokens=2048)
    longest = max(len(p) for p in prompts) + max_new
    num_blocks = batch * -(-longest // 16) + 16
    engine = make_engine(model, make_scheduler(cfg, BlockAllocator(num_blocks, 16)),
                         SamplingParams(ignore_eos=eos is None), eos_token_id=eos)
    reqs = run_offline(engine, prompts, [max_new] * len(prompts))
    return [engine.output_ids(r) for r in reqs]


def dense_hidden(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [B, T, hidden] of a plain causal forward over `ids` [B, T] (no cache): the
    training forward, differentiable, same weights and math as the serving forward."""
    b, t = ids.shape
    c = model.config
    cos, sin = model.rotary(torch.arange(t, device=ids.device))
    x = model.embed_tokens(ids).reshape(b * t, -1)
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b * t, attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(b, t, -1)


@torch.no_grad()
def teacher_targets(teacher: LlamaModel, sequences: list[list[int]], k: int = 32,
                    keep_hidden: bool = False) -> DistillData:
    """The teacher's top-k next-token distribution at every position of every sequence (and its final
    hidden states there, for Medusa heads)."""
    top_ids, top_probs, hiddens = [], [], []
    for seq in sequences:
        hidden = dense_hidden(teacher, torch.tensor([seq[:-1]]))[0]
        probs = torch.softmax(teacher.lm_head(hidden).float(), dim=-1)
        p, i = probs.topk(k, dim=-1)
        top_ids.append(i)
        top_probs.append(p)
        hiddens.append(hidden)
    return DistillData(sequences, top_ids, top_probs, hiddens if keep_hidden else None)


def draft_vocab(data: DistillData, vocab_size: int, always: list[int]) -> list[int]:
    """The draft's vocabulary: tokens of the training text and the teacher's top-4 candidates, most frequent
    first, up to vocab_size, plus `always` (e.g. EOS)."""
    counts: dict[int, int] = {}
    for seq, ids in zip(data.sequences, data.top_ids):
        for t in seq + ids[:, :4].flatten().tolist():
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    vocab = [t for t in always if t is not None]
    vocab += [t for t in ranked if t not in set(vocab)][:max(0, vocab_size - len(vocab))]
    return vocab


def _vocab_columns(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary id -> column in the reduced vocabulary, -1 outside it."""
    col = torch.full((vocab_size,), -1, dtype=torch.long)
    col[vocab] = torch.arange(len(vocab))
    return col


def _soft(ids: torch.Tensor, probs: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher top-k targets as (reduced-vocabulary columns, probabilities renormalised on that vocabulary)."""
    c = col[ids]
    p = probs * (c >= 0)
    return c.clamp(min=0), p / p.sum(-1, keepdim=True).clamp(min=1e-9)


def _batch(data: DistillData, idx: list[int], col: torch.Tensor, seq_len: int, prompt_weight: float = 1.0):
    """Padded [B, T] inputs, soft targets over the draft vocabulary [B, T, k] (draft-vocabulary columns and
    probabilities) and each position's weight: 1 in answers, `prompt_weight` in prompts, 0 in padding."""
    n = min(seq_len, max(len(data.sequences[i]) - 1 for i in idx))
    ids = torch.zeros(len(idx), n, dtype=torch.long)
    top_ids = torch.zeros(len(idx), n, data.top_ids[0].shape[1], dtype=torch.long)
    top_p = torch.zeros(len(idx), n, data.top_ids[0].shape[1])
    mask = torch.zeros(len(idx), n)
    for row, i in enumerate(idx):
        seq = data.sequences[i]
        m = min(n, len(seq) - 1)
        ids[row, :m] = torch.tensor(seq[:m])
        top_ids[row, :m] = data.top_ids[i][:m]
        top_p[row, :m] = data.top_probs[i][:m]
        mask[row, :m] = prompt_weight
        mask[row, data.answer_start(i):m] = 1.0
    return (ids, *_soft(top_ids, top_p, col), mask)


def distill_loss(student: DraftModel, ids, tgt_col, tgt_p, mask) -> torch.Tensor:
    """Mean KL(teacher || student) per position, on the draft vocabulary (the teacher's top-k, renormalised)."""
    logp = torch.log_softmax(student.model.lm_head(dense_hidden(student.model, ids)).float(), dim=-1)
    kl = (tgt_p * (tgt_p.clamp(min=1e-12).log() - logp.gather(-1, tgt_col))).sum(-1)
    return (kl * mask).sum() / mask.sum()


@torch.no_grad()
def agreement(student: DraftModel, data: DistillData, idx: list[int]) -> float:
    """Share of answer positions where the student's argmax is the teacher's (the greedy α of a draft)."""
    hit = total = 0
    for i in idx:
        seq, a = data.sequences[i], data.answer_start(i)
        logits = student.model.lm_head(dense_hidden(student.model, torch.tensor([seq[:-1]]))[0])
        hit += int((student.vocab[logits.argmax(-1)][a:] == data.top_ids[i][a:, 0]).sum())
        total += len(seq) - 1 - a
    return hit / max(total, 1)


def _cosine_steps(opt: torch.optim.Optimizer, lr: float, minutes: float, max_steps: int | None):
    """Step numbers 1, 2, ... until max_steps (if given) or `minutes` have passed, setting the optimizer's
    learning rate to `lr` cosine-decayed over that run before each."""
    t0, step = time.perf_counter(), 0
    while (done := step / max_steps if max_steps else
           (time.perf_counter() - t0) / (minutes * 60) if minutes else 1.0) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * done))
        step += 1
        yield step


@dataclass
class Fit:
    """A training run: its last step, the lowest held-out loss and the step it was measured at, and when it began
    (time.perf_counter)."""

    step: int
    best: float | list[float]
    best_step: int
    t0: float


def fit(opt: torch.optim.Optimizer, steps, batch_loss, held_loss, best, state_of, restore, every: int, log,
        clip: list | None = None, total=float) -> Fit:
    """Train: an optimizer step on `batch_loss()` for each of `steps` (_cosine_steps: it sets the learning rate),
    gradients clipped to norm 1 over `clip` where given. Every `every` steps the held-out loss (`held_loss()`,
    compared by `total` of it, starting from `best`) is measured and logged and the best weights (`state_of()`)
    kept: a small corpus is memorised well before the budget ends. Those weights are `restore`d at the end."""
    best_state, best_step = {k: v.clone() for k, v in state_of().items()}, 0
    t0, step = time.perf_counter(), 0
    for step in steps:
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(clip, 1.0)
        opt.step()
        if step % every == 0:
            h = held_loss()
            if total(h) < total(best):
                best, best_state, best_step = h, {k: v.clone() for k, v in state_of().items()}, step
            log(f"step {step}: loss {loss.item():.3f}, held-out {total(h):.3f} "
                f"({(time.perf_counter() - t0) / 60:.1f} min)")
    restore(best_state)
    return Fit(step, best, best_step, t0)


def train(student: DraftModel, data: DistillData, train_idx: list[int], held_idx: list[int], minutes: float,
          batch: int = 8, seq_len: int = 256, lr: float = 1e-3, seed: int = 0, max_steps: int | None = None,
          prompt_weight: float = 0.2, eval_every: int = 25, log=print) -> dict:
    """AdamW on every student weight but the shared embedding, cosine-decayed over the time budget (or over
    max_steps). Every `eval_every` steps the held-out KL is measured and the best weights are kept: with a few
    tens of thousands of answer tokens the student starts to memorise them well before the budget ends."""
    col = _vocab_columns(student.vocab, student.config.vocab_size)
    params = [p for n, p in student.model.named_parameters() if not n.startswith("embed_tokens")]
    student.model.embed_tokens.weight.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    held = _batch(data, held_idx, col, seq_len, prompt_weight=0.0)  # scored where drafting happens

    def held_loss() -> float:
        with torch.no_grad():
            return distill_loss(student, *held).item()

    def batch_loss() -> torch.Tensor:
        pick = torch.randint(len(train_idx), (batch,), generator=gen).tolist()
        return distill_loss(student, *_batch(data, [train_idx[i] for i in pick], col, seq_len, prompt_weight))

    loss_before = held_loss()
    before = agreement(student, data, held_idx)
    log(f"held-out: loss {loss_before:.3f}, agreement with the teacher's argmax {before:.3f} before training")
    run = fit(opt, _cosine_steps(opt, lr, minutes, max_steps), batch_loss, held_loss, loss_before,
              student.trainable_state_dict, lambda state: student.model.load_state_dict(state, strict=False),
              eval_every, log, clip=params)
    for p in params:
        p.requires_grad_(False)
    student.eval()
    after = agreement(student, data, held_idx)
    log(f"held-out after {run.step} steps (best at step {run.best_step}): loss {run.best:.3f}, agreement {after:.3f}")
    return {"steps": run.step, "best_step": run.best_step, "train_minutes": (time.perf_counter() - run.t0) / 60,
            "agreement_before": before, "agreement_after": after, "heldout_loss_before": loss_before,
            "heldout_loss_after": run.best}


def held_out(groups: list) -> list[int]:
    """Indices of the sequences in every 8th group (a paragraph's or a topic's prompts are all on one side:
    their answers share too much to test generalisation)."""
    held = set(list(dict.fromkeys(groups))[::8])
    return [i for i, g in enumerate(groups) if g in held]


def teacher_data(teacher: LlamaModel, prompts: list[list[int]], answers: list[list[int]], groups: list,
                 eos: int | None, vocab_size: int, min_len: int = 2,
                 keep_hidden: bool = False) -> tuple[DistillData, list[int], list[int]]:
    """What a drafter trains on: the teacher's targets over each prompt + answer at least `min_len` tokens long (its
    hidden states too with `keep_hidden`; `prompt_lens` where the answers start), the draft vocabulary they give,
    and the indices of the held-out sequences (whole groups, held_out)."""
    kept = [(p, a, g) for p, a, g in zip(prompts, answers, groups) if len(p + a) >= min_len]
    data = teacher_targets(teacher, [p + a for p, a, _ in kept], keep_hidden=keep_hidden)
    data.prompt_lens = [len(p) for p, _, _ in kept]
    return data, draft_vocab(data, vocab_size, [eos]), held_out([g for _, _, g in kept])


def distill(teacher: LlamaModel, prompts: list[list[int]], eos: int | None, layers: list[int], vocab_size: int,
            minutes: float, max_new: int = 128, max_steps: int | None = None, answers: list[list[int]] | None = None,
            groups: list | None = None, log=print) -> tuple[DraftModel, dict]:
    """The whole recipe on given prompts: generate (unless `answers` are given), teacher targets, vocabulary,
    student, training. `groups`: each prompt's group for the held-out split (default: its own)."""
    check_layers(teacher, layers)
    t0 = time.perf_counter()
    answers = answers if answers is not None else generate(teacher, prompts, max_new, eos)
    data, vocab, held = teacher_data(teacher, prompts, answers, groups or list(range(len(prompts))), eos,
                                     vocab_size)
    sequences = data.sequences
    student = make_student(teacher, layers, vocab)
    held_set = set(held)
    record = train(student, data, [i for i in range(len(sequences)) if i not in held_set], held, minutes,
                   max_steps=max_steps, log=log)
    record.update({"teacher_layers": layers, "prompts": len(prompts), "answer_tokens": sum(map(len, answers)),
                   "train_positions": sum(len(s) - 1 for i, s in enumerate(sequences) if i not in held_set),
                   "hidden_size": teacher.config.hidden_size, "total_minutes": (time.perf_counter() - t0) / 60})
    return student, record


def _medusa_examples(data: DistillData, idx: list[int], num_heads: int, answers_only: bool = False):
    """Positions t of the sequences `idx` with a target for every head (only inside answers, or anywhere):
    (hidden [N, hidden], per head d the teacher's top-k at t + d + 1 — head d guesses the token d + 1 places
    after the next)."""
    xs, ids, ps = [], [[] for _ in range(num_heads)], [[] for _ in range(num_heads)]
    for i in idx:
        a = data.answer_start(i) if answers_only else 0
        n = data.top_ids[i].shape[0] - num_heads
        if n <= a:
            continue
        xs.append(data.hidden[i][a:n])
        for d in range(num_heads):
            ids[d].append(data.top_ids[i][a + d + 1:d + 1 + n])
            ps[d].append(data.top_probs[i][a + d + 1:d + 1 + n])
    return torch.cat(xs), torch.stack([torch.cat(x) for x in ids]), torch.stack([torch.cat(x) for x in ps])


def medusa_rank_probs(heads: MedusaHeads, x: torch.Tensor, top_ids: torch.Tensor) -> list[list[float]]:
    """Per head, how often the teacher's next token there has each rank among the head's TOPK candidates
    (last entry: none of them)."""
    with torch.no_grad():
        cands = heads.vocab[heads(x).topk(TOPK, dim=-1).indices]  # [K, N, TOPK]
    hit = cands == top_ids[:, :, :1]
    rank = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(hit[..., 0], TOPK, dtype=torch.long))
    return [(torch.bincount(r, minlength=TOPK + 1).float() / r.numel()).tolist() for r in rank]


def train_medusa(target: LlamaModel, data: DistillData, num_heads: int, vocab: list[int], minutes: float,
                 max_steps: int | None = None, batch: int = 512, lr: float = 1e-3, seed: int = 0,
                 held: list[int] | None = None, log=print) -> tuple[MedusaHeads, dict]:
    """Medusa-1: the target frozen, each head's residual block trained with a KL loss to the target's own
    distribution d + 1 tokens further on (cosine-decayed AdamW over the time budget or max_steps). `held`:
    sequences kept out of training, where the heads are scored inside answers (default: every 8th)."""
    heads = MedusaHeads(target, num_heads, vocab)
    col = _vocab_columns(heads.vocab, target.config.vocab_size)
    held = held if held is not None else list(range(0, len(data.sequences), 8))
    held_set = set(held)
    x, t_ids, t_p = _medusa_examples(data, [i for i in range(len(data.sequences)) if i not in held_set], num_heads)
    hx, h_ids, h_p = _medusa_examples(data, held, num_heads, answers_only=True)
    cols, probs = _soft(t_ids, t_p, col)
    h_cols, h_probs = _soft(h_ids, h_p, col)

    def loss_of(xb, cb, pb):
        logp = torch.log_softmax(heads(xb), dim=-1)  # [K, B, V']
        return (pb * (pb.clamp(min=1e-12).log() - logp.gather(-1, cb))).sum(-1).mean(-1)  # KL per head

    def held_loss() -> list[float]:
        with torch.no_grad():
            return loss_of(hx, h_cols, h_probs).tolist()

    def batch_loss() -> torch.Tensor:
        pick = torch.randint(x.shape[0], (batch,), generator=gen)
        return loss_of(x[pick], cols[:, pick], probs[:, pick]).sum()

    before = held_loss()
    opt = torch.optim.AdamW(heads.blocks.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    # the best heads on held-out answers kept, every 100 steps (they overfit a small corpus too)
    run = fit(opt, _cosine_steps(opt, lr, minutes, max_steps), batch_loss, held_loss, before,
              heads.blocks.state_dict, heads.blocks.load_state_dict, 100, log, total=sum)
    heads.eval()
    ranks = medusa_rank_probs(heads, hx, h_ids)
    log("held-out KL per head " + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in zip(before, run.best))
        + "; top-1 accuracy per head " + ", ".join(f"{r[0]:.3f}" for r in ranks))
    return heads, {"steps": run.step, "best_step": run.best_step, "train_minutes": (time.perf_counter() - run.t0) / 60,
                   "train_positions": x.shape[0], "heldout_kl_before": before, "heldout_kl_after": run.best,
                   "heldout_rank_probs": ranks}


def _load_smollm2(threads: int | None):
    """SmolLM2-135M for distillation or Medusa training: (model, tokenizer, its EOS token id)."""
    from executor.model.weights import load_smollm2

    if threads:
        torch.set_num_threads(threads)
    stage("loading SmolLM2-135M")
    model, hf_config, tok = load_smollm2()
    eos = hf_config.eos_token_id[0] if isinstance(hf_config.eos_token_id, list) else hf_config.eos_token_id
    return model, tok, eos


def stage(text: str) -> None:
    """One line per stage of a long command, on stderr."""
    print(text, file=sys.stderr, flush=True)


def _warn_if_busy(load: CpuLoad, what: str) -> None:
    load.sample()
    warning = load.warning(what)
    if warning:
        print(warning, file=sys.stderr)


def cached_answers(teacher: LlamaModel, prompts: list[list[int]], eos: int | None, max_new: int,
                   log=print) -> list[list[int]]:
    """The teacher's greedy answers, kept in the cache folder (keyed by the prompts, max_new and the weights'
    checksum) so that distill and train-medusa generate them once."""
    key = hashlib.sha1(json.dumps([prompts, max_new, eos]).encode())
    key.update(str(teacher.lm_head.weight.detach().double().sum().item()).encode())
    path = default_draft_dir().parent / f"answers-{key.hexdigest()[:12]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    answers = generate(teacher, prompts, max_new, eos)
    log(f"teacher answered {len(prompts)} prompts: {sum(map(len, answers))} tokens "
        f"({(time.perf_counter() - t0) / 60:.1f} min)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(answers))
    except OSError:
        pass  # no writable cache: the next command generates them again
    return answers


def target_answers(threads: int | None, max_new: int) -> tuple[LlamaModel, int | None, list, list, list]:
    """SmolLM2-135M, its EOS token id, the training prompts with their groups, and its answers to them (cached):
    (target, eos, prompts, groups, answers)."""
    target, tok, eos = _load_smollm2(threads)
    prompts, groups = training_prompts(tok, corpus_ids(tok))
    stage(f"the target's answers to {len(prompts)} prompts (generated once, then cached)")
    return target, eos, prompts, groups, cached_answers(target, prompts, eos, max_new)


def distill_command(out: Path | None, layers: list[int], vocab_size: int, minutes: float, max_new: int,
                    threads: int | None) -> dict:
    """`infersim distill`: SmolLM2-135M's draft model, saved to `out` (default: default_draft_dir())."""
    out = out or default_draft_dir()
    load = CpuLoad()
    teacher, tok, eos = _load_smollm2(threads)
    check_layers(teacher, layers)  # before minutes of generation
    prompts, groups = training_prompts(tok, corpus_ids(tok))
    stage(f"the teacher's answers to {len(prompts)} prompts (generated once, then cached)")
    answers = cached_answers(teacher, prompts, eos, max_new)
    stage(f"distilling layers {layers} for up to {minutes:g} minutes")
    student, record = distill(teacher, prompts, eos, layers, vocab_size, minutes, max_new, answers=answers,
                              groups=groups)
    record.update({"teacher": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
                   "made": time.strftime("%Y-%m-%d %H:%M")})
    student.save(out, record)
    print(f"saved the draft model to {out} ({len(layers)} layers, vocabulary {len(student.vocab)}; held-out "
          f"agreement with the teacher {record['agreement_before']:.3f} -> {record['agreement_after']:.3f})")
    _warn_if_busy(load, "distillation")
    (out / "distill_log.json").write_text(json.dumps(record, indent=1))
    return record


def choose_tree(rank_probs: list[list[float]], profile: Path | None, max_size: int = 15,
                context: int = 256, draft_cost=None) -> tuple[list[tuple[int, ...]], list[dict]]:
    """The candidate tree with the most tokens per second at batch 1: for each size, the likeliest nodes
    (best_tree), their expected tokens per verify step over the step's time relative to a plain decode step,
    as the device's fitted profile predicts it (without a profile: a verify row costs as much as a decode), plus
    `draft_cost(tree)` decode steps of drafting where the drafter's time grows with the tree (EAGLE: a pass per
    depth)."""
    from sim.cost.fitted import FittedCostModel
    from sim.cost.pricer import StepPricer
    from sim.cost.speculation import best_tree, tree_expected_tokens
    from sim.policy.batch import shape_of

    pricer = StepPricer(FittedCostModel.load(profile)) if profile is not None and Path(profile).is_file() else None

    def step(n: int) -> float:  # the model's own forward: the tree's verify cost is what this chooses by
        return pricer.step_s(shape_of([n], [context + n], sampled=n, num_prefill=0)) if pricer else 1.0

    table = []
    for size in range(1, max_size + 1):
        tree = best_tree(rank_probs, size, TOPK)
        tokens = tree_expected_tokens(tree, rank_probs)
        ratio = step(1 + len(tree)) / step(1) + (draft_cost(tree) if draft_cost else 0.0)
        table.append({"size": len(tree), "expected_tokens": tokens, "cost_ratio": ratio, "speedup": tokens / ratio,
                      "tree": [list(p) for p in tree]})
    best = max(table, key=lambda row: row["speedup"])
    return [tuple(p) for p in best["tree"]], table


def retree_command(folder: Path | None, profile: Path | None) -> dict:
    """`infersim train-medusa --retree`: pick saved heads' candidate tree again from their held-out accuracies
    and a (new) profile, without training: the best tree size follows what a verify row costs on the device."""
    import json

    from executor.speculative.medusa import NAME

    meta_file = Path(folder or default_medusa_dir()) / f"{NAME}.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"no Medusa heads in {meta_file.parent} (train them with `infersim train-medusa`)")
    record = json.loads(meta_file.read_text())
    summary = pick_tree(record, profile)
    meta_file.write_text(json.dumps(record))
    print(f"{meta_file}: {summary}")
    return record


def pick_tree(record: dict, profile: Path | None) -> str:
    """Choose the candidate tree for heads' held-out accuracies (`record["heldout_rank_probs"]`) and the
    profile, store it (tree, the table it was picked from, the profile) in `record`; a one-line summary."""
    tree, table = choose_tree(record["heldout_rank_probs"], profile)
    record.update({"tree": [list(p) for p in tree], "tree_choice": table, "profile": str(profile) if profile else None})
    chosen = next(row for row in table if row["size"] == len(tree))
    return (f"tree of {len(tree)} nodes: {chosen['expected_tokens']:.2f} tokens per verify step expected, "
            f"step cost {chosen['cost_ratio']:.2f}x a decode")


def train_medusa_command(out: Path | None, num_heads: int, vocab_size: int, minutes: float, max_new: int,
                         threads: int | None, profile: Path | None) -> dict:
    """`infersim train-medusa`: Medusa heads for SmolLM2-135M and the candidate tree chosen for them."""
    out = out or default_medusa_dir()
    load = CpuLoad()
    target, eos, prompts, groups, answers = target_answers(threads, max_new)
    stage(f"training {num_heads} Medusa heads for up to {minutes:g} minutes, then choosing their tree")
    t0 = time.perf_counter()
    data, vocab, held = teacher_data(target, prompts, answers, groups, eos, vocab_size, keep_hidden=True)
    heads, record = train_medusa(target, data, num_heads, vocab, minutes, held=held)
    summary = pick_tree(record, profile)
    record.update({"teacher": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
                   "made": time.strftime("%Y-%m-%d %H:%M"), "total_minutes": (time.perf_counter() - t0) / 60})
    heads.save(out, record)
    print(f"saved {num_heads} Medusa heads to {out}; {summary}")
    _warn_if_busy(load, "training (its tree is chosen from timed steps)")
    return record

"""`infersim train-eagle`: an EAGLE head for SmolLM2-135M, trained on the CPU from the target's own answers (the
ones `infersim distill` and `train-medusa` cache) with the target frozen.

Each training sequence is a prompt and the target's greedy answer; one target forward gives its final hidden state
f_i and its top-k next-token distribution at every position. At position i the head reads (x_{i+1}, f_i) and learns,
with a KL loss to the target's distribution at i + 1, the token after next. Chained drafting feeds the head its own
output instead of f_i, so training unrolls the chain as it runs when serving (EAGLE-3's "training-time test"):
step j's query at position i reads the step-(j-1) output at i - 1, and attends to the real positions up to its
chain's root (i - j + 1) and to the chain's own entries after it, one per earlier step. Held-out sequences (whole
groups: a paragraph's or a topic's prompts) score the head as serving would see it: per depth, the rank of the
target's token among the head's candidates given the depths before were right.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from executor.core.cpu_load import CpuLoad
from executor.model.layers import apply_rope
from executor.speculative.eagle import EagleHead, default_eagle_dir
from executor.speculative.medusa import TOPK
from executor.training.speculative import (
    DistillData,
    _cosine_steps,
    _soft,
    _vocab_columns,
    _warn_if_busy,
    choose_tree,
    fit,
    stage,
    target_answers,
    teacher_data,
)


def _qkv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k, v [B, heads, T, head_dim] of decoder layer `layer` for inputs x [B, T, hidden], rotated."""
    attn = layer.self_attn
    b, t, _ = x.shape
    q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = apply_rope(q.reshape(b, t, attn.num_heads, attn.head_dim), cos, sin).transpose(1, 2)
    k = apply_rope(k.reshape(b, t, attn.num_kv_heads, attn.head_dim), cos, sin).transpose(1, 2)
    return q, k, v.reshape(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)


def chain_mask(t: int, step: int) -> torch.Tensor:
    """[t, step · t] bool: what step `step`'s query at each position attends to among the keys of steps 1..step
    (laid side by side): step 1's up to its chain's root i - step + 1, and step m's (m ≥ 2) at i - step + m."""
    i = torch.arange(t).unsqueeze(1)
    p = torch.arange(t).unsqueeze(0)
    blocks = [p <= i - step + 1] + [p == i - step + m for m in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs [B, T, hidden] at every position for chain steps 1..steps, teacher-forced: position i's
    token is x_{i+1} (`tokens` [B, T]); step 1 reads the target's hidden states (`features` [B, T, hidden]), step j
    the step-(j-1) output one position back. Differentiable; the same weights and math as serving."""
    layer = head.model.layers[0]
    attn = layer.self_attn
    b, t = tokens.shape
    cos, sin = head.model.rotary(torch.arange(t, device=tokens.device))
    ks, vs, outs = [], [], []
    feat = features
    for step in range(1, steps + 1):
        x = head.inputs(tokens, feat)
        q, k, v = _qkv(layer, x, cos, sin)
        ks.append(k)
        vs.append(v)
        mask = chain_mask(t, step).to(tokens.device)
        o = F.scaled_dot_product_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), attn_mask=mask,
                                           enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        outs.append(x)
        feat = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # the next step reads one position back
    return outs


def _batch(data: DistillData, idx: list[int], col: torch.Tensor, seq_len: int, prompt_weight: float):
    """Padded inputs of sequences `idx`: tokens x_{i+1} [B, T], the target's hidden states f_i [B, T, hidden], soft
    targets for x_{i+2} (vocabulary columns and probabilities [B, T, k]), and each position's weight as a chain's
    root (1 where a chain starting there drafts answer tokens, `prompt_weight` in the prompt, 0 in padding)."""
    t = min(seq_len, max(len(data.sequences[i]) - 2 for i in idx))
    k = data.top_ids[0].shape[1]
    tokens = torch.zeros(len(idx), t, dtype=torch.long)
    feats = torch.zeros(len(idx), t, data.hidden[0].shape[1])
    tgt_ids = torch.zeros(len(idx), t, k, dtype=torch.long)
    tgt_p = torch.zeros(len(idx), t, k)
    weight = torch.zeros(len(idx), t)
    for row, i in enumerate(idx):
        seq = data.sequences[i]
        m = min(t, len(seq) - 2)
        tokens[row, :m] = torch.tensor(seq[1:m + 1])
        feats[row, :m] = data.hidden[i][:m]
        tgt_ids[row, :m] = data.top_ids[i][1:m + 1]
        tgt_p[row, :m] = data.top_probs[i][1:m + 1]
        weight[row, :m] = prompt_weight
        weight[row, data.answer_start(i):m] = 1.0
    cols, probs = _soft(tgt_ids, tgt_p, col)
    return tokens, feats, cols, probs, weight, tgt_ids[..., 0]


def chain_loss(head: EagleHead, batch, steps: int, decay: float = 0.8) -> torch.Tensor:
    """KL(target ‖ head) per position, summed over the chain's steps (step j weighted decay^(j-1)), each step's
    position weighted by its chain root's weight."""
    tokens, feats, cols, probs, weight, _ = batch
    total = norm = 0.0
    for j, out in enumerate(unrolled(head, tokens, feats, steps)):
        w = torch.cat([torch.zeros_like(weight[:, :j]), weight[:, :weight.shape[1] - j]], dim=1)  # root i - j
        at = w > 0  # the LM head and softmax only where the loss counts: most of the step's time
        logp = torch.log_softmax(head.logits(out[at]).float(), dim=-1)
        p = probs[at]
        kl = (p * (p.clamp(min=1e-12).log() - logp.gather(-1, cols[at]))).sum(-1)
        total = total + decay ** j * (kl * w[at]).sum()
        norm += decay ** j * float(w.sum())
    return total / max(norm, 1e-9)


@torch.no_grad()
def chain_rank_probs(head: EagleHead, data: DistillData, idx: list[int], steps: int,
                     seq_len: int = 512) -> list[list[float]]:
    """Per depth, how often the target's token has each rank among the head's TOPK candidates there (last entry:
    none of them), over the chains rooted in answers whose earlier depths the head got right (first choice)."""
    col = _vocab_columns(head.vocab, head.model.embed_tokens.weight.shape[0])
    counts = torch.zeros(steps, TOPK + 1)
    for i in idx:
        tokens, feats, _, _, weight, truth = _batch(data, [i], col, seq_len, 0.0)
        right = torch.ones_like(weight, dtype=torch.bool) & (weight > 0)  # roots in the answer
        for j, out in enumerate(unrolled(head, tokens, feats, steps)):
            cands = head.vocab[head.logits(out).topk(TOPK, dim=-1).indices]  # [1, T, TOPK]
            hit = cands == truth.unsqueeze(-1)
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(truth, TOPK))
            at = rank[:, j:]  # depth j + 1 of the chain rooted at r sits at position r + j
            live = right[:, :at.shape[1]]
            counts[j] += torch.bincount(at[live], minlength=TOPK + 1).float()
            right = live & (at == 0)
    return [(c / c.sum()).tolist() if c.sum() else [0.0] * TOPK + [1.0] for c in counts]


def train_eagle(target, data: DistillData, vocab: list[int], minutes: float, steps: int = 3,
                max_steps: int | None = None, batch: int = 8, seq_len: int = 320, lr: float = 1e-3,
                prompt_weight: float = 0.0, seed: int = 0, eval_every: int = 20, held: list[int] | None = None,
                log=print) -> tuple[EagleHead, dict]:
    """The head trained with chain_loss over `steps` unrolled steps (AdamW, cosine-decayed over the time budget or
    max_steps), the best weights on held-out sequences kept (they overfit a small corpus). `held`: sequences kept
    out of training, where it is scored (default: every 8th)."""
    head = EagleHead(target, vocab)
    col = _vocab_columns(head.vocab, target.config.vocab_size)
    held = held if held is not None else list(range(0, len(data.sequences), 8))
    held_set = set(held)
    train_idx = [i for i in range(len(data.sequences)) if i not in held_set]
    params = [p for n, p in head.named_parameters() if not n.startswith(("model.embed_tokens", "model.lm_head"))]
    for p in head.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    held_batch = _batch(data, held, col, seq_len, 0.0)

    def held_loss() -> float:
        with torch.no_grad():
            return chain_loss(head, held_batch, steps).item()

    def batch_loss() -> torch.Tensor:
        first = int(torch.randint(max(1, len(by_length) - batch + 1), (1,), generator=gen))
        return chain_loss(head, _batch(data, by_length[first:first + batch], col, seq_len, prompt_weight), steps)

    before = held_loss()
    ranks_before = chain_rank_probs(head, data, held, steps)
    log(f"held-out: loss {before:.3f}, first-choice acceptance by depth "
        + ", ".join(f"{r[0]:.3f}" for r in ranks_before) + " before training")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    by_length = sorted(train_idx, key=lambda i: len(data.sequences[i]))  # batches of similar lengths: little padding
    cpu0 = time.process_time()
    run = fit(opt, _cosine_steps(opt, lr, minutes, max_steps), batch_loss, held_loss, before,
              head.trainable_state_dict, lambda state: head.load_state_dict(state, strict=False), eval_every, log,
              clip=params)
    for p in params:
        p.requires_grad_(False)
    head.eval()
    ranks = chain_rank_probs(head, data, held, steps)
    log(f"held-out after {run.step} steps (best at step {run.best_step}): loss {run.best:.3f}, first-choice "
        "acceptance by depth " + ", ".join(f"{r[0]:.3f}" for r in ranks))
    return head, {"steps": run.step, "best_step": run.best_step, "train_minutes": (time.perf_counter() - run.t0) / 60,
                  "train_cpu_minutes": (time.process_time() - cpu0) / 60,  # on a shared machine: what it got
                  "unrolled_steps": steps, "train_sequences": len(train_idx),
                  "heldout_loss_before": before, "heldout_loss_after": run.best,
                  "heldout_rank_probs_before": ranks_before, "heldout_rank_probs": ranks}


def draft_step_ratio(target, head: EagleHead, context: int = 256, repeats: int = 30) -> float:
    """One draft pass of the head (a one-token row at `context`: its fused input, layer, logits and candidates) over
    one decode step of the target at batch 1, both timed here, interleaved (medians): what each depth of a chain
    costs, in decode steps."""
    import statistics

    from executor.model.attention import AttentionMetadata
    from executor.model.cache_engine import KVCache

    blocks = -(-(context + 1) // 16)
    tok = torch.tensor([1])
    feat = torch.zeros(1, head.model.config.hidden_size)

    def timed(model, forward):
        kv = KVCache.for_model(model.config, blocks, 16, dtype=model.embed_tokens.weight.dtype)

        def run() -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                meta = AttentionMetadata.build([1], [context + 1], [list(range(blocks))], 16)
                forward(meta, kv)
            return time.perf_counter() - t
        return run

    plain = timed(target, lambda meta, kv: target.compute_logits(target(tok, meta.positions(), meta, kv,
                                                                         last_of=[0])))
    draft = timed(head.model, lambda meta, kv: head.logits(head.model(
        None, meta.positions(), meta, kv, hidden=head.inputs(tok, feat), final=False)).topk(TOPK, dim=-1))
    target_s, head_s = [], []
    for _ in range(repeats):
        target_s.append(plain())
        head_s.append(draft())
    return statistics.median(head_s) / statistics.median(target_s)


def train_eagle_command(out: Path | None, vocab_size: int, minutes: float, max_new: int, threads: int | None,
                        profile: Path | None, steps: int) -> dict:
    """`infersim train-eagle`: an EAGLE head for SmolLM2-135M and its chain or tree, saved to `out` (default: the
    shipped folder)."""
    out = out or default_eagle_dir()
    load = CpuLoad()
    target, eos, prompts, groups, answers = target_answers(threads, max_new)
    stage(f"training an EAGLE head ({steps} chained steps) for up to {minutes:g} minutes, then choosing its drafts")
    t0 = time.perf_counter()
    data, vocab, held = teacher_data(target, prompts, answers, groups, eos, vocab_size, min_len=3, keep_hidden=True)
    head, record = train_eagle(target, data, vocab, minutes, steps, held=held)
    record["draft_step_ratio"] = draft_step_ratio(target, head)
    summary = pick_drafts(record, profile)
    _warn_if_busy(load, "training (its drafts are chosen from timed steps)")
    record.update({"teacher": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
                   "made": time.strftime("%Y-%m-%d %H:%M"), "total_minutes": (time.perf_counter() - t0) / 60,
                   "other_processes_cores": round(load.mean_others, 2)})  # cores others used meanwhile
    head.save(out, record)
    print(f"saved an EAGLE head to {out}; {summary}")
    return record


def pick_drafts(record: dict, profile: Path | None) -> str:
    """The chain or tree with the most tokens per second at batch 1 for the head's held-out rank probabilities,
    the device's fitted verify cost and the head's measured pass per depth; stored in `record`."""
    ratio = record["draft_step_ratio"]
    tree, table = choose_tree(record["heldout_rank_probs"], profile, max_size=8,
                              draft_cost=lambda t: ratio * max(len(p) for p in t))
    record.update({"tree": [list(p) for p in tree], "tree_choice": table, "profile": str(profile) if profile else None})
    chosen = next(row for row in table if row["size"] == len(tree))
    shape = "chain" if all(p == (0,) * len(p) for p in tree) else "tree"
    return (f"a {shape} of {len(tree)} drafts: {chosen['expected_tokens']:.2f} tokens per verify step expected, "
            f"the step and its drafting {chosen['cost_ratio']:.2f}x a decode")

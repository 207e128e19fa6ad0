"""Speculative decoding on the real executor (issue 5): each drafter against plain decoding, side by side.

SmolLM2-135M-Instruct, fp32, greedy, 2 threads, every request stopping at EOS or `--max-new` tokens.
Five prompt sets, each through the model's chat template:
  - repeat: repeat a paragraph of plain modern English (notices written for the project, executor/data)
    word for word — the task on which transformers' prompt lookup was measured at 3.8x on a reference machine;
    the model copies these nearly verbatim (it drops or adds a comma, a word);
  - repeat_1776: the same, on paragraphs of the Declaration of Independence, whose 1776 English the model only
    partly copies (it modernizes it, skips sentences, and on one paragraph falls into a loop);
  - summarize: summarize a plain paragraph in two sentences — input-grounded, the model reuses its phrases;
  - rewrite: rewrite a Declaration paragraph in modern English — input-grounded, but the model paraphrases;
  - chat: open questions whose answers are not in the prompt.
Two loads: batch 1 (requests one after another) and continuous batching (all submitted at once,
max_num_seqs = --batch). For each drafter and setting it runs plain decoding and speculative decoding
interleaved (plain, spec, plain, spec ... `--repeats` times; the medians are compared) and prints α (the
per-draft acceptance, maximum likelihood), the mean accepted length per verify step, output tokens/s of
both, the speedup, and whether the outputs are token for token those of plain greedy decoding.
Prompt lookup at batch 1 also runs with its drafts cut to the part that will be accepted (it is given the plain
run's output): the ceiling of any rule for how many of a match's tokens to draft. And it runs through
transformers (`generate` plain and with `prompt_lookup_num_tokens` = γ, interleaved the same way) on the same
prompts, so both engines' speedups are measured side by side on this machine.

Drafters: prompt lookup (ngram), the distilled draft model (`infersim distill`), Medusa heads with their
candidate tree (`infersim train-medusa`; the heads shipped in executor/data) and the EAGLE head with its chain or
tree (`infersim train-eagle`; shipped in executor/data). The trained drafters never saw these prompts (their
training prompts exclude paragraphs 0-5 and these questions). At batch 1 every drafter's acceptance by position is
measured too: of the verify steps whose drafts reached position j (a tree's depth j), the share that accepted it,
given the positions before it were accepted. A last table puts the drafters side by side per task and load.
Usage: python bench/spec_decode.py [--quick] [--gamma 10] [--gamma-cb 4] [--draft-gamma 3] [--batch 8]
       [--draft DIR] [--medusa DIR] [--eagle DIR] [--only prompt_lookup draft_model medusa eagle]
       [--tasks repeat ... chat] [--no-hf]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor.core.build import make_engine, run_offline  # noqa: E402
from executor.core.engine import SamplingParams  # noqa: E402
from executor.core.malloc_tuning import keep_freed_memory  # noqa: E402
from executor.core.prompts import paragraphs, plain_paragraphs  # noqa: E402
from executor.model.weights import load_hf_model, smollm2_gguf_path  # noqa: E402
from executor.speculative.draft_model import DraftModelDrafter, default_draft_dir, load_draft  # noqa: E402
from executor.speculative.eagle import EagleDrafter, default_eagle_dir, load_eagle  # noqa: E402
from executor.speculative.medusa import MedusaDrafter, default_medusa_dir, load_medusa  # noqa: E402
from executor.speculative.ngram import PromptLookup  # noqa: E402
from sim.config.plan import scheduler_config  # noqa: E402
from sim.policy.block_manager import BlockAllocator  # noqa: E402
from sim.policy.scheduler import make_scheduler  # noqa: E402
from sim.report.metrics import speculation_summary  # noqa: E402

THREADS = 2
CHAT_QUESTIONS = [
    "What are three good habits for staying healthy?",
    "Explain what a black hole is to a child.",
    "Give me some ideas for a birthday party.",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "What should I pack for a weekend camping trip?",
    "Write a short poem about the ocean.",
    "What is the difference between weather and climate?",
]


REPEAT = "Repeat the following text exactly, word for word:\n\n{p}"
TASKS = {"repeat": (REPEAT, plain_paragraphs), "repeat_1776": (REPEAT, paragraphs),
         "summarize": ("Summarize the following text in two sentences:\n\n{p}", plain_paragraphs),
         "rewrite": ("Rewrite the following text in modern English, keeping its meaning:\n\n{p}", paragraphs)}


def task_prompts(tok, task: str, n: int) -> list[list[int]]:
    if task in TASKS:
        template, source = TASKS[task]
        texts = [template.format(p=p) for p in source(n)]
    else:
        texts = (CHAT_QUESTIONS * (n // len(CHAT_QUESTIONS) + 1))[:n]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok(c, add_special_tokens=False).input_ids for c in chats]


class KnownOutputLookup(PromptLookup):
    """Prompt lookup whose drafts are cut where they would be rejected, because it is given each request's
    greedy output (from a plain run). Not a drafter to serve with: it measures the ceiling of any rule for how
    many of a match's tokens to draft, on this machine and these outputs."""

    def __init__(self, references: list[list[int]], **kw):
        super().__init__(**kw)
        self.references = references  # prompt + plain greedy output, per request

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        drafts = super().propose(token_ids, k)
        ref = next(r for r in self.references if r[:len(token_ids)] == token_ids)
        future = ref[len(token_ids):]
        n = 0
        while n < min(len(drafts), len(future)) and drafts[n] == future[n]:
            n += 1
        return drafts[:n]


def serve(model, prompts, max_new, max_num_seqs, drafter, gamma, eos) -> tuple[float, list[list[int]], dict | None]:
    """Run the prompts (one at a time if max_num_seqs is 1, else all at once); (seconds, outputs, speculation)."""
    cfg = scheduler_config(2048, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                          num_speculative_tokens=gamma if drafter else 0)
    engine = make_engine(model, make_scheduler(cfg, BlockAllocator(1024, 16)), SamplingParams(ignore_eos=False),
                         eos_token_id=eos, drafter=drafter)
    t0 = time.perf_counter()
    if max_num_seqs == 1:  # one at a time: each request alone in the engine
        reqs = [run_offline(engine, [p], [max_new])[0] for p in prompts]
    else:
        reqs = run_offline(engine, prompts, [max_new] * len(prompts))
    wall = time.perf_counter() - t0
    spec = np.array([(r.num_drafted, r.num_accepted, r.num_verify_steps, r.num_rejections) for r in reqs])
    outputs = [engine.output_ids(r) for r in reqs]
    if not drafter:
        return wall, outputs, None
    summary = speculation_summary(spec, np.array([len(o) for o in outputs]))
    if max_num_seqs == 1:  # one row a step: the step's counts are the row's
        summary["by_position"] = acceptance_by_position(engine.records, getattr(drafter, "tree", None))
    return wall, outputs, summary


def acceptance_by_position(records, tree=None, positions: int = 3) -> list[float | None]:
    """Per draft position j (a tree's depth), of the verify steps whose drafts reached j with the positions before
    it accepted, the share that accepted j; one row per step (batch 1). `tree`: the drafter's candidate tree (the
    first n nodes of it are drafted), else the drafts are a chain."""
    reached, kept = np.zeros(positions), np.zeros(positions)
    for r in records:
        if not r.num_drafted:
            continue
        depth = max(len(p) for p in tree[:r.num_drafted]) if tree else r.num_drafted
        for j in range(min(depth, positions, r.num_accepted + 1)):
            reached[j] += 1
            kept[j] += j < r.num_accepted
    return [float(k / n) if n else None for k, n in zip(kept, reached)]


def interleaved(run_plain, run_spec, repeats: int) -> tuple[dict, object]:
    """Plain and speculative runs alternated `repeats` times (each returns (seconds, outputs, extra)), their
    medians compared; (speeds, speedup and whether the outputs match; the last speculative run's extra)."""
    plain_t, spec_t = [], []
    for _ in range(repeats):
        t, plain_out, _ = run_plain()
        plain_t.append(t)
        t, spec_out, extra = run_spec()
        spec_t.append(t)
    tokens = sum(len(o) for o in plain_out)
    plain_s, spec_s = statistics.median(plain_t), statistics.median(spec_t)
    return {"tokens": tokens, "plain_tok_s": tokens / plain_s, "spec_tok_s": sum(len(o) for o in spec_out) / spec_s,
            "speedup": plain_s / spec_s, "identical": spec_out == plain_out, "plain_outputs": plain_out}, extra


def compare(model, prompts, max_new, batch, drafter, gamma, eos, repeats) -> dict:
    """`drafter`: makes a fresh drafter for each run."""
    r, spec = interleaved(lambda: serve(model, prompts, max_new, batch, None, 0, eos),
                          lambda: serve(model, prompts, max_new, batch, drafter(), gamma, eos), repeats)
    return {**r, "alpha": spec["alpha"], "mean_accepted": spec["mean_accepted_length"],
            "acceptance": spec["acceptance_rate"], "by_position": spec.get("by_position")}


def compare_hf(hf, prompts, max_new, gamma, repeats, ours_plain) -> dict:
    """transformers' prompt lookup against its own plain `generate`, one request at a time (interleaved,
    medians), on the same prompts; also whether its plain greedy output equals infersim's."""
    def run(lookup):
        t, outs = time.perf_counter(), []
        for p in prompts:
            kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
            out = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, **kw)
            outs.append(out[0, len(p):].tolist())
        return time.perf_counter() - t, outs, None
    r, _ = interleaved(lambda: run(0), lambda: run(gamma), repeats)
    return {**r, "same_as_infersim": r["plain_outputs"] == ours_plain}


def load_drafters(args, model) -> dict:
    """name -> (make a fresh drafter, γ at batch 1, γ under load), for every drafter there is (the trained ones are
    skipped, with a line, where they have not been made)."""
    drafters = {"prompt_lookup": (lambda: PromptLookup(max_ngram=3, min_ngram=1), args.gamma, args.gamma_cb)}
    draft_dir = args.draft or default_draft_dir()
    try:
        draft = load_draft(draft_dir, model)
        drafters["draft_model"] = (lambda: DraftModelDrafter(draft, SamplingParams(), max_num_seqs=max(1, args.batch),
                                                                max_model_len=2048), args.draft_gamma, args.draft_gamma)
        print(f"draft model {draft_dir}: {draft.config.num_layers} layers, vocabulary {len(draft.vocab)}")
    except FileNotFoundError:
        print(f"no draft model in {draft_dir} (make one with `infersim distill`): its rows are skipped")
    medusa_dir = args.medusa or default_medusa_dir()
    try:
        heads = load_medusa(medusa_dir, model)
        tree = [tuple(p) for p in heads.meta["tree"]]
        drafters["medusa"] = (lambda: MedusaDrafter(heads, tree), len(tree), len(tree))
        print(f"Medusa {medusa_dir}: {heads.num_heads} heads, tree of {len(tree)} nodes")
    except FileNotFoundError:
        print(f"no Medusa heads in {medusa_dir} (train them with `infersim train-medusa`): their rows are skipped")
    eagle_dir = args.eagle or default_eagle_dir()
    try:
        head = load_eagle(eagle_dir, model)
        drafts = [tuple(p) for p in head.meta["tree"]]
        drafters["eagle"] = (lambda: EagleDrafter(head, drafts), len(drafts), len(drafts))
        shape = "chain" if all(p == (0,) * len(p) for p in drafts) else "tree"
        print(f"EAGLE {eagle_dir}: one layer, vocabulary {len(head.vocab)}, a {shape} of {len(drafts)} drafts")
    except FileNotFoundError:
        print(f"no EAGLE head in {eagle_dir} (train one with `infersim train-eagle`): its rows are skipped")
    return drafters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a smoke run)")
    ap.add_argument("--gamma", type=int, default=10, help="prompt lookup: most drafts per verify step at batch 1 "
                    "(transformers' prompt_lookup_num_tokens is 10 in its docs)")
    ap.add_argument("--gamma-cb", type=int, default=4, help="prompt lookup: most drafts per verify step under the "
                    "continuous-batching load (on this CPU a verify row of 5 tokens costs ~1.3x a decode row at batch 1, "
                    "~1.6x in a batch of 8)")
    ap.add_argument("--draft-gamma", type=int, default=3, help="γ of the draft model (each draft costs a pass)")
    ap.add_argument("--draft", type=str, default=None, help="draft model folder (default: infersim distill's)")
    ap.add_argument("--medusa", type=str, default=None, help="Medusa heads folder (default: the shipped ones)")
    ap.add_argument("--eagle", type=str, default=None, help="EAGLE head folder (default: the shipped one)")
    ap.add_argument("--only", nargs="+", choices=["prompt_lookup", "draft_model", "medusa", "eagle"], default=None,
                    help="drafters to run (default: all)")
    ap.add_argument("--tasks", nargs="+", choices=[*TASKS, "chat"], default=[*TASKS, "chat"])
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' prompt lookup")
    ap.add_argument("--batch", type=int, default=8, help="max_num_seqs of the continuous-batching load")
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    keep_freed_memory()  # the engine sets it; set first so transformers' runs get the same allocator
    n_prompts = 2 if args.quick else 6
    max_new = args.max_new or (48 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 2)

    model, _, tok = load_hf_model(smollm2_gguf_path())
    eos = tok.eos_token_id
    drafters = load_drafters(args, model)
    if args.only:
        drafters = {k: v for k, v in drafters.items() if k in args.only}
    hf = None
    if "prompt_lookup" in drafters and not args.no_hf:
        from executor.model.weights import load_transformers_model

        path = smollm2_gguf_path()
        hf, _ = load_transformers_model(str(path.parent), path.name)
    serve(model, task_prompts(tok, "chat", 1), 8, 1, None, 0, eos)  # warm-up
    rows = []
    print(f"SmolLM2-135M fp32, greedy, {THREADS} threads, γ ≤ {args.gamma} (lookup, batch 1) / {args.gamma_cb} (lookup, "
          f"cb{args.batch}) / {args.draft_gamma} (draft model), "
          f"up to {max_new} new tokens, "
          f"median of {repeats} interleaved runs")
    print(f"{'drafter':14s} {'task':11s} {'load':8s} {'tokens':>6s} {'α':>5s} {'acc/step':>8s} {'plain tok/s':>11s} "
          f"{'spec tok/s':>10s} {'speedup':>7s} identical  accepted by position (batch 1)")
    for name, (make, gamma, gamma_cb) in drafters.items():
        for task in args.tasks:
            prompts = task_prompts(tok, task, n_prompts)
            for load, batch, g in (("batch1", 1, gamma), (f"cb{args.batch}", args.batch, gamma_cb)):
                r = compare(model, prompts, max_new, batch, make, g, eos, repeats)
                rows.append((name, task, load, r))
                print(f"{name:14s} {task:11s} {load:8s} {r['tokens']:6d} {r['alpha'] or 0:5.2f} {r['mean_accepted'] or 0:8.2f} "
                      f"{r['plain_tok_s']:11.1f} {r['spec_tok_s']:10.1f} {r['speedup']:6.2f}x {'yes' if r['identical'] else 'NO':9s}"
                      f"{_positions(r.get('by_position'))}", flush=True)
                if name == "prompt_lookup" and batch == 1:  # the same matches, drafts cut to what is accepted
                    refs = [p + o for p, o in zip(prompts, r["plain_outputs"])]
                    c = compare(model, prompts, max_new, 1, lambda: KnownOutputLookup(refs, max_ngram=3, min_ngram=1),
                                g, eos, repeats)
                    rows.append(("prompt_lookup_ceiling", task, load, c))
                    print(f"{'  ceiling':14s} {task:11s} {load:8s} {c['tokens']:6d} {c['alpha'] or 0:5.2f} "
                          f"{c['mean_accepted'] or 0:8.2f} {c['plain_tok_s']:11.1f} {c['spec_tok_s']:10.1f} "
                          f"{c['speedup']:6.2f}x {'yes' if c['identical'] else 'NO'}", flush=True)
                if hf is not None and name == "prompt_lookup" and batch == 1:
                    h = compare_hf(hf, prompts, max_new, gamma, repeats, r["plain_outputs"])
                    rows.append(("hf_prompt_lookup", task, load, h))
                    print(f"{'transformers':14s} {task:11s} {load:8s} {'':6s} {'':5s} {'':8s} {h['plain_tok_s']:11.1f} "
                          f"{h['spec_tok_s']:10.1f} {h['speedup']:6.2f}x {'yes' if h['identical'] else 'NO'} "
                          f"(plain output = infersim's: {'yes' if h['same_as_infersim'] else 'no'})", flush=True)
    side_by_side(rows, [n for n in drafters])
    for name, task, load, r in rows:
        key = f"{name}_{task}_{load}"
        print(f"{key}_speedup: {r['speedup']:.2f}")
        if "alpha" in r:
            print(f"{key}_alpha: {r['alpha'] or 0:.3f}")
        for j, a in enumerate(r.get("by_position") or []):
            if a is not None:
                print(f"{key}_accepted_position{j + 1}: {a:.3f}")
    print(f"outputs_identical: {all(r['identical'] for *_, r in rows)}")


def _positions(by_position) -> str:
    return " / ".join("-" if a is None else f"{a:.2f}" for a in by_position) if by_position else ""


def side_by_side(rows, names: list[str]) -> None:
    """Per task and load, each drafter's speedup and (batch 1) acceptance by position on one line."""
    print("\nside by side: speedup (accepted by position at batch 1)")
    print(f"{'task':11s} {'load':8s} " + " ".join(f"{n:>26s}" for n in names))
    cells = {(n, t, ld): r for n, t, ld, r in rows}
    for task, load in dict.fromkeys((t, ld) for _, t, ld, _ in rows):
        line = []
        for n in names:
            r = cells.get((n, task, load))
            line.append(f"{'':>26s}" if r is None else f"{r['speedup']:5.2f}x {_positions(r.get('by_position')):>19s}")
        print(f"{task:11s} {load:8s} " + " ".join(line))


if __name__ == "__main__":
    main()

"""Model compression on the real executor (issue 31), side by side in one run: SmolLM2-135M on the CPU as fp32, with
int8 weights (per-channel scales), int4 weights (group-wise scales), int8 weights + an int8 KV cache, and 2:4
magnitude-pruned weights (dense on the CPU: no sparse kernels, so no speedup is expected there).

Per configuration: decode tokens/s at batch 1 and 16 (engine decode steps over 128-token contexts), prompt tokens/s
(one 512-token prompt step), the weights' bytes, perplexity over held-out text shipped with the project
(executor/data/heldout_prose.txt, never a prompt anywhere), and greedy agreement with fp32 over 8 prompts cut from
the shipped corpus (32 new tokens each; tokens up to the first difference). Timings alternate between the
configurations round by round (`--rounds`) and each figure is the median of its rounds, so every ratio is taken on
the same minutes of this machine. Each is printed as a ratio to fp32. A decode figure is the median of 24 steps after
the batch's first decode on a fresh engine: the window is not biased against the faster configurations (checked on
SmolLM2 at batch 1, fp32 / int8 / int4, 3 interleaved rounds: steps 1-24 and 20-99 of the same engines gave the same
speedups, 2.42x / 2.38x int8 and 2.64x / 2.63x int4); what moves a figure between runs is other load on the machine.

Usage: python bench/compression.py [--rounds 5] [--threads 2] [--only fp32 int8 ...] [--quick]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from executor.core.build import make_engine  # noqa: E402
from executor.core.engine import SamplingParams  # noqa: E402
from executor.core.prompts import corpus_ids, prompt_ids  # noqa: E402
from executor.model.quality import agreement, heldout_ids, perplexity  # noqa: E402
from executor.model.quantize import quantize_weights, weight_bytes  # noqa: E402
from executor.model.sparsity import prune_model_2_4, sparsity  # noqa: E402
from executor.model.weights import load_hf_model, smollm2_gguf_path  # noqa: E402
from sim.config.plan import scheduler_config  # noqa: E402
from sim.policy.block_manager import BlockAllocator  # noqa: E402
from sim.policy.request import Request  # noqa: E402
from sim.policy.scheduler import make_scheduler  # noqa: E402

# name -> (weight_dtype or None, kv_dtype or None, 2:4 pruned)
CONFIGS = {"fp32": (None, None, False), "int8": ("int8", None, False), "int4": ("int4", None, False),
           "int8_kv8": ("int8", "int8", False), "sparse_2_4": (None, None, True)}
CONTEXT = 128  # tokens each decode row has in the cache while it is timed
PROMPT = 512  # tokens of the timed prompt step
BLOCK = 16


def build(base, name: str):
    """A copy of the fp32 model compressed as `name` says, and its KV dtype."""
    weight_dtype, kv_dtype, pruned = CONFIGS[name]
    model = copy.deepcopy(base)
    if weight_dtype:
        quantize_weights(model, weight_dtype)
    if pruned:
        prune_model_2_4(model)
    return model, kv_dtype


def engine_for(model, kv_dtype, batch: int, max_len: int):
    cfg = scheduler_config(max_len, max_num_seqs=batch, max_num_batched_tokens=max(PROMPT, batch * CONTEXT))
    blocks = batch * (-(-max_len // BLOCK)) + 4
    policy = make_scheduler(cfg, BlockAllocator(blocks, BLOCK))
    return make_engine(model, policy, SamplingParams(ignore_eos=True), kv_dtype=kv_dtype)


def decode_step_s(model, kv_dtype, batch: int, corpus: list[int], steps: int) -> float:
    """Median time of `steps` decode steps of `batch` rows, each with CONTEXT tokens of context."""
    engine = engine_for(model, kv_dtype, batch, CONTEXT + steps + 8)
    reqs = [Request(i, 0.0, CONTEXT, steps + 4) for i in range(batch)]
    for r in reqs:
        engine.add(r, prompt_ids(corpus, CONTEXT, r.id))
    while any(len(engine.tokens[r]) <= r.prompt_len for r in reqs):
        engine.step()  # the prompts
    engine.step()  # the first decode of this batch (its shapes may still be new)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompt_step_s(model, kv_dtype, corpus: list[int]) -> float:
    """Time of one PROMPT-token prompt step (the engine's whole step)."""
    engine = engine_for(model, kv_dtype, 1, PROMPT + 8)
    engine.add(Request(0, 0.0, PROMPT, 2), prompt_ids(corpus, PROMPT, 0))
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def greedy(model, kv_dtype, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    engine = engine_for(model, kv_dtype, len(prompts), max(map(len, prompts)) + new_tokens + 8)
    reqs = [Request(i, 0.0, len(p), new_tokens) for i, p in enumerate(prompts)]
    for r, p in zip(reqs, prompts):
        engine.add(r, p)
    while engine.has_work():
        engine.step()
    return [engine.output_ids(r) for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer steps, a shorter perplexity text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = ["fp32"] + [n for n in args.only if n != "fp32"]
    rounds, steps = (2, 8) if args.quick else (args.rounds, 24)

    base, _, tokenizer = load_hf_model(smollm2_gguf_path())
    base.eval()
    corpus = corpus_ids(tokenizer)
    held = heldout_ids(tokenizer)[:600 if args.quick else None]
    prompts = [prompt_ids(corpus, 48 + 8 * i, 100 + i) for i in range(8)]
    models = {n: build(base, n) for n in names}
    print(f"SmolLM2-135M, {args.threads} threads, {rounds} rounds, load average {os.getloadavg()[0]:.2f} at start")

    timing: dict[str, dict[str, list[float]]] = {n: {"b1": [], "b16": [], "prompt": []} for n in names}
    for _ in range(rounds):
        for n in names:  # alternating: every configuration sees the machine of the same minutes
            model, kv = models[n]
            with torch.inference_mode():
                timing[n]["b1"].append(decode_step_s(model, kv, 1, corpus, steps))
                timing[n]["b16"].append(decode_step_s(model, kv, 16, corpus, steps))
                timing[n]["prompt"].append(prompt_step_s(model, kv, corpus))
    print(f"load average {os.getloadavg()[0]:.2f} after the timings")

    rows = {}
    reference = None
    for n in names:
        model, kv = models[n]
        with torch.inference_mode():
            ppl = perplexity(model, held, kv_dtype=kv)
            outs = greedy(model, kv, prompts, 32)
        reference = reference or outs
        agree = agreement(reference, outs)
        t = {k: statistics.median(v) for k, v in timing[n].items()}
        rows[n] = {"b1_tok_s": 1 / t["b1"], "b16_tok_s": 16 / t["b16"], "prompt_tok_s": PROMPT / t["prompt"],
                   "weight_mb": weight_bytes(model) / 1e6, "ppl": ppl, "agree": agree.token_agreement,
                   "exact": agree.exact_match, "zeros": sparsity(model)}

    f = rows["fp32"]
    print(f"\n{'config':<11} {'decode b1':>16} {'decode b16':>17} {'prompt':>17} {'weights':>15} {'perplexity':>16} "
          f"{'agree':>6} {'exact':>6}")
    for n, r in rows.items():
        print(f"{n:<11} {r['b1_tok_s']:7.1f} t/s {r['b1_tok_s'] / f['b1_tok_s']:4.2f}x "
              f"{r['b16_tok_s']:7.1f} t/s {r['b16_tok_s'] / f['b16_tok_s']:4.2f}x "
              f"{r['prompt_tok_s']:7.0f} t/s {r['prompt_tok_s'] / f['prompt_tok_s']:4.2f}x "
              f"{r['weight_mb']:6.0f} MB {r['weight_mb'] / f['weight_mb']:4.2f}x "
              f"{r['ppl']:7.2f} {r['ppl'] / f['ppl']:6.3f}x {r['agree']:6.2f} {r['exact']:6.2f}")
    if "sparse_2_4" in rows:
        print(f"sparse_2_4: {rows['sparse_2_4']['zeros']:.0%} of the decoder weights zero, stored and multiplied "
              "dense: the CPU has no sparse kernels, so it saves no time or memory here")
    print()
    headline = []  # the four figures come last
    for n in names[1:]:
        r = rows[n]
        lines = [(f"{n}_decode_speedup_b1", f"{r['b1_tok_s'] / f['b1_tok_s']:.2f}"),
                 (f"{n}_decode_speedup_b16", f"{r['b16_tok_s'] / f['b16_tok_s']:.2f}"),
                 (f"{n}_prompt_speedup", f"{r['prompt_tok_s'] / f['prompt_tok_s']:.2f}"),
                 (f"{n}_weight_bytes_ratio", f"{r['weight_mb'] / f['weight_mb']:.3f}"),
                 (f"{n}_ppl_ratio", f"{r['ppl'] / f['ppl']:.3f}"),
                 (f"{n}_greedy_agreement", f"{r['agree']:.3f}")]
        for name, value in lines:
            if n in ("int8", "int4") and name.endswith(("_decode_speedup_b1", "_ppl_ratio")):
                headline.append((name, value))
            else:
                print(f"{name}: {value}")
    for name, value in sorted(headline, key=lambda x: (x[0].endswith("ppl_ratio"), x[0].startswith("int4"))):
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()

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

Builds side by side (bench/builds.py): the native kernels' best build for this CPU and, on a CPU with AVX-512, the
AVX2 build (INFERSIM_ISA=avx2: what an AMD Zen 2/3 runs) beside it, each in a worker process of its own, alternating
config by config within every round; `--isa` names the builds instead. Ratios are to fp32 of the same build. The first
build's headline lines keep their names, another's end in `_<build>` (e.g. `int8_decode_speedup_b1_avx2`).
`--cpu-time` (with `--threads 1`) times the process's CPU time instead of the wall clock: on a machine others keep
busy, what a step costs without the time it waits for a core.

Usage: python bench/compression.py [--rounds 5] [--threads 2] [--only fp32 int8 ...] [--quick] [--isa auto avx2]
       [--cpu-time]
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

import builds  # noqa: E402
import torch  # noqa: E402

from executor.core.build import make_engine  # noqa: E402
from executor.core.engine import SamplingParams  # noqa: E402
from executor.core.prompts import corpus_ids, prompt_ids  # noqa: E402
from executor.model import native  # noqa: E402
from executor.model.quality import agreement, heldout_ids, perplexity  # noqa: E402
from executor.model.quantize import quantize_weights, weight_bytes  # noqa: E402
from executor.model.sparsity import prune_model_2_4, sparsity  # noqa: E402
from executor.model.weights import load_hf_model, smollm2_gguf_path  # noqa: E402
from sim.config.environment import ISAS  # noqa: E402
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
CLOCK = [time.perf_counter]  # what steps are timed with (--cpu-time: the process's CPU time)


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
    times, clock = [], CLOCK[0]
    for _ in range(steps):
        t = clock()
        engine.step()
        times.append(clock() - t)
    return statistics.median(times)


def prompt_step_s(model, kv_dtype, corpus: list[int]) -> float:
    """Time of one PROMPT-token prompt step (the engine's whole step)."""
    engine = engine_for(model, kv_dtype, 1, PROMPT + 8)
    engine.add(Request(0, 0.0, PROMPT, 2), prompt_ids(corpus, PROMPT, 0))
    t = CLOCK[0]()
    engine.step()
    return CLOCK[0]() - t


def greedy(model, kv_dtype, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    engine = engine_for(model, kv_dtype, len(prompts), max(map(len, prompts)) + new_tokens + 8)
    reqs = [Request(i, 0.0, len(p), new_tokens) for i, p in enumerate(prompts)]
    for r, p in zip(reqs, prompts):
        engine.add(r, p)
    while engine.has_work():
        engine.step()
    return [engine.output_ids(r) for r in reqs]


class Configs:
    """A bench worker's models (bench/builds.py): SmolLM2-135M compressed as each of `names` says, under the native
    kernels of this process's INFERSIM_ISA."""

    def __init__(self, names: list[str], quick: bool, cpu_time: bool):
        if cpu_time:
            CLOCK[0] = time.process_time
        self.steps = 8 if quick else 24
        base, _, tokenizer = load_hf_model(smollm2_gguf_path())
        base.eval()
        self.corpus = corpus_ids(tokenizer)
        self.held = heldout_ids(tokenizer)[:600 if quick else None]
        self.prompts = [prompt_ids(self.corpus, 48 + 8 * i, 100 + i) for i in range(8)]
        self.models = {n: build(base, n) for n in names}
        self.reference = None

    def timing(self, name: str) -> dict[str, float]:
        """Seconds of a batch-1 and a batch-16 decode step and of a prompt step."""
        model, kv = self.models[name]
        with torch.inference_mode():
            return {"b1": decode_step_s(model, kv, 1, self.corpus, self.steps),
                    "b16": decode_step_s(model, kv, 16, self.corpus, self.steps),
                    "prompt": prompt_step_s(model, kv, self.corpus)}

    def quality(self, name: str) -> dict[str, float]:
        """Weights' MB, perplexity, greedy agreement with fp32 (asked first), share of zero weights."""
        model, kv = self.models[name]
        with torch.inference_mode():
            ppl = perplexity(model, self.held, kv_dtype=kv)
            outs = greedy(model, kv, self.prompts, 32)
        self.reference = self.reference or outs
        agree = agreement(self.reference, outs)
        return {"weight_mb": weight_bytes(model) / 1e6, "ppl": ppl, "agree": agree.token_agreement,
                "exact": agree.exact_match, "zeros": sparsity(model), "isa": native.isa() or "torch"}


def measure(workers: dict, names: list[str], rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """{build: {config: figures}}: timings alternating config by config and build by build within every round
    (medians of the rounds), then each configuration's quality."""
    timing = {b: {n: {"b1": [], "b16": [], "prompt": []} for n in names} for b in workers}
    for _ in range(rounds):
        for n in names:
            for b, worker in workers.items():
                for key, seconds in worker.call("timing", n).items():
                    timing[b][n][key].append(seconds)
    print(f"load average {os.getloadavg()[0]:.2f} after the timings")
    rows = {}
    for b, worker in workers.items():
        rows[b] = {}
        for n in names:
            t = {k: statistics.median(v) for k, v in timing[b][n].items()}
            rows[b][n] = {"b1_tok_s": 1 / t["b1"], "b16_tok_s": 16 / t["b16"], "prompt_tok_s": PROMPT / t["prompt"],
                          **worker.call("quality", n)}
    return rows


def report(rows: dict[str, dict[str, dict[str, float]]]) -> None:
    """The table (each configuration's builds side by side) and the headline lines, the first build's plain, the
    others' ending in _<build>."""
    print(f"\n{'config':<11} {'build':<7} {'decode b1':>16} {'decode b16':>17} {'prompt':>17} {'weights':>15} "
          f"{'perplexity':>16} {'agree':>6} {'exact':>6}")
    names = list(next(iter(rows.values())))
    for n in names:
        for b, table in rows.items():
            r, f = table[n], table["fp32"]
            print(f"{n:<11} {b:<7} {r['b1_tok_s']:7.1f} t/s {r['b1_tok_s'] / f['b1_tok_s']:4.2f}x "
                  f"{r['b16_tok_s']:7.1f} t/s {r['b16_tok_s'] / f['b16_tok_s']:4.2f}x "
                  f"{r['prompt_tok_s']:7.0f} t/s {r['prompt_tok_s'] / f['prompt_tok_s']:4.2f}x "
                  f"{r['weight_mb']:6.0f} MB {r['weight_mb'] / f['weight_mb']:4.2f}x "
                  f"{r['ppl']:7.2f} {r['ppl'] / f['ppl']:6.3f}x {r['agree']:6.2f} {r['exact']:6.2f}")
    first = next(iter(rows.values()))
    if "sparse_2_4" in first:
        print(f"sparse_2_4: {first['sparse_2_4']['zeros']:.0%} of the decoder weights zero, stored and multiplied "
              "dense: the CPU has no sparse kernels, so it saves no time or memory here")
    print()
    headline = []  # the figures come last
    for i, (b, table) in enumerate(rows.items()):
        suffix, f = "" if i == 0 else f"_{b}", table["fp32"]
        for n in names[1:]:
            r = table[n]
            lines = [(f"{n}_decode_speedup_b1", f"{r['b1_tok_s'] / f['b1_tok_s']:.2f}"),
                     (f"{n}_decode_speedup_b16", f"{r['b16_tok_s'] / f['b16_tok_s']:.2f}"),
                     (f"{n}_prompt_speedup", f"{r['prompt_tok_s'] / f['prompt_tok_s']:.2f}"),
                     (f"{n}_weight_bytes_ratio", f"{r['weight_mb'] / f['weight_mb']:.3f}"),
                     (f"{n}_ppl_ratio", f"{r['ppl'] / f['ppl']:.3f}"),
                     (f"{n}_greedy_agreement", f"{r['agree']:.3f}")]
            for name, value in lines:
                if n in ("int8", "int4") and name.endswith(("_decode_speedup_b1", "_ppl_ratio")):
                    headline.append((i, name + suffix, value))
                else:
                    print(f"{name}{suffix}: {value}")
    for _, name, value in sorted(headline, key=lambda x: ("_ppl_ratio" in x[1], x[0], x[1].startswith("int4"))):
        print(f"{name}: {value}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer steps, a shorter perplexity text")
    ap.add_argument("--isa", nargs="+", choices=ISAS, help="the builds to measure (default: the CPU's best, and "
                    "avx2 beside it on an AVX-512 CPU)")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU time, not the wall clock (with --threads 1)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time measures one thread: add --threads 1")
    names = ["fp32"] + [n for n in args.only if n != "fp32"]
    workers = builds.isa_workers(Configs, (names, args.quick, args.cpu_time), args.isa, args.threads)
    try:
        print(f"SmolLM2-135M, builds {', '.join(workers)}, {args.threads} threads, {2 if args.quick else args.rounds} "
              f"rounds{', CPU time' if args.cpu_time else ''}, load average {os.getloadavg()[0]:.2f} at start")
        report(measure(workers, names, 2 if args.quick else args.rounds))
    finally:
        for w in workers.values():
            w.close()


if __name__ == "__main__":
    main()

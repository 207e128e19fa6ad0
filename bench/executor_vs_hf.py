"""infersim's executor against transformers on one fixed offline workload (issue 3).

Workload: the first 64 requests of the Azure LLM 2023 conversation trace with prompt and output lengths
divided by 4 (at least 8 and 4 tokens), all submitted at t=0, EOS ignored (every request generates exactly
its output length), SmolLM2-135M fp32, greedy, 2 threads. Prompts are real text of exactly those lengths.

In one process it runs, one after the other:
  1. infersim: the Engine with a continuous-batching Scheduler and a paged BlockAllocator, every request
     added at t=0, stepped until done;
  2. transformers `generate` in static batches of 8 in arrival order (left padding, attention mask,
     max_new_tokens = the batch's longest output; useful tokens = each request's own output length);
  3. transformers' own continuous batching (`init_continuous_batching`, per-request max_new_tokens, EOS off);
and prints useful output tokens/s for each, the ratios, and the physical floor of the workload on this
machine: prefill FLOPs (2·params·prompt tokens + attention; LM head only for the last position) at the
matmul rate, plus the weight bytes of every decode step infersim ran at the memory bandwidth, both the best
of what was measured right before and right after infersim's run. It checks infersim's greedy output against HF static's, request by request.

With `--against TREE` (another checkout of the project, e.g. the commit before a change, made with `git archive
COMMIT | tar -x -C TREE`) it runs only infersim's part, this tree's and TREE's alternately round by round, each in a
process of its own, and prints the median walls and their ratio (a change's effect on the executor's speed, side by
side, so the machine's drift falls on both).

Usage: python bench/executor_vs_hf.py [--quick] [--only infersim|hf_static|hf_cb ...] [--against TREE --rounds N]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from executor.core.build import make_engine, run_offline  # noqa: E402
from executor.core.engine import Engine, SamplingParams  # noqa: E402
from executor.core.prompts import corpus_ids, prompt_ids  # noqa: E402
from sim.config.plan import scheduler_config  # noqa: E402
from sim.config.traces import load_trace  # noqa: E402
from sim.policy.block_manager import BlockAllocator  # noqa: E402
from sim.policy.request import Status  # noqa: E402
from sim.policy.scheduler import Scheduler  # noqa: E402

THREADS = 2
NUM_REQUESTS = 64
QUICK_REQUESTS = 16
HF_STATIC_BATCH = 8
ROOT = Path(__file__).resolve().parents[1]

# infersim's serving knobs for this workload (all 64 requests fit in flight at once)
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 4096
BLOCK_SIZE = 16
CHUNKED_PREFILL = True
ATTENTION = "sdpa"


def workload(n: int) -> tuple[list[int], list[int]]:
    _, prompt, output = load_trace("builtin:azure_conv")
    prompt = np.maximum(np.asarray(prompt[:n]) // 4, 8)
    output = np.maximum(np.asarray(output[:n]) // 4, 4)
    return [int(p) for p in prompt], [int(o) for o in output]


# ---- machine rates ---------------------------------------------------------------------------


def matmul_rate(reps: int = 3) -> float:
    """Best fp32 FLOP/s of large square matmuls (2048 and 4096) on the configured threads."""
    best = 0.0
    for n in (2048, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best


def memory_bandwidth(reps: int = 5) -> float:
    """Best bytes/s of streaming a 512 MiB fp32 tensor: a read-only sum, or a copy (read + write)."""
    x = torch.randn(128 * 2 ** 20)
    y = torch.empty_like(x)
    y.copy_(x)
    x.sum()
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        y.copy_(x)
        best = max(best, 2 * x.nbytes / (time.perf_counter() - t))
    return best


# ---- the three engines -----------------------------------------------------------------------


def run_infersim(model, prompts, outputs, args) -> tuple[float, list[list[int]], Engine]:
    total = [p + o for p, o in zip(prompts, outputs)]
    bs = args.block_size
    num_blocks = sum(-(-t // bs) for t in total) + 8  # everything fits: no preemption
    cfg = scheduler_config(max(2048, max(total)), max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.chunked,
                           prefill_chunk_size=args.max_num_batched_tokens)
    model.attn_backend = args.attention

    def engine():
        return make_engine(model, Scheduler(cfg, BlockAllocator(num_blocks, bs), eager=True),
                           SamplingParams(ignore_eos=True))

    # first forwards allocate and pick kernels
    run_offline(engine(), [list(range(100, 100 + n)) for n in (64, 300)], [3, 3])

    eng = engine()
    t0 = time.perf_counter()
    eng.t0 = t0
    reqs = run_offline(eng, args.prompt_ids, outputs)
    wall = time.perf_counter() - t0
    assert all(r.status is Status.FINISHED for r in reqs)
    return wall, [eng.output_ids(r) for r in reqs], eng


def run_hf_static(hf, prompt_id_lists, outputs, pad_id) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    def batch_generate(ids_list, outs):
        width = max(len(p) for p in ids_list)
        input_ids = torch.full((len(ids_list), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids_list), width), dtype=torch.long)
        for j, p in enumerate(ids_list):  # left padding
            input_ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(outs)
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                              eos_token_id=None, bos_token_id=None)
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, generation_config=gc)
        return [out[j, width:width + o].tolist() for j, o in enumerate(outs)]

    batch_generate(prompt_id_lists[:2], [2, 2])  # warm-up
    t0 = time.perf_counter()
    results: list[list[int]] = []
    per_batch = []
    for s in range(0, len(prompt_id_lists), HF_STATIC_BATCH):
        ids, outs = prompt_id_lists[s:s + HF_STATIC_BATCH], outputs[s:s + HF_STATIC_BATCH]
        t = time.perf_counter()
        results += batch_generate(ids, outs)
        per_batch.append(f"{time.perf_counter() - t:.1f} s ({len(ids)}x{max(len(p) for p in ids)} prompt, "
                         f"{max(outs)} steps)")
    print("  HF static batches:", "; ".join(per_batch))
    return time.perf_counter() - t0, results


def run_hf_cb(hf, prompt_id_lists, outputs, pad_id, max_batch_tokens) -> tuple[float, list[list[int]], str]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    num_blocks = sum(-(-(len(p) + o) // page) for p, o in zip(prompt_id_lists, outputs)) + 8
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=pad_id)
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                   max_requests_per_batch=len(prompt_id_lists), use_cuda_graph=False,
                                   use_async_batching=False)
    attn_before = hf.config._attn_implementation

    def run(ids_list, outs):
        mgr = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
        mgr.start()
        try:
            rids = [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
                    for i, (p, o) in enumerate(zip(ids_list, outs))]
            done: dict = {}
            while len(done) < len(rids):
                res = mgr.get_result(timeout=10)
                if res is None:
                    if not mgr.is_running():
                        raise RuntimeError("transformers' continuous batching loop stopped")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"transformers CB request {res.request_id}: {res.error}")
                    done[res.request_id] = res
        finally:
            mgr.stop(block=True, timeout=30)
            hf.destroy_cached_continuous_batching_manager()
        return [list(done[r].generated_tokens) for r in rids]

    run(prompt_id_lists[:2], [2, 2])  # warm-up
    t0 = time.perf_counter()
    results = run(prompt_id_lists, outputs)
    wall = time.perf_counter() - t0
    attn_during = hf.config._attn_implementation
    hf.config._attn_implementation = attn_before
    return wall, results, f"page_size {page}, {num_blocks} blocks, max_batch_tokens {max_batch_tokens}, attn {attn_during}"


# ---- the floor -------------------------------------------------------------------------------


def floor_terms(model, prompts, outputs, records):
    """(prefill FLOPs, weight bytes per decode step, decode steps, FLOPs of one decode token)."""
    c = model.config
    linear = sum(m.weight.numel() for layer in model.layers for m in
                 (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    lm_head = c.vocab_size * c.hidden_size
    attn = sum(4 * c.num_heads * c.head_dim * p * (p + 1) // 2 for p in prompts) * c.num_layers
    prefill_flops = 2 * linear * sum(prompts) + attn + 2 * lm_head * len(prompts)
    norms = (2 * c.num_layers + 1) * c.hidden_size
    weight_bytes = (linear + lm_head + norms) * 4
    decode_steps = [r for r in records if r.num_decode and not r.num_prefill]
    return prefill_flops, weight_bytes, decode_steps, 2 * (linear + lm_head)


def compare(ours, ref):
    """(number of requests that differ, [(request, first differing token index)])."""
    diffs = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append((i, k))
    return len(diffs), diffs


def against(tree: Path, rounds: int, quick: bool) -> None:
    """infersim's run of this tree and of `tree`, alternating which goes first, each a process of its own; the
    median walls and their ratio (this / the other)."""
    walls: dict[str, list[float]] = {"this": [], "baseline": []}
    for r in range(rounds):
        order = [("this", ROOT), ("baseline", tree)]
        for name, root in order if r % 2 == 0 else order[::-1]:
            out = subprocess.run([sys.executable, str(root / "bench" / "executor_vs_hf.py"), "--only", "infersim",
                                  *(["--quick"] if quick else [])], cwd=root, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(root)}, check=True).stdout
            walls[name].append(float(re.search(r"^infersim_wall_s: (\S+)$", out, re.M).group(1)))
            print(f"round {r + 1} {name} ({root}): {walls[name][-1]:.2f} s", flush=True)
    this, base = statistics.median(walls["this"]), statistics.median(walls["baseline"])
    print(f"ab_this_wall_s: {this:.3f}")
    print(f"ab_baseline_wall_s: {base:.3f}")
    print(f"ab_wall_ratio: {this / base:.4f}")
    print(f"ab_load_avg_1min: {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only the first {QUICK_REQUESTS} requests")
    ap.add_argument("--only", nargs="+", choices=["infersim", "hf_static", "hf_cb"],
                    default=["infersim", "hf_static", "hf_cb"])
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--chunked", action=argparse.BooleanOptionalAction, default=CHUNKED_PREFILL)
    ap.add_argument("--attention", default=ATTENTION)
    ap.add_argument("--profile", action="store_true", help="cProfile the infersim run (top 25 by tottime)")
    ap.add_argument("--against", type=Path, help="another checkout: infersim's run of both, alternately")
    ap.add_argument("--rounds", type=int, default=4, help="--against: rounds (each runs both trees)")
    args = ap.parse_args()
    if args.against is not None:
        against(args.against.resolve(), args.rounds, args.quick)
        return

    torch.set_num_threads(THREADS)
    from executor.core.malloc_tuning import keep_freed_memory
    from executor.model.weights import load_hf_model, load_transformers_model, smollm2_gguf_path

    # infersim's engine sets this; set here first so all three engines and the rate probes run alike
    heap = keep_freed_memory()
    t = time.perf_counter()
    path = smollm2_gguf_path()
    model, hf_config, tokenizer = load_hf_model(path)
    hf, _ = load_transformers_model(str(path.parent), path.name)
    print(f"loaded SmolLM2-135M in {time.perf_counter() - t:.0f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads ({torch.get_num_interop_threads()} interop); freed memory kept in the heap: "
          f"{'yes' if heap else 'no'}")

    n = QUICK_REQUESTS if args.quick else NUM_REQUESTS
    prompts, outputs = workload(n)
    corpus = corpus_ids(tokenizer)
    args.prompt_ids = [prompt_ids(corpus, p, i) for i, p in enumerate(prompts)]
    useful = sum(outputs)
    print(f"workload: {n} requests of the Azure conv trace, lengths / 4: {sum(prompts)} prompt tokens "
          f"(max {max(prompts)}), {useful} output tokens (max {max(outputs)}), all at t=0, EOS ignored, greedy, fp32")

    rates = [("before", matmul_rate(), memory_bandwidth())]
    results: dict[str, tuple[float, list[list[int]]]] = {}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    if "infersim" in args.only:
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        wall, outs, eng = run_infersim(model, prompts, outputs, args)
        if args.profile:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        results["infersim"] = (wall, outs)
        rates.append(("after infersim", matmul_rate(), memory_bandwidth()))  # the floor uses the machine of its run
        recs = eng.records
        prefill_s = sum(r.end_s - r.start_s for r in recs if r.num_prefill)
        decode_s = sum(r.end_s - r.start_s for r in recs if not r.num_prefill)
        print(f"infersim: {wall:.2f} s, {len(recs)} steps ({sum(1 for r in recs if r.num_prefill)} with prompt "
              f"tokens: {prefill_s:.2f} s; {sum(1 for r in recs if not r.num_prefill)} decode-only: {decode_s:.2f} s); "
              f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, chunked "
              f"prefill {args.chunked}, block size {args.block_size}, attention {args.attention}")
    if "hf_static" in args.only:
        wall, outs = run_hf_static(hf, args.prompt_ids, outputs, pad_id)
        results["hf_static"] = (wall, outs)
        print(f"transformers generate, static batches of {HF_STATIC_BATCH}: {wall:.2f} s")
    if "hf_cb" in args.only:
        wall, outs, desc = run_hf_cb(hf, args.prompt_ids, outputs, pad_id, args.max_num_batched_tokens)
        results["hf_cb"] = (wall, outs)
        print(f"transformers continuous batching ({desc}): {wall:.2f} s")
    if set(results) - {"infersim"}:
        rates.append(("at the end", matmul_rate(), memory_bandwidth()))
    # infersim's floor: the best rates measured right before and right after its own run (the machine's speed
    # drifts over the minutes the transformers engines take)
    flops_rate, bandwidth = max(r[1] for r in rates[:2]), max(r[2] for r in rates[:2])
    print("machine: " + "; ".join(f"{label} fp32 matmul {f / 1e9:.0f} GFLOP/s, memory {b / 1e9:.1f} GB/s"
                                  for label, f, b in rates) + "; the floor uses the best before / after infersim")

    tok_s = {k: useful / w for k, (w, _) in results.items()}
    for k, v in tok_s.items():
        print(f"{k}: {v:.1f} useful output tok/s ({results[k][0]:.2f} s)")

    headline = {}
    if "infersim" in results:
        wall = results["infersim"][0]
        prefill_flops, weight_bytes, decode_steps, flops_per_token = floor_terms(model, prompts, outputs, eng.records)
        prefill_floor = prefill_flops / flops_rate
        decode_floor = len(decode_steps) * weight_bytes / bandwidth
        floor = prefill_floor + decode_floor
        # stricter: a decode step also costs its tokens' FLOPs when those outweigh the weight reads
        strict = prefill_floor + sum(max(weight_bytes / bandwidth, r.num_decode * flops_per_token / flops_rate)
                                     for r in decode_steps)
        mixed_decode_tokens = sum(r.num_decode for r in eng.records if r.num_prefill)
        strict += mixed_decode_tokens * flops_per_token / flops_rate
        print(f"floor: prefill {prefill_flops / 1e12:.2f} TFLOP at {flops_rate / 1e9:.0f} GFLOP/s = {prefill_floor:.2f} s "
              f"+ {len(decode_steps)} decode steps x {weight_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s = "
              f"{decode_floor:.2f} s -> {floor:.2f} s; infersim wall / floor = {wall / floor:.2f}")
        print(f"stricter floor (decode steps also pay their tokens' FLOPs, {mixed_decode_tokens} decode tokens in "
              f"prefill steps): {strict:.2f} s; infersim wall / stricter floor = {wall / strict:.2f}")
        headline["infersim_tok_s"] = f"{tok_s['infersim']:.1f}"
    for k in ("hf_static", "hf_cb"):
        if k in tok_s:
            headline[f"{k}_tok_s"] = f"{tok_s[k]:.1f}"
    if "infersim" in results:
        for k in ("hf_static", "hf_cb"):
            if k in tok_s:
                headline[f"speedup_vs_{k}"] = f"{tok_s['infersim'] / tok_s[k]:.2f}"
        headline["wall_over_floor"] = f"{wall / floor:.2f}"
        headline["wall_over_strict_floor"] = f"{wall / strict:.2f}"
        headline["floor_s"] = f"{floor:.2f}"
        headline["floor_matmul_gflops"] = f"{flops_rate / 1e9:.0f}"  # the floor moves with the machine's rate
        headline["floor_bandwidth_gbs"] = f"{bandwidth / 1e9:.1f}"
        headline["infersim_wall_s"] = f"{wall:.2f}"
    if "infersim" in results and "hf_static" in results:
        ndiff, diffs = compare(results["infersim"][1], results["hf_static"][1])
        print(f"infersim greedy output identical to HF static for every request: {'yes' if not ndiff else 'no'}"
              + (f" ({ndiff} of {n} differ; (request, first differing token): {diffs})" if ndiff else ""))
        headline["outputs_identical_to_hf_static"] = "yes" if not ndiff else "no"
        headline["requests_differing"] = str(ndiff)
    if "hf_cb" in results and "hf_static" in results:
        ndiff, diffs = compare(results["hf_cb"][1], results["hf_static"][1])
        print(f"HF CB output identical to HF static: {'yes' if not ndiff else f'no, {ndiff} differ: {diffs}'}")
    for k, v in headline.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

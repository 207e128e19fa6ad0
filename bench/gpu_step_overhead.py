"""Where a CUDA engine step's time goes (SmolLM2-135M's shapes, random weights, fp32): the step's wall time
against the GPU's busy time in it (torch profiler: kernels and copies), the host-device synchronisations per
step — each for plain decode steps, and the time of lone prompt steps, run eagerly and replayed from CUDA graphs,
side by side — and, over a long stretch of batch-1 decodes as a low-load scenario runs them, how step time
follows the GPU's SM clock. Needs CUDA; on the CPU it says so and exits 2.

Usage: python bench/gpu_step_overhead.py [--steps 1500]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
import torch

from calibration.profile import profile_engine
from executor.core.prompts import prompt_ids
from executor.model.tiny import tiny_config, tiny_model
from sim.config.models import catalog_model
from sim.policy.request import Request

CORPUS = list(range(1000, 9000))


def smollm2_shapes(device: str):
    m = catalog_model("SmolLM2-135M")
    cfg = tiny_config(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                      num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size, vocab_size=m.vocab_size,
                      rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=2048)
    return tiny_model(0, cfg).to(device)


def decoding_engine(model, batch: int, context: int, steps: int, graphs: bool = True):
    """An engine whose `batch` requests have prefilled `context` tokens and have `steps` decodes left; its plain
    decode steps replay CUDA graphs, or with graphs=False run eagerly."""
    engine = profile_engine(model, "cuda", num_blocks=max(64, batch * (context + steps) // 16 + batch),
                            use_graphs=graphs, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * context))
    for i in range(batch):
        engine.add(Request(i, 0.0, context, steps + 1), prompt_ids(CORPUS, context, i))
    engine.step()  # the prefills
    return engine


def step_anatomy(model, batch: int, context: int, graphs: bool, n: int = 20) -> dict:
    """Median wall ms per decode step, GPU busy ms per step (profiler), syncs per step."""
    engine = decoding_engine(model, batch, context, 3 * n + 5, graphs)
    for _ in range(5):
        engine.step()
    walls = []
    for _ in range(n):
        engine.step()
        walls.append(engine.records[-1].end_s - engine.records[-1].start_s)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels) / n  # one stream: kernels never overlap
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            engine.step()
    torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught) / n
    wall = statistics.median(walls) * 1000
    return {"wall_ms": wall, "gpu_busy_ms": busy_us / 1000, "busy_fraction": busy_us / 1000 / wall,
            "syncs_per_step": syncs}


def prompt_step_ms(model, tokens: int, graphs: bool, n: int = 20) -> float:
    """Median wall ms of a step that prefills one `tokens`-token prompt alone (each request ends at its first
    token, so every step is such a prompt step)."""
    engine = profile_engine(model, "cuda", num_blocks=max(64, tokens // 16 + 8), use_graphs=graphs, max_num_seqs=1)
    walls = []
    for i in range(n + 3):
        engine.add(Request(i, 0.0, tokens, 1), prompt_ids(CORPUS, tokens, i))
        engine.step()
        walls.append(engine.records[-1].end_s - engine.records[-1].start_s)
    return statistics.median(walls[3:]) * 1000


def capture_time(model) -> tuple[int, float]:
    """(graphs, seconds) to capture the sets of an engine shaped like the validation scenarios (16 sequences, 1024
    tokens of context, 2048-token budget), on a fresh model so nothing is cached."""
    import copy

    fresh = copy.deepcopy(model)
    t0 = time.perf_counter()
    engine = profile_engine(fresh, "cuda", num_blocks=256, max_num_seqs=16, max_model_len=1024)
    seconds = time.perf_counter() - t0
    return len(engine.graphs.decode.graphs) + len(engine.graphs.prompt.graphs), seconds


def sm_clock() -> float:
    """The GPU's SM clock now (MHz; through NVML), NaN where it cannot be read."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - no NVML: the stretch still reports step times
        return float("nan")


def clock_stretch(model, steps: int) -> dict:
    """Batch-1 decodes back to back: each step's wall time and the SM clock read right after it."""
    engine = decoding_engine(model, 1, 128, steps)
    times, cpu, clocks = [], [], []
    for _ in range(steps):
        c0 = time.thread_time()
        engine.step()
        cpu.append((time.thread_time() - c0) * 1000)  # this thread's CPU time: < wall when it waits or is descheduled
        times.append((engine.records[-1].end_s - engine.records[-1].start_s) * 1000)
        clocks.append(sm_clock())
    t, c, u = np.array(times), np.array(clocks, dtype=float), np.array(cpu)
    slow = t > 1.5 * np.percentile(t, 10)

    def median(x, where):  # None where no step falls in the group
        return float(np.median(x[where])) if where.any() else None

    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "slow_fraction": float(slow.mean()),
            "cpu_ms_fast": median(u, ~slow), "cpu_ms_slow": median(u, slow),
            "wall_ms_fast": median(t, ~slow), "wall_ms_slow": median(t, slow),
            "clock_fast_mhz": median(c, ~slow), "clock_slow_mhz": median(c, slow),
            "corr": float(np.corrcoef(t, c)[0, 1]) if np.nanstd(c) > 0 else None,
            "series": [f"{x:.0f}@{y:.0f}" for x, y in zip(t[::max(1, steps // 60)], c[::max(1, steps // 60)])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500, help="batch-1 decodes in the clock stretch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stretch-only", action="store_true", help="skip the per-shape anatomy table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step_overhead: error: needs a CUDA device (none here)", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    model = smollm2_shapes("cuda")
    rows = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.threads} CPU threads")
    shapes = [] if args.stretch_only else [(1, 128), (1, 1024), (8, 256), (32, 256)]
    if shapes:
        print("eager: every op launched from Python; graph: the step replayed from a CUDA graph (the default)")
        print("| batch | context | eager ms/step | graph ms/step | graph/eager | GPU busy ms (eager, graph) | "
              "busy fraction (eager, graph) | syncs/step (eager, graph) |")
        print("|---:|---:|---:|---:|---:|---|---|---|")
    for batch, context in shapes:
        e, g = (step_anatomy(model, batch, context, graphs) for graphs in (False, True))
        rows[(batch, context)] = (e, g)
        print(f"| {batch} | {context} | {e['wall_ms']:.2f} | {g['wall_ms']:.2f} | {g['wall_ms'] / e['wall_ms']:.2f} | "
              f"{e['gpu_busy_ms']:.2f}, {g['gpu_busy_ms']:.2f} | {e['busy_fraction']:.2f}, {g['busy_fraction']:.2f} | "
              f"{e['syncs_per_step']:.1f}, {g['syncs_per_step']:.1f} |")
    prompts = {}
    if shapes:
        print("| lone prompt tokens | eager ms/step | graph ms/step | graph/eager |")
        print("|---:|---:|---:|---:|")
    for tokens in [] if args.stretch_only else [32, 128, 512]:
        e, g = (prompt_step_ms(model, tokens, graphs) for graphs in (False, True))
        prompts[tokens] = (e, g)
        print(f"| {tokens} | {e:.2f} | {g:.2f} | {g / e:.2f} |")
    graphs, seconds = capture_time(model)
    print(f"capture: {graphs} graphs in {seconds:.1f} s for an engine of 16 sequences, 1024 tokens of context")
    s = clock_stretch(model, args.steps)
    print(f"clock stretch, {args.steps} batch-1 decodes: step ms@SM MHz every {max(1, args.steps // 60)} steps:")
    print(" ".join(s["series"]))
    if rows:
        (e1, g1), (e32, g32) = rows[(1, 128)], rows[(32, 256)]
        print(f"decode_b1_eager_ms: {e1['wall_ms']:.2f}")
        print(f"decode_b1_graph_ms: {g1['wall_ms']:.2f}")
        print(f"decode_b1_graph_over_eager: {g1['wall_ms'] / e1['wall_ms']:.2f}")
        print(f"decode_b32_graph_over_eager: {g32['wall_ms'] / e32['wall_ms']:.2f}")
        print(f"decode_b1_gpu_busy_fraction_graph: {g1['busy_fraction']:.2f}")
        print(f"syncs_per_decode_step_eager: {e1['syncs_per_step']:.1f}")
        print(f"syncs_per_decode_step_graph: {g1['syncs_per_step']:.1f}")
        print(f"prompt_128_graph_over_eager: {prompts[128][1] / prompts[128][0]:.2f}")
    print(f"capture_s_per_graph: {seconds / max(graphs, 1):.3f}")
    print(f"stretch_p90_over_p10: {s['p90_ms'] / s['p10_ms']:.2f}")
    print(f"stretch_slow_fraction: {s['slow_fraction']:.2f}")
    for k in ("wall_ms_fast", "cpu_ms_fast", "wall_ms_slow", "cpu_ms_slow"):
        print(f"stretch_{k}: {s[k]}")
    print(f"sm_clock_fast_steps_mhz: {s['clock_fast_mhz']}")
    print(f"sm_clock_slow_steps_mhz: {s['clock_slow_mhz']}")
    print(f"corr_step_time_sm_clock: {s['corr']}")


if __name__ == "__main__":
    main()

"""How fast the simulator runs a model with windowed or linear-attention layers (vLLM's hybrid KV cache groups,
sim/policy/hybrid_allocator.py) against a model of full attention: the whole Azure LLM 2023 conversation trace (19,366
requests, one hour) end to end (workload, simulation, token times, metrics) on one core, side by side, repeats
interleaved so the machine's drift falls on both:

- gpt-oss-20b (12 sliding-window + 12 full layers, MoE) against Qwen3-30B-A3B (full attention, MoE), both one H100;
- Llama-4-Scout (36 chunked-local + 12 full layers, MoE) against Qwen3-32B (full attention), both on 8 H200s at TP 8.

A hybrid model's decoding rows have a calendar event at each block boundary and at each block leaving a window (the
lock-step calendar of a full-attention model has the first only), and a run of identical steps stops where freed
blocks could start a waiting request. Ends with the worse pair's ratio of wall time per simulated request.

Usage: python bench/hybrid_speed.py [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import time

from sim.config.generator import generate_requests
from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.report.metrics import compute_metrics
from sim.simulator.cluster import sim_records, simulate

TRACE = {"trace": {"path": "builtin:azure_conv"}}
SERVING = {"max_num_seqs": 256, "max_model_len": 8192, "enable_chunked_prefill": True, "max_num_batched_tokens": 2048}
PAIRS = {"gpt-oss-20b vs qwen3-30b-a3b, one H100": ("gpt-oss-20b", "Qwen3-30B-A3B", "H100-SXM", 1),
         "llama-4-scout vs qwen3-32b, TP 8 H200": ("Llama-4-Scout", "Qwen3-32B", "H200", 8)}


def scenario(model: str, hardware: str, tp: int) -> dict:
    return {"name": model, "model": model, "hardware": hardware, "parallel": {"tensor_parallel_size": tp},
            "serving": SERVING, "workload": TRACE}


def one_run(data: dict) -> tuple[float, dict, int]:
    """(wall s, metrics, engine steps) of one run end to end."""
    t0 = time.perf_counter()
    plan = make_plan(parse_scenario(data))
    result = simulate(plan, generate_requests(plan.workload, plan.base_dir))
    metrics = compute_metrics(sim_records(result))
    return time.perf_counter() - t0, metrics, sum(len(r.step_end) for r in result.replicas)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    ratios = []
    for label, (hybrid, full, hardware, tp) in PAIRS.items():
        runs = {m: [] for m in (hybrid, full)}
        one_run(scenario(hybrid, hardware, tp))  # warm-up: imports, the trace's parse
        for _ in range(args.repeats):
            for m in runs:
                runs[m].append(one_run(scenario(m, hardware, tp)))
        per_request = {}
        for m, rs in runs.items():
            wall, metrics, steps = min(rs, key=lambda r: r[0])
            n = metrics["requests"]["arrived"]
            per_request[m] = wall / n
            print(f"{label}: {m}: {n} requests ({metrics['requests']['completed']} completed), {steps} engine steps, "
                  f"{', '.join(f'{r[0]:.2f}' for r in rs)} s; {wall / n * 1e6:.1f} µs a request")
        ratios.append(per_request[hybrid] / per_request[full])
        print(f"{label}: hybrid/full wall time per request {ratios[-1]:.2f}")
    print(f"hybrid_vs_full_sim_time_ratio: {max(ratios):.2f}")


if __name__ == "__main__":
    main()

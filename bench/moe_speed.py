"""How fast the simulator runs a mixture of experts against a dense model of its active size: the whole Azure LLM
2023 conversation trace (19,366 requests, one hour) end to end (workload, simulation, token times, metrics) on one
core, side by side, repeats interleaved so the machine's drift falls on both:

- Mixtral-8x7B (12.9B active) against Llama-2-13B, both on two H100s at tensor parallelism 2;
- Qwen3-30B-A3B (3.3B active) against Llama-3.2-3B, both on one H100.

The MoE's steps cost more to price (expected experts touched, the busiest expert, per-batch caches) but take the
same runs of decode steps at once. Ends with the worse pair's ratio of wall time per simulated request.

Usage: python bench/moe_speed.py [--repeats N]
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
PAIRS = {"mixtral-8x7b vs llama-2-13b, TP 2": ("Mixtral-8x7B", "Llama-2-13B", {"tensor_parallel_size": 2}),
         "qwen3-30b-a3b vs llama-3.2-3b, TP 1": ("Qwen3-30B-A3B", "Llama-3.2-3B", {})}


def scenario(model: str, parallel: dict) -> dict:
    serving = SERVING if model != "Llama-2-13B" else {**SERVING, "max_model_len": 4096}
    return {"name": model, "model": model, "hardware": "H100-SXM", "parallel": parallel, "serving": serving,
            "workload": TRACE}


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
    for label, (moe_model, dense_model, parallel) in PAIRS.items():
        runs = {m: [] for m in (moe_model, dense_model)}
        one_run(scenario(moe_model, parallel))  # warm-up: imports, the trace's parse
        for _ in range(args.repeats):
            for m in runs:
                runs[m].append(one_run(scenario(m, parallel)))
        per_request = {}
        for m, rs in runs.items():
            wall, metrics, steps = min(rs, key=lambda r: r[0])
            n = metrics["requests"]["arrived"]
            per_request[m] = wall / n
            print(f"{label}: {m}: {n} requests ({metrics['requests']['completed']} completed), {steps} engine steps, "
                  f"{', '.join(f'{r[0]:.2f}' for r in rs)} s; {wall / n * 1e6:.1f} µs a request; TPOT p50 "
                  f"{metrics['tpot_s']['p50'] * 1e3:.1f} ms")
        ratios.append(per_request[moe_model] / per_request[dense_model])
        print(f"{label}: moe/dense wall time per request {ratios[-1]:.2f}")
    print(f"moe_vs_dense_sim_time_ratio: {max(ratios):.2f}")


if __name__ == "__main__":
    main()

"""How fast the simulator runs: the whole Azure LLM 2023 conversation trace (19,366 requests, one hour)
on Llama-2-7B / A100-80GB, continuous batching + paged KV, end to end (workload, simulation, token
times, metrics) on one core. Also runs the same simulation stepping every engine step on its own,
side by side, to show what advancing runs of identical decode steps at once buys.

Usage: python bench/sim_speed.py [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.config.workload import generate_requests
from sim.report.metrics import compute_metrics
from sim.simulator.cluster import sim_records, simulate

SCENARIO = {"name": "azure-conv-llama2-7b-a100", "model": "Llama-2-7B", "hardware": "A100-80GB",
            "serving": {"batching": "continuous"}, "kv_cache": {"allocator": "paged"},
            "workload": {"trace": {"path": "builtin:azure_conv"}}}


def one_run(bulk: bool) -> tuple[float, dict, int]:
    t0 = time.perf_counter()
    plan = make_plan(parse_scenario(SCENARIO))
    specs = generate_requests(plan.workload, plan.base_dir)
    result = simulate(plan, specs, bulk=bulk)
    metrics = compute_metrics(sim_records(result))
    wall = time.perf_counter() - t0
    return wall, metrics, sum(len(r.step_end) for r in result.replicas)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    one_run(True)  # warm-up: imports, trace parse
    fast, slow = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        wall, metrics, steps = one_run(True)
        fast.append(wall)
        wall_slow, metrics_slow, _ = one_run(False)
        slow.append(wall_slow)
        assert metrics == metrics_slow, "bulk stepping changed the result"
    n = metrics["requests"]["arrived"]
    best, best_slow = min(fast), min(slow)
    print(f"workload: {n} requests ({metrics['requests']['completed']} completed, "
          f"{metrics['requests']['rejected']} rejected), {metrics['duration_s']:.0f} s simulated, {steps} engine steps")
    print(f"runs of identical decode steps at once: {', '.join(f'{w:.2f}' for w in fast)} s")
    print(f"every step on its own:                  {', '.join(f'{w:.2f}' for w in slow)} s")
    print(f"sim_wall_s: {best:.3f}")
    print(f"sim_wall_s_median: {statistics.median(fast):.3f}")
    print(f"sim_requests_per_wall_s: {n / best:.0f}")
    print(f"simulated_s_per_wall_s: {metrics['duration_s'] / best:.0f}")
    print(f"bulk_vs_single_step_speedup: {best_slow / best:.2f}")


if __name__ == "__main__":
    main()

"""How fast the simulator runs: the whole Azure LLM 2023 conversation trace (19,366 requests, one hour)
on Llama-2-7B / A100-80GB, continuous batching + paged KV, end to end (workload, simulation, token
times, metrics) on one core. Also runs the same simulation stepping every engine step on its own,
side by side, to show what advancing runs of identical decode steps at once buys; and a speculative
(Medusa) scenario, whose verify steps are simulated one at a time, to show that rate too.

Usage: python bench/sim_speed.py [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from sim.config.generator import generate_requests
from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.report.metrics import compute_metrics
from sim.simulator.cluster import sim_records, simulate

SCENARIO = {"name": "azure-conv-llama2-7b-a100", "model": "Llama-2-7B", "hardware": "A100-80GB",
            "serving": {"batching": "continuous"}, "kv_cache": {"allocator": "paged"},
            "workload": {"trace": {"path": "builtin:azure_conv"}}}
# Medusa verify steps: each row keeps its own number of tokens a step, so every step is its own event
SPEC_SCENARIO = {"name": "medusa-long", "model": "Llama-3.1-8B", "hardware": "H100-SXM", "serving": {"max_num_seqs": 64},
                 "speculative": {"method": "medusa",
                                 "medusa_tree": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
                                 "medusa_rank_probs": [[0.5, 0.15, 0.05, 0.05, 0.25], [0.4, 0.15, 0.45], [0.35, 0.65]]},
                 "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 4}, "num_requests": 100,
                              "prompt_len": {"dist": "uniform", "min": 64, "max": 512},
                              "output_len": {"dist": "uniform", "min": 500, "max": 2000}}}


def one_run(bulk: bool, scenario: dict = SCENARIO) -> tuple[float, dict, int, int]:
    """(wall s, metrics, engine steps, output tokens) of one run end to end."""
    t0 = time.perf_counter()
    plan = make_plan(parse_scenario(scenario))
    specs = generate_requests(plan.workload, plan.base_dir)
    result = simulate(plan, specs, bulk=bulk)
    metrics = compute_metrics(sim_records(result))
    wall = time.perf_counter() - t0
    return wall, metrics, sum(len(r.step_end) for r in result.replicas), sum(r.num_generated for r in result.requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    one_run(True)  # warm-up: imports, trace parse
    fast, slow = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        wall, metrics, steps, _ = one_run(True)
        fast.append(wall)
        wall_slow, metrics_slow, *_ = one_run(False)
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
    one_run(True, SPEC_SCENARIO)  # warm-up
    spec = [one_run(True, SPEC_SCENARIO) for _ in range(args.repeats)]
    best_spec = min(w for w, *_ in spec)
    _, spec_metrics, spec_steps, spec_tokens = spec[0]
    print(f"speculative (Medusa): {spec_metrics['requests']['arrived']} requests, {spec_tokens} output tokens, "
          f"{spec_steps} engine steps: {', '.join(f'{w:.2f}' for w, *_ in spec)} s")
    print(f"spec_sim_requests_per_wall_s: {spec_metrics['requests']['arrived'] / best_spec:.0f}")
    print(f"spec_sim_tokens_per_wall_s: {spec_tokens / best_spec:.0f}")

if __name__ == "__main__":
    main()

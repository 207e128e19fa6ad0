"""The fleet-scale scenario: Llama-3-70B on 64 H100s as tensor-parallel replicas (scenarios/llama3_70b_h100_tp8.yaml,
the Azure conversation trace at 8x its rate), at TP 8 x 8 replicas and TP 4 x 16, side by side in one run: wall
time per simulated request, and what each layout predicts.

Usage: python bench/fleet.py
"""
from __future__ import annotations

import time
from pathlib import Path

from infersim.api import load_plan
from sim.config.plan import replan
from sim.config.workload import generate_requests
from sim.report.outputs import build_report
from sim.simulator.cluster import sim_records, simulate

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "llama3_70b_h100_tp8.yaml"


def one(tp: int, replicas: int) -> tuple[float, int, dict]:
    plan = load_plan(SCENARIO)
    plan = replan(plan, parallel={"tensor_parallel_size": tp}, replicas=replicas)
    t0 = time.perf_counter()
    specs = generate_requests(plan.workload, plan.base_dir)
    result = simulate(plan, specs)
    report = build_report(plan, sim_records(result), result.replicas, 0.0)
    return time.perf_counter() - t0, len(specs), report


def main() -> None:
    rows = {}
    for tp, replicas in ((8, 8), (4, 16)):
        wall, n, r = one(tp, replicas)
        rows[tp] = (wall, n)
        print(f"TP {tp} x {replicas} replicas: {n:,} requests in {wall:.2f} s ({wall / n * 1e6:.0f} us a request); "
              f"TTFT p50 {r['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 {r['tpot_s']['p50'] * 1e3:.1f} ms, "
              f"${r['cost']['usd_per_million_output_tokens']:.2f} per 1M output tokens")
    print(f"fleet_tp8_wall_s: {rows[8][0]:.2f}")
    print(f"fleet_tp8_us_per_request: {rows[8][0] / rows[8][1] * 1e6:.0f}")
    print(f"fleet_tp4_us_per_request: {rows[4][0] / rows[4][1] * 1e6:.0f}")


if __name__ == "__main__":
    main()

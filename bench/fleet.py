"""The fleet-scale scenarios: Llama-3-70B on 64 H100s serving the Azure conversation trace at 8x its rate
(scenarios/llama3_70b_h100_tp8.yaml and scenarios/llama3_70b_h100_disaggregated.yaml), side by side in one run:
colocated TP 8 x 8 replicas and TP 4 x 16, and TP-8 prefill and decode pools at several P:D ratios. For each: the
wall time per simulated request, and what the layout predicts.

Usage: python bench/fleet.py
"""
from __future__ import annotations

import time
from pathlib import Path

from infersim.api import load_plan
from sim.config.generator import generate_requests
from sim.config.plan import Plan, replan
from sim.report.outputs import build_report
from sim.simulator.cluster import sim_records, simulate

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
RATIOS = ((2, 6), (3, 5), (4, 4), (5, 3))


def one(plan: Plan) -> tuple[float, int, dict]:
    t0 = time.perf_counter()
    specs = generate_requests(plan.workload, plan.base_dir)
    result = simulate(plan, specs)
    report = build_report(plan, sim_records(result), result.replicas, 0.0, extra=result.extra)
    return time.perf_counter() - t0, len(specs), report


def show(label: str, wall: float, n: int, r: dict) -> None:
    print(f"{label:<28} {n:,} requests in {wall:.2f} s ({wall / n * 1e6:.0f} us a request); "
          f"TTFT p50/p90 {r['ttft_s']['p50'] * 1e3:.0f}/{r['ttft_s']['p90'] * 1e3:.0f} ms, "
          f"TPOT p50/p90 {r['tpot_s']['p50'] * 1e3:.1f}/{r['tpot_s']['p90'] * 1e3:.1f} ms, "
          f"SLO {'met' if r['slo']['met'] else 'MISSED'}, ${r['cost']['usd_per_million_output_tokens']:.2f} per 1M "
          "output tokens")


def main() -> None:
    colocated = load_plan(SCENARIOS / "llama3_70b_h100_tp8.yaml")
    rows = {}
    for tp, replicas in ((8, 8), (4, 16)):
        rows[f"tp{tp}"] = one(replan(colocated, parallel={"tensor_parallel_size": tp}, replicas=replicas))
        show(f"colocated TP {tp} x {replicas}", *rows[f"tp{tp}"])
    disaggregated = load_plan(SCENARIOS / "llama3_70b_h100_disaggregated.yaml")
    pools = disaggregated.source["pools"]
    for p, d in RATIOS:
        plan = replan(disaggregated, pools={**pools, "prefill": {**pools["prefill"], "replicas": p},
                                            "decode": {**pools["decode"], "replicas": d}})
        rows[f"{p}:{d}"] = one(plan)
        show(f"disaggregated TP 8, {p}P:{d}D", *rows[f"{p}:{d}"])
    per_request = lambda key: rows[key][0] / rows[key][1] * 1e6  # noqa: E731
    disagg_wall = sum(rows[f"{p}:{d}"][0] for p, d in RATIOS)
    disagg_n = sum(rows[f"{p}:{d}"][1] for p, d in RATIOS)
    print(f"fleet_tp8_wall_s: {rows['tp8'][0]:.2f}")
    print(f"fleet_tp8_us_per_request: {per_request('tp8'):.0f}")
    print(f"fleet_tp4_us_per_request: {per_request('tp4'):.0f}")
    print(f"fleet_disaggregated_us_per_request: {disagg_wall / disagg_n * 1e6:.0f}")


if __name__ == "__main__":
    main()

"""The capacity search at the size of Vidur-Search's LLaMA2-70B study: scenarios/search/llama2_70b_capacity.yaml
(144 configurations: A100 vs H100, TP 2/4/8, PP 1/2, three schedulers, two batch caps, colocated vs 1P+1D, each with
its own rate bisection on the Azure conversation trace). Vidur reports about one CPU-hour for its search; the
target here is 60 s on a 2-core machine. Prints the search's figures and how its time splits.

Usage: python bench/search_speed.py [--workers N]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from infersim.api import load_search_spec, run_search

SPEC = Path(__file__).resolve().parents[1] / "scenarios" / "search" / "llama2_70b_capacity.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=None, help="processes (default: the cores)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    search = load_search_spec(SPEC)
    result = run_search(search, workers=args.workers)
    wall = time.perf_counter() - t0
    ok = [r for r in result.rows if r.status == "ok"]
    best = result.recommended
    print(f"{len(result.rows)} configurations ({len(ok)} searched, {len(result.rows) - len(ok)} pruned), "
          f"{result.probes} probes of {search.settings.max_requests} requests, {os.cpu_count()} cores, "
          f"{args.workers or os.cpu_count()} workers")
    print(f"recommended for {result.target_rate:g} req/s: {best.label if best else None}"
          + (f" (${best.usd_per_hour:.2f}/h, capacity {best.capacity_rps:.3g} req/s)" if best else ""))
    print(f"probes per searched configuration: {result.probes / max(1, len(ok)):.1f}")
    print(f"configurations: {len(result.rows)}")
    print(f"search_wall_s: {wall:.1f}")


if __name__ == "__main__":
    main()

"""The capacity search at the size of Vidur-Search's LLaMA2-70B study: scenarios/search/llama2_70b_capacity.yaml
(144 configurations: A100 vs H100, TP 2/4/8, PP 1/2, three schedulers, two batch caps, colocated vs 1P+1D, each with
its own rate bisection on the Azure conversation trace). Vidur reports about one CPU-hour for its search; the
target here is 30 s on a 2-core machine. Prints the search's figures.

`--against DIR` runs DIR's search (another worktree, e.g. `git worktree add --detach /tmp/search_base main`) and this
tree's, each in a fresh process, alternately for `--rounds` rounds, and prints wall and CPU time (the process and its
workers) side by side, their ratios, and whether the two agree: the same recommendation and, for every configuration
both searched, the same status and capacity (rows this tree pruned as costlier than the recommendation are counted).

Usage: python bench/search_speed.py [--workers N] [--against DIR [--rounds R]]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = "scenarios/search/llama2_70b_capacity.yaml"
# run in a fresh process with the tree's own code and spec (the base tree has no such mode of its own)
CHILD = """
import json, sys, time
t0 = time.perf_counter()
from infersim.api import load_search_spec, run_search
search = load_search_spec(sys.argv[1])
r = run_search(search, workers=int(sys.argv[2]) if sys.argv[2] != "0" else None)
print(json.dumps({"wall_s": time.perf_counter() - t0, "probes": r.probes, "recommended":
                  r.recommended.label if r.recommended else None, "rows": {x.label: [x.status, x.capacity_rps,
                  x.reason] for x in r.rows}}))
"""


def run_tree(tree: Path, workers: int) -> dict:
    """One search in a fresh process on `tree`'s code: its summary, wall time and CPU time (with its workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree / SPEC), str(workers)], cwd=tree, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_wall_s": wall, "cpu_s": cpu}


def agreement(base: dict, this: dict) -> tuple[bool, int]:
    """(whether every configuration both searched has the same status and capacity, and the recommendation is the
    same; how many this tree pruned for cost that the base searched)."""
    costly = [k for k, (st, _, why) in this["rows"].items() if st == "pruned" and "prune_costlier" in why]
    same = base["recommended"] == this["recommended"] and base["rows"].keys() == this["rows"].keys() and all(
        base["rows"][k][:2] == v[:2] for k, v in this["rows"].items() if k not in costly)
    return same, len(costly)


def against(base_tree: Path, workers: int, rounds: int) -> None:
    """Alternate the two trees' searches and print the side-by-side figures."""
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    for i in range(rounds):
        for name, tree in (("base", base_tree), ("this", ROOT)) if i % 2 == 0 else (("this", ROOT),
                                                                                       ("base", base_tree)):
            runs[name].append(run_tree(tree, workers))
            r = runs[name][-1]
            print(f"round {i + 1} {name}: wall {r['process_wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, "
                  f"{r['probes']} probes, recommended {r['recommended']} "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    same, costly = agreement(runs["base"][0], runs["this"][0])
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("process_wall_s", "cpu_s")} for k, v in runs.items()}
    print(f"rows: {len(runs['this'][0]['rows'])}, {costly} pruned here as costlier than the cheapest that carries the "
          f"target; the rest and the recommendation {'identical' if same else 'DIFFER'}")
    print(f"base_search_wall_s: {med['base']['process_wall_s']:.1f}")
    print(f"base_search_cpu_s: {med['base']['cpu_s']:.1f}")
    print(f"search_wall_s: {med['this']['process_wall_s']:.1f}")
    print(f"search_cpu_s: {med['this']['cpu_s']:.1f}")
    print(f"search_speedup_vs_base: {med['base']['process_wall_s'] / med['this']['process_wall_s']:.2f}")
    print(f"search_cpu_speedup_vs_base: {med['base']['cpu_s'] / med['this']['cpu_s']:.2f}")
    print(f"search_agrees_with_base: {int(same)}")


def alone(workers: int | None) -> None:
    """This tree's search in this process: its figures."""
    from infersim.api import load_search_spec, run_search

    t0 = time.perf_counter()
    search = load_search_spec(ROOT / SPEC)
    result = run_search(search, workers=workers)
    wall = time.perf_counter() - t0
    ok = [r for r in result.rows if r.status == "ok"]
    best = result.recommended
    print(f"{len(result.rows)} configurations ({len(ok)} searched, {len(result.rows) - len(ok)} pruned), "
          f"{result.probes} probes of {search.settings.max_requests} requests, {os.cpu_count()} cores, "
          f"{workers or os.cpu_count()} workers")
    print(f"recommended for {result.target_rate:g} req/s: {best.label if best else None}"
          + (f" (${best.usd_per_hour:.2f}/h, capacity {best.capacity_rps:.3g} req/s)" if best else ""))
    print(f"probes per searched configuration: {result.probes / max(1, len(ok)):.1f}")
    print(f"configurations: {len(result.rows)}")
    print(f"search_wall_s: {wall:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=None, help="processes (default: the cores)")
    ap.add_argument("--against", type=Path, default=None, help="another tree to run side by side with this one")
    ap.add_argument("--rounds", type=int, default=2, help="with --against: rounds of the two, alternating")
    args = ap.parse_args()
    if args.against is None:
        alone(args.workers)
    else:
        against(args.against.resolve(), args.workers or 0, args.rounds)


if __name__ == "__main__":
    main()

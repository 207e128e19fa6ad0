"""The run's PNG plots side by side: this tree against another, each figure taken in fresh processes, the two trees
alternating so that a busy machine slows both alike.

A child process on one tree simulates a scenario as `infersim run` does (with what `run` has imported by then:
`infersim.commands.run`), then times, in CPU seconds, the plots' whole share of the run: importing
sim/report/plots.py (and with it the canvas, Pillow) and `write_plots` (latency_cdf.png, kv_cache.png,
batch_size.png: draw, encode, write). Scenarios: the Vidur-sized run (bench/scenarios/vidur_llama2_7b_a100.yaml, one
replica, 10,000 requests) and two replicas behind a router (scenarios/azure_conv_llama3_8b_h100_x2.yaml: the
legend's plots). With --instructions, also valgrind's instruction count of the Vidur plots' share: a child that
simulates and plots less one that only simulates (needs valgrind; ~5 minutes). Medians over --rounds. Every process
reads byte code compiled once into a scratch PYTHONPYCACHEPREFIX. Ends with headline lines `name: value`.

Usage: python bench/plot_speed.py --against REV_OR_TREE [--rounds N] [--instructions]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from instructions import VIDUR, environment, instructions
from sim_speed import tree_of

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"vidur": VIDUR,
             "two_replicas": ROOT / "scenarios" / "azure_conv_llama3_8b_h100_x2.yaml"}
# argv: scenario file, output folder, "plot" or not; prints the plots' import and draw CPU seconds as JSON
CHILD = """
import json, sys, time
from pathlib import Path
from infersim.commands.run import run_scenario  # noqa: F401  what `run` has imported when it writes the plots
from infersim.inputs import load_plan
from sim.config.generator import plan_requests
from sim.simulator.cluster import sim_records, simulate
plan = load_plan(Path(sys.argv[1]))
result = simulate(plan, plan_requests(plan))
records = sim_records(result)
if sys.argv[3] == "plot":
    c0 = time.process_time()
    from sim.report.plots import write_plots
    c1 = time.process_time()
    write_plots(Path(sys.argv[2]), records, result.replicas)
    c2 = time.process_time()
    print(json.dumps({"import_s": c1 - c0, "draw_s": c2 - c1, "total_s": c2 - c0}))
"""
def child(tree: Path, scenario: Path, out: Path, plot: bool = True) -> dict[str, float]:
    """Run the child on `tree`'s code; the plots' import and draw CPU seconds."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-c", CHILD, str(scenario), str(out), "plot" if plot else "no"],
                       cwd=tree, env=environment(tree), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: the plot child failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout) if plot else {}


def plot_instructions(tree: Path, out: Path) -> int:
    """Instructions of the Vidur run's plots on `tree`: a child that plots less one that does not (cachegrind)."""
    out.mkdir(parents=True, exist_ok=True)
    plotted, not_plotted = (instructions(tree, ["-c", CHILD, str(VIDUR), str(out), mode]) for mode in ("plot", "no"))
    return plotted - not_plotted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="a tree or a commit to time side by side with this one")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--instructions", action="store_true", help="also count the Vidur plots' instructions")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="plot_speed_"))
    try:
        trees = {"base": tree_of(args.against, scratch), "this": ROOT}
        for tree in trees.values():  # byte code written, not counted
            child(tree, SCENARIOS["vidur"], scratch / "warm", plot=True)
        times: dict[tuple[str, str], list[dict]] = {(t, s): [] for t in trees for s in SCENARIOS}
        for i in range(args.rounds):
            for name in trees if i % 2 == 0 else reversed(list(trees)):
                for scenario, path in SCENARIOS.items():
                    r = child(trees[name], path, scratch / name / scenario)
                    times[name, scenario].append(r)
                    print(f"round {i + 1} {name} {scenario}: import {r['import_s']:.4f} s, draw {r['draw_s']:.4f} s, "
                          f"total {r['total_s']:.4f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
        median = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in times.items()}
        for scenario in SCENARIOS:
            base, this = median["base", scenario], median["this", scenario]
            print(f"{scenario}: base {base['total_s']:.4f} s (import {base['import_s']:.4f}), this "
                  f"{this['total_s']:.4f} s (import {this['import_s']:.4f}): {base['total_s'] / this['total_s']:.2f}x")
        counts = {name: plot_instructions(tree, scratch / "count") for name, tree in trees.items()
                  if args.instructions}
        for scenario in SCENARIOS:
            print(f"plots_cpu_s_{scenario}: {median['this', scenario]['total_s']:.4f}")
            ratio = median["base", scenario]["total_s"] / median["this", scenario]["total_s"]
            print(f"plots_speedup_{scenario}: {ratio:.2f}")
        if counts:
            print(f"plots_instructions_vidur: {counts['this']}")
            print(f"plots_instructions_ratio_vidur: {counts['base'] / counts['this']:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

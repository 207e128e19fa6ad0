"""A run's work around the simulation, side by side: this tree against another, phase by phase, on the Vidur-sized
workload (bench/scenarios/vidur_llama2_7b_a100.yaml: 10,000 requests). Each sample is a fresh process that loads the
scenario and times (CPU, process_time) the phases an `infersim run` does besides simulating (untimed): the requests (`plan_requests`), the records (`sim_records`), report.json's figures (`build_report`) and the files
(`write_outputs` without plots: report.json and requests.csv), each once, as the run does (a first call pays its lazy
imports). The two trees alternate sample by sample, so a busy machine slows both alike; medians over --repeats.
With --instructions, valgrind's count of the same work instead (bench/instructions.py: deterministic to ~0.05%,
so a busy machine does not blur it): per tree, a process that plans and simulates, and one that then also takes
the phases (plan_requests a second time), the difference being the phases' instructions.
Ends with headline lines `name: value`.

Usage: python bench/report_speed.py --against TREE_OR_REV [--repeats N] [--instructions]
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

from instructions import instructions
from sim_speed import tree_of

ROOT = Path(__file__).resolve().parents[1]
VIDUR = ROOT / "bench" / "scenarios" / "vidur_llama2_7b_a100.yaml"
PHASES = ("requests", "records", "report", "write")
# argv: scenario, output folder; prints each phase's CPU seconds as JSON
CHILD = """
import json, sys, time
from pathlib import Path
from infersim.inputs import load_plan
from sim.config.generator import plan_requests
from sim.report.outputs import build_report, write_outputs
from sim.simulator.cluster import sim_records, simulate
plan = load_plan(Path(sys.argv[1]))
clock, got = time.process_time, {}
t = clock(); specs = plan_requests(plan); got["requests"] = clock() - t
res = simulate(plan, specs)
t = clock(); rec = sim_records(res); got["records"] = clock() - t
t = clock(); rep = build_report(plan, rec, res.replicas, res.wall_time_s, engine="sim", extra=res.extra)
got["report"] = clock() - t
t = clock(); write_outputs(Path(sys.argv[2]), rep, rec, res.replicas, plots=False); got["write"] = clock() - t
print(json.dumps(got))
"""

# argv: scenario, output folder, "phases" or not: plans and simulates, then (with "phases") takes the phases
COUNTED = """
import sys
from pathlib import Path
from infersim.inputs import load_plan
from sim.config.generator import plan_requests
from sim.report.outputs import build_report, write_outputs
from sim.simulator.cluster import sim_records, simulate
plan = load_plan(Path(sys.argv[1]))
res = simulate(plan, plan_requests(plan))
if sys.argv[3] == "phases":
    plan_requests(plan)
    rec = sim_records(res)
    rep = build_report(plan, rec, res.replicas, res.wall_time_s, engine="sim", extra=res.extra)
    write_outputs(Path(sys.argv[2]), rep, rec, res.replicas, plots=False)
"""


def phases(tree: Path, out: Path) -> dict[str, float]:
    """Each phase's CPU seconds in a fresh process on `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(VIDUR), str(out)], cwd=tree, env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: the phases failed: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def counted(tree: Path, scratch: Path) -> int:
    """The phases' instructions on `tree`: a process that takes them less one that only plans and simulates."""
    with_phases, without = (instructions(tree, ["-c", COUNTED, str(VIDUR), str(scratch / tree.name), mode])
                            for mode in ("phases", "none"))
    return with_phases - without


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="a tree or a commit to time side by side with this one")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--instructions", action="store_true", help="count instructions (valgrind) instead of timing")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="report_speed_"))
    try:
        base = tree_of(args.against, scratch)
        if args.instructions:
            before, after = counted(base, scratch), counted(ROOT, scratch)
            print(f"phases: base {before:,}, this tree {after:,} instructions")
            print(f"phases_instructions_ratio: {after / before:.4f}")
            return
        samples = {base: [], ROOT: []}
        for i in range(args.repeats):
            for tree in (base, ROOT):
                samples[tree].append(phases(tree, scratch / f"out_{i}_{tree == ROOT}"))
    finally:
        shutil.rmtree(scratch)
    figures = {}
    for phase in (*PHASES, "total"):
        before, after = (statistics.median(sum(s.values()) if phase == "total" else s[phase] for s in samples[t])
                         for t in (base, ROOT))
        print(f"{phase}: base {before * 1000:.1f} ms, this tree {after * 1000:.1f} ms ({before / after:.2f}x)")
        figures[f"{phase}_speedup"] = before / after
        if phase == "total":
            figures["total_ms"] = after * 1000
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()

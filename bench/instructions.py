"""Instructions, not seconds: the simulator's work counted by valgrind's cachegrind (`I refs`), this tree against
another, so that a change of a few percent can be told apart on a machine whose timings move ±8% run to run.

Counted, each in a fresh interpreter on its tree's code (PYTHONHASHSEED=0, BLAS and OpenMP at one thread):
- `simulate()` of bench/sim_speed.py's Azure hour (Llama-2-7B / A100-80GB): a process that simulates twice minus one
  that simulates once, i.e. one warm run: as the tree plans the plain scenario (`default_plan`; this tree plans it as
  vLLM serves it) and, on this tree, with `engine: infersim` (`same_plan`: the plan the code before the engine work
  made of it);
- the whole `infersim run` process on the Vidur-sized workload (bench/scenarios/vidur_llama2_7b_a100.yaml,
  `--no-plots`, or with `--plots` its PNGs too): start-up, simulation, report.
`--scenario FILE` counts that scenario instead, in both: its `simulate()` (as planned, and with `engine: infersim`)
and its whole run.
Two counts of one process differ by ~0.05%. Instructions are a proxy: they do not see cache misses or branch
mispredictions, so a ratio here and the seconds of bench/sim_speed.py can differ by a few percent. Needs `valgrind`;
each count runs ~50x slower than natively (the whole bench: ~15 minutes).

Usage: python bench/instructions.py --against REV_OR_TREE [--only sim|run] [--scenario FILE] [--plots]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sim_speed import PLANNED, SCENARIO, knows_engines, tree_of

ROOT = Path(__file__).resolve().parents[1]
VIDUR = ROOT / "bench" / "scenarios" / "vidur_llama2_7b_a100.yaml"
# argv: scenario (JSON), how many times to simulate it
CHILD = PLANNED + """
for _ in range(int(sys.argv[2])):
    simulate(plan, specs)
"""
PYCACHE = Path(tempfile.gettempdir()) / "infersim_instructions_pyc"
RUN = "import sys; sys.argv = ['infersim', *sys.argv[1:]]; from infersim.cli import main; main()"


def environment(tree: Path) -> dict[str, str]:
    """`tree` first on the path, fixed hashing, one BLAS / OpenMP thread, byte code written and kept apart (an
    installed package has its .pyc: compiling every module in every process would be counted otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": str(PYCACHE / tree.name)}


def instructions(tree: Path, argv: list[str]) -> int:
    """The instructions a fresh `python ARGV` process executes on `tree`'s code, counted by cachegrind, after one
    run of it outside valgrind that writes the byte code."""
    subprocess.run([sys.executable, *argv], cwd=tree, env=environment(tree), capture_output=True, check=True)
    r = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                        sys.executable, *argv], cwd=tree, env=environment(tree), capture_output=True, text=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    if r.returncode != 0 or not found:
        raise SystemExit(f"{tree}: {' '.join(argv[:2])} failed under valgrind: {r.stderr.strip()[-300:]}")
    return int(found.group(1).replace(",", ""))


def simulate_instructions(tree: Path, scenario: dict) -> int:
    """One warm simulate() of `scenario` on `tree`: a process simulating twice minus one simulating once."""
    twice, once = (instructions(tree, ["-c", CHILD, json.dumps(scenario), str(n)]) for n in (2, 1))
    return twice - once


def run_instructions(tree: Path, scratch: Path, scenario: Path = VIDUR, plots: bool = False) -> int:
    """The whole `infersim run SCENARIO` process on `tree` (`--no-plots` unless `plots`)."""
    flags = [] if plots else ["--no-plots"]
    return instructions(tree, ["-c", RUN, "run", str(scenario), "--out", str(scratch / tree.name), "-q", *flags])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="a tree or a commit to count side by side with this one")
    ap.add_argument("--only", choices=("sim", "run"), help="count only simulate() or only the whole run")
    ap.add_argument("--scenario", type=Path, help="a scenario file to count instead of the Azure hour and the "
                    "Vidur-sized run")
    ap.add_argument("--plots", action="store_true", help="the whole run with its plots")
    args = ap.parse_args()
    scenario = args.scenario.resolve() if args.scenario else None
    if scenario is not None and not scenario.is_file():
        raise SystemExit(f"--scenario {args.scenario}: no such file")
    if shutil.which("valgrind") is None:
        raise SystemExit("bench/instructions.py needs valgrind (apt install valgrind)")
    scratch = Path(tempfile.mkdtemp(prefix="instructions_"))
    figures = {}
    try:
        base = tree_of(args.against, scratch)
        if args.only != "run":
            plain = scenario_dict(scenario) if scenario else SCENARIO
            same, engines, counted = {**plain, "engine": "infersim"}, knows_engines(base), {}
            for name, chosen in (("default_plan", plain), ("same_plan", same)):
                # a tree from before the engine work plans the plain scenario as `engine: infersim` does now
                key = json.dumps(chosen if engines else plain)
                base_ir = counted[key] = counted.get(key) or simulate_instructions(base, json.loads(key))
                ir = simulate_instructions(ROOT, chosen)
                print(f"simulate() {name}: base {base_ir:,}, this tree {ir:,} instructions", flush=True)
                figures[f"{name}_instructions_ratio"] = ir / base_ir
        if args.only != "sim":
            file = scenario or VIDUR
            base_ir, ir = (run_instructions(t, scratch, file, args.plots) for t in (base, ROOT))
            what = "with plots" if args.plots else "--no-plots"
            print(f"infersim run ({file.name}, {what}): base {base_ir:,}, this tree {ir:,} instructions")
            figures["run_instructions_ratio" if args.plots else "run_no_plots_instructions_ratio"] = ir / base_ir
    finally:
        shutil.rmtree(scratch)
    for name, value in figures.items():
        print(f"{name}: {value:.4f}")


def scenario_dict(path: Path) -> dict:
    """A scenario file as the JSON the counting process parses (in the tree's folder: a file it names by a relative
    path is read from there)."""
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise SystemExit(f"--scenario {path}: not a mapping of keys")
    return data


if __name__ == "__main__":
    main()

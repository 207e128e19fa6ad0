"""The whole `infersim run` process side by side: this tree against another (default: a detached worktree of `main`,
the commit before the change), on the Vidur-sized workload (bench/scenarios/vidur_llama2_7b_a100.yaml: Llama-2-7B on
one A100, 10,000 requests, Poisson 4 req/s, 512/128 tokens), with its plots and without (`--no-plots`). Fresh
processes, the two trees alternating run by run so that a busy machine slows both alike; each run's wall time and CPU
time (user + system of the child, which a shared machine disturbs less than the wall). Every process reads byte-code
compiled once per tree into a scratch PYTHONPYCACHEPREFIX (bench/startup.py's), as an installed package's is. Medians
over --repeats runs.
Ends with headline lines `name: value`.

Usage: python bench/run_speed.py [--against DIR | --base-ref REF] [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import CLI, PYCACHE, VIDUR, _env, worktree

HERE = Path(__file__).resolve().parents[1]
MODES = {"run": [], "run_no_plots": ["--no-plots"]}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(tree: Path, flags: list[str], out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh `infersim run VIDUR --out OUT -q FLAGS` process in `tree`."""
    env = _env(tree)  # byte-code read from one compiled copy per tree, as an installed package's is
    c0, t0 = children_cpu(), time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CLI, "run", VIDUR, "--out", str(out), "-q", *flags], cwd=tree, env=env,
                       capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    if r.returncode != 0:
        raise SystemExit(f"{tree}: infersim run failed: {r.stderr.strip()[-300:]}")
    return wall, cpu


def side_by_side(base: Path, repeats: int, scratch: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """Per mode, per figure (wall_s, cpu_s): the medians (base, this tree), the trees alternating run by run."""
    got = {}
    for mode, flags in MODES.items():
        samples = {base: [], HERE: []}
        for i in range(repeats):
            for tree in (base, HERE):
                samples[tree].append(one_run(tree, flags, scratch / f"{mode}_{i}_{tree == HERE}"))
        got[mode] = {}
        for j, figure in enumerate(("wall_s", "cpu_s")):
            before, after = (statistics.median(s[j] for s in samples[t]) for t in (base, HERE))
            got[mode][figure] = (before, after)
            print(f"{mode} {figure}: base {before:.3f}, this tree {after:.3f} ({before / after:.2f}x)", flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", type=Path, help="the tree to compare with (default: a worktree of --base-ref)")
    ap.add_argument("--base-ref", default="main", help="the commit before the change (default: main)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="run_speed_"))
    base = args.against.resolve() if args.against else worktree(args.base_ref, tmp / "tree")
    try:
        print(f"base {base}, this tree {HERE}, {os.cpu_count()} cores, median of {args.repeats} fresh processes each")
        for tree in (base, HERE):  # compiles the byte-code every later process reads
            one_run(tree, ["--no-plots"], tmp / f"compile_{tree == HERE}")
        got = side_by_side(base, args.repeats, tmp)
    finally:
        shutil.rmtree(PYCACHE, ignore_errors=True)
        if not args.against:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)], check=True)
    for mode, figures in got.items():
        for figure, (before, after) in figures.items():
            print(f"vidur_{mode}_{figure}_base: {before:.3f}")
            print(f"vidur_{mode}_{figure}: {after:.3f}")
    for mode, figures in got.items():
        print(f"vidur_{mode}_speedup_vs_base: {figures['cpu_s'][0] / figures['cpu_s'][1]:.2f}")
        print(f"vidur_{mode}_wall_speedup_vs_base: {figures['wall_s'][0] / figures['wall_s'][1]:.2f}")


if __name__ == "__main__":
    main()

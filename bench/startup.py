"""Start-up side by side: this tree against another (default: a detached worktree of `main`, the commit before the
change), each figure taken in fresh processes, the two trees alternating so that a busy machine slows both alike.

- imports of `import infersim.cli` and of what `infersim run` imports over its whole process (the sum of the
  top-level cumulative times of `python -X importtime`, after the interpreter's own start-up);
- the whole `infersim --help` process, and the whole `infersim run` process on the Vidur-sized workload
  (bench/scenarios/vidur_llama2_7b_a100.yaml: Llama-2-7B on one A100, 10,000 requests, 4 req/s, 512/128 tokens).

Medians over --repeats runs per tree. Ends with headline lines `name: value`.

Usage: python bench/startup.py [--base DIR | --base-ref REF] [--repeats N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
VIDUR = str(HERE / "bench" / "scenarios" / "vidur_llama2_7b_a100.yaml")  # both trees run this one
MARK = "infersim-startup-mark"
# the interpreter's start-up, then the CLI as the `infersim` script runs it (sys.argv as the command line gives it)
CLI = ("import sys; sys.stderr.write('" + MARK + "\\n'); sys.argv = ['infersim', *sys.argv[1:]]; "
       "from infersim.cli import main; main()")


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "120"}


def import_seconds(tree: Path, code: str, args: list[str]) -> float:
    """The seconds a fresh process spent importing after MARK: the sum of `-X importtime`'s top-level cumulative
    figures (an import nested in another is inside its parent's)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], cwd=tree, env=_env(tree),
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args) or code} failed: {r.stderr.strip().splitlines()[-1]}")
    total, seen = 0, False
    for line in r.stderr.splitlines():
        seen = seen or line == MARK
        parts = line.split("|")
        if seen and line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit() \
                and not parts[2].startswith("  "):
            total += int(parts[1])
    return total / 1e6


def process_seconds(tree: Path, args: list[str]) -> float:
    """The wall time of a fresh `infersim ARGS` process."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CLI, *args], cwd=tree, env=_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{tree}: infersim {' '.join(args)} failed: {r.stderr.strip()[-300:]}")
    return wall


MEASURES = {  # name: what one sample of it runs in a tree
    "cli_import_s": lambda tree: import_seconds(tree, f"import sys; sys.stderr.write('{MARK}\\n'); import infersim.cli",
                                                []),
    "run_imports_s": lambda tree: import_seconds(tree, CLI, ["run", VIDUR, "-q", "--no-plots"]),
    "help_process_s": lambda tree: process_seconds(tree, ["--help"]),
    "run_process_s": lambda tree: process_seconds(tree, ["run", VIDUR, "-q", "--no-plots"]),
}


def side_by_side(base: Path, repeats: int) -> dict[str, tuple[float, float]]:
    """Per measure, the medians (base, this tree), the trees alternating sample by sample."""
    out = {}
    for name, measure in MEASURES.items():
        samples = {base: [], HERE: []}
        for _ in range(repeats):
            for tree in (base, HERE):
                samples[tree].append(measure(tree))
        out[name] = (statistics.median(samples[base]), statistics.median(samples[HERE]))
        print(f"{name}: base {out[name][0]:.3f}, this tree {out[name][1]:.3f} ({out[name][0] / out[name][1]:.2f}x)",
              flush=True)
    return out


def worktree(ref: str, where: Path) -> Path:
    """A detached worktree of `ref` at `where` (removed by the caller)."""
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(where), ref], check=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="the tree to compare with (default: a worktree of --base-ref)")
    ap.add_argument("--base-ref", default="main", help="the commit before the change (default: main)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = None if args.base else Path(tempfile.mkdtemp(prefix="startup_base_")) / "tree"
    base = args.base.resolve() if args.base else worktree(args.base_ref, tmp)
    try:
        print(f"base {base}, this tree {HERE}, {os.cpu_count()} cores, median of {args.repeats} fresh processes each")
        got = side_by_side(base, args.repeats)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tmp)], check=True)
    for name, (before, after) in got.items():
        print(f"{name}_base: {before:.3f}")
        print(f"{name}: {after:.3f}")
        print(f"{name.removesuffix('_s')}_speedup: {before / after:.2f}")


if __name__ == "__main__":
    main()

"""Start-up side by side: this tree against another (default: a detached worktree of `main`, the commit before the
change), each figure taken in fresh processes, the two trees alternating so that a busy machine slows both alike.

- imports of `import infersim.cli` and of what `infersim run` imports over its whole process (the sum of the
  top-level cumulative times of `python -X importtime`, after the interpreter's own start-up);
- the CPU time (user + system) of a whole `infersim run` process on 10 requests of the Vidur-sized workload: the
  start-up a run pays before its simulation, less disturbed by a shared machine than the wall;
- the whole `infersim --help` process, and the whole `infersim run` process on the Vidur-sized workload
  (bench/scenarios/vidur_llama2_7b_a100.yaml: Llama-2-7B on one A100, 10,000 requests, 4 req/s, 512/128 tokens);
- the floor beside them, alike in every tree: a bare `python -c pass` process and a fresh process importing the
  third-party libraries a run needs (numpy, pydantic, simpy, PyYAML) with one OpenBLAS thread, as
  `infersim run` loads them, so the report says how far above the floor the project's own start-up is.

Every process reads byte-code compiled once into a scratch PYTHONPYCACHEPREFIX (a first run per tree, not counted,
writes it), as an installed package's is: under PYTHONDONTWRITEBYTECODE the sources would be compiled in every
process (~0.1 s of `run`'s imports on this machine). Medians over --repeats runs per tree. Ends with headline lines
`name: value`.

Usage: python bench/startup.py [--base DIR | --base-ref REF] [--repeats N]
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
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


FLOOR = "import numpy, pydantic, simpy, yaml"  # the third-party libraries `infersim run` needs
PYCACHE = Path(tempfile.gettempdir()) / f"startup_pycache_{os.getpid()}"  # byte-code for every tree, compiled once


def _env(tree: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(tree), "COLUMNS": "120", "PYTHONPYCACHEPREFIX": str(PYCACHE), **extra}


@functools.cache
def tiny_scenario() -> str:
    """The Vidur-sized scenario cut to 10 requests (a run that is mostly start-up), in a scratch file."""
    PYCACHE.mkdir(parents=True, exist_ok=True)
    path = PYCACHE / "vidur_10_requests.yaml"
    text = Path(VIDUR).read_text()
    if "num_requests: 10000" not in text:
        raise SystemExit(f"{VIDUR}: no 'num_requests: 10000' to cut to 10")
    path.write_text(text.replace("num_requests: 10000", "num_requests: 10"))
    return str(path)


def import_seconds(tree: Path, code: str, args: list[str], **env: str) -> float:
    """The seconds a fresh process spent importing after MARK: the sum of `-X importtime`'s top-level cumulative
    figures (an import nested in another is inside its parent's)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], cwd=tree, env=_env(tree, **env),
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


def process_seconds(tree: Path, code: str, args: list[str], **env: str) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh `python -c CODE ARGS` process: CODE is CLI for `infersim ARGS`."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=_env(tree, **env), capture_output=True,
                       text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args) or code} failed: {r.stderr.strip()[-300:]}")
    return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


MEASURES = {  # name: what one sample of it runs in a tree
    "cli_import_s": lambda tree: import_seconds(tree, f"import sys; sys.stderr.write('{MARK}\\n'); import infersim.cli",
                                                []),
    "run_imports_s": lambda tree: import_seconds(tree, CLI, ["run", VIDUR, "-q", "--no-plots"]),
    "start_cpu_s": lambda tree: process_seconds(tree, CLI, ["run", tiny_scenario(), "-q", "--no-plots"])[1],
    "help_process_s": lambda tree: process_seconds(tree, CLI, ["--help"])[0],
    "run_process_s": lambda tree: process_seconds(tree, CLI, ["run", VIDUR, "-q", "--no-plots"])[0],
}
FLOOR_MEASURES = {  # name: one sample, the same in every tree
    "bare_process_s": lambda: process_seconds(HERE, "pass", [])[0],
    "floor_imports_s": lambda: import_seconds(HERE, f"import sys; sys.stderr.write('{MARK}\\n'); {FLOOR}", [],
                                              OPENBLAS_NUM_THREADS="1"),
    "floor_cpu_s": lambda: process_seconds(HERE, FLOOR, [], OPENBLAS_NUM_THREADS="1")[1],
}


def side_by_side(base: Path, repeats: int) -> dict[str, tuple[float, float]]:
    """Per measure, the medians (base, this tree), the trees alternating sample by sample."""
    for tree in (base, HERE):  # compiles the byte-code every later process reads
        process_seconds(tree, CLI, ["run", tiny_scenario(), "-q", "--no-plots"])
        import_seconds(tree, CLI, ["run", tiny_scenario(), "-q", "--no-plots"])
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


def floor(repeats: int) -> dict[str, float]:
    """Per floor measure, the median of `repeats` samples."""
    process_seconds(HERE, FLOOR, [])
    out = {name: statistics.median(measure() for _ in range(repeats)) for name, measure in FLOOR_MEASURES.items()}
    print("floor: " + ", ".join(f"{name} {value:.3f}" for name, value in out.items()), flush=True)
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
        low = floor(args.repeats)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tmp)], check=True)
        shutil.rmtree(PYCACHE, ignore_errors=True)
    for name, (before, after) in got.items():
        print(f"{name}_base: {before:.3f}")
        print(f"{name}: {after:.3f}")
        print(f"{name.removesuffix('_s')}_speedup: {before / after:.2f}")
    for name, value in low.items():
        print(f"{name}: {value:.3f}")
    for name, floor_name, above in (("run_imports_s", "floor_imports_s", "run_above_floor_s"),
                                    ("start_cpu_s", "floor_cpu_s", "start_cpu_above_floor_s")):
        print(f"{above.removesuffix('_s')}_base_s: {got[name][0] - low[floor_name]:.3f}")
        print(f"{above}: {got[name][1] - low[floor_name]:.3f}")


if __name__ == "__main__":
    main()

"""Hardware validation on a CUDA device in one short run: check that the executor gives on the GPU the output
it gives on the CPU (tests/test_cuda.py), profile the executor there, then validate two scenarios with that
profile (each run twice, for the real-vs-real spread), writing everything into one folder.

    python -m calibration.gpu_check --out gpu_check_out      # ≤ 8 minutes on one GPU

Writes OUT/cuda.json (the profile), OUT/<scenario>/validation.json and a CDF plot per scenario, and
OUT/summary.md (the tables). Decode, prompt and verify steps replay CUDA graphs (executor/cuda_graph.py) unless
`--eager`. `--device cpu` runs the same stages on the CPU (a dry run of this script); the CPU path of the
project never needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from calibration.profile import profile_command
from calibration.validate import METRICS, markdown_table, model_loader, summarize, validate_many
from executor import engine
from executor.serve import check_device
from sim.config.errors import ConfigError
from sim.config.plan import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [ROOT / "scenarios/validation/low_load.yaml", ROOT / "scenarios/validation/medium_load.yaml"]


def run_cuda_tests() -> str:
    """tests/test_cuda.py's outcome in one line (its tiny model needs no download)."""
    import pytest

    class Count:
        def __init__(self):
            self.outcomes: dict[str, int] = {}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self.outcomes[report.outcome] = self.outcomes.get(report.outcome, 0) + 1

    count = Count()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests/test_cuda.py")], plugins=[count])
    return ", ".join(f"{n} {k}" for k, n in sorted(count.outcomes.items())) + f" (pytest exit {int(rc)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of every stage on this machine")
    ap.add_argument("--quick", action="store_true", help="smaller profile sweep")
    ap.add_argument("--runs", type=int, default=2, help="executor runs per scenario")
    ap.add_argument("--skip-tests", action="store_true", help="tests/test_cuda.py already ran on this machine")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads while profiling (the scenarios' own)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: every engine step launched from Python")
    args = ap.parse_args()
    check_device(args.device)
    engine.CUDA_GRAPHS = not args.eager
    stages = {}
    t0 = time.perf_counter()
    tests = "skipped here (run separately)" if args.skip_tests else run_cuda_tests()
    stages["cuda tests"] = time.perf_counter() - t0
    prof_path = args.out / f"{args.device}.json"
    t = time.perf_counter()
    prof = profile_command(args.device, "SmolLM2-135M", prof_path, args.threads, args.quick)
    stages["profile"] = time.perf_counter() - t
    t = time.perf_counter()
    # one folder per scenario file, as `infersim validate --out` names them: `--real-from OUT` re-scores them
    plans = [(load_scenario(path)[1], args.out / path.stem) for path in SCENARIOS]
    results = validate_many(plans, prof_path, args.device, runs=args.runs, load=model_loader(args.device))
    stages["validate"] = time.perf_counter() - t
    host, fit = prof["host"], prof["fit"]["heldout"]
    lines = [f"# GPU check: {host.get('gpu') or host.get('cpu')}, torch {host['torch']}, {time.strftime('%Y-%m-%d')}",
             "", f"- tests/test_cuda.py (GPU output equals CPU output): {tests}",
             f"- profile: {len(prof['samples'])} steps in {prof['sweep_s']:.0f} s, held-out MAPE "
             f"{fit['mape'] * 100:.1f}%, R² {fit['r2']:.4f}; matmul {prof['measured']['matmul_flops'] / 1e12:.1f} "
             f"TFLOP/s (fp32), copy bandwidth {prof['measured']['memory_bandwidth'] / 1e9:.0f} GB/s",
             f"- decode, prompt and verify steps: {'eager' if args.eager else 'replayed from CUDA graphs'} (on a GPU)",
             f"- validation: {args.runs} executor run(s) per scenario (real = their mean)", "",
             markdown_table(results, [name for name, *_ in METRICS]), "| metric | max abs error | median abs error "
             "| median spread |", "|---|---:|---:|---:|"]
    for name, row in summarize(results).items():
        cells = [f"{row[k]:.1f}%" if row[k] is not None else "-"
                 for k in ("max_abs_error_pct", "median_abs_error_pct", "median_spread_pct")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "stages: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
              + f"; total {time.perf_counter() - t0:.0f} s"]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"out": str(args.out)}))


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"gpu_check: error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None

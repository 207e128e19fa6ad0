"""Hardware validation on a CUDA device in one short run: check that the executor gives on the GPU the output
it gives on the CPU (tests/test_cuda.py); then per model — SmolLM2-135M, a Llama-3.2-1B-shaped and a
Llama-3-8B-shaped model in bf16 with seeded random weights (scenarios/gpu/) — profile the executor there, validate
the model's scenarios with that profile (each run twice, for the real-vs-real spread), and measure the 8B shape's
capacity against the simulator's (a rate search of real serves); everything into one folder and one summary.

    python -m calibration.gpu_check --out gpu_check_out      # ~8 minutes on one H200

Writes OUT/<model>/cuda.json (the profile), OUT/<model>/<scenario>/validation.json with a CDF plot,
OUT/llama-3-8b/capacity/capacity.json and OUT/summary.md (the tables). Decode, prompt and verify steps replay CUDA
graphs (executor/model/cuda_graph.py) unless `--eager`. `--device cpu` is the dry run: the same stages on this machine
with every model cut to a tiny one of the same family and every workload to a few requests (checks the command,
not the numbers); the CPU path of the project never needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from calibration.capacity import validate_capacity
from calibration.profile import profile_command
from calibration.validate import METRICS, markdown_table, model_loader, summarize, validate_many
from executor.serving.serve import check_device
from sim.config.errors import ConfigError
from sim.config.plan import load_scenario, replan

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "scenarios/gpu"
# model -> its validation scenarios (the first is also the one it is profiled as)
MODELS = {"smollm2-135m": [GPU / "smollm2_h200.yaml"],
          "llama-3.2-1b": [GPU / "llama32_1b_h200.yaml", GPU / "llama32_1b_h200_prefix.yaml"],
          "llama-3-8b": [GPU / "llama3_8b_h200.yaml", GPU / "llama3_8b_h200_chunked.yaml"]}
CAPACITY = {"llama-3-8b": GPU / "llama3_8b_h200.yaml"}  # the capacity search costs a few minutes: one scenario
# the dry run's stand-in for every model: the family's layout at a size a 2-core CPU profiles in seconds
DRY_MODEL = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
             "intermediate_size": 256, "vocab_size": 2048, "weight_dtype": "fp32"}
DRY_REQUESTS = 12


def dry_scenario(path: Path, folder: Path) -> Path:
    """`path` with its model cut to DRY_MODEL (random weights, on the CPU) and its workload to DRY_REQUESTS
    requests, written into `folder`."""
    data = yaml.safe_load(path.read_text())
    base = data["model"]["base"] if isinstance(data["model"], dict) else data["model"]
    data["model"] = {"base": base, **DRY_MODEL}
    data["hardware"] = "cpu"
    data["executor"] = {**data.get("executor", {}), "random_weights": True, "threads": 2}
    data["executor"].pop("max_kv_cache_gib", None)
    data["kv_cache"] = {**data["kv_cache"], "num_blocks": 512}
    data["slo"] = {**data["slo"], "ttft_s": 2.0, "tpot_s": 0.2}
    data["workload"] = {**data["workload"], "num_requests": DRY_REQUESTS}
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / path.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


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


def as_run(plan, eager: bool):
    """The plan as this check runs it: `--eager` turns its executor's CUDA graphs off."""
    return replan(plan, executor={**plan.source["executor"], "cuda_graphs": False}) if eager else plan


def check_model(name: str, paths: list[Path], out: Path, args, stages: dict) -> tuple[dict, list, dict | None]:
    """Profile one model as its first scenario runs it, validate its scenarios with that profile, and measure its
    capacity where CAPACITY names a scenario: (profile, validation results, capacity.json content or None)."""
    folder = out / name
    if args.device == "cpu":
        paths = [dry_scenario(p, folder / "scenarios") for p in paths]
    t = time.perf_counter()
    prof_path = folder / f"{args.device}.json"
    prof = profile_command(args.device, name, prof_path, args.threads, args.quick, repeats=args.repeats,
                           scenario=paths[0], cuda_graphs=not args.eager)
    stages[f"{name} profile"] = time.perf_counter() - t
    t = time.perf_counter()
    load = model_loader(args.device)
    # one folder per scenario file, as `infersim validate --out` names them: `--real-from` re-scores them
    plans = [(as_run(load_scenario(path)[1], args.eager), folder / path.stem) for path in paths]
    results = validate_many(plans, prof_path, args.device, runs=args.runs, load=load)
    stages[f"{name} validate"] = time.perf_counter() - t
    capacity = None
    if name in CAPACITY and not args.no_capacity:
        t = time.perf_counter()
        path = CAPACITY[name] if args.device != "cpu" else dry_scenario(CAPACITY[name], folder / "scenarios")
        plan = as_run(load_scenario(path)[1], args.eager)
        capacity = validate_capacity(plan, prof_path, args.device, args.threads, load(plan),
                                     out=folder / "capacity", precision=args.precision)
        stages[f"{name} capacity"] = time.perf_counter() - t
    return prof, results, capacity


def profile_line(name: str, prof: dict) -> str:
    fit = prof["fit"]["heldout"]
    return (f"- {name}: profile of {len(prof['samples'])} steps in {prof['sweep_s']:.0f} s, held-out MAPE "
            f"{fit['mape'] * 100:.1f}%, R² {fit['r2']:.4f}")


def capacity_lines(name: str, c: dict) -> list[str]:
    def pct(v):
        return "-" if v is None else f"{v:+.1f}%"

    def rate(v):
        return "-" if v is None else f"{v:.3g}"

    m, p, s = c["measured"], c["predicted"], c.get("predicted_at_run_speed") or {}
    return [f"| {name} | {rate(m['capacity_rps'])} | {rate(m['missed_at_rps'])} | {rate(p['capacity_rps'])} | "
            f"{pct(c['error_pct'])} | {rate(s.get('capacity_rps'))} | {pct(c.get('error_at_run_speed_pct'))} | "
            f"{sum(q['passes'] == q['sim_passes'] for q in c['probes'])}/{len(c['probes'])} |"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of every stage on this machine, tiny models")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--quick", action="store_true", help="smaller profile sweeps")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each profile workload (median step)")
    ap.add_argument("--runs", type=int, default=2, help="executor runs per scenario")
    ap.add_argument("--precision", type=float, default=0.05, help="the capacity search's relative grid step")
    ap.add_argument("--no-capacity", action="store_true", help="skip the capacity search")
    ap.add_argument("--skip-tests", action="store_true", help="tests/test_cuda.py already ran on this machine")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the host side of every step)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: every engine step launched from Python")
    args = ap.parse_args()
    check_device(args.device)
    names = [n.strip().lower() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ConfigError(f"unknown model {unknown[0] if unknown else args.models!r}; allowed: {', '.join(MODELS)}",
                          "--models")
    stages = {}
    t0 = time.perf_counter()
    tests = "skipped here (run separately)" if args.skip_tests or args.device == "cpu" else run_cuda_tests()
    stages["cuda tests"] = time.perf_counter() - t0
    done = {name: check_model(name, MODELS[name], args.out, args, stages) for name in names}
    host = next(iter(done.values()))[0]["host"]
    lines = [f"# GPU check: {host.get('gpu') or host.get('cpu')}, torch {host['torch']}, {time.strftime('%Y-%m-%d %H:%M')}"
             + (" (CPU dry run: tiny stand-in models)" if args.device == "cpu" else ""),
             "", f"- tests/test_cuda.py (GPU output equals CPU output): {tests}",
             f"- decode, prompt and verify steps: {'eager' if args.eager or args.device == 'cpu' else 'CUDA graphs'}",
             f"- validation: {args.runs} executor run(s) per scenario (real = their mean)"]
    lines += [profile_line(name, prof) for name, (prof, _, _) in done.items()]
    results = [r for _, rs, _ in done.values() for r in rs]
    lines += ["", markdown_table(results, [name for name, *_ in METRICS]),
              "| metric | max abs error | median abs error | median spread |", "|---|---:|---:|---:|"]
    for name, row in summarize(results).items():
        cells = [f"{row[k]:.1f}%" if row[k] is not None else "-"
                 for k in ("max_abs_error_pct", "median_abs_error_pct", "median_spread_pct")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    caps = [(name, c) for name, (_, _, c) in done.items() if c is not None]
    if caps:
        lines += ["", "| capacity | measured req/s | missed at | predicted | error | at run speed | error | "
                  "verdicts agree |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, c in caps:
            lines += capacity_lines(name, c)
    lines += ["", "stages: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
              + f"; total {time.perf_counter() - t0:.0f} s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"out": str(args.out)}))


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"gpu_check: error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None

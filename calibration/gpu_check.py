"""Hardware validation on a CUDA device in one short run: profile the executor there, then validate two
scenarios with that profile, writing everything into one folder.

    python -m calibration.gpu_check --out gpu_check_out      # ≤ 8 minutes on one GPU

Writes OUT/cuda.json (the profile), OUT/<scenario>/validation.json and a CDF plot per scenario, and
OUT/summary.md (the error table). The CPU path of the project never needs this.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from calibration.profile import profile_command
from calibration.validate import validate
from executor.serve import check_device
from sim.errors import ConfigError
from sim.scenario import load_scenario

SCENARIOS = ["scenarios/validation/low_load.yaml", "scenarios/validation/medium_load.yaml"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--quick", action="store_true", help="smaller profile sweep")
    args = ap.parse_args()
    check_device("cuda")
    t0 = time.perf_counter()
    prof_path = args.out / "cuda.json"
    prof = profile_command("cuda", "SmolLM2-135M", prof_path, None, args.quick)
    lines = [f"# GPU check: {prof['host'].get('gpu')}, torch {prof['host']['torch']}",
             f"profile: {len(prof['samples'])} steps, held-out MAPE {prof['fit']['heldout']['mape'] * 100:.1f}%, "
             f"matmul {prof['measured']['matmul_flops'] / 1e12:.1f} TFLOP/s, "
             f"bandwidth {prof['measured']['memory_bandwidth'] / 1e9:.0f} GB/s", ""]
    for path in SCENARIOS:
        _, plan = load_scenario(path)
        result = validate(plan, prof_path, "cuda", out=args.out / plan.scenario.name)
        lines += [f"## {plan.scenario.name}", "| metric | real | sim | error % |", "|---|---|---|---|"]
        for name, row in result["metrics"].items():
            err = "-" if row["error_pct"] is None else f"{row['error_pct']:+.1f}"
            lines.append(f"| {name} | {row['real']:.4g} | {row['sim']:.4g} | {err} |")
        lines.append("")
    lines.append(f"total {time.perf_counter() - t0:.0f} s")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"out": str(args.out)}))


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        raise SystemExit(f"gpu_check: error: {e.one_line()}") from None

"""How well infersim predicts real vLLM on H100-SXM, end to end: BLIS's 16 published experiments
(scenarios/gpu_validation/, 24 load stages), every stage simulated and compared on vLLM's TPOT ((e2e - TTFT) /
(out - 1), mean per stage), TTFT mean and whether each side kept up with the stage's rate.

First the simulator as it is (no end-to-end fit: "before"), then the host overheads (cost_model.step_overhead_s,
per_seq_overhead_s) fitted end to end and judged leave one experiment out: fitted to 15 experiments' stages (a
linearization from one simulation per parameter around the kernel model's defaults, a bounded least squares on the
relative errors of TPOT and TTFT), the 16th simulated with them. Medians are over the stages real vLLM kept up with;
the saturation agreement over all stages. Simulated time only: the figures need no quiet machine.

Usage: python bench/engine_truth.py [--stage-s 180 | --full] [--no-fit] [--family host_overheads|refinement]
(~2 min on 2 busy cores; --no-fit ~25 s; --full ~15 min). `--family refinement` fits the GPU kernel model's linear,
attention and communication parts instead (dense models only: 12 experiments; TPOT alone).
"""
from __future__ import annotations

import argparse
import time

from calibration.engine_truth import (
    CALIBRATION_PATH,
    FAMILIES,
    STAGE_S,
    evaluate,
    headline,
    leave_one_out,
    load_experiments,
    without_front_end,
    write_calibration,
)


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0f}%"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def table(before: list[dict], after: list[dict] | None) -> str:
    """One line per stage: real vs simulated before (and leave-one-out after) the fit."""
    head = f"{'experiment':28} {'st':>2} {'rate':>4} | {'TPOT ms real':>12} {'sim':>6} {'err':>5}"
    head += f" {'LOO':>6} {'err':>5}" if after else ""
    head += f" | {'TTFT ms real':>12} {'sim':>8} {'err':>7}" + (f" {'LOO':>8} {'err':>7}" if after else "")
    head += " | kept up real/sim" + ("/LOO" if after else "")
    lines = [head, "-" * len(head)]
    by_stage = {(r["experiment"], r["stage"]): r for r in after or []}
    for b in before:
        a = by_stage.get((b["experiment"], b["stage"]))
        line = (f"{b['experiment']:28} {b['stage']:>2} {b['rate']:>4g} | {_ms(b['tpot_real']):>12} "
                f"{_ms(b['tpot_sim']):>6} {_pct(b['tpot_err_pct']):>5}")
        if a:
            line += f" {_ms(a['tpot_sim']):>6} {_pct(a['tpot_err_pct']):>5}"
        line += f" | {_ms(b['ttft_real']):>12} {_ms(b['ttft_sim']):>8} {_pct(b['ttft_err_pct']):>7}"
        if a:
            line += f" {_ms(a['ttft_sim']):>8} {_pct(a['ttft_err_pct']):>7}"
        verdicts = [b["keeps_up_real"], b["keeps_up_sim"]] + ([a["keeps_up_sim"]] if a else [])
        if after and not a:
            line += "   (not fitted)"
        lines.append(line + " | " + "/".join("yes" if v else "no" for v in verdicts))
    return "\n".join(lines)


def _fmt(x) -> str:
    return "none" if x is None else f"{x:.3g}"


def _headlines(prefix: str, h: dict) -> None:
    for key in ("tpot_abs_err_median_pct", "ttft_abs_err_median_pct", "saturation_agreement"):
        print(f"{prefix}_{key}: {_fmt(h[key])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage-s", type=float, default=STAGE_S, help="simulated seconds per stage (steady state)")
    p.add_argument("--full", action="store_true", help="every stage as long as it ran (600-1200 s)")
    p.add_argument("--no-fit", action="store_true", help="only the simulator as it is")
    p.add_argument("--family", choices=sorted(FAMILIES), default="front_end", help="what is fitted end to end: the "
                   "engine's front end (its API server's time a request, TTFT), the host overheads, or the kernel "
                   "model's parts (dense models, TPOT only)")
    p.add_argument("--write", action="store_true", help="fit the front end to every experiment and write it with its "
                   "leave-one-out error to sim/data/engine_calibration.json")
    a = p.parse_args()
    stage_s = None if a.full else a.stage_s
    t0 = time.perf_counter()
    experiments = load_experiments()
    before, b = evaluate(without_front_end, experiments, stage_s)
    family, after = FAMILIES[a.family], None
    if not a.no_fit:
        after, h, thetas = leave_one_out(family, experiments, stage_s)
    print(table(before, after))
    print(f"\n{len(experiments)} experiments, {b['stages']} stages ({b['stages_served']} real vLLM kept up with); "
          f"stages {'as long as they ran' if stage_s is None else f'cut to {stage_s:g} simulated s'}; "
          f"{time.perf_counter() - t0:.0f} s")
    _headlines("before", b)
    if after:
        fitted = [e for e in experiments if family.applies(e.plan)]
        print(f"fitted leave one out: {a.family} ({', '.join(family.names)}) on {len(fitted)} experiments")
        for exp, theta in zip(fitted, thetas):
            print(f"  held out {exp.name}: " + ", ".join(f"{v:.4g}" for v in theta))
        names = {e.name for e in fitted}
        if len(fitted) < len(experiments):
            _headlines("before_same_experiments", headline([r for r in before if r["experiment"] in names]))
    _headlines("e2e", h if after else b)
    if a.write and after and a.family == "front_end":
        written = write_calibration(family, experiments, stage_s, h)
        print(f"wrote {CALIBRATION_PATH}: vLLM's front end {written['vllm']['front_end']['frontend_s'] * 1e3:.2f} ms "
              "a request")


if __name__ == "__main__":
    main()

"""Capacity validation (`infersim validate --capacity`): the planner's own number — the highest arrival rate at which
a scenario meets its SLOs — measured on the executor by a rate search of real online serves, and predicted by the
simulator with the same definition and the same rate grid (sim/report/capacity.py, as `infersim search` finds it).

Each probe serves the scenario's requests with their arrival gaps scaled to the probe's rate, so every rate sees the
same prompts, outputs and burst pattern; a closed loop's capacity is counted in users instead, each probe dealing the
same requests and think times to that many users (sim.report.capacity.users_probe). With `--profile-alongside` a
slice of the profile sweep runs before each probe, so the profile predicting the capacity saw the machine in the same
minutes. The prediction is reported raw
and at the probes' own step speed (the profile scaled by their measured over predicted step time)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from calibration.validate import print_stage, run_real, simulated, slo_metrics, step_time_ratio, with_profile
from sim.config.generator import generate_requests
from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.cost.build import make_pricer
from sim.report.capacity import Grid, offered_rate, probe_rows, rates_grid, users_grid

EXPECTED_PROBES = 8  # how many slices the alongside sweep is cut into before the probe count is known


def probe_grid(plan: Plan, specs: list[RequestSpec]) -> Grid:
    """The grid a scenario's capacity is searched on, from its requests (`specs`, the workload's)."""
    loop = plan.workload.closed_loop
    if loop is not None:
        return users_grid(plan.workload, plan.base_dir, len(specs), float(loop.users))
    return rates_grid(probe_rows(specs), offered_rate([s.arrival_s for s in specs]))


def predicted_capacity(plan: Plan, profile: Path, grid: Grid, precision: float, scale: float = 1.0) -> tuple:
    """The simulator's capacity on the grid: (Capacity, {point: (metrics, verdict)})."""
    runs: dict[float, tuple] = {}

    def meets(x: float) -> bool:
        runs[x] = simulated_verdict(plan, profile, grid, x, scale)
        return runs[x][1]

    return grid.search(meets, precision), runs


def simulated_verdict(plan: Plan, profile: Path, grid: Grid, x: float, scale: float = 1.0) -> tuple:
    """The simulator's run of the grid's probe at `x`: (metrics, whether it meets the SLOs)."""
    specs = grid.probe(x)
    _, records, m = simulated(plan, profile, scale, specs)
    return grid.judge(m, records, specs, x)


def validate_capacity(plan: Plan, profile: Path | None, device: str, threads: int | None, loaded,
                      sweep=None, write_sweep=None, out: Path | None = None, precision: float = 0.05,
                      stage=print_stage) -> dict:
    """Measure the capacity on the executor and predict it; returns capacity.json's content (written under `out`
    with each probe's traces). `sweep`: an alongside profile sweep to advance between probes; `write_sweep()` then
    finishes it, writes it and returns its path, which predicts instead of `profile`."""
    grid = probe_grid(plan, generate_requests(plan.workload, plan.base_dir))
    probes: list[dict] = []
    steps_of: dict[float, list] = {}

    def real_meets(rate: float) -> bool:
        if sweep is not None:
            sweep.run_until(min(len(probes) + 1, EXPECTED_PROBES) / (EXPECTED_PROBES + 1))
        probe = grid.probe(rate)
        stage(f"{plan.name}: executor probe {len(probes) + 1} at {rate:.3g} {grid.unit}")
        folder = None if out is None else out / f"probe{len(probes) + 1}"
        records, steps = run_real(plan, probe, device, threads, loaded, folder)
        m, ok = grid.judge(slo_metrics(plan, records), records, probe, rate)  # a closed loop: no first wave
        steps_of[rate] = steps
        probes.append({"rate": rate, "passes": ok, **_summary(m)})
        return ok

    real = grid.search(real_meets, precision)
    if write_sweep is not None:
        profile = write_sweep()
    sim, sim_runs = predicted_capacity(plan, profile, grid, precision)
    pricer = make_pricer(with_profile(plan, profile))
    ratios = [step_time_ratio(steps, pricer)["all"] for steps in steps_of.values()]  # as the sim charges
    ratios = [r for r in ratios if r]
    speed = float(np.mean(ratios)) if ratios else None
    at_speed = predicted_capacity(plan, profile, grid, precision, speed)[0] if speed else None
    for p in probes:  # the simulator's verdict at each rate the executor was probed at
        if p["rate"] not in sim_runs:
            sim_runs[p["rate"]] = simulated_verdict(plan, profile, grid, p["rate"])
        m, p["sim_passes"] = sim_runs[p["rate"]]
        p["sim"] = _summary(m)
    result = {"scenario": plan.name, "device": device, "profile": str(profile), "unit": grid.unit,
              "target_rate": grid.target,
              "precision": precision, "slo": plan.slo.model_dump(),
              "measured": {"capacity_rps": real.rate, "missed_at_rps": real.missed_at},
              "predicted": {"capacity_rps": sim.rate, "missed_at_rps": sim.missed_at},
              "predicted_at_run_speed": None if at_speed is None else
              {"capacity_rps": at_speed.rate, "missed_at_rps": at_speed.missed_at, "step_time_ratio": speed},
              "error_pct": _error(sim.rate, real.rate),
              "error_at_run_speed_pct": None if at_speed is None else _error(at_speed.rate, real.rate),
              "probes": probes}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _summary(m: dict) -> dict:
    slo = m["slo"]
    return {"ttft_at_quantile_s": slo["ttft_at_quantile_s"], "tpot_at_quantile_s": slo["tpot_at_quantile_s"],
            "e2e_at_quantile_s": slo["e2e_at_quantile_s"],
            "requests_per_s": m["throughput"]["requests_per_s"], "completed": m["requests"]["completed"],
            "rejected": m["requests"]["rejected"]}


def _error(sim: float, real: float) -> float | None:
    return 100.0 * (sim - real) / real if real else None

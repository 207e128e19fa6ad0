"""`infersim validate` (and `--capacity`): scenarios run on the PyTorch executor and in the simulator, scored against
each other. The executor's modules (torch) are imported inside the functions that run it."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from calibration.capacity import validate_capacity as measure
from calibration.validate import (
    PROFILES,
    alongside_sweep,
    check_graphs,
    markdown_table,
    model_loader,
    summarize,
    validate_many,
)
from infersim.inputs import (
    check_checkpoint,
    check_drafters,
    load_plan,
    prepare_out,
    prepare_out_file,
    scenario_files,
    warn_threads,
)
from infersim.tables import num, pct, print_validation
from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.config.plan import replan
from sim.config.profile import read_profile
from sim.cost.build import speculation_model
from sim.report.capacity import STEADY_ROUNDS, check_has_slo, check_scalable


def validate(scenarios: list[Path], out: Path | None = None, device: str = "cpu", profile: Path | None = None,
             threads: int | None = None, repeat: int = 1, real_from: Path | None = None,
             alongside: Path | None = None) -> tuple[list[dict], Path, dict | None]:
    """Run scenarios on the executor and in the simulator: (each scenario's validation.json content, the profile
    predicted with, the summary over scenarios or None for one). Writes summary.json and table.md under `out`."""
    from executor.serving.serve import check_device

    check_device(device, present=real_from is None)  # re-scoring recorded runs needs no device
    paths = scenario_files(scenarios)
    plans = [(path, load_plan(path)) for path in paths]
    prepare_out(out)
    _check_before_runs(plans, drafters=real_from is None)
    prof = _validation_profile(profile, alongside, device, plans)
    _check_profile(prof, alongside, plans)
    if real_from is None:
        for plan in {plan.executor.threads: plan for _, plan in plans}.values():
            warn_threads(plan, threads)
    for path, plan in plans if real_from is None else ():
        check_checkpoint(plan, path)
    folders = [None if out is None else (out if len(plans) == 1 else out / path.stem) for path, _ in plans]
    recorded = None
    if real_from is not None:
        recorded = [real_from if len(plans) == 1 else real_from / path.stem for path, _ in plans]
    shared = model_loader(device)

    def load(plan):  # a model that will not load is reported against its scenario file
        try:
            return shared(plan)
        except ConfigError as e:
            raise e.with_file(str(next((p for p, pl in plans if pl is plan), plans[0][0]))) from None

    results = validate_many([(plan, f) for (_, plan), f in zip(plans, folders)], prof, device, threads,
                            repeat, load, real_from=recorded, alongside=alongside)
    prof = alongside or prof
    summary = summarize(results) if len(results) > 1 else None
    if summary is not None and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"profile": str(prof), "device": device,
                                                      "summary": summary, "scenarios": results}, indent=2) + "\n")
        (out / "table.md").write_text(markdown_table(results))
    return results, prof, summary


def validate_capacity(scenarios: list[Path], out: Path | None = None, device: str = "cpu",
                      profile: Path | None = None, threads: int | None = None, alongside: Path | None = None,
                      precision: float = 0.05, requests: int | None = None) -> tuple[list[dict], Path]:
    """Each scenario's capacity (the highest rate meeting its SLOs; a closed loop's: the most users) measured on the
    executor by a search of real serves and predicted by the simulator on the same grid: (each scenario's
    capacity.json content, the profile predicted with). `alongside`: profile meanwhile (a sweep slice before each
    probe) and predict with it. `requests`: the probes' workload has this many requests (the scenario's
    distributions and seed)."""
    from calibration.profile import write_profile
    from executor.serving.serve import check_device, set_threads

    check_device(device)
    paths = scenario_files(scenarios)
    plans = [(path, load_plan(path)) for path in paths]
    if requests is not None:
        plans = [(path, _with_requests(plan, requests, path)) for path, plan in plans]
    for path, plan in plans:
        try:
            check_has_slo(plan.slo)
            specs = plan_requests(plan)
            if plan.workload.closed_loop is None:  # a closed loop's capacity is in users: nothing to scale
                check_scalable(specs, count_key="--requests" if requests is not None else None)
            elif len(specs) < STEADY_ROUNDS:
                raise ConfigError(f"probes of {len(specs)} requests cannot judge even one user (a closed loop's probe "
                                  f"needs {STEADY_ROUNDS} requests per user or more)",
                                  "--requests" if requests is not None else "workload.num_requests")
        except ConfigError as e:
            raise e.with_file(str(path)) from None
    prepare_out(out)
    _check_before_runs(plans, drafters=True)
    prof = _validation_profile(profile, alongside, device, plans)
    _check_profile(prof, alongside, plans)
    for path, plan in plans:
        check_checkpoint(plan, path)
    check_graphs([plan for _, plan in plans], None if alongside else prof, device)
    load = model_loader(device)
    results = []
    for path, plan in plans:
        folder = None if out is None else (out if len(plans) == 1 else out / path.stem)
        try:
            loaded = load(plan)
        except ConfigError as e:
            raise e.with_file(str(path)) from None
        set_threads(plan, threads)
        sweep = alongside_sweep([plan], load, device, False) if alongside is not None else None
        own = None if alongside is None else (alongside if len(plans) == 1 else
                                               alongside.with_name(f"{alongside.stem}-{path.stem}{alongside.suffix}"))

        def finish(sweep=sweep, own=own, plan=plan):
            write_profile(own, sweep.profile(plan.model.model_dump()))
            return own

        results.append(measure(plan, prof if sweep is None else None, device, threads, loaded, sweep,
                               finish if sweep is not None else None, folder, precision))
    return results, alongside or prof


def _with_requests(plan, requests: int, path: Path):
    """The plan with `requests` requests in its workload (a trace's workload is a one-line error)."""

    workload = dict(plan.source.get("workload") or {})
    if workload.get("trace") is not None:
        raise ConfigError(f"{path}: --requests sizes a generated workload; this one replays a trace", "--requests")
    workload.pop("duration_s", None)  # a workload is sized by one of the two
    try:
        return replan(plan, workload={**workload, "num_requests": requests})
    except ConfigError as e:  # e.g. past the request limit: the flag's fault, in this scenario
        raise ConfigError(e.message, "--requests", str(path)) from None


def _validation_profile(profile: Path | None, alongside: Path | None, device: str, plans: list = ()) -> Path:
    """The profile a validation predicts with: `profile`, else the one every scenario's cost_model.profile names
    (a model other than SmolLM2 ships its own), else the device's shipped one (checked to exist unless
    `--profile-alongside` measures its own, which excludes `--profile`)."""

    if alongside is not None and profile is not None:
        raise ConfigError("--profile-alongside measures the profile to predict with: not with --profile", "--profile")
    prepare_out_file(alongside, "--profile-alongside")
    named = {plan.cost.profile.path.resolve() if plan.cost.profile else None for _, plan in plans}
    own = named.pop() if len(named) == 1 else None
    prof = profile or own or PROFILES / f"{device}.json"
    if alongside is None and not prof.exists():
        raise ConfigError(f"no profile at {prof}; make one with `infersim profile --device {device}`", "--profile")
    if alongside is None and not prof.is_file():  # a folder: reported later against cost_model.profile, wrongly
        raise ConfigError(f"{prof} is not a profile file", "--profile")
    return prof


def _check_profile(prof: Path, alongside: Path | None, plans: list) -> None:
    """The profile predicted with read for each plan's model before any executor run (a broken one, or one of
    another model, surfaced after the runs); a plan's own cost_model.profile was read with it."""

    for _, plan in plans if alongside is None else ():
        if plan.cost.profile is None or plan.cost.profile.path.resolve() != prof.resolve():
            read_profile(prof, plan.model, "--profile")


def _check_before_runs(plans: list, drafters: bool) -> None:
    """What the simulator (and, with `drafters`, a draft-model or Medusa drafter) needs, per (path, plan), checked
    before any executor run, which takes minutes; errors name the scenario file."""

    for path, plan in plans:
        try:
            speculation_model(plan, 0)
        except ConfigError as e:
            raise e.with_file(str(path)) from None
    if drafters:
        check_drafters(plans)


def print_validations(results: list[dict], device: str, prof, summary: dict | None, out: Path | None) -> None:
    """Each scenario's real vs sim table, the machine's drift, and over several scenarios the summary table."""
    for result in results:
        print_validation(result, device, prof, result["runs"])
    drift = drift_line(results)
    if drift:
        Console().print(drift)
    if summary is None:
        return
    spread = any(r["runs"] > 1 for r in results)
    t = Table("metric", "max |error| %", "median |error| %", "median |error| % at run speed",
              *(["median spread %"] if spread else []))
    for name, row in summary.items():
        t.add_row(name, num(row["max_abs_error_pct"]), num(row["median_abs_error_pct"]),
                  num(row["median_abs_error_at_run_speed_pct"]),
                  *([num(row["median_spread_pct"])] if spread else []))
    Console().print(f"[bold]{len(results)} scenarios[/]")
    Console().print(t)
    if out is not None:
        Console().print(f"wrote {out}/summary.json, table.md and one folder per scenario")


def print_capacity(results: list[dict], device: str, prof: Path) -> None:
    """Each scenario's measured and predicted capacity, and its probes."""
    units = sorted({r.get("unit", "req/s") for r in results})
    t = Table("scenario", f"measured {' / '.join(units)}", "missed at", "predicted", "error %", "at run speed",
              "error %", "probes")
    for r in results:
        m, p, s = r["measured"], r["predicted"], r["predicted_at_run_speed"] or {}
        t.add_row(r["scenario"], num(m["capacity_rps"]), num(m["missed_at_rps"]), num(p["capacity_rps"]),
                  pct(r["error_pct"]), num(s.get("capacity_rps")), pct(r["error_at_run_speed_pct"]),
                  " ".join(f"{q['rate']:.3g}{'+' if q['passes'] else '-'}{'' if q['sim_passes'] == q['passes'] else '!'}"
                           for q in r["probes"]))
    Console().print(f"capacity on {device} (grid step {results[0]['precision']:.0%}) vs simulated with {prof}; "
                    "probes: rate (a closed loop: users), + met the SLOs / - missed, ! where the simulator said "
                    "otherwise")
    Console().print(t)


# Steps running this far from the profile on average mean the machine itself has changed speed since profiling.
DRIFT_WARN = 0.05


def drift_line(results: list[dict]) -> str | None:
    """One line when the executor's steps ran, on average over every run, more than DRIFT_WARN off the profile's
    prediction for their own shapes: the latencies' errors then carry the machine's drift, not the model's."""
    ratios = [r["all"] for result in results for r in result.get("step_time_ratio", []) if r.get("all")]
    if not ratios:
        return None
    mean = sum(ratios) / len(ratios)
    if abs(mean - 1) <= DRIFT_WARN:
        return None
    way = "faster" if mean < 1 else "slower"
    return (f"steps ran {mean:.2f}x the profile's prediction for their shapes ({min(ratios):.2f}-{max(ratios):.2f} "
            f"over {len(ratios)} runs): this machine is {abs(1 / mean - 1) * 100:.0f}% {way} than when profiled, "
            "and TPOT's error carries that; `infersim profile` again, or read the 'at the run's step speed' column")

"""`infersim run`: simulate a scenario file; report.json, requests.csv, plots and the console summary."""
from __future__ import annotations

from pathlib import Path

from infersim.inputs import check_drafters, load_plan, prepare_out
from infersim.progress import progress_bar
from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.config.plan import check_profile_device
from sim.report.outputs import build_report, check_finite, summary_text, write_outputs
from sim.simulator.cluster import sim_records, simulate


def run_scenario(path: Path, out: Path | None, quiet: bool = False, plots: bool = True) -> dict:
    """Load, simulate, report. Returns report.json's content."""

    plan = load_plan(path)
    try:
        check_profile_device(plan)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    check_drafters([(path, plan)], named_only=True)
    prepare_out(out)
    try:
        specs = plan_requests(plan)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    n, step = len(specs), max(1, len(specs) // 100)
    try:
        with progress_bar(None, quiet or n < 2000, "simulating", n) as bar:
            result = simulate(plan, specs, progress=bar and (lambda done: done % step == 0 and bar(done, n)))
    except ConfigError as e:  # e.g. a setting only the simulator needs
        raise e.with_file(str(path)) from None
    del specs  # the requests hold what the report needs
    records = sim_records(result)
    report = build_report(plan, records, result.replicas, result.wall_time_s, engine="sim", extra=result.extra)
    try:
        check_finite(report)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    if out is not None:
        write_outputs(out, report, records, result.replicas, plots=plots)
    if not quiet:
        print(summary_text(report))
        if out is not None:
            print(f"wrote {out}/report.json, requests.csv" + (", *.png" if plots else ""))
    return report

"""A scenario mapping simulated in this process, its outcome kept whole (the dashboard's pages, `infersim compare`):
validated, resolved, simulated, reported."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sim.config.generator import plan_requests
from sim.config.plan import Plan, check_profile_device, plan_of
from sim.report.metrics import RequestRecords
from sim.report.outputs import build_report, check_finite
from sim.report.trace import ReplicaTrace
from sim.simulator.cluster import sim_records, simulate


@dataclass
class Outcome:
    """One simulated scenario: the resolved plan, report.json's content, the per-request records and the replicas'
    traces (each pool's replicas, with pools)."""

    plan: Plan
    report: dict
    records: RequestRecords
    traces: list[ReplicaTrace]


def simulate_data(data: dict, base_dir: Path = Path("."), *,
                  progress: Callable[[int, int], None] | None = None) -> Outcome:
    """Validate, resolve and simulate a scenario mapping (as a YAML file holds it; paths relative to `base_dir`).
    `progress(done, total)` is called as requests finish (about 100 times); an exception it raises aborts the run."""

    plan = plan_of(data, base_dir)
    check_profile_device(plan)
    specs = plan_requests(plan)
    n, step = len(specs), max(1, len(specs) // 100)
    result = simulate(plan, specs, progress=progress and (lambda done: done % step == 0 and progress(done, n)))
    records = sim_records(result)
    report = build_report(plan, records, result.replicas, result.wall_time_s, engine="sim", extra=result.extra)
    check_finite(report)
    return Outcome(plan, report, records, result.replicas)

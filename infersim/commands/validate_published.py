"""`infersim validate --published`: a scenario simulated and scored, stage by stage, against a real run's published
figures. Needs no torch."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from calibration.published import validate_published as score
from infersim.inputs import load_plan, prepare_out
from infersim.tables import num, pct
from sim.config.errors import ConfigError
from sim.config.plan import check_profile_device


def validate_published(scenario: Path, published: Path, out: Path | None = None) -> dict:
    """Simulate a scenario and score it, stage by stage, against a real run's published figures (a
    infersim-published-run/1 file: scenarios/gpu_validation/published/): validation.json's content, written under
    `out`. Needs no torch."""

    plan = load_plan(scenario)
    if plan.pools is not None:
        raise ConfigError("a published run is one server: a scenario with pools cannot be compared with it; allowed: "
                          "one replica set", "pools", str(scenario))
    prepare_out(out)
    try:
        check_profile_device(plan)
        return score(plan, published, out)
    except ConfigError as e:
        raise e.with_file(str(scenario)) from None


def print_published(result: dict, out: Path | None) -> None:
    """Per load stage, the published run's metrics against the simulation's, and whether each kept up."""
    engine = result["engine"]
    what = f"{engine.get('name', 'the real run')} {engine.get('version') or ''}".strip()
    for stage in result["stages"]:
        t = Table("metric", "real", "sim", "error %")
        for name, row in stage["metrics"].items():
            t.add_row(name, num(row["real"]), num(row["sim"]), pct(row["error_pct"]))
        up = stage["keeps_up"]
        Console().print(f"[bold]{result['scenario']}[/] stage {stage['stage']} at {stage['rate']:g} req/s: {what} "
                        f"(published) vs simulated; kept up: real {'yes' if up['real'] else 'no'}, sim "
                        f"{'yes' if up['sim'] else 'no'}", highlight=False)
        Console().print(t)
    if out is not None:
        Console().print(f"wrote {out}/validation.json")

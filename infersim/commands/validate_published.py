"""`infersim validate --published`: a scenario simulated and scored, stage by stage, against a real run's published
figures. Needs no torch."""
from __future__ import annotations

from pathlib import Path

from calibration.published import validate_published as score
from infersim.inputs import load_plan, prepare_out
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

"""`infersim validate SCENARIO --published FILE`: a scenario simulated and scored, stage by stage, against the
figures a real run published (scenarios/gpu_validation/published/*.json: format infersim-published-run/1), as
`validate` scores it against a live run: per metric real, simulated and the signed error, and per stage whether each
kept up with its rate (sim.report.stages.keeps_up, one rule for both)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError

from calibration.validate import error_pct
from sim.config.errors import ConfigError
from sim.config.schema_base import StrictModel
from sim.report.stages import keeps_up

FORMAT = "infersim-published-run/1"
MAX_PUBLISHED_BYTES = 4 * 2**20  # a published file is tens of KB

# (row, section, key): what is compared per stage; vLLM's benchmark definitions on both sides (the published file
# derives them from the tool's own figures: docs/published-runs.md)
METRICS = [("ttft_mean", "ttft_s", "mean"), ("ttft_p50", "ttft_s", "p50"), ("ttft_p90", "ttft_s", "p90"),
           ("tpot_mean", "tpot_s", "mean"), ("tpot_p50", "tpot_s", "p50"), ("tpot_p90", "tpot_s", "p90"),
           ("e2e_p50", "e2e_s", "p50"), ("throughput_out_tok_s", "", "output_tokens_per_s")]


class Quantiles(StrictModel):
    mean: Optional[float] = None
    p50: Optional[float] = None
    p90: Optional[float] = None
    p99: Optional[float] = None


class PublishedStage(StrictModel):
    """One load stage of a real run: what was sent and completed, and its latencies by vLLM's definitions."""

    stage: int = Field(ge=0)
    rate: float = Field(gt=0)
    duration_s: float = Field(gt=0)
    sent: int = Field(ge=0)
    completed: int = Field(ge=0)
    achieved_rate: Optional[float] = None
    completed_rate: Optional[float] = None
    prompt_len: Quantiles = Quantiles()
    output_len: Optional[int] = Field(default=None, ge=1)
    ttft_s: Quantiles
    e2e_s: Quantiles
    tpot_s: Quantiles
    itl_s: Quantiles = Quantiles()
    output_tokens_per_s: Optional[float] = None
    tool: dict[str, Any] = {}  # the client's own figures, as it defines them


class Published(StrictModel):
    """A real run's published figures, stage by stage, and where they come from."""

    format: Literal["infersim-published-run/1"]
    name: str
    source: dict[str, Any]
    engine: dict[str, Any] = {}
    client: dict[str, Any] = {}
    hardware: Optional[str] = None
    model: Optional[str] = None
    tensor_parallel_size: Optional[int] = None
    stages: list[PublishedStage] = Field(min_length=1)


def read_published(path: Path) -> Published:
    """A published result file, checked; ConfigError (one line: the file, the key, what is allowed) otherwise."""
    where = "--published"
    try:
        if not path.is_file():
            raise ConfigError("no such file", where, str(path))
        if path.stat().st_size > MAX_PUBLISHED_BYTES:
            raise ConfigError(f"{path.stat().st_size / 2**20:.0f} MiB; allowed: at most "
                              f"{MAX_PUBLISHED_BYTES // 2**20} MiB", where, str(path))
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"not a JSON file ({type(e).__name__}); allowed: a published run ({FORMAT})", where,
                          str(path)) from None
    try:
        return Published.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise ConfigError(f"{key}: {err['msg']}; allowed: a published run ({FORMAT}, "
                          "scenarios/gpu_validation/published/ has examples)", where, str(path)) from None


def check_stages(plan, pub: Published, path: Path) -> None:
    """The scenario's load stages are the published run's (count and rates), or it has none and the run one."""
    cfg = plan.workload.load_stages
    mine = [s.rate for s in cfg.stages] if cfg is not None else None
    theirs = [s.rate for s in pub.stages]
    if mine is None and len(theirs) == 1 or mine == theirs:
        return
    raise ConfigError(f"its stages are at rates {theirs} req/s, the scenario's workload.load_stages at "
                      f"{mine or 'none (one stage: the whole run)'}; allowed: the same stages", "--published",
                      str(path))


def stage_figures(report: dict) -> list[dict]:
    """The simulated run's stages as the comparison reads them: report.json's `stages`, or the whole run as one."""
    if "stages" in report:
        return report["stages"]
    rq = report["requests"]
    return [{**report, "sent": rq["arrived"], "completed_rate": report["throughput"]["requests_per_s"],
             "duration_s": report["duration_s"],
             "keeps_up": keeps_up(rq["arrived"], rq["completed"], report["ttft_s"]["mean"], report["duration_s"])}]


def _value(d: dict, section: str, key: str):
    if not section:
        return d.get(key) if key in d else d.get("throughput", {}).get(key)
    return (d.get(section) or {}).get(key)


def compare_stage(real: PublishedStage, sim: dict) -> dict:
    """One stage: per metric real, sim and the signed % error; and whether each kept up with the stage's rate."""
    r = real.model_dump()
    metrics = {}
    for name, section, key in METRICS:
        a, b = _value(r, section, key), _value(sim, section, key)
        metrics[name] = {"real": a, "sim": b, "error_pct": error_pct(b, a)}
    real_up = keeps_up(real.sent, real.completed, real.ttft_s.mean, real.duration_s)
    return {"stage": real.stage, "rate": real.rate, "sent": {"real": real.sent, "sim": sim["sent"]},
            "completed": {"real": real.completed, "sim": sim["requests"]["completed"]},
            "keeps_up": {"real": real_up, "sim": bool(sim["keeps_up"])}, "metrics": metrics}


def compare_published(pub: Published, report: dict) -> list[dict]:
    """Every stage of a published run against the simulated report's (the stages in order)."""
    return [compare_stage(real, sim) for real, sim in zip(pub.stages, stage_figures(report))]


def validate_published(plan, path: Path, out: Path | None = None) -> dict:
    """Simulate the plan and score it against the published run in `path`: validation.json's content (written to
    `out`)."""
    from sim.config.generator import generate_requests
    from sim.report.outputs import build_report
    from sim.simulator.cluster import sim_records, simulate

    pub = read_published(path)
    check_stages(plan, pub, path)
    result = simulate(plan, generate_requests(plan.workload, plan.base_dir))
    report = build_report(plan, sim_records(result), result.replicas, result.wall_time_s, extra=result.extra)
    out_doc = {"scenario": plan.name, "published": str(path), "source": pub.source, "engine": pub.engine,
               "client": pub.client, "cost_model": report.get("cost_model"),
               "stages": compare_published(pub, report)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(out_doc, indent=2) + "\n")
    return out_doc

"""`infersim validate SCENARIO --endpoint URL`: the scenario's workload replayed against a running OpenAI-compatible
server (calibration.endpoint), the same scenario simulated, and real vs simulated per metric as the in-process
validation reports them (calibration.validate: validation.json, the CDF plot)."""
from __future__ import annotations

import json
from pathlib import Path

from calibration.endpoint import Endpoint, Outcome, replay
from calibration.validate import compare, latency_quantiles, slo_metrics, with_profile, write_cdf_plot
from sim.config.client import slides
from sim.config.generator import generate_requests
from sim.config.plan import Plan
from sim.report.metrics import records_from_requests
from sim.report.outputs import write_requests_csv
from sim.simulator.cluster import sim_records, simulate


def endpoint_records(outcomes: list[Outcome]):
    """The replay's requests and their report records (latencies from sending; the refused ones rejected with
    the endpoint's reason)."""
    requests = [o.request() for o in outcomes]
    return requests, records_from_requests(requests)


def check_lengths(outcomes: list[Outcome]) -> dict:
    """How closely the endpoint ran the workload's lengths: prompts it counted otherwise than asked (its usage) and
    finished outputs of another length than forced."""
    seen = [o for o in outcomes if o.prompt_tokens is not None]
    prompts = [o for o in seen if o.prompt_tokens != o.spec.prompt_len]
    done = [o for o in outcomes if o.finished]
    outputs = [o for o in done if len(o.token_times) != o.spec.output_len]
    return {"prompts_counted_by_server": len(seen), "prompts_off": len(prompts),
            "prompt_tokens_off_max": max((abs(o.prompt_tokens - o.spec.prompt_len) for o in prompts), default=0),
            "outputs_finished": len(done), "outputs_off": len(outputs)}


def write_endpoint_requests(out: Path, outcomes: list[Outcome], records) -> None:
    """requests.csv (the report's columns, with each request's ITLs, the server's prompt count and its error) and
    requests.jsonl (every token's time)."""
    extra = {"server_prompt_tokens": [o.prompt_tokens if o.prompt_tokens is not None else "" for o in outcomes],
             "finish_reason": [o.finish_reason or "" for o in outcomes],
             "itl_s": [" ".join(f"{g:.6f}" for g in o.row()["itl_s"]) for o in outcomes],
             "error": [o.error or "" for o in outcomes]}
    write_requests_csv(out / "requests.csv", records, extra)
    with (out / "requests.jsonl").open("w") as f:
        for o in outcomes:
            f.write(json.dumps(o.row()) + "\n")


def validate_endpoint(plan: Plan, ep: Endpoint, profile: Path | None = None, out: Path | None = None,
                      chat: bool = False, timeout_s: float | None = None, progress=None) -> dict:
    """Replay the plan's workload against the endpoint, simulate it (with `profile`, else the plan's own cost
    model) and compare; returns validation.json's content (written to `out` with the CDF plot and the requests)."""
    specs = generate_requests(plan.workload, plan.base_dir)
    outcomes = replay(ep, specs, plan.workload.max_concurrency, chat, timeout_s, progress, slides(plan.client))
    _, real = endpoint_records(outcomes)
    sim_plan = with_profile(plan, profile) if profile is not None else plan
    sim = sim_records(simulate(sim_plan, specs))
    real_m, sim_m = slo_metrics(plan, real), slo_metrics(plan, sim)
    result = {"scenario": plan.name, "endpoint": ep.describe(), "profile": str(profile) if profile else None,
              "runs": 1, "requests": real_m["requests"], "requests_sim": sim_m["requests"],
              "metrics": compare([real_m], sim_m), "lengths": check_lengths(outcomes),
              "latency_cdf": latency_quantiles(real, sim)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
        write_cdf_plot(out / "latency_cdf_sim_vs_real.png", real, sim)
        write_endpoint_requests(out, outcomes, real)
    return result

"""`infersim validate --endpoint`: a scenario's workload replayed against a running OpenAI-compatible server and
compared with the simulation. Needs no torch."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from calibration.endpoint import connect
from calibration.endpoint_validate import validate_endpoint as replay
from infersim.inputs import load_plan, prepare_out
from infersim.progress import progress_bar
from infersim.tables import print_validation
from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.config.profile import read_profile


def validate_endpoint(scenario: Path, endpoint: str, served_model: str | None = None, profile: Path | None = None,
                      out: Path | None = None, tokenizer: str | None = None, chat: bool = False,
                      timeout_s: float | None = None, quiet: bool = False) -> dict:
    """Replay a scenario's workload against a running OpenAI-compatible server and compare with the simulation
    (`profile`, else the scenario's own cost model): validation.json's content, written under `out` with
    requests.csv, requests.jsonl and the CDF plot. Needs no torch."""

    plan = load_plan(scenario)
    if plan.pools is not None:
        raise ConfigError("an endpoint is one server: a scenario with pools cannot be compared with it; allowed: "
                          "one replica set", "pools", str(scenario))
    if profile is not None:

        read_profile(profile, plan.model, "--profile")
    prepare_out(out)
    ep = connect(endpoint, served_model, tokenizer)
    err = Console(stderr=True)
    if not quiet:
        err.print(f"{plan.name}: replaying {plan.workload.num_requests or 'the'} requests against {ep.url} "
                  f"({ep.model}, {ep.engine})", highlight=False)
    try:
        n = len(plan_requests(plan))
        with progress_bar(err, quiet, "replaying", n) as progress:
            return replay(plan, ep, profile, out, chat, timeout_s, progress)
    except ConfigError as e:
        raise e.with_file(str(scenario)) from None
    finally:
        ep.close()


def print_endpoint_validation(result: dict, out: Path | None) -> None:
    """The endpoint's real vs simulated table, and what became of the requests sent."""
    ep = result["endpoint"]
    print_validation(result, f"{ep['url']} ({ep['model']}, {ep['engine']})", result["profile"] or "its cost model",
                     1)
    rq, lengths = result["requests"], result["lengths"]
    Console().print(f"requests: {rq['arrived']} sent, {rq['completed']} completed, {rq['rejected']} rejected"
                    + "".join(f"; {n} {reason}" for reason, n in rq["rejected_by_reason"].items())
                    + f"; prompts the server counted otherwise: {lengths['prompts_off']} of "
                    f"{lengths['prompts_counted_by_server']}, outputs of another length: {lengths['outputs_off']}")
    if out is not None:
        Console().print(f"wrote {out}/validation.json, requests.csv, requests.jsonl, latency_cdf_sim_vs_real.png")

"""`infersim profile --endpoint`: the step-cost model fitted to a running OpenAI-compatible server's streams. Needs no
torch."""
from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from calibration.endpoint import connect
from calibration.endpoint_profile import profile_endpoint as fit_streams
from calibration.endpoint_profile import sweep
from infersim.inputs import check_replaces_a_profile, load_plan, prepare_out_file
from infersim.progress import progress_bar
from sim.config.errors import ConfigError
from sim.config.hf_config import load_hf_config
from sim.config.models import catalog_model
from sim.config.profile import check_profile


def profile_endpoint(endpoint: str, out: Path, served_model: str | None = None, model: str = "SmolLM2-135M",
                     scenario: Path | None = None, quick: bool = False, tokenizer: str | None = None,
                     quiet: bool = False) -> dict:
    """Fit the step-cost model to a running server's streams (calibration.endpoint_profile) and write the profile
    `cost_model: {profile: OUT}` reads. The model it records: the scenario's, else `model` (a catalog name or a
    local config). Needs no torch."""

    check_replaces_a_profile(out)
    prepare_out_file(out, "--out")
    max_len = None
    if scenario is not None:
        plan = load_plan(scenario)
        spec, max_len = plan.model, plan.scheduler.max_model_len
    elif Path(model).exists():
        spec = load_hf_config(Path(model), "--model")
    else:
        try:
            spec = catalog_model(model)
        except (KeyError, ConfigError):
            raise ConfigError(f"{model!r} is neither a catalog model (infersim models) nor a local config",
                              "--model") from None
    ep = connect(endpoint, served_model, tokenizer)
    err = Console(stderr=True)
    if not quiet:
        err.print(f"profiling {ep.url} ({ep.model}, {ep.engine}) as {spec.name}", highlight=False)
    try:

        with progress_bar(err, quiet, "profile loads", len(sweep(quick))) as progress:
            prof = fit_streams(ep, spec.model_dump(), quick, progress=progress, max_len=max_len)
    finally:
        ep.close()
    try:
        check_profile(prof, out)
    except ConfigError as e:
        raise ConfigError(f"the fit of the endpoint's streams is no profile `infersim run` takes ({e.message})",
                          "--endpoint") from None
    out.write_text(json.dumps(prof, indent=1) + "\n")
    if not quiet:
        f, streams = prof["fit"], prof["endpoint"]["max_concurrent_streams"]
        Console().print(f"profiled {len(prof['samples'])} step shapes in {prof['sweep_s']:.0f} s; held-out MAPE "
                        f"{f['heldout']['mape'] * 100:.1f}%, R² {f['heldout']['r2']:.4f}; the endpoint ran at most "
                        f"{streams} stream{'s' if streams > 1 else ''} at once"
                        + (" (plan with serving.max_num_seqs: 1)" if streams == 1 else "") + f"; wrote {out}")
    return prof

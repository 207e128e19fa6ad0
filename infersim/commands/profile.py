"""`infersim profile`: engine steps of many shapes timed on the PyTorch executor and the step-cost model fitted to
them (or, `--refit`, fitted again). The executor's modules (torch) are imported inside."""
from __future__ import annotations

from pathlib import Path

from infersim.inputs import check_replaces_a_profile, prepare_out_file


def profile(device: str, model: str, out: Path, threads: int | None, quick: bool, repeats: int,
            refit: bool = False, scenario: Path | None = None) -> dict:
    """Time engine steps of many shapes on the executor and fit the step-cost model (or, with `refit`, fit
    the samples stored in `out` again); writes the profile JSON. `scenario`: as that scenario runs the executor."""
    from calibration.profile import profile_command, refit_command

    if not refit:
        check_replaces_a_profile(out)
        prepare_out_file(out, "--out")
    return refit_command(out) if refit else profile_command(device, model, out, threads, quick, repeats, scenario)

"""One small validation end to end on the real SmolLM2-135M: profile this machine (the quick sweep), serve a
scenario online on the executor (twice), predict it with that profile, and the errors stay inside the bound.

Profiling here rather than using the shipped calibration/profiles/cpu.json keeps the test about the method:
these shared VMs drift 10-20% in speed within an hour (docs/calibration.md), and CI may run on another CPU.

It times the machine, so it is out of the default run (`pytest -m timing`): CI once measured the quick profile's
held-out error at 0.18 on a machine no other process was using, and a busy core made it 0.59. What it checks
without a clock runs by default: the fit's form on the shipped profiles' recorded steps
(tests/test_fitted_cost.py) and profile-then-validate on a tiny model (tests/test_calibration.py)."""
from __future__ import annotations

import json

import pytest
import yaml

from executor.core.cpu_load import BUSY_CORES, BUSY_SHARE
from tests.cli_runner import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timing]

# Not the 5%: on these shared 2-core VMs two measurements minutes apart do not agree to 5% (with a
# profile made two minutes earlier this test measured TPOT p50 +0.3% once and +17% once; throughput -1.6%
# and -4.3%; docs/calibration.md has the real-vs-real spreads). These bounds catch a broken cost model, policy or replay
# (which missed by 20-80% before they were fixed), not the machine's own drift. Each bound is widened by half
# the real-vs-real spread of that metric: the simulator cannot be judged more finely than the two real runs
# agree (a noisy burst once gave TTFT p50 0.34 s and 0.19 s in the two runs, and TPOT -26%); and by how far
# the executor's own steps ran from the profile's prediction for them (a fresh-clone CI run once had its
# quick profile taken in a slow minute: TPOT +31% with both real runs agreeing to 2%). That widening cannot
# hide a broken cost model: the profile's held-out error, measured within one sweep, is checked on its own.
BOUNDS = {"throughput_out_tok_s": 10.0, "tpot_p50": 25.0, "ttft_p50": 25.0}

SCENARIO = {
    "name": "ci-validation",
    "model": {"base": "SmolLM2-135M", "weight_dtype": "fp32"},
    "hardware": "cpu",
    "executor": {"attention": "sdpa", "threads": 2},
    "serving": {"max_num_seqs": 16, "max_model_len": 1024},
    "kv_cache": {"allocator": "paged", "block_size": 16, "num_blocks": 256},
    "workload": {"seed": 21, "arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 16,
                 "prompt_len": {"dist": "uniform", "min": 32, "max": 256},
                 "output_len": {"dist": "uniform", "min": 16, "max": 48}},
}


def test_small_validation_within_bound(tmp_path):
    from executor.model.weights import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    prof = tmp_path / "cpu.json"
    r = run_cli(["profile", "--device", "cpu", "--threads", "2", "--quick", "--repeats", "1",
                 "--out", str(prof)])
    assert r.exit_code == 0, r.output
    host = json.loads(prof.read_text())["host"]
    others, share = host["other_processes_cores"], host["other_processes_busy_share"]
    if others >= BUSY_CORES or share >= BUSY_SHARE:  # another process's timings: test_fitted_cost checks the form
        pytest.skip(f"other processes used {others:.1f} of the 2 cores during the profile sweep (busy in {share:.0%} "
                    "of its samples): no timing to judge")
    assert json.loads(prof.read_text())["fit"]["heldout"]["mape"] < 0.15
    path = tmp_path / "ci.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    out = tmp_path / "val"
    r = run_cli(["validate", str(path), "--device", "cpu", "--profile", str(prof), "--repeat", "2",
                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    assert v["requests"]["completed"] == 16 and v["runs"] == 2
    errors = {m: v["metrics"][m]["error_pct"] for m in BOUNDS}
    ratios = [r["all"] for r in v["step_time_ratio"]]
    drift_pct = 100 * abs(sum(ratios) / len(ratios) - 1)
    allowed = {m: bound + v["metrics"][m]["spread_pct"] / 2 + drift_pct for m, bound in BOUNDS.items()}
    assert all(abs(errors[m]) <= allowed[m] for m in BOUNDS), (errors, allowed, ratios)

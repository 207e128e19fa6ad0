"""One small validation end to end on the real SmolLM2-135M: the executor serves a scenario online (twice),
the simulator predicts it with the shipped CPU profile, and the errors stay inside the target bound.

The profile (calibration/profiles/cpu.json) was measured on the 2-core CPU machines these tests run on; on
other hardware re-profile (`infersim profile`) before trusting this bound."""
from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from sim.cli import app

pytestmark = pytest.mark.slow

# The target is 5% on all three. Throughput holds it; TPOT and TTFT p50 get the spread this shared
# 2-core VM shows between two back-to-back executor runs of one scenario (median ~10% TPOT and ~15% TTFT over
# the validation scenarios, up to ~38%; README), so this catches a broken cost model, policy or replay
# (those missed by 20-80% before they were fixed), not the machine's own drift.
BOUNDS = {"throughput_out_tok_s": 5.0, "tpot_p50": 20.0, "ttft_p50": 25.0}

SCENARIO = {
    "name": "ci-validation",
    "model": {"base": "SmolLM2-135M", "weight_dtype": "fp32"},
    "hardware": "cpu",
    "executor": {"attention": "sdpa", "threads": 2},
    "serving": {"max_num_seqs": 16, "max_model_len": 1024},
    "kv_cache": {"allocator": "paged", "block_size": 16, "num_blocks": 256},
    "workload": {"seed": 21, "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 16,
                 "prompt_len": {"dist": "uniform", "min": 32, "max": 256},
                 "output_len": {"dist": "uniform", "min": 16, "max": 48}},
}


def test_small_validation_within_bound(tmp_path):
    from executor.weights import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    path = tmp_path / "ci.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    out = tmp_path / "val"
    r = CliRunner().invoke(app, ["validate", str(path), "--device", "cpu", "--repeat", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    assert v["requests"]["completed"] == 16 and v["runs"] == 2
    errors = {m: v["metrics"][m]["error_pct"] for m in BOUNDS}
    assert all(abs(errors[m]) <= bound for m, bound in BOUNDS.items()), (errors, v["metrics"])

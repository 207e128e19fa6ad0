"""Profile → fit → validate on a tiny checkpoint: the machinery end to end (accuracy is measured on the
real model by the validation scenarios, not here)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sim.cli import app
from tests.helpers import tiny_checkpoint, write_tiny_scenario


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1, max_position_embeddings=4096)


def test_profile_then_validate(tmp_path, checkpoint):
    runner = CliRunner()
    prof = tmp_path / "tiny.json"
    r = runner.invoke(app, ["profile", "--model", str(checkpoint), "--out", str(prof), "--quick", "--threads", "1"])
    assert r.exit_code == 0, r.output
    data = json.loads(prof.read_text())
    assert data["model"]["num_layers"] == 2 and data["host"]["threads"] == 1
    assert data["measured"]["matmul_flops"] > 0 and data["measured"]["memory_bandwidth"] > 0
    assert len(data["samples"]) > 50 and data["fit"]["coefs"]["step"] > 0
    kinds = {(len(s["new_tokens"]) > 1, max(s["new_tokens"]) > 1) for s in data["samples"]}
    assert kinds >= {(False, True), (True, False), (True, True)}  # prefills, decode batches, mixed steps

    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-validate",
                               serving={"max_model_len": 512, "max_num_batched_tokens": 512},
                               kv_cache={"num_blocks": 128, "block_size": 16},
                               workload={"seed": 3, "num_requests": 20})
    out = tmp_path / "val"
    r = runner.invoke(app, ["validate", str(path), "--profile", str(prof), "--out", str(out), "--repeat", "2"])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    assert v["requests"]["completed"] == 20
    for name in ("ttft_p50", "tpot_p50", "throughput_out_tok_s", "itl_p50", "e2e_p50"):
        row = v["metrics"][name]
        assert row["real"] > 0 and row["sim"] > 0 and row["error_pct"] is not None and row["spread_pct"] is not None
    assert (out / "latency_cdf_sim_vs_real.png").exists()


def test_validate_without_a_profile_says_how_to_make_one(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: SmolLM2-135M\nhardware: cpu\nworkload: {trace: {path: builtin:azure_conv}}\n")
    r = CliRunner().invoke(app, ["validate", str(path), "--profile", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "infersim profile" in r.output

"""A mixture of experts' CPU profile (calibration/profile.py through the scenario's layout): `infersim profile
--scenario` of the tiny expert-parallel scenario sweeps its two ranks, records the layout, fits the experts_touched
term, and prices that scenario; a profile of the other layout, or of one device for a parallel MoE, is refused with
one line naming the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from infersim.api import profile, run_scenario
from sim.config.errors import ConfigError
from sim.config.plan import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "executor" / "tiny_moe_ep2.yaml"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-profile") / "ep2.json"
    profile("cpu", "SmolLM2-135M", out, None, True, 1, scenario=SCENARIO)
    return out


def priced(tmp_path: Path, prof: Path, **parallel) -> Path:
    data = yaml.safe_load(SCENARIO.read_text())
    data["cost_model"] = {"profile": str(prof)}
    data["parallel"] = {**data["parallel"], **parallel}
    path = tmp_path / "priced.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_profile_sweeps_the_expert_parallel_ranks_and_prices_the_scenario(measured, tmp_path):
    prof = json.loads(measured.read_text())
    assert prof["parallel"] == {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    assert prof["model"]["num_experts"] == 8 and "experts_touched" in prof["fit"]["coefs"]
    assert {1, 4} <= {len(s["new_tokens"]) for s in prof["samples"]}  # decode batches of 1 and 4
    report = run_scenario(priced(tmp_path, measured), None, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] == 24 == rq["completed"] + rq["rejected"] and rq["completed"] == 24
    assert report["cost_model"]["source"] == "profile" and report["tpot_s"]["p50"] > 0


def test_a_profile_of_another_layout_is_refused(measured, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_scenario(priced(tmp_path, measured, enable_expert_parallel=False))
    assert e.value.key_path == "parallel.enable_expert_parallel" and "with expert parallelism" in e.value.message


def test_a_one_device_profile_does_not_price_a_parallel_mixture_of_experts(measured, tmp_path):
    one = json.loads(measured.read_text())
    del one["parallel"]  # as if swept on one device
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    with pytest.raises(ConfigError) as e:
        load_scenario(priced(tmp_path, path))
    assert e.value.key_path == "parallel.tensor_parallel_size" and "through their layout" in e.value.message


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_profile_s_expert_parallel_flag_is_true_or_false(measured, tmp_path, value):
    bad = json.loads(measured.read_text())
    bad["parallel"]["enable_expert_parallel"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as e:
        load_scenario(priced(tmp_path, path))
    assert e.value.key_path == "parallel.enable_expert_parallel" and "true or false" in e.value.message
    assert e.value.file == str(path)

"""Published real runs (scenarios/gpu_validation/): the shipped files and scenarios agree, the reader refuses bad
files in one line, `infersim validate --published` scores one experiment stage by stage, and the end-to-end fit of
calibration/engine_truth.py recovers a known host overhead leave one experiment out (docs/published-runs.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from calibration.engine_truth import (
    HOST_OVERHEADS,
    Experiment,
    bounded_lstsq,
    headline,
    leave_one_out,
    simulate_stages,
)
from calibration.published import Published, read_published
from sim.config.errors import ConfigError
from sim.config.plan import load_scenario, plan_of
from tests.test_bad_input_more import invoke, one_line_error

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "scenarios" / "gpu_validation"
SCENARIOS = sorted(FOLDER.glob("*.yaml"))


def test_sixteen_experiments_each_with_its_published_stages():
    assert len(SCENARIOS) == 16
    stages = 0
    for path in SCENARIOS:
        plan = load_scenario(path)[1]
        pub = read_published(FOLDER / "published" / f"{path.stem}.json")
        assert path.read_text().startswith("# Source: github.com/inference-sim/training")
        assert [s.rate for s in plan.workload.load_stages.stages] == [s.rate for s in pub.stages]
        assert plan.hardware.name == pub.hardware == "H100-SXM" and plan.sharding.tp == pub.tensor_parallel_size
        assert plan.workload.output_len.value == pub.client["max_tokens"]
        stages += len(pub.stages)
    assert stages == 24


@pytest.mark.parametrize("path", SCENARIOS[:1] + SCENARIOS[-1:], ids=lambda p: p.stem)
def test_vllm_tpot_is_the_tools_times_its_gaps_per_token(path):
    """inference-perf times two lines per SSE event: 2K + 1 gaps for K tokens, vLLM's TPOT K - 1."""
    for s in read_published(FOLDER / "published" / f"{path.stem}.json").stages:
        k = s.output_len
        assert s.tpot_s.mean == pytest.approx(s.tool["time_per_output_token_s"]["mean"] * (2 * k + 1) / (k - 1))
        # the same from the aggregates, client-side tokenization after the stream included: within 0.3%
        assert s.tool["tpot_mean_from_e2e_s"] == pytest.approx(s.tpot_s.mean, rel=3e-3)


GOOD = json.loads((FOLDER / "published" / "codellama_34b_tp2_codegen.json").read_text())
BAD = {
    "not-json": ("{", "not a JSON file"),
    "format": ({**GOOD, "format": "blis/2"}, "format"),
    "no-stages": ({**GOOD, "stages": []}, "stages"),
    "extra-key": ({**GOOD, "stagez": 1}, "stagez"),
    "rate-0": ({**GOOD, "stages": [{**GOOD["stages"][0], "rate": 0}]}, "stages.0.rate"),
    "ttft-missing": ({**GOOD, "stages": [{k: v for k, v in GOOD["stages"][0].items() if k != "ttft_s"}]},
                     "stages.0.ttft_s"),
    "a-list": ([1, 2], "(top level)"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_published_file_is_one_line(tmp_path, name):
    content, needle = BAD[name]
    path = tmp_path / "p.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as e:
        read_published(path)
    assert needle in e.value.one_line() and str(path) in e.value.one_line() and "--published" in e.value.one_line()
    scenario = FOLDER / "codellama_34b_tp2_codegen.yaml"
    one_line_error(invoke("validate", scenario, "--published", path), path, "--published")


def test_a_missing_published_file_and_other_stages_and_other_flags_are_one_line(tmp_path):
    scenario = FOLDER / "codellama_34b_tp2_codegen.yaml"
    one_line_error(invoke("validate", scenario, "--published", tmp_path / "none.json"), "none.json")
    other = FOLDER / "published" / "llama2_7b_tp1_roleplay.json"  # one stage at 6 req/s, the scenario two
    one_line_error(invoke("validate", scenario, "--published", other), other, "stages")
    pub = FOLDER / "published" / "codellama_34b_tp2_codegen.json"
    one_line_error(invoke("validate", scenario, "--published", pub, "--repeat", "2"), "--repeat")
    one_line_error(invoke("validate", FOLDER, "--published", pub), "SCENARIO")


def _short(tmp_path: Path, stem: str, seconds: float) -> Path:
    """A shipped scenario with its stages cut to `seconds` (the rates kept)."""
    text = (FOLDER / f"{stem}.yaml").read_text()
    data = yaml.safe_load(text)
    for s in data["workload"]["load_stages"]["stages"]:
        s["duration_s"] = seconds
    path = tmp_path / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_published_scores_each_stage(tmp_path):
    scenario = _short(tmp_path, "codellama_34b_tp2_codegen", 40)
    pub = FOLDER / "published" / "codellama_34b_tp2_codegen.json"
    r = invoke("validate", scenario, "--published", pub, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "stage 0 at 5 req/s" in r.output and "stage 1 at 10 req/s" in r.output and "tpot_mean" in r.output
    doc = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert [s["rate"] for s in doc["stages"]] == [5, 10]
    for s in doc["stages"]:
        m = s["metrics"]["tpot_mean"]
        assert m["real"] == pytest.approx(read_published(pub).stages[s["stage"]].tpot_s.mean)
        assert m["error_pct"] == pytest.approx(100 * (m["sim"] - m["real"]) / m["real"])
        assert s["keeps_up"]["real"] is True and s["sent"]["sim"] == int(s["rate"] * 40)
    assert doc["source"]["repository"] == "github.com/inference-sim/training"


def test_bounded_lstsq_finds_the_constrained_minimum():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 3))
    b = a @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=0.01, size=30)
    lower = np.zeros(3)
    x = bounded_lstsq(a, b, lower)
    assert np.all(x >= 0) and x[1] == 0
    grid = [np.array(v) for v in np.stack(np.meshgrid(*[np.linspace(0, 2, 21)] * 3), -1).reshape(-1, 3)]
    best = min(grid, key=lambda v: float(np.sum((a @ v - b) ** 2)))
    assert np.sum((a @ x - b) ** 2) <= np.sum((a @ best - b) ** 2) + 1e-12
    free = bounded_lstsq(a, b, np.full(3, -10.0))
    assert free == pytest.approx([1.0, -2.0, 0.5], abs=0.02)


def _tiny(rate: float, output: int) -> dict:
    # synchronous scheduling: the host's overheads show in every step (async scheduling hides them under the GPU's)
    return {"name": f"tiny-{rate}", "model": "Llama-3.2-1B", "hardware": "H100-SXM",
            "engine": {"name": "vllm", "async_scheduling": False}, "kv_cache": {"enable_prefix_caching": True},
            "workload": {"seed": 1, "load_stages": {"stages": [{"rate": rate, "duration_s": 4}]},
                         "prompt_len": {"dist": "fixed", "value": 200}, "output_len": {"dist": "fixed", "value": output},
                         "shared_prefix": {"prefix_len": 32, "num_prefixes": 2, "prompts_per_prefix": 3}}}


def _published_by(plan, truth) -> Published:
    """What a 'real' run publishes when it is the simulator at the host overheads `truth`."""
    (s,) = simulate_stages(HOST_OVERHEADS.apply(plan, truth))
    stage = {"stage": 0, "rate": s["rate"], "duration_s": s["duration_s"], "sent": s["sent"],
             "completed": s["requests"]["completed"], "ttft_s": s["ttft_s"], "e2e_s": s["e2e_s"], "tpot_s": s["tpot_s"]}
    return Published.model_validate({"format": "infersim-published-run/1", "name": plan.name, "source": {},
                                     "stages": [stage]})


def test_leave_one_out_recovers_the_overheads_the_runs_were_made_with():
    """Runs made by the simulator with a slower host than the kernel model's default (126 µs a step + 4.4 µs a
    sequence): each held-out one is predicted with overheads fitted to the others, near those it was made with."""
    truth = (4e-4, 1e-5)
    plans = [plan_of(_tiny(rate, out), ROOT) for rate, out in ((5, 40), (30, 150), (60, 150), (90, 120))]
    experiments = [Experiment(p.name, p, _published_by(p, truth)) for p in plans]
    rows, head, thetas = leave_one_out(HOST_OVERHEADS, experiments, None)
    for step_s, seq_s in thetas:
        assert step_s == pytest.approx(truth[0], rel=0.15) and seq_s == pytest.approx(truth[1], rel=0.25)
    assert head["tpot_abs_err_median_pct"] < 2 and head["ttft_abs_err_median_pct"] < 3
    assert head["saturation_agreement"] == 1.0 and head["stages_served"] == 4
    before = headline([r for e in experiments for r in _rows_at_start(e)])
    assert before["tpot_abs_err_median_pct"] > 10 * head["tpot_abs_err_median_pct"]


def _rows_at_start(exp: Experiment) -> list[dict]:
    from calibration.engine_truth import stage_rows

    return stage_rows(exp, simulate_stages(exp.plan))

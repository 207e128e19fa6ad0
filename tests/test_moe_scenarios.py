"""The mixture-of-experts scenarios (scenarios/moe/) under the report contract, their comparisons, and the planner's
search over data and expert parallelism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from infersim import api
from infersim.api import run_scenario
from infersim.commands.search import parse_search_spec, run_search
from sim.config.models import MODEL_CATALOG
from tests.test_random_scenarios import check_report

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios" / "moe").glob("*.yaml"))
MOE_MODELS = ("Mixtral-8x7B", "Mixtral-8x22B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for path in SCENARIOS:
        folder = tmp_path_factory.mktemp(path.stem)
        out[path.stem] = run_scenario(path, out=folder, quiet=True, plots=False)
        assert json.loads((folder / "report.json").read_text())["requests"] == out[path.stem]["requests"]
    return out


def test_the_moe_scenarios_say_what_they_answer():
    assert {p.stem for p in SCENARIOS} >= {"mixtral_8x7b_h100_tp2", "mixtral_8x7b_h100_ep2", "qwen3_30b_a3b_h100_tp1",
                                           "qwen3_30b_a3b_h100_dp4_ep", "qwen3_30b_a3b_h100_dp4",
                                           "deepseek_v3_h200_tp8",
                                           "deepseek_v3_h200_dp8_ep"}
    for p in SCENARIOS:
        assert p.read_text().startswith("# Question:"), p.name


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_each_runs_under_the_report_contract(reports, path):
    report = reports[path.stem]
    check_report(report)
    rq = report["requests"]
    assert rq["arrived"] == rq["completed"] + rq["rejected"] and rq["completed"] > rq["rejected"]
    assert report["tpot_s"]["p50"] > 0 and report["throughput"]["output_tokens_per_s"] > 0
    assert report["cost_model"]["source"] == "gpu_kernels" and "experts_error" in report["cost_model"]
    assert report["kv_cache"]["bytes_per_token"] > 0


def test_the_scenarios_comparisons(reports):
    ds_tp, ds_ep = reports["deepseek_v3_h200_tp8"], reports["deepseek_v3_h200_dp8_ep"]
    assert ds_tp["kv_cache"]["bytes_per_token"] == 61 * 576 * 2  # MLA's latent, whole on each TP rank
    assert ds_ep["kv_cache"]["capacity_tokens"] > 4 * ds_tp["kv_cache"]["capacity_tokens"]  # 8 ranks' own caches
    assert ds_ep["memory_gib"]["kv_cache"] < ds_ep["memory_gib"]["device"]  # one device's share
    q1, q4 = reports["qwen3_30b_a3b_h100_tp1"], reports["qwen3_30b_a3b_h100_dp4_ep"]
    assert q4["tpot_s"]["p50"] < q1["tpot_s"]["p50"]  # each card reads a quarter of the experts the step touched
    assert q4["cost"]["usd_per_hour"] == q1["cost"]["usd_per_hour"]  # four H100s either way
    d4 = reports["qwen3_30b_a3b_h100_dp4"]  # DP 4 without EP: every expert sliced over the four cards (vLLM)
    assert d4["memory_gib"]["weights"] == pytest.approx(q4["memory_gib"]["weights"])  # not the whole model a card
    assert d4["kv_cache"]["capacity_tokens"] == q4["kv_cache"]["capacity_tokens"]
    assert d4["tpot_s"]["p50"] < q1["tpot_s"]["p50"]  # a quarter of each touched expert a card, not every expert


def test_models_lists_total_and_active_parameters():
    from tests.cli_runner import run_cli

    r = run_cli(["models"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    for name in MOE_MODELS:
        line = next(ln for ln in r.output.splitlines() if name + " " in ln)
        m = MODEL_CATALOG[name]
        assert f"{m.num_params / 1e9:.2f}B" in line and f"{m.active_params / 1e9:.2f}B" in line
    assert set(MOE_MODELS) <= set(api.model_catalog())  # the dashboard's and the search's model list


def test_the_search_sweeps_data_and_expert_parallelism():
    base = {"model": "Qwen3-30B-A3B", "hardware": "H100-SXM", "serving": {"max_model_len": 4096},
            "workload": {"seed": 5, "arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 300,
                         "prompt_len": {"dist": "fixed", "value": 500}, "output_len": {"dist": "fixed", "value": 100}},
            "slo": {"ttft_s": 0.5, "tpot_s": 0.05, "quantile": 0.9}}
    search = parse_search_spec({"name": "t", "scenario": base, "target": {"rate": 4.0},
                                "space": {"parallel.data_parallel_size": [1, 2, 3],
                                          "parallel.enable_expert_parallel": [False, True]},
                                "search": {"max_requests": 200, "precision": 0.2, "prune_costlier": False}})
    by = {r.label: r for r in run_search(search, workers=1).rows}
    assert set(by) == {f"dp={d} ep={e}" for d in (1, 2, 3) for e in ("False", "True")}
    assert by["dp=3 ep=True"].status == "pruned" and "does not divide the 128 experts" in by["dp=3 ep=True"].reason
    assert by["dp=2 ep=True"].devices == 2 and by["dp=2 ep=True"].usd_per_hour == 2 * by["dp=1 ep=False"].usd_per_hour
    assert by["dp=2 ep=True"].capacity_rps > by["dp=1 ep=False"].capacity_rps

"""The layer-kind scenarios (scenarios/layers/) under the report contract, each with its hybrid KV cache section."""
from __future__ import annotations

from pathlib import Path

import pytest

from infersim.api import run_scenario
from tests.test_random_scenarios import check_report

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios" / "layers").glob("*.yaml"))
KINDS = {"gpt_oss_120b_h100": "sliding_window", "qwen3_next_80b_h100_tp4_prefix": "linear",
         "llama4_scout_h200_tp8_long": "chunked_local"}


def test_each_scenario_says_what_it_answers():
    assert {p.stem for p in SCENARIOS} == set(KINDS)
    for p in SCENARIOS:
        assert p.read_text().startswith("# Question:"), p.name


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_each_runs_under_the_report_contract(path, tmp_path):
    report = run_scenario(path, out=tmp_path, quiet=True, plots=False)
    check_report(report)
    rq, kv = report["requests"], report["kv_cache"]
    assert rq["arrived"] == rq["completed"] + rq["rejected"] and rq["completed"] > rq["rejected"]
    kind = KINDS[path.stem]
    assert kind in kv["groups"] and "priced_as_full_attention" not in kv  # every kind priced as what it is
    assert kv["groups"]["full"]["peak_blocks"] > 0 and kv["groups"][kind]["peak_blocks"] > 0
    if kind == "linear":
        assert kv["state_bytes_per_sequence"] == 36 * 274_432 and kv["block_size"] == 272
        assert kv["prefix_cache_hit_rate"] > 0.3  # four 2,000-token system prompts
    else:
        assert kv["bytes_per_token_by_layer_type"][kind] > 0

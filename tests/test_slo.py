"""SLO targets: TTFT, TPOT and E2E (vLLM's `--goodput ttft:… tpot:… e2el:…`), each on the SLO's quantile, in the
report, the goodput, the capacity search and the summary line."""
from __future__ import annotations

import numpy as np
import pytest

from infersim.api import simulate_data
from infersim.commands.search import parse_search_spec, probes_of, run_probe, run_search
from sim.config.plan import make_plan
from sim.config.scenario import SLOConfig, parse_scenario
from sim.report.capacity import scaled
from sim.report.metrics import RequestRecords, compute_metrics, summarize_gaps

BASE = {"model": "Llama-2-7B", "hardware": "A100-80GB",
        "workload": {"seed": 3, "arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 300,
                     "prompt_len": {"dist": "lognormal", "median": 500, "sigma": 0.6, "max": 3000},
                     "output_len": {"dist": "lognormal", "median": 200, "sigma": 0.6, "max": 1000}}}


def records(e2e: list[float], ttft: float = 0.1, outputs: int = 11, rejected: int = 0) -> RequestRecords:
    """Completed requests arriving at 0 with the given E2E latencies, then `rejected` ones."""
    n = len(e2e) + rejected
    done = np.array([True] * len(e2e) + [False] * rejected)
    finish = np.array(e2e + [np.nan] * rejected)
    first = np.where(done, ttft, np.nan)
    return RequestRecords(np.arange(n), np.zeros(n, int), np.zeros(n), np.full(n, 100), np.full(n, outputs), done,
                          [""] * len(e2e) + ["queue full"] * rejected, np.zeros(n, int), first, finish,
                          summarize_gaps([np.zeros(0), np.zeros(0, np.int64)]))


def test_an_e2e_target_decides_met_goodput_and_attainment_on_its_quantile():
    rec = records([1.0] * 8 + [5.0, 6.0])  # p90 of the E2E: 5.1 s
    m = compute_metrics(rec, SLOConfig(e2e_s=5.5))
    assert m["slo"]["e2e_at_quantile_s"] == pytest.approx(5.1)
    assert m["slo"]["met"] and m["slo"]["e2e_s"] == 5.5
    assert m["slo_attainment"] == pytest.approx(0.9)  # the 6 s request misses
    assert not compute_metrics(rec, SLOConfig(e2e_s=5.0))["slo"]["met"]
    # the other targets still apply beside it
    assert not compute_metrics(rec, SLOConfig(e2e_s=10.0, ttft_s=0.05))["slo"]["met"]
    assert compute_metrics(rec, SLOConfig(e2e_s=10.0, ttft_s=0.5))["slo_attainment"] == 1.0
    # rejected requests count as misses in the stricter verdict
    m = compute_metrics(records([1.0] * 8, rejected=2), SLOConfig(e2e_s=2.0))
    assert m["slo"]["met"] and not m["slo"]["met_counting_rejected"]


def test_without_an_slo_the_report_says_none_and_counts_every_completion():
    m = compute_metrics(records([1.0, 2.0]))
    assert m["slo"]["e2e_s"] is None and m["slo"]["met"] and m["slo_attainment"] == 1.0


def test_a_tighter_e2e_target_lowers_the_searched_capacity_and_the_probes_agree():
    space = {"replicas": [1]}

    def searched(slo):
        spec = {"name": "e2e", "scenario": {**BASE, "slo": slo}, "target": {"rate": 3.0}, "space": space,
                "search": {"max_requests": 300, "precision": 0.1}}
        search = parse_search_spec(spec)
        return search, run_search(search, workers=1).rows[0]

    _, loose = searched({"ttft_s": 2.0})
    search, tight = searched({"ttft_s": 2.0, "e2e_s": 6.0})
    assert 0 < tight.capacity_rps < loose.capacity_rps
    assert tight.e2e_p90_s is None or tight.e2e_p90_s > 0
    plan = make_plan(parse_scenario(probes_of(search)[0].data))
    specs = probes_of(search)[0].specs
    assert run_probe(plan, scaled(specs, tight.capacity_rps))[0]
    at_miss = scaled(specs, tight.missed_at_rps)
    meets, metrics, _ = run_probe(plan, at_miss, early_stop=False)
    assert not meets and metrics["slo"]["e2e_at_quantile_s"] > 6.0
    assert not run_probe(plan, at_miss)[0]  # stopping early when the E2E target cannot hold: the same verdict


def test_the_summary_line_names_the_e2e_target():
    from sim.report.outputs import summary_text

    report = simulate_data({**BASE, "slo": {"e2e_s": 30.0}}).report
    assert "E2E ≤ 30000.0 ms" in summary_text({**report, "wall_time_s": 0.0})

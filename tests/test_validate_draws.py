"""A speculative scenario's prediction is the mean over several seeded acceptance draws (simulator only)."""
from pathlib import Path

import pytest

from calibration.validate import PROFILES, SPEC_DRAWS, mean_metrics, plain_of, simulated, slo_metrics, with_profile
from sim.config.plan import load_scenario
from sim.simulator.cluster import sim_records, simulate

SCENARIO = Path(__file__).parent.parent / "scenarios" / "validation" / "spec_ngram.yaml"


def test_mean_metrics_averages_numbers_and_keeps_the_rest():
    a = {"tpot_s": {"p50": 1.0, "n": 3}, "name": "x", "flag": True}
    b = {"tpot_s": {"p50": 3.0, "n": 3}, "name": "y", "flag": False}
    assert mean_metrics([a, b]) == {"tpot_s": {"p50": 2.0, "n": 3}, "name": "x", "flag": True}


def test_speculative_prediction_is_the_mean_over_acceptance_draws():
    plan = load_scenario(SCENARIO)[1]
    profile = PROFILES / "cpu.json"
    _, _, got = simulated(plan, profile, 1.0, None)
    draws = [slo_metrics(plan, sim_records(simulate(with_profile(plan, profile), None, spec_draw=d)))
             for d in range(SPEC_DRAWS)]
    tpots = [m["tpot_s"]["p50"] for m in draws]
    assert len(set(tpots)) > 1  # the draws differ ...
    assert got["tpot_s"]["p50"] == pytest.approx(sum(tpots) / len(tpots))  # ... and the prediction is their mean
    assert got["requests"]["completed"] == draws[0]["requests"]["completed"]
    plain = plain_of(plan)  # no speculation: one simulation, nothing to average
    _, _, once = simulated(plain, profile, 1.0, None)
    assert once == slo_metrics(plain, sim_records(simulate(with_profile(plain, profile))))


def test_a_disaggregated_run_is_predicted_at_each_pools_own_step_speed():
    from calibration.validate import pool_scaled, pool_scales, sims_at_run_speed
    from sim.cost.build import make_pricer

    plan = load_scenario(SCENARIO.parent / "disaggregated.yaml")[1]
    profile = PROFILES / "cpu.json"
    pricer = make_pricer(with_profile(plan, profile))
    steps = []
    for pool, slower, new_tokens in (("prefill", 1.2, [100]), ("decode", 1.0, [1, 1, 1])):
        r = {"new_tokens": new_tokens, "context_lens": [100] * len(new_tokens), "num_decode": 0 if pool == "prefill"
             else 3, "num_prefill": 1 if pool == "prefill" else 0, "start_s": 0.0, "pool": pool}
        r["end_s"] = slower * pricer.record_s(r)
        steps.append(r)
    scales = pool_scales(steps, pricer)
    assert scales == pytest.approx({"prefill": 1.2, "decode": 1.0})
    assert pool_scaled(plan, scales).pools.prefill.cost.profile_scale == pytest.approx(1.2)
    even, uneven = sims_at_run_speed(plan, profile, [1.0, scales], None)
    assert uneven["ttft_s"]["p50"] > even["ttft_s"]["p50"] * 1.1  # the slower prefill pool shows in TTFT ...
    assert uneven["tpot_s"]["p50"] == pytest.approx(even["tpot_s"]["p50"], rel=0.02)  # ... not in TPOT
    assert pool_scales([s for s in steps if s["pool"] == "decode"], pricer) is None

"""The analytic results speculative decoding is modelled with (Leviathan et al., 2023)."""
from __future__ import annotations

import random

import pytest

from sim.cost.speculation import best_draft_length, expected_accepted_drafts, expected_tokens_per_step, walltime_speedup


def test_expected_tokens_chain():
    assert expected_tokens_per_step(0.8, 5) == pytest.approx(3.689, abs=5e-4)  # the 3.69
    assert expected_tokens_per_step(0.0, 5) == 1.0  # every draft rejected: the target's own token
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.6, 0) == 1.0  # no drafts: plain decoding
    assert expected_accepted_drafts(0.8, 5) == pytest.approx(2.689, abs=5e-4)


def test_expected_tokens_match_a_simulated_acceptance_process():
    rng = random.Random(0)
    for alpha, gamma in [(0.8, 5), (0.5, 3), (0.95, 8)]:
        n = 40_000
        total = 0
        for _ in range(n):
            accepted = 0
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            total += accepted + 1
        assert total / n == pytest.approx(expected_tokens_per_step(alpha, gamma), rel=0.02)


def test_leviathan_speedup():
    # Leviathan et al. (2023), Eq. 1: (1 − α^(γ+1)) / ((1 − α)(γc + 1))
    assert walltime_speedup(0.8, 5, 0.05) == pytest.approx((1 - 0.8 ** 6) / (0.2 * 1.25))
    assert walltime_speedup(0.8, 5, 0.0) == pytest.approx(expected_tokens_per_step(0.8, 5))
    assert walltime_speedup(0.3, 4, 0.5) < 1.0  # a poor, costly drafter slows decoding down
    assert best_draft_length(0.3, 0.5) == 0
    g = best_draft_length(0.9, 0.05)
    assert g > 3 and walltime_speedup(0.9, g, 0.05) >= max(walltime_speedup(0.9, k, 0.05) for k in range(17))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.2, 3)
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens_per_step(0.5, -1)
    with pytest.raises(ValueError, match="cost ratio"):
        walltime_speedup(0.5, 3, -0.1)


# ---- the simulator's speculative policy --------------------------------------------------------

def _spec_scenario(rate, alpha=None, gamma=5, max_num_seqs=64, n=120):
    from tests.helpers import scenario

    sc = scenario(serving={"max_num_seqs": max_num_seqs},
                  workload={"seed": 4, "arrival": {"process": "poisson", "rate": rate}, "num_requests": n,
                            "prompt_len": {"dist": "uniform", "min": 64, "max": 512},
                            "output_len": {"dist": "uniform", "min": 64, "max": 256}})
    if alpha is not None:
        sc["speculative"] = {"num_speculative_tokens": gamma, "acceptance_rate": alpha}
    return sc


def _requested_lengths(sc) -> dict:
    from sim.config.generator import generate_requests
    from tests.helpers import plan_of

    plan = plan_of(sc)
    return {s.id: s.output_len for s in generate_requests(plan.workload, plan.base_dir)}


def test_simulated_verify_steps_yield_the_expected_tokens():
    """α = 0.8, γ = 5: the simulated requests get 3.69 tokens per verify step on average, and every one of
    them completes with exactly its output length."""
    from tests.helpers import run

    sc = _spec_scenario(0.5, alpha=0.8)
    report, _, rec = run(sc)
    spec = report["speculative"]
    assert report["requests"]["completed"] == 120
    assert _requested_lengths(sc) == dict(zip(rec.id.tolist(), rec.output_len.tolist()))
    # γ is cut near the end of each output, so per step slightly fewer than the uncut expectation
    assert 1 + spec["mean_accepted_length"] == pytest.approx(expected_tokens_per_step(0.8, 5), rel=0.06)
    assert spec["alpha"] == pytest.approx(0.8, abs=0.02)
    again, _, _ = run(_spec_scenario(0.5, alpha=0.8))
    assert again["tpot_s"] == report["tpot_s"] and again["speculative"] == spec  # same seed, same result


def test_speculation_helps_at_low_load_and_hurts_at_high_load():
    """Llama-3-8B on an A100 (GPU kernel model): a lone decode step is memory-bound, so verifying 6 tokens costs
    about what decoding 1 does and TPOT drops; at high load the batch is compute-bound, every draft costs
    compute, and with α = 0.5 speculation lowers throughput — the crossover the policy must show. (Llama-2-7B's
    full-size KV keeps even a large batch bound by its KV reads, which verifying drafts does not add to.)"""
    from tests.helpers import run

    def tpot_and_throughput(rate, alpha):
        report, _, _ = run({**_spec_scenario(rate, alpha=alpha, max_num_seqs=256, n=400), "model": "Llama-3-8B"})
        return report["tpot_s"]["p50"], report["throughput"]["output_tokens_per_s"]

    low_plain, low_spec = tpot_and_throughput(0.2, None), tpot_and_throughput(0.2, 0.5)
    assert low_spec[0] < 0.7 * low_plain[0]
    high_plain, high_spec = tpot_and_throughput(60.0, None), tpot_and_throughput(60.0, 0.5)
    assert high_spec[1] < 0.95 * high_plain[1]
    # vLLM's remedy: no drafts while the batch is big; low load keeps its gain, high load loses (almost) nothing
    sc = {**_spec_scenario(60.0, alpha=0.5, max_num_seqs=256, n=400), "model": "Llama-3-8B"}
    sc["speculative"]["disable_by_batch_size"] = 16
    gated = run(sc)[0]["throughput"]["output_tokens_per_s"]
    assert gated > high_spec[1] and gated > 0.97 * high_plain[1]


def test_drafting_cost_lengthens_every_verify_step():
    """A draft model's time (draft_s_per_step + draft_s_per_seq × requests, as `infersim serve` measures
    it) is charged before each drafting step: at low load, where a lone request decodes, TPOT grows by
    about that much per verify step over the tokens that step yields."""
    from tests.helpers import run

    sc = _spec_scenario(0.05, alpha=0.8, gamma=4, n=30)
    free = run(sc)[0]
    sc["speculative"].update(draft_s_per_step=0.004, draft_s_per_seq=0.001)
    paid = run(sc)[0]
    per_token = 0.005 / expected_tokens_per_step(0.8, 4)
    assert paid["tpot_s"]["p50"] - free["tpot_s"]["p50"] == pytest.approx(per_token, rel=0.25)


def test_a_drafter_that_runs_is_charged_even_when_nobody_drafts():
    """draft_s_per_step is charged in every step the drafter runs for (prompt lookup searches whether or not
    it finds an n-gram): with proposal_rate 0 no request drafts, yet each decode step costs that much more."""
    from tests.helpers import run

    sc = _spec_scenario(0.05, alpha=0.8, gamma=4, n=30)
    sc["speculative"]["proposal_rate"] = 0.0
    free = run(sc)[0]["tpot_s"]["p50"]
    sc["speculative"]["draft_s_per_step"] = 0.002
    assert run(sc)[0]["tpot_s"]["p50"] - free == pytest.approx(0.002, rel=0.05)


def test_a_draft_model_catches_up_on_what_it_has_not_read():
    """The simulated draft model reads, before drafting, what the executor's reads: a new request's whole
    context, then per step the target's token after its accepted drafts (two when all k were accepted; its
    drafts but the last are already held); a request it was not asked for in a step is forgotten and read
    again whole; one with a single token left is not drafted for and reads nothing."""
    from sim.cost.speculation import SpeculationModel
    from sim.policy.request import Request

    spec = SpeculationModel(4, 0.5, draft_s_per_step=0.001, draft_s_per_token=1e-5)
    a, b = Request(1, 0.0, 100, 50, num_generated=1), Request(2, 0.0, 40, 50, num_generated=1)
    assert spec.propose([a]) == pytest.approx(0.001 + spec.draft_s_per_seq + 101 * 1e-5)
    a.num_generated += 3  # two of four drafts accepted, then the target's own token
    assert spec._catch_up([a, b]) == 1 + 41
    a.num_generated += 5  # all four accepted + one: the last draft was never fed
    b.num_generated += 1  # none accepted
    assert spec._catch_up([a, b]) == 2 + 1
    assert spec._catch_up([b]) == 1 and spec._catch_up([a, b]) == a.num_tokens + 1  # a was forgotten
    a.num_generated = a.max_tokens - 1
    assert spec._catch_up([a]) == 0


def test_drafter_times_follow_the_profile_s_speed_from_their_reference_step():
    """Drafter times measured at a profile's speed (draft_s_reference_step: that profile's one-row decode step)
    are scaled by the simulator's own cost model: against a cost model twice as slow as the reference, the
    drafter costs twice its given time; with no reference, exactly its given time."""
    from sim.cost.build import make_cost_model
    from sim.cost.speculation import reference_step_s
    from tests.helpers import plan_of, run

    sc = _spec_scenario(0.05, alpha=0.8, gamma=4, n=30)
    sc["speculative"]["proposal_rate"] = 0.0
    free = run(sc)[0]["tpot_s"]["p50"]
    sc["speculative"]["draft_s_per_step"] = 0.002
    given = run(sc)[0]["tpot_s"]["p50"] - free
    sc["speculative"]["draft_s_reference_step"] = reference_step_s(make_cost_model(plan_of(sc))) / 2
    doubled = run(sc)[0]["tpot_s"]["p50"] - free
    assert given == pytest.approx(0.002, rel=0.05) and doubled == pytest.approx(0.004, rel=0.05)


def test_verify_cost_ratio_scales_the_verify_forward():
    """verify_cost_ratio (a verify forward measured over the cost model's prediction) scales only the steps
    that verify drafts: at low load with α = 0, where every decode step verifies, TPOT scales by about it."""
    from tests.helpers import run

    sc = _spec_scenario(0.05, alpha=0.0, gamma=2, n=30)
    base = run(sc)[0]["tpot_s"]["p50"]
    sc["speculative"]["verify_cost_ratio"] = 1.5
    assert run(sc)[0]["tpot_s"]["p50"] / base == pytest.approx(1.5, rel=0.03)


def test_request_rates_give_each_request_its_own_acceptance():
    """With request_rates each request keeps one calibration request's (proposal_rate, α): half the requests
    copy (draft every step, keep almost all), half never draft, so TPOTs split in two where the pooled rates
    (proposal 0.5, α 0.95) give every request the same; the mean tokens per verify step follow the copiers'."""
    import numpy as np

    from sim.report.metrics import per_request_latency, request_rates
    from tests.helpers import run

    pooled = _spec_scenario(0.05, alpha=0.95, gamma=4, n=40)
    pooled["speculative"]["proposal_rate"] = 0.5
    mixed = _spec_scenario(0.05, gamma=4, n=40)
    mixed["speculative"] = {"num_speculative_tokens": 4, "request_rates": [[1.0, 0.95], [0.0, 0.0]]}
    report, _, rec = run(mixed)
    assert report["requests"]["completed"] == 40
    rates = request_rates(rec.speculation, rec.output_len)
    copiers = [a for p, a in rates if p > 0]
    assert 10 <= len(copiers) <= 30 and all(p == 0.0 or p > 0.8 for p, _ in rates)  # the last token never drafts
    assert np.mean(copiers) == pytest.approx(0.95, abs=0.03)
    tpot = per_request_latency(rec)["tpot"]
    fast, slow = np.sort(tpot)[:5], np.sort(tpot)[-5:]
    assert slow.min() > 2.5 * fast.max()  # plain decoding vs ~4.5 tokens per step
    pooled_tpot = per_request_latency(run(pooled)[2])["tpot"]
    assert np.percentile(pooled_tpot, 90) < 1.5 * np.percentile(pooled_tpot, 10)
    assert run(mixed)[0]["tpot_s"] == report["tpot_s"]  # same seed, same draws


def test_speculation_needs_an_acceptance_rate_to_simulate_and_continuous_batching():
    from sim.config.errors import ConfigError
    from tests.helpers import plan_of, run

    sc = _spec_scenario(1.0, alpha=0.7)
    del sc["speculative"]["acceptance_rate"]
    with pytest.raises(ConfigError) as e:
        run(sc)
    assert e.value.key_path == "speculative.acceptance_rate"
    bad = _spec_scenario(1.0, alpha=0.7)
    bad["serving"]["batching"] = "static"
    with pytest.raises(ConfigError) as e:
        plan_of(bad)
    assert "continuous" in e.value.message


def test_simulated_speculation_under_a_small_kv_cache_keeps_every_request():
    """Drafts need KV slots too: with a cache too small for the load, requests are preempted and recomputed,
    and every one still ends completed with its full output."""
    from tests.helpers import run

    sc = _spec_scenario(8.0, alpha=0.8, max_num_seqs=64, n=80)
    sc["kv_cache"] = {"num_blocks": 100}
    report, _, rec = run(sc)
    assert report["kv_cache"]["preemptions"] > 0
    assert report["requests"]["completed"] == 80 and report["requests"]["rejected"] == 0
    assert _requested_lengths(sc) == dict(zip(rec.id.tolist(), rec.output_len.tolist()))


def test_bench_paragraphs_ship_with_the_package():
    """bench/spec_decode.py's input-grounded prompts, read from the installed package: the Declaration's passages
    and the plain notices (whole paragraphs), 40-90 words each."""
    from executor.core.prompts import paragraphs, plain_paragraphs

    for source in (paragraphs, plain_paragraphs):
        texts = source(6)
        assert len(texts) == 6 and len(set(texts)) == 6
        assert all(40 <= len(t.split()) <= 90 for t in texts)
    assert all(t.endswith(".") for t in plain_paragraphs())
    assert len(plain_paragraphs()) == 8 and not set(plain_paragraphs()) & set(paragraphs())

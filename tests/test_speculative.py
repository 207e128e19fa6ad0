"""The analytic results speculative decoding is modelled with (Leviathan et al., 2023)."""
from __future__ import annotations

import random

import pytest

from sim.speculative import best_draft_length, expected_accepted_drafts, expected_tokens_per_step, walltime_speedup


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

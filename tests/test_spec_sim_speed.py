"""Speculative simulation draws what it drew one row and one numpy call at a time: the same values in the same
order, so a seed gives the same result however the draws are batched."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from sim.cost.speculation import GEOMETRIC_ARRAY_ROWS, SpeculationModel
from sim.policy.request import Request
from sim.simulator import replica


class OneAtATime:
    """The drafter's draws as first written: a numpy call per request, rank and acceptance."""

    def __init__(self, model: SpeculationModel):
        self.m = model
        self.rng = np.random.default_rng(model.seed)
        self.rates: dict = {}

    def rates_of(self, r):
        if not self.m.request_rates:
            return self.m.proposal_rate, self.m.acceptance_rate
        if r.id not in self.rates:
            self.rates[r.id] = self.m.request_rates[int(self.rng.integers(len(self.m.request_rates)))]
        return self.rates[r.id]

    def propose(self, requests) -> list[int]:
        gamma = self.m.num_speculative_tokens
        return [gamma if (rate := self.rates_of(r)[0]) >= 1.0 or self.rng.random() < rate else 0 for r in requests]

    def accept(self, rows) -> dict:
        out = {}
        for r in rows:
            d = r.num_draft
            if d and self.m.tree is not None:
                out[r] = self._walk(set(self.m.tree[:d]))
            elif d:
                alpha = self.rates_of(r)[1]
                out[r] = d if alpha >= 1.0 else min(d, int(self.rng.geometric(1.0 - alpha)) - 1)
        return out

    def _walk(self, nodes: set) -> int:
        path: tuple[int, ...] = ()
        for probs in self.m.rank_probs:
            path += (int(self.rng.choice(len(probs), p=probs)),)
            if path not in nodes:
                return len(path) - 1
        return len(path)


def _drive(model: SpeculationModel, steps: int, rows: int, seed: int) -> None:
    """Steps of propose, a scheduler-like cut of some drafts, then accept, on a changing set of requests: the
    model and the one-at-a-time drafter agree on every draft and acceptance."""
    ref = OneAtATime(model)
    pick = np.random.default_rng(seed)
    live = [Request(i, 0.0, 100, 10_000) for i in range(rows)]
    next_id = rows
    for _ in range(steps):
        model.propose(live)
        assert [r.num_draft for r in live] == ref.propose(live)
        for r in live:  # the scheduler may cut a row's drafts (budget, remaining output)
            if r.num_draft and pick.random() < 0.2:
                r.num_draft = int(pick.integers(0, r.num_draft + 1))
        assert model.accept(live) == ref.accept(live)
        for r in live:
            r.num_draft = 0
        if pick.random() < 0.3:  # a request leaves, another joins (its rates drawn at its first step)
            live.pop(int(pick.integers(len(live))))
            live.insert(int(pick.integers(len(live) + 1)), Request(next_id, 0.0, 100, 10_000))
            next_id += 1


TREE = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]


@pytest.mark.parametrize("proposal_rate", [1.0, 0.7])
@pytest.mark.parametrize("tree, probs", [
    (TREE, [[0.5, 0.15, 0.05, 0.05, 0.25], [0.4, 0.15, 0.45], [0.6, 0.1, 0.3]]),  # a walk may accept every depth
    (TREE, [[0.5, 0.15, 0.05, 0.05, 0.25], [0.4, 0.15, 0.45], [0.35, 0.1, 0.55], [0.2, 0.8]]),  # a head past the tree
    ([(0,), (1,), (2,)], [[0.2, 0.1, 0.1, 0.05, 0.55]])])
def test_medusa_walks_draw_what_rng_choice_drew(proposal_rate, tree, probs, monkeypatch):
    from sim.cost import speculation

    monkeypatch.setattr(speculation.MedusaWalks, "CHUNK", 37)  # refills mid-step, often
    model = SpeculationModel(0, 0.0, proposal_rate, seed=3, tree=tree, rank_probs=probs)
    _drive(model, steps=300, rows=12, seed=1)


@pytest.mark.parametrize("rows", [6, GEOMETRIC_ARRAY_ROWS + 5])
@pytest.mark.parametrize("rates", [None, [(0.3, 0.5), (1.0, 0.9), (0.6, 1.0), (1.0, 0.2), (0.8, 0.0)]])
def test_acceptance_draws_match_one_numpy_call_per_row(rows, rates):
    for alpha, proposal in [(0.7, 1.0), (0.4, 0.5), (1.0, 0.8)]:
        model = SpeculationModel(4, alpha, proposal, seed=11, request_rates=rates)
        _drive(model, steps=150, rows=rows, seed=2)


def _digest(report: dict, result) -> str:
    report = {k: v for k, v in report.items() if k != "wall_time_s"}
    times = [(r.id, r.token_times, r.num_drafted, r.num_accepted, r.num_verify_steps, r.num_rejections)
             for r in result.requests]
    return hashlib.sha256(json.dumps([report, times], sort_keys=True).encode()).hexdigest()


def test_token_times_written_in_chunks_are_those_written_at_the_end(monkeypatch):
    from tests.helpers import run, scenario

    sc = scenario(serving={"max_num_seqs": 16, "enable_chunked_prefill": True, "max_num_batched_tokens": 256},
                  kv_cache={"num_blocks": 200},
                  speculative={"method": "ngram", "num_speculative_tokens": 4, "acceptance_rate": 0.7,
                               "proposal_rate": 0.6},
                  workload={"seed": 5, "arrival": {"process": "poisson", "rate": 8.0}, "num_requests": 40,
                            "prompt_len": {"dist": "uniform", "min": 32, "max": 400},
                            "output_len": {"dist": "uniform", "min": 16, "max": 300}})
    report, result, _ = run(sc)
    assert report["kv_cache"]["preemptions"] > 0  # recomputed prompts add tokens between decode steps
    monkeypatch.setattr(replica, "TOKEN_LOG_STEPS", 3)
    again, result_again, _ = run(sc)
    assert _digest(report, result) == _digest(again, result_again)
    assert all(len(r.token_times) == r.num_generated for r in result.requests)

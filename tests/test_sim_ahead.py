"""The simulator's shortcuts between arrivals: a book that knows every sending sends them all ahead
(ArrivalBook.send_all), and an engine that nothing but the book's arrivals reaches runs its steps up to the next one
without SimPy events (Replica.ahead). Neither may change a bit of what a run records: step ends, KV samples, busy time,
runs of steps, every request's times."""
from __future__ import annotations

import numpy as np
import pytest

from sim.config.workload import RequestSpec
from sim.policy.arrivals import ArrivalBook
from sim.policy.base_scheduler import BaseScheduler
from sim.policy.scheduler import Scheduler
from sim.simulator.cluster import simulate
from tests.helpers import plan_of, scenario


def spec(i: int, at: float, in_s: float, front_s: float) -> RequestSpec:
    return RequestSpec(id=i, arrival_s=at, prompt_len=8, output_len=4, in_s=in_s, front_s=front_s)


def test_a_book_that_sent_ahead_makes_the_same_requests_due_at_the_same_times():
    rng = np.random.default_rng(3)
    at = np.cumsum(rng.exponential(0.01, 200))
    specs = [spec(i, float(t), float(a), float(b)) for i, (t, a, b) in
             enumerate(zip(at, rng.exponential(0.02, 200), rng.exponential(0.005, 200)))]
    lazy, ahead = ArrivalBook(specs, frontends=2), ArrivalBook(specs, frontends=2)
    assert ahead.send_all() == [s.arrival_s for s in specs]
    lazy_times = []
    while lazy.pending():  # the lazy book stops at every sending as well as at every arrival at the engine
        now = lazy.next_s()
        lazy_times.append((now, lazy.due(now)))
    got = [(now, ahead.due(now)) for now, _ in lazy_times]
    assert got == lazy_times and not ahead.pending()
    assert sum(len(sends) for _, sends in got) == len(specs)


def trace(result) -> list:
    """Everything a report reads from a run, bit for bit."""
    out = []
    for t in result.replicas:
        out += [t.step_end.tobytes(), t.step_decodes_all.tobytes(), t.samples.tobytes(), t.runs.tobytes(),
                t.busy_s.hex()]
    return out + [(r.id, r.arrival_s, r.first_token_s, r.finish_s, r.num_generated, r.status, r.reject_reason)
                  for r in result.requests]


@pytest.mark.parametrize("overrides", [
    {"engine": "vllm"},  # async scheduling's one-step lag, chunked prefill, prefix caching, a client transport
    {"engine": "vllm", "replicas": 2, "router": "least_outstanding"},
    {"engine": "infersim", "workload": {"client": {"transport": "measured"}}, "serving": {"max_num_seqs": 16}},
    {"engine": "sglang", "serving": {"max_queue_delay_s": 2.0}},  # prompts alone, queue timeouts
])
def test_running_ahead_of_simpy_and_sending_ahead_change_nothing(overrides, monkeypatch):
    data = scenario(**overrides)
    data["workload"] = {**data["workload"], "num_requests": 150, "arrival": {"process": "poisson", "rate": 8.0}}
    plan = plan_of(data)
    fast = trace(simulate(plan))
    assert fast == trace(simulate(plan, watch=lambda r: False))  # a watch keeps every step an event
    monkeypatch.setattr(ArrivalBook, "send_all", lambda self: None)  # the book sends each request at its time
    assert fast == trace(simulate(plan, watch=lambda r: False))
    assert fast == trace(simulate(plan))


@pytest.mark.parametrize("overrides", [
    {"engine": "vllm"},
    {"engine": "vllm", "kv_cache": {"num_blocks": 300}},  # short of blocks: runs end at a block horizon too
])
def test_a_run_priced_past_sendings_closes_each_as_a_run_cut_there(overrides, monkeypatch):
    data = scenario(**overrides)
    data["workload"] = {**data["workload"], "num_requests": 150, "arrival": {"process": "poisson", "rate": 4.0}}
    plan = plan_of(data)
    passed = []
    pass_decodes = BaseScheduler.pass_decodes
    monkeypatch.setattr(BaseScheduler, "pass_decodes", lambda self, n: passed.append(n) or pass_decodes(self, n))
    fast = trace(simulate(plan))
    assert passed  # some runs went on past a sending
    monkeypatch.setattr(Scheduler, "decodes_settled", lambda self: False)  # every run stops at the next sending
    passed.clear()
    assert trace(simulate(plan)) == fast and not passed

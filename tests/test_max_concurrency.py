"""workload.max_concurrency (vLLM's benchmark --max-concurrency): the client holds at most that many requests in
flight; the rest wait, first come first served, and are sent when one ends. Simulator and executor alike."""
from __future__ import annotations

import pytest

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario, make_plan
from sim.config.scenario import parse_scenario
from sim.policy.client import ClientGate
from sim.policy.request import Status
from sim.simulator.cluster import simulate
from tests.helpers import in_flight, run, scenario, tiny_checkpoint, write_tiny_scenario

LOAD = {"seed": 4, "arrival": {"process": "poisson", "rate": 30.0}, "num_requests": 400,
        "prompt_len": {"dist": "lognormal", "median": 600, "sigma": 0.7, "max": 3000},
        "output_len": {"dist": "lognormal", "median": 150, "sigma": 0.7, "max": 800}}


def test_the_gate_sends_in_arrival_order_and_hands_a_freed_slot_on():
    gate = ClientGate(2)
    assert gate.offer("a") and gate.offer("b") and not gate.offer("c") and not gate.offer("d")
    assert gate.release() == "c" and gate.release() == "d"
    assert gate.release() is None and gate.in_flight == 1 and gate.offer("e") and not gate.offer("f")


@pytest.mark.parametrize("replicas, pools", [(1, None), (2, None), (1, {"prefill": {"replicas": 1},
                                                                          "decode": {"replicas": 1}})])
def test_never_more_in_flight_than_the_limit_and_nothing_lost(replicas, pools):
    data = scenario(workload={**LOAD, "max_concurrency": 8}, replicas=replicas,
                    **({"pools": pools} if pools else {}))
    result = simulate(make_plan(parse_scenario(data)))
    reqs = result.requests
    assert len(reqs) == 400 and all(r.is_done for r in reqs) and in_flight(reqs) <= 8
    specs = {s.id: s for s in generate_requests(parse_scenario(data).workload)}
    waited = [r for r in reqs if r.client_wait_s > 0]
    assert len(waited) > 100  # 30 requests/s is far more than 8 slots carry
    for r in reqs:  # sent when its time came, or later by exactly its wait
        assert r.arrival_s == pytest.approx(specs[r.id].arrival_s + r.client_wait_s)


def test_first_come_first_served_and_the_report_says_how_long_the_client_waited():
    report, result, _ = run(scenario(workload={**LOAD, "max_concurrency": 8}))
    sent = sorted(result.requests, key=lambda r: (r.arrival_s, r.id))
    assert [r.id for r in sent] == sorted(r.id for r in sent)  # the order they arrived in at the client
    gate = report["max_concurrency"]
    assert gate["limit"] == 8 and gate["requests_waited"] > 100 and gate["client_wait_s"]["p90"] > 0
    assert 0 < gate["mean_in_flight"] <= 8
    free, _, _ = run(scenario(workload=LOAD))
    assert "max_concurrency" not in free
    # latencies count from sending: the client's queue is not the deployment's
    assert report["ttft_s"]["p90"] < free["ttft_s"]["p90"]


def test_a_limit_above_the_requests_in_flight_changes_nothing():
    free, _, _ = run(scenario(workload=LOAD))
    wide, _, _ = run(scenario(workload={**LOAD, "max_concurrency": 400}))
    for key in ("ttft_s", "tpot_s", "e2e_s", "throughput", "requests"):
        assert wide[key] == free[key]
    assert wide["max_concurrency"]["requests_waited"] == 0


def test_bulk_decode_runs_give_what_steps_one_by_one_give():
    data = scenario(workload={**LOAD, "max_concurrency": 8})
    a, _, _ = run(data, bulk=True)
    b, _, _ = run(data, bulk=False)
    assert a["requests"] == b["requests"] and a["max_concurrency"] == b["max_concurrency"]
    assert a["ttft_s"] == pytest.approx(b["ttft_s"], rel=1e-9) and a["e2e_s"] == pytest.approx(b["e2e_s"], rel=1e-9)


def test_a_closed_loop_needs_no_second_limit():
    data = scenario(workload={"num_requests": 10, "prompt_len": {"dist": "fixed", "value": 10},
                              "output_len": {"dist": "fixed", "value": 10}, "closed_loop": {"users": 2},
                              "max_concurrency": 2})
    data["workload"].pop("arrival", None)
    data["workload"].pop("duration_s", None)
    with pytest.raises(ConfigError, match="max_concurrency"):
        parse_scenario(data)


def test_a_capacity_search_counts_the_rate_the_client_meant_to_send():
    """Latencies count from sending, so the SLOs alone would hold at any rate; the probe whose throughput falls
    behind the arrivals the client meant (before waiting for a slot) fails."""
    from infersim.commands.search import parse_search_spec, run_search

    spec = {"name": "mc", "scenario": scenario(workload={**LOAD, "max_concurrency": 4},
                                               slo={"ttft_s": 5.0, "tpot_s": 0.5}),
            "target": {"rate": 2.0}, "space": {"replicas": [1]}, "search": {"max_requests": 400, "precision": 0.1}}
    row = run_search(parse_search_spec(spec), workers=1).rows[0]
    assert 0 < row.capacity_rps and row.missed_at_rps is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-gate"), seed=11)


def test_the_executor_keeps_the_limit_and_loses_nothing(tmp_path, checkpoint):
    from executor.serving.serve import serve

    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-gate",
                               workload={"arrival": {"process": "poisson", "rate": 2000.0}, "num_requests": 20,
                                         "max_concurrency": 3})
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    _, _, _, requests, _, _ = serve(plan, specs, "cpu", threads=1)
    assert len(requests) == 20 and all(r.status is Status.FINISHED for r in requests)
    assert in_flight(requests) <= 3
    assert sum(r.client_wait_s > 0 for r in requests) >= 10
    by_id = {s.id: s for s in specs}
    assert all(r.arrival_s >= by_id[r.id].arrival_s for r in requests)

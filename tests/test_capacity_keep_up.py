"""The capacity verdict's keep-up rule (sim.report.capacity.pace): a deployment that keeps up passes whatever its
requests' latency beside the probe's length, an overloaded one or a burst fails, and a search's capacity no longer
climbs with `search.max_requests`."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from infersim.commands.search import parse_search_spec, probes_of, run_probe, run_search
from sim.config.plan import make_plan
from sim.config.scenario import SLOConfig, parse_scenario
from sim.report.capacity import KEEP_UP, offered_rate, pace, ramp_s, scaled, why_failed
from sim.report.metrics import GapSummary, RequestRecords, compute_metrics

SLO = SLOConfig(ttft_s=10.0, e2e_s=10.0, quantile=0.9)


def records(arrival, finish, completed=None, client_wait=None, warmup=None) -> RequestRecords:
    """Records of requests that arrive and end when given (each one output token, its first token at its end)."""
    arrival, finish = np.asarray(arrival, float), np.asarray(finish, float)
    n = len(arrival)
    done = np.ones(n, bool) if completed is None else np.asarray(completed, bool)
    finish = np.where(done, finish, np.nan)
    return RequestRecords(
        id=np.arange(n), replica=np.zeros(n, np.int64), arrival_s=arrival, prompt_len=np.full(n, 100),
        output_len=np.ones(n, np.int64), completed=done, reject_reason=["" if d else "too long" for d in done],
        num_preemptions=np.zeros(n, np.int64), first_token_s=finish, finish_s=finish,
        itl=GapSummary(0, {"mean": None, "p50": None, "p90": None, "p99": None}, np.zeros(0), np.zeros(0)),
        client_wait_s=None if client_wait is None else np.asarray(client_wait, float),
        warmup=None if warmup is None else np.asarray(warmup, bool))


def verdict(rec: RequestRecords) -> str:
    return why_failed(compute_metrics(rec, SLO), rec, [])


ARRIVALS = np.arange(100) * 0.1  # 10 requests/s over 9.9 s


def test_a_deployment_that_keeps_up_passes_however_long_its_drain():
    """Every request takes 3 s, more than a quarter of the arrival window: the whole-run throughput (drain
    included) is 0.77 of the offered rate, which failed the rule before; completions keep pace with arrivals."""
    rec = records(ARRIVALS, ARRIVALS + 3.0)
    metrics = compute_metrics(rec, SLO)
    assert metrics["throughput"]["requests_per_s"] < KEEP_UP * offered_rate(ARRIVALS)  # the old rule's verdict
    assert pace(rec) == 1.0 and verdict(rec) == ""


@pytest.mark.parametrize("share, keeps", [(0.9, True), (0.7, False), (0.5, False)])
def test_an_overloaded_deployment_fails_when_it_serves_under_keep_up_of_the_rate(share, keeps):
    """One server completing requests in order at `share` of the arrival rate, from 0.5 s on: it passes only at
    KEEP_UP of the rate or more."""
    finish = 0.5 + np.arange(100) * 0.1 / share
    rec = records(ARRIVALS, np.maximum(finish, ARRIVALS + 0.5))
    assert pace(rec) == pytest.approx(share, abs=0.05)
    assert verdict(rec) == ("" if keeps else "keep_up")


def test_a_burst_that_drains_within_the_slos_fails_as_too_short_to_tell():
    """All at once (or nearly): nothing completes in the judged window, and the requests took longer than their
    arrivals' span: it fails, and a search shows the capacity below it as "≥ C" (a longer probe would tell)."""
    rec = records(np.zeros(10), np.full(10, 0.5))
    assert compute_metrics(rec, SLO)["slo"]["met_counting_rejected"]
    assert pace(rec) == 0.0 and verdict(rec) == "short"
    rec = records(np.arange(10) * 1e-3, 0.5 + np.arange(10) * 1e-3)  # nearly at once
    assert verdict(rec) == "short"


@pytest.mark.parametrize("latency, why", [(2.0, ""), (7.0, "short")])
def test_a_probe_too_short_for_its_requests_latency_says_so(latency, why):
    """A deployment that keeps up with requests of 7 s over a 9.9 s window paces 0.6 (what completes in the judged
    half arrived before it): not a verdict on the deployment, so "short", not "keep_up"; at 2 s it passes."""
    rec = records(ARRIVALS, ARRIVALS + latency)
    assert ramp_s(rec) == latency
    assert verdict(rec) == why


def test_arrivals_count_when_the_client_meant_to_send_them():
    """max_concurrency 2 and 1 s a request: the client sends 2 requests/s of the 10 it meant; latency counts from
    sending, so the SLOs hold. Judged on the sends the run falls behind nothing; on what was meant it fails."""
    sent = np.maximum(ARRIVALS, np.arange(100) // 2 * 1.0)
    rec = records(sent, sent + 1.0, client_wait=sent - ARRIVALS)
    assert pace(replace(rec, client_wait_s=None)) >= KEEP_UP
    assert pace(rec) < 0.3 and verdict(rec) == "keep_up"


def test_rejected_and_warm_up_requests_are_left_out():
    """A third rejected (too long: the SLO counts them as misses) leaves the pace of the rest; warm-up requests
    long before the run do not stretch its arrival window."""
    rejected = np.arange(100) % 3 == 0
    rec = records(ARRIVALS, ARRIVALS + 1.0, completed=~rejected)
    assert pace(rec) == pytest.approx(1.0, abs=0.05) and verdict(rec) == "slo"
    warm = records(np.r_[np.full(5, -60.0), ARRIVALS], np.r_[np.full(5, -59.0), ARRIVALS + 1.0],
                   warmup=np.r_[np.ones(5, bool), np.zeros(100, bool)])
    assert pace(warm) == pace(records(ARRIVALS, ARRIVALS + 1.0)) == 1.0


BASE = {"model": "Llama-2-7B", "hardware": "A100-80GB",
        "workload": {"seed": 5, "arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 600,
                     "prompt_len": {"dist": "lognormal", "median": 500, "sigma": 0.6, "max": 3000},
                     "output_len": {"dist": "lognormal", "median": 400, "sigma": 0.6, "max": 2000}},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05, "quantile": 0.9}}


def test_a_search_s_capacity_does_not_climb_with_the_probe_s_length():
    """Requests of ~20 s beside probes of 400 and 600 requests (100 and 150 s at 4 req/s): the same capacity. At it
    the shorter probe completes under KEEP_UP of the offered rate over its whole run (the drain's weight), the
    verdict before 2026-12-06, which found 3.63 req/s with 400 requests and 3.99 with 600."""
    found = {}
    for n in (400, 600):
        search = parse_search_spec({"name": "t", "scenario": BASE, "target": {"rate": 3.0},
                                    "space": {"replicas": [1]}, "search": {"max_requests": n, "precision": 0.1}})
        found[n] = run_search(search, workers=1).rows[0]
    assert found[400].capacity_rps == found[600].capacity_rps == pytest.approx(3.0 * 1.1 ** 3)
    probe = probes_of(parse_search_spec({"name": "t", "scenario": BASE, "target": {"rate": 3.0},
                                         "space": {"replicas": [1]}, "search": {"max_requests": 400}}))[0]
    specs = scaled(probe.specs, found[400].capacity_rps)
    ok, metrics, why = run_probe(make_plan(parse_scenario(probe.data)), specs)
    assert ok and metrics["throughput"]["requests_per_s"] < KEEP_UP * offered_rate([s.arrival_s for s in specs])


@pytest.mark.parametrize("space_requests, workload_requests, key", [(10, 600, "search.max_requests"),
                                                                     (1500, 12, "scenario.workload")])
def test_a_probe_too_short_to_judge_keeping_up_is_one_clear_error(space_requests, workload_requests, key):
    """Under MIN_PROBE_REQUESTS the rule counts a handful, and the last to arrive cannot end by the window's end: a
    search refuses such probes, naming what sets their number (the search's cap, or a workload that short)."""
    from sim.config.errors import ConfigError
    from sim.report.capacity import MIN_PROBE_REQUESTS

    base = {**BASE, "workload": {**BASE["workload"], "num_requests": workload_requests}}
    with pytest.raises(ConfigError) as e:
        probes_of(parse_search_spec({"name": "t", "scenario": base, "target": {"rate": 3.0},
                                     "space": {"replicas": [1]}, "search": {"max_requests": space_requests}}))
    assert e.value.key_path == key and f"{MIN_PROBE_REQUESTS} or more" in e.value.message

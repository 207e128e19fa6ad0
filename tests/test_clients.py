"""Benchmark clients (workload.client): how each tool sends (vLLM's schedule and ramp-up, aiperf's schedule under a
concurrency limit, warm-up requests), the time between client and engine (each request's way in through a front end,
its tokens' way out, a closed loop's next request after its stream closed), the report's latencies as each tool
defines them, and what a client cannot go with."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sim.config.client import MEASURED_TRANSPORT, ResolvedClient, resolve_client
from sim.config.client_requests import vllm_schedule
from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.scenario import parse_scenario
from sim.config.workload import ArrivalConfig, RequestSpec
from sim.policy.arrivals import ArrivalBook, Send
from sim.policy.request import Request, Status
from sim.report.definitions import weighted_summary
from sim.report.metrics import compute_metrics, records_from_requests
from tests.helpers import in_flight, run, scenario

FIXED = {"seed": 7, "num_requests": 96, "prompt_len": {"dist": "fixed", "value": 512},
         "output_len": {"dist": "fixed", "value": 64}}


def loop(users: int, **workload) -> dict:
    """A fixed-concurrency benchmark: `users` users back to back, fixed lengths."""
    data = scenario(workload={**FIXED, "closed_loop": {"users": users}, **workload})
    data["workload"].pop("arrival")
    return data


def spec(i: int, at: float, **kw) -> RequestSpec:
    return RequestSpec(id=i, arrival_s=at, prompt_len=8, output_len=4, **kw)


# -- sending ---------------------------------------------------------------------------------------------------------

def test_vllm_bench_s_schedule_is_normalized_its_first_request_after_a_gap_and_ramps_unnormalized():
    """vllm bench serve draws every gap (the first too) and scales the times so the last is sent at n / rate; at
    constant rate (burstiness inf) the gaps are 1 / rate; a ramp-up draws each gap at its request's rate, unscaled."""
    client = ResolvedClient("vllm_bench", None)
    rng = np.random.default_rng(0)
    t = vllm_schedule(50, ArrivalConfig(process="poisson", rate=5.0), client, rng)
    assert t[0] > 0 and np.all(np.diff(t) > 0) and t[-1] == pytest.approx(50 / 5.0, rel=1e-12)
    const = vllm_schedule(4, ArrivalConfig(process="constant", rate=2.0), client, rng)
    assert const.tolist() == pytest.approx([0.5, 1.0, 1.5, 2.0])
    ramp = ResolvedClient("vllm_bench", None, ramp_up=parse_scenario(
        scenario(workload={"client": {"tool": "vllm_bench", "ramp_up": {"strategy": "linear", "start_rps": 1,
                                                                          "end_rps": 4}}})).workload.client.ramp_up)
    up = vllm_schedule(4, ArrivalConfig(process="constant", rate=9.0), ramp, rng)  # rates 1, 2, 3, 4
    assert up.tolist() == pytest.approx([1.0, 1.5, 1.5 + 1 / 3, 1.5 + 1 / 3 + 1 / 4])
    data = scenario(workload={"client": {"tool": "vllm_bench", "transport": "none"}})
    specs = generate_requests(parse_scenario(data).workload)
    plain = generate_requests(parse_scenario(scenario()).workload)
    assert [(s.prompt_len, s.output_len) for s in specs] == [(s.prompt_len, s.output_len) for s in plain]
    assert specs[0].arrival_s > 0 and specs[-1].arrival_s == pytest.approx(300 / 4.0)
    assert generate_requests(parse_scenario(data).workload) == specs  # same seed, same schedule


def test_under_a_concurrency_limit_vllm_keeps_its_times_and_aiperf_slides():
    """One slot, requests due at 0, 0.1, 0.2, the first ending at 0.5: vLLM's tasks are scheduled in advance and
    wait at a semaphore (request 2 is sent when request 1 ends, its time long past); aiperf takes the slot, sends,
    then sleeps the next gap (request 2 goes 0.1 after request 1 was sent)."""
    def sends(slide: bool) -> list[Send]:
        book = ArrivalBook([spec(i, 0.1 * i) for i in range(3)], max_concurrency=1, slide=slide)
        out = book.due(0.3)
        book.ended(0, 0.5, True)
        out += book.due(0.55)
        book.ended(1, 0.9, True)
        return out + book.due(2.0)

    fixed, slid = sends(False), sends(True)
    assert fixed == [Send(0, 0.0), Send(1, 0.5, client_wait_s=0.4), Send(2, 0.9, client_wait_s=pytest.approx(0.7))]
    assert slid[:2] == fixed[:2] and slid[2] == Send(2, 0.9, client_wait_s=pytest.approx(0.3))
    book = ArrivalBook([spec(i, 0.1 * i) for i in range(3)], max_concurrency=1, slide=True)
    book.due(0.3)
    book.ended(0, 0.5, True)
    assert book.due(0.55) == [Send(1, 0.5, client_wait_s=0.4)] and book.next_s() == pytest.approx(0.6)


def test_warm_up_requests_go_first_and_the_workload_starts_when_the_last_ended():
    """Two warm-ups (copies of the first request, ids 0-1), then the workload: its times count from the end of the
    last warm-up, and the report leaves them out."""
    book = ArrivalBook([spec(0, 0.0, warmup=True), spec(1, 0.0, warmup=True), spec(2, 0.0), spec(3, 0.3)])
    assert not book.known and book.due(1.0) == [Send(0, 0.0), Send(1, 0.0)]
    book.ended(1, 1.2, True)
    assert book.due(5.0) == [] and book.pending()
    book.ended(0, 2.0, True)
    assert book.due(2.1) == [Send(2, 2.0)] and book.next_s() == pytest.approx(2.3)
    data = loop(4, client={"tool": "aiperf", "warmup_requests": 3})
    specs = generate_requests(parse_scenario(data).workload)
    assert [s.warmup for s in specs[:4]] == [True, True, True, False] and len(specs) == 99
    assert all(s.users == 4 for s in specs)
    report, result, _ = run(data)
    assert report["requests"]["arrived"] == 96 and report["client"]["warmup_completed"] == 3
    warm_end = max(r.finish_s + r.client_out_s + r.client_close_s for r in result.requests if r.warmup)
    assert min(r.arrival_s for r in result.requests if not r.warmup) > warm_end
    assert in_flight(result.requests) <= 4


def test_a_closed_loop_s_users_take_their_warm_ups_first():
    units = [replace(spec(i, 0.0, warmup=i < 2), users=2) for i in range(4)]
    book = ArrivalBook(units)
    assert book.due(0.0) == [Send(0, 0.0), Send(1, 0.0)]
    book.ended(0, 1.0, True)
    assert book.due(1.5) == []  # a user is free, but the workload waits for the other warm-up
    book.ended(1, 2.0, True)
    assert book.due(2.0) == [Send(2, 2.0), Send(3, 2.0)]


def test_the_tools_normal_lengths_round_and_clip():
    from sim.config.workload import NormalLength

    x = NormalLength(dist="normal", mean=512, stddev=50).sample(np.random.default_rng(1), 20_000, None)
    assert x.dtype.kind == "i" and x.mean() == pytest.approx(512, rel=0.01) and x.std() == pytest.approx(50, rel=0.05)
    clipped = NormalLength(dist="normal", mean=5, stddev=20, min=2, max=9).sample(np.random.default_rng(1), 1000, None)
    assert clipped.min() == 2 and clipped.max() == 9
    with pytest.raises(ConfigError) as e:
        parse_scenario(scenario(workload={"prompt_len": {"dist": "normal", "mean": 100, "stddev": -1}}))
    assert e.value.key_path.startswith("workload.prompt_len")


# -- transport -------------------------------------------------------------------------------------------------------

def test_requests_reach_the_engine_through_one_front_end_in_the_order_sent_and_users_go_on_when_streams_close():
    """A front end works on one request at a time: two sent at once reach the engine one front_s after the other;
    the user of a request that ended goes on its out_s + close_s later (the client saw the last token and the
    stream's close)."""
    units = [replace(spec(i, 0.0, in_s=0.001, front_s=0.01, out_s=0.002, close_s=0.003), users=2) for i in range(3)]
    book = ArrivalBook(units)
    assert book.due(0.0) == [] and book.next_s() == pytest.approx(0.011)
    assert book.due(0.05) == [Send(0, pytest.approx(0.011), in_s=pytest.approx(0.011)),
                              Send(1, pytest.approx(0.021), in_s=pytest.approx(0.021))]
    book.ended(1, 1.0, True)
    assert book.next_s() == pytest.approx(1.005)  # the end reaches the client
    assert book.due(1.2) == [Send(2, pytest.approx(1.005 + 0.011), in_s=pytest.approx(0.011))]
    two = ArrivalBook([replace(s, users=0) for s in units[:2]], frontends=2)
    assert [s.arrival_s for s in two.due(1.0)] == pytest.approx([0.011, 0.011])  # a front end each
    real = ArrivalBook(units, transport=False)  # the HTTP replay client: the way is real, the book adds nothing
    assert real.due(0.0) == [Send(0, 0.0), Send(1, 0.0)]


def test_the_report_counts_latencies_from_sending_and_the_engine_sees_a_request_when_it_arrives():
    """TTFT and E2E as the client measures them hold the way in and the way out; nothing is lost; same seed, same
    result; without a transport the closed loop is the lock-step one."""
    data = loop(8, client={"transport": {"request_s": 0.002, "frontend_s": 0.001, "prompt_token_s": 1e-5,
                                         "token_s": 0.004, "close_s": 0.001, "jitter_cv": 0.5}})
    report, result, rec = run(data)
    assert report["requests"]["arrived"] == 96 == report["requests"]["completed"]
    assert in_flight(result.requests) <= 8
    for r, i in zip(result.requests, range(len(result.requests))):
        assert r.client_in_s >= 0.001 + 512e-5 * 0.0 and r.client_out_s > 0
    reqs = {r.id: r for r in result.requests}
    for k, i in enumerate(rec.id.tolist()):
        r = reqs[i]
        assert rec.first_token_s[k] - rec.arrival_s[k] == pytest.approx(
            r.first_token_s - r.arrival_s + r.client_in_s + r.client_out_s)
    c = report["client"]
    assert c["tool"] == "none" and not c["assumed"] and c["in_s"]["p50"] > 0.006 and c["out_s"]["p50"] > 0.002
    again, _, _ = run(data)
    assert again == report
    lock, _, _ = run(loop(8, client={"transport": "none"}))
    assert lock["ttft_s"]["p50"] != report["ttft_s"]["p50"] and "client" in lock


def test_a_closed_loop_with_no_think_time_is_a_fixed_concurrency_benchmark_by_default():
    data = loop(4)
    client = resolve_client(parse_scenario(data).workload)
    assert client.assumed and client.transport == MEASURED_TRANSPORT and client.tool == "none"
    thinking = loop(4)
    thinking["workload"]["closed_loop"]["think_time_s"] = 1.0
    assert resolve_client(parse_scenario(thinking).workload) is None
    assert resolve_client(parse_scenario(scenario()).workload) is None
    report, _, _ = run(data)
    assert report["client"]["assumed"] and report["latency_definitions"]["tool"] == "none"


SPREAD = {"request_s": 0.001, "frontend_s": 0.003, "prompt_token_s": 3e-6, "token_s": 5e-4, "close_s": 4e-4,
          "jitter_cv": 0.7}


def test_a_front_end_and_jitter_break_the_cohorts_that_lock_step_keeps_together():
    """16 users, fixed lengths: in lock step every user's next request reaches the engine at the same instant and all
    16 prefill in one step, cycle after cycle; when the front end takes the requests one at a time and each comes at
    its own time, an idle engine starts with what has come, those arriving during a step wait for the next, and no
    later cycle prefills the whole cohort together."""
    def cohorts(transport) -> tuple[int, float]:
        data = loop(16, client={"transport": transport}, prompt_len={"dist": "fixed", "value": 128})
        data["workload"]["num_requests"] = 16 * 8
        _, result, _ = run(data)
        late = [r.first_token_s for r in result.requests if r.id >= 16 * 3]  # after a few cycles
        sizes = {t: late.count(t) for t in late}
        return max(sizes.values()), float(np.mean([sizes[t] for t in late]))

    lock, spread = cohorts("none"), cohorts(SPREAD)
    assert lock == (16, 16.0) and spread[0] < 12 and spread[1] < 8


def test_overload_loses_nothing_with_a_transport():
    """More users than the engine holds, a queue limit that rejects: every request ends, completed or rejected,
    warm-ups counted apart; the users go on after rejections."""
    data = loop(64, client={"tool": "genai_perf", "warmup_requests": 4})
    data["serving"] = {"max_num_seqs": 8, "max_queue_len": 16}
    data["workload"]["num_requests"] = 400
    report, result, _ = run(data)
    rq = report["requests"]
    assert len(result.requests) == 404 and all(r.is_done for r in result.requests)
    assert rq["arrived"] == 400 == rq["completed"] + rq["rejected"] and rq["rejected"] > 0
    assert report["client"]["warmup_completed"] + report["client"]["warmup_rejected"] == 4


def test_the_executor_s_replay_charges_the_same_transport_from_the_same_book(tmp_path):
    """A tiny model served by 2 users behind a transport: each request reaches the engine through the front end (its
    way in and the queue behind the other user's), the user goes on after the stream's close, and the report counts
    from sending: the simulator's rules, kept by the same arrival book, on the wall clock."""
    import yaml

    from executor.serving.serve import serve
    from sim.config.plan import load_scenario
    from tests.helpers import tiny_checkpoint, write_tiny_scenario
    from tests.test_closed_loop import assert_users_take_the_units_in_order

    transport = {"request_s": 0.004, "frontend_s": 0.006, "token_s": 0.003, "close_s": 0.002, "jitter_cv": 0.5}
    path = write_tiny_scenario(tmp_path, tiny_checkpoint(tmp_path / "tiny", seed=11), name="tiny-client",
                               workload={"num_requests": 8, "output_len": {"dist": "fixed", "value": 4},
                                         "closed_loop": {"users": 2}, "client": {"transport": transport}})
    data = yaml.safe_load(path.read_text())
    data["workload"].pop("arrival")
    path.write_text(yaml.safe_dump(data))
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    records, _, _, requests, _, _ = serve(plan, specs, "cpu", threads=1)
    assert all(r.status is Status.FINISHED for r in requests) and in_flight(requests) <= 2
    assert_users_take_the_units_in_order(specs, requests, 2)  # exact: the book computes every time it hands out
    by_id = {r.id: r for r in requests}
    for k, i in enumerate(records.id.tolist()):
        r = by_id[i]
        assert records.arrival_s[k] == pytest.approx(r.arrival_s - r.client_in_s)
        assert records.first_token_s[k] == pytest.approx(r.first_token_s + r.client_out_s)


# -- definitions -----------------------------------------------------------------------------------------------------

def request(rid: int, sent: float, tokens: list[float], close: float = 0.0, warmup: bool = False) -> Request:
    """A finished request sent at `sent` whose tokens reached the client at `tokens` (no transport of its own)."""
    r = Request(rid, sent, 8, len(tokens), status=Status.FINISHED, token_times=list(tokens), client_close_s=close,
                warmup=warmup)
    r.num_generated, r.first_token_s, r.finish_s = len(tokens), tokens[0], tokens[-1]
    return r


def metrics_of(tool: str, requests: list[Request], events: int | None = None) -> dict:
    return compute_metrics(records_from_requests(requests), None, ResolvedClient(tool, None, sse_events_per_token=events))


def test_each_tool_s_definitions_on_hand_computed_token_times():
    """Sent at 0, tokens at 1.0, 1.5, 2.0, 3.0, the stream closed 0.2 s after the last."""
    one = [request(0, 0.0, [1.0, 1.5, 2.0, 3.0], close=0.2)]
    vllm = metrics_of("vllm_bench", one)
    assert vllm["ttft_s"]["p50"] == 1.0 and vllm["e2e_s"]["p50"] == 3.0
    assert vllm["tpot_s"]["p50"] == pytest.approx(2 / 3) and vllm["itl_s"]["p50"] == pytest.approx(0.5)
    assert vllm["itl_s"]["mean"] == pytest.approx(2 / 3)
    for tool in ("genai_perf", "aiperf"):  # their inter-token latency is per request
        m = metrics_of(tool, one)
        assert m["tpot_s"]["p50"] == m["itl_s"]["p50"] == pytest.approx(2 / 3) and m["e2e_s"]["p50"] == 3.0
    g = metrics_of("guidellm", one)
    assert g["tpot_s"]["p50"] == pytest.approx(3.0 / 4) and g["itl_s"]["p50"] == pytest.approx(2 / 3)
    assert g["e2e_s"]["p50"] == pytest.approx(3.2) and g["ttft_s"]["p50"] == 1.0
    ip = metrics_of("inference_perf", one)
    assert ip["tpot_s"]["p50"] == pytest.approx(2 / 3) and ip["e2e_s"]["p50"] == pytest.approx(3.2)
    ev = metrics_of("inference_perf", one, events=2)  # 2 events a token and [DONE]: 9 events, 8 gaps
    assert ev["tpot_s"]["p50"] == pytest.approx((3.2 - 1.0) / 8)
    assert ev["itl_s"]["mean"] == pytest.approx((2.0 + 0.2) / 8) and ev["itl_s"]["p50"] == 0.0
    assert metrics_of("none", one)["throughput"]["output_tokens_per_s"] == pytest.approx(4 / 3.0)
    assert vllm["throughput"]["output_tokens_per_s"] == pytest.approx(4 / 3.2)  # its clock stops when all streams did


def test_guidellm_weights_by_tokens_and_takes_the_value_where_the_share_is_reached():
    """Two requests: 2 tokens 1 s apart, and 11 tokens 0.1 s apart: guidellm's ITL is weighted by tokens - 1 (1 and
    10): mean (1 + 10 x 0.1) / 11, median 0.1; vLLM's TPOT is their plain mean and numpy's interpolated median."""
    two = [request(0, 0.0, [0.5, 1.5]), request(1, 0.0, [0.5 + 0.1 * k for k in range(11)])]
    g = metrics_of("guidellm", two)
    assert g["itl_s"]["mean"] == pytest.approx(2.0 / 11) and g["itl_s"]["p50"] == pytest.approx(0.1)
    assert g["itl_s"]["p99"] == pytest.approx(1.0)
    assert metrics_of("vllm_bench", two)["tpot_s"]["p50"] == pytest.approx(0.55)
    assert weighted_summary(np.array([3.0, 1.0, 2.0]))["p50"] == 2.0
    assert weighted_summary(np.array([np.nan]))["mean"] is None


def test_warm_ups_are_in_no_figure_and_no_tool_means_today_s_figures():
    warm = request(0, 0.0, [5.0, 9.0], warmup=True)
    one = [request(1, 0.0, [1.0, 1.5, 2.0, 3.0])]
    assert metrics_of("vllm_bench", [warm] + one)["ttft_s"] == metrics_of("vllm_bench", one)["ttft_s"]
    plain = compute_metrics(records_from_requests(one))
    assert plain == compute_metrics(records_from_requests(one), None, ResolvedClient("none", None))
    report, _, _ = run(scenario())
    assert "client" not in report and report["latency_definitions"]["tool"] == "none"


# -- what a client cannot go with ------------------------------------------------------------------------------------

@pytest.mark.parametrize("client, workload, where", [
    ({"tool": "locust"}, {}, "workload.client.tool"),
    ({"tool": "aiperf", "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 2}}, {}, "workload.client"),
    ({"tool": "guidellm", "sse_events_per_token": 2}, {}, "workload.client"),
    ({"tool": "guidellm", "warmup_requests": 5}, {}, "workload.client"),
    ({"tool": "vllm_bench"}, {"duration_s": 60.0, "num_requests": None}, "workload"),
    ({"tool": "genai_perf"}, {"bursts": [{"at_s": 1.0, "count": 2}]}, "workload"),
    ({"transport": {"request_s": -1, "token_s": 0}}, {}, "workload.client.transport"),
    ({"transport": "fast"}, {}, "workload.client.transport"),
    ({"tool": "vllm_bench", "ramp_up": {"strategy": "linear", "start_rps": 1, "end_rps": 2}},
     {"closed_loop": {"users": 2}, "arrival": None}, "workload"),
    ({"warmup_requests": 2}, {"conversation": {"turns": {"dist": "fixed", "value": 2},
                                               "user_len": {"dist": "fixed", "value": 4}}}, "workload"),
])
def test_what_a_client_cannot_go_with_is_one_line(client, workload, where):
    data = scenario(workload={"client": client, **workload})
    data["workload"] = {k: v for k, v in data["workload"].items() if v is not None}
    with pytest.raises(ConfigError) as e:
        parse_scenario(data)
    assert e.value.key_path.startswith(where) and "\n" not in e.value.message


def test_a_bad_client_exits_2_in_one_line(tmp_path):
    import yaml

    from tests.cli_runner import run_cli

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario(workload={"client": {"tool": "aiperf", "sse_events_per_token": 2}})))
    r = run_cli(["run", str(path)])
    assert r.exit_code == 2 and "sse_events_per_token" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1

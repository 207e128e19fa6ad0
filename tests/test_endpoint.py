"""`validate --endpoint` and `profile --endpoint` against `infersim serve --http` on a tiny model: the scenario's
workload replayed over HTTP (exact prompt lengths through the server's /tokenize, outputs forced, conversations and
the client's limit as in the simulator), every request accounted for, the real-vs-simulated table, and a profile fitted
from the streams alone that a scenario's cost_model takes."""
from __future__ import annotations

import csv
import json

import pytest
import yaml

from tests.helpers import png_size, tiny_checkpoint, tiny_tokenizer, write_tiny_scenario


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from executor.api_server.server import Running
    from infersim.api import http_server

    folder = tmp_path_factory.mktemp("tiny-endpoint")
    checkpoint = tiny_checkpoint(folder / "ck", seed=9)
    tiny_tokenizer(checkpoint)
    path = write_tiny_scenario(folder, checkpoint, name="endpoint", serving={"max_num_seqs": 8})
    _, server = http_server(path, "cpu", 1, served_model="tiny")
    running = Running(server)
    yield running, path, checkpoint
    running.stop()


def test_validate_against_the_endpoint_replays_the_workload_and_compares(served, tmp_path):
    from infersim.api import validate_endpoint

    running, path, _ = served
    out = tmp_path / "v"
    result = validate_endpoint(path, running.url + "/v1", out=out, quiet=True)
    rq = result["requests"]
    assert rq["arrived"] == 24 == rq["completed"] + rq["rejected"] and rq["completed"] == 24
    lengths = result["lengths"]
    assert lengths["prompts_counted_by_server"] == 24 and lengths["prompts_off"] == 0 and lengths["outputs_off"] == 0
    for name in ("ttft_p50", "tpot_p50", "itl_p50", "throughput_out_tok_s"):
        row = result["metrics"][name]
        assert row["real"] > 0 and row["sim"] > 0 and row["error_pct"] is not None
    assert result["endpoint"]["model"] == "tiny" and "infersim" in result["endpoint"]["engine"]
    saved = json.loads((out / "validation.json").read_text())
    assert saved["metrics"] == result["metrics"] and png_size(out / "latency_cdf_sim_vs_real.png") == (1170, 324)
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 24 and all(r["status"] == "completed" and r["error"] == "" for r in rows)
    assert all(len(r["itl_s"].split()) == int(r["output_tokens"]) - 1 for r in rows)
    assert all(int(r["server_prompt_tokens"]) == int(r["prompt_tokens"]) for r in rows)


def test_conversations_and_the_client_limit_over_http(served, tmp_path):
    """Each later turn is sent its think time after the turn before it ended, its prompt that turn's prompt and
    answer and new text, counted as the scenario's length; never more than the limit in flight."""
    from infersim.api import validate_endpoint

    running, path, checkpoint = served
    chat = write_tiny_scenario(tmp_path, checkpoint, name="chats", workload={
        "num_requests": 6, "max_concurrency": 3, "prompt_len": {"dist": "uniform", "min": 4, "max": 20},
        "output_len": {"dist": "uniform", "min": 2, "max": 8},
        "conversation": {"turns": {"dist": "fixed", "value": 3}, "think_time_s": 0.01,
                         "user_len": {"dist": "fixed", "value": 5}}})
    out = tmp_path / "c"
    result = validate_endpoint(chat, running.url, out=out, quiet=True)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and result["requests"]["completed"] == 18
    assert all(r["prompt_tokens_server"] == r["prompt_len"] for r in rows)
    events = sorted([(r["sent_s"], 1) for r in rows] + [(r["token_times"][-1], -1) for r in rows])
    flight, most = 0, 0
    for _, d in events:
        flight += d
        most = max(most, flight)
    assert most <= 3


def test_refused_requests_are_counted_with_the_endpoint_s_reason(served, tmp_path):
    from infersim.api import validate_endpoint

    running, _, checkpoint = served
    long = write_tiny_scenario(tmp_path, checkpoint, name="long", workload={
        "num_requests": 6, "prompt_len": {"dist": "uniform", "min": 200, "max": 250},
        "output_len": {"dist": "fixed", "value": 40}})
    result = validate_endpoint(long, running.url, quiet=True)
    rq = result["requests"]
    assert rq["arrived"] == 6 == rq["completed"] + rq["rejected"] and rq["rejected"] > 0
    assert all(reason.startswith("HTTP 400") for reason in rq["rejected_by_reason"])


def test_profile_from_the_endpoint_s_streams_prices_a_scenario(served, tmp_path):
    from infersim.api import profile_endpoint, run_scenario

    running, path, _ = served
    prof_path = tmp_path / "p.json"
    prof = profile_endpoint(running.url, prof_path, scenario=path, quick=True, quiet=True)
    kinds = {s["kind"] for s in prof["samples"]}
    assert kinds == {"prefill", "decode", "mixed"}
    assert prof["endpoint"]["max_concurrent_streams"] >= 4  # the server batches streams sent together
    assert prof["host"]["endpoint"] == running.url and prof["endpoint"]["model"] == "tiny"
    # a tiny model's ~1 ms steps seen through HTTP: the bound catches a broken fit, not its accuracy (measured on a
    # real model by bench/llamacpp_endpoint.py)
    assert prof["fit"]["heldout"]["mape"] < 3.0
    data = yaml.safe_load(path.read_text())
    data["cost_model"] = {"profile": str(prof_path)}
    (tmp_path / "priced.yaml").write_text(yaml.safe_dump(data))
    report = run_scenario(tmp_path / "priced.yaml", None, quiet=True, plots=False)
    assert report["requests"]["completed"] == 24 and report["ttft_s"]["p50"] > 0


@pytest.mark.parametrize("args, message", [
    (["validate", "SCENARIO", "--endpoint", "http://127.0.0.1:9/v1"], "--endpoint"),
    (["validate", "SCENARIO", "--endpoint", "localhost:8000"], "not an http(s) URL"),
    (["validate", "SCENARIO", "--endpoint", "URL", "--repeat", "2"], "not with --repeat"),
    (["validate", "SCENARIO", "--chat"], "only with --endpoint"),
    (["profile", "--endpoint", "URL", "--refit"], "not with --refit"),
    (["profile", "--served-model", "x"], "only with --endpoint"),
])
def test_bad_endpoint_flags_are_one_line_and_exit_2(served, args, message, capsys):
    from infersim.cli import main

    running, path, _ = served
    args = [str(path) if a == "SCENARIO" else running.url if a == "URL" else a for a in args]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_tokens_that_came_in_a_burst_share_the_span_before_them():
    from calibration.endpoint_profile import step_gaps

    # steps of 1 ms; the server's event loop held tokens 5-7 and sent them with token 4
    times = [0.0, 0.001, 0.002, 0.003, 0.006, 0.00601, 0.00602, 0.00603, 0.00703]
    gaps = step_gaps(times, floor=0.0002)
    assert gaps[:3] == pytest.approx([0.001] * 3)
    assert gaps[3:7] == pytest.approx([0.00603 / 4 - 0.003 / 4] * 4)  # 3.03 ms over four steps
    assert gaps[7] == pytest.approx(0.001)
    first, second, third = step_gaps([0.0, 0.00001, 0.00002, 0.001], floor=0.0002)
    assert first is None and second is None and third == pytest.approx(0.00098)  # the burst's wait is in the TTFT
    assert step_gaps(times, floor=0.0) == pytest.approx([b - a for a, b in zip(times, times[1:])])


def test_a_stream_sent_whole_in_one_burst_shows_no_step():
    from calibration.endpoint import Outcome
    from calibration.endpoint_profile import burst_floor, steps_of
    from sim.config.workload import RequestSpec

    def stream(rid, times):
        o = Outcome(RequestSpec(rid, 0.0, 32, len(times)), 0.0, None, sent_s=0.0)
        o.token_times, o.finish_reason = list(times), "length"
        return o

    steady = stream(0, [0.01 + 0.001 * k for k in range(12)])
    whole = stream(1, [0.5 + 0.00001 * k for k in range(6)])  # a lone request whose tokens all came at once
    floor = burst_floor([steady, whole])
    assert 0.0001 < floor < 0.001
    assert [s["kind"] for s in steps_of([whole], floor)] == ["prefill"]
    decode = [s for s in steps_of([steady], floor) if s["kind"] == "decode"]
    assert decode and all(s["time_s"] == pytest.approx(0.001) for s in decode)

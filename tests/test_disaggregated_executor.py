"""Disaggregated prefill/decode serving on the executor (executor/serving/disaggregated.py): a prefill process and a decode
process on a tiny checkpoint give the colocated engine's greedy output, every request ends, each KV transfer moves
the KV formula's bytes, `infersim serve` writes the pools and kv_transfer sections, and a decode process killed
mid-run ends the serve with one line and a partial report instead of a hang."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
from contextlib import contextmanager

import pytest
import torch

import executor.serving.disaggregated
from executor.core.build import run_offline
from executor.core.prompts import corpus_ids, prompt_ids
from executor.serving.disaggregated import STOPPED, check_pools
from executor.serving.serve import build_engine, load_model
from sim.config import environment
from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario
from sim.report.metrics import compute_metrics
from tests.cli_runner import run_cli
from tests.helpers import tiny_checkpoint, write_tiny_scenario

POOLS = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


@contextmanager
def deadline(seconds: int):
    """Fail the test instead of hanging it."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def colocated_outputs(plan, specs) -> dict[int, list[int]]:
    """Greedy outputs of one engine serving the same prompts with the decode pool's knobs (one thread, as the
    serve's processes ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = load_model(plan, "cpu")
        engine = build_engine(plan, loaded, "cpu")
        corpus = [i for i in corpus_ids(loaded.tokenizer) if i < loaded.model.config.vocab_size]
        reqs = run_offline(engine, [prompt_ids(corpus, s.prompt_len, s.id) for s in specs],
                           [s.output_len for s in specs])
    finally:
        torch.set_num_threads(threads)
    return {s.id: engine.output_ids(r) for s, r in zip(specs, reqs)}


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """One `infersim serve` of 24 tiny requests on a prefill and a decode process: (plan, specs, what serve returned,
    the output folder). The decode instance takes two requests at a time, so hand-offs queue for it."""
    tmp = tmp_path_factory.mktemp("pools")
    path = write_tiny_scenario(tmp, checkpoint, name="tiny-pools", kv_cache={"num_blocks": 160},  # no preemption
                               pools={**POOLS, "decode": {"replicas": 1, "serving": {"max_num_seqs": 2}}})
    _, plan = load_scenario(path)
    returned, real_serve = [], executor.serving.disaggregated.serve_pools

    def serve_and_keep(*args, **kwargs):
        returned.append(real_serve(*args, **kwargs))
        return returned[-1]

    out = tmp / "out"
    with deadline(120), pytest.MonkeyPatch.context() as mp:
        mp.setattr(executor.serving.disaggregated, "serve_pools", serve_and_keep)
        r = run_cli(["serve", str(path), "--out", str(out), "-q", "--no-plots"])
    assert r.exit_code == 0, r.output
    return plan, generate_requests(plan.workload, plan.base_dir), returned[0], out


def test_greedy_output_is_the_colocated_engines(served):
    plan, specs, (_, _, run, requests, _, _), _ = served
    assert run.outputs == colocated_outputs(plan, specs)
    assert all(len(run.outputs[r.id]) == len(r.token_times) for r in requests)


def test_every_request_ends_and_the_counts_add_up(served):
    _, specs, (records, traces, run, requests, _, _), _ = served
    assert len(requests) == len(specs) == len(records.id)
    assert all(r.status.value == "finished" for r in requests)
    assert [t.pool for t in traces] == ["prefill", "decode"] and all(t.busy_s > 0 for t in traces)
    handed_off = [r for r in requests if len(r.token_times) > 1]
    assert {t.request for t in run.transfers} == {r.id for r in handed_off}
    steps = [s.to_json() for s in run.records]
    assert {s["pool"] for s in steps} == {"prefill", "decode"}
    assert sum(s["num_prefill"] for s in steps if s["pool"] == "prefill") >= len(specs)
    assert not any(s["num_prefill"] for s in steps if s["pool"] == "decode")  # no prompt is computed twice


def test_each_transfer_moves_the_kv_formula_bytes_before_the_second_token(served):
    plan, _, (_, _, run, requests, _, _), _ = served
    m = plan.model
    by_id = {r.id: r for r in requests}
    for t in run.transfers:
        r = by_id[t.request]
        assert t.tokens == r.prompt_len
        assert t.bytes == 2 * m.num_layers * m.num_kv_heads * m.head_size * 4 * t.tokens  # fp32
        assert r.token_times[0] == t.handoff_s <= t.start_s <= t.end_s <= r.token_times[1]
        assert r.token_times == sorted(r.token_times)


def test_serve_writes_the_pools_report_and_the_transfers(served):
    _, specs, (_, _, run, _, _, _), out = served
    report = json.loads((out / "report.json").read_text())
    rq = report["requests"]
    assert rq["arrived"] == rq["completed"] == len(specs) and rq["rejected"] == 0
    assert set(report["pools"]) == {"prefill", "decode"}
    assert all(0 < p["utilization"] < 1 and p["engine_steps"] > 0 for p in report["pools"].values())
    transfers = [json.loads(line) for line in (out / "transfers.jsonl").read_text().splitlines()]
    kvt = report["kv_transfer"]
    assert kvt["transfers"] == len(transfers) == len(run.transfers) > 0
    assert kvt["bytes"] == sum(t["bytes"] for t in transfers)
    assert kvt["wait_s"]["p99"] > kvt["wait_s"]["p50"] >= 0 and kvt["link_bandwidth"] > 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == report["engine_steps"] and {s["pool"] for s in steps} == {"prefill", "decode"}


def test_what_the_decode_pool_cannot_hold_is_turned_away_before_its_prefill_as_simulated(checkpoint, tmp_path):
    """A decode pool of 6 blocks (48 tokens): requests that could never fit there are rejected on arrival with its
    reason, before the prefill instance computes them, the same requests as the simulator rejects."""
    from sim.simulator.cluster import simulate

    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-pools-small-decode",
                               pools={**POOLS, "decode": {"replicas": 1, "kv_cache": {"num_blocks": 6}}})
    _, plan = load_scenario(path)
    out = tmp_path / "out"
    with deadline(120):
        r = run_cli(["serve", str(path), "--out", str(out), "-q", "--no-plots"])
    assert r.exit_code == 0, r.output
    ended = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    rejected = {d["id"] for d in ended if d["status"] == "rejected"}
    specs = generate_requests(plan.workload, plan.base_dir)
    assert rejected == {s.id for s in specs if s.prompt_len + s.output_len - 1 > 48} != set()
    assert all(not d["token_times"] and "decode instance" in d["reject_reason"] for d in ended if d["id"] in rejected)
    prefilled = sum(s["num_prefill"] for line in (out / "steps.jsonl").read_text().splitlines()
                    for s in [json.loads(line)] if s["pool"] == "prefill")
    assert prefilled == len(specs) - len(rejected)  # no prompt computed for a request the decode pool refuses
    sim = simulate(plan, specs)
    assert {q.id for q in sim.requests if q.status.value == "rejected"} == rejected


def test_a_turn_the_decode_pool_cannot_hold_ends_its_conversation_as_simulated(checkpoint, tmp_path):
    """Conversations grow past what a 6-block decode pool holds: the turn that no longer fits is turned away on
    arrival and the turns after it end with it, the same requests as the simulator's; every request ends."""
    from sim.policy.conversation import CONVERSATION_ENDED
    from sim.simulator.cluster import simulate

    path = write_tiny_scenario(
        tmp_path, checkpoint, name="tiny-pools-chat-small-decode",
        pools={**POOLS, "decode": {"replicas": 1, "kv_cache": {"num_blocks": 6}}},
        workload={"num_requests": 6, "prompt_len": {"dist": "uniform", "min": 16, "max": 30},
                  "output_len": {"dist": "uniform", "min": 2, "max": 8},
                  "conversation": {"turns": {"dist": "uniform", "min": 3, "max": 5},
                                   "user_len": {"dist": "uniform", "min": 2, "max": 10}}})
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    with deadline(120):
        _, _, _, requests, _, _ = executor.serving.disaggregated.serve_pools(plan, specs)
    assert len(requests) == len(specs) and all(r.is_done for r in requests)
    rejected = {r.id: r.reject_reason for r in requests if r.status.value == "rejected"}
    assert CONVERSATION_ENDED in rejected.values() and any("decode instance" in w for w in rejected.values())
    sim = simulate(plan, specs)
    assert {q.id: q.reject_reason for q in sim.requests if q.status.value == "rejected"} == rejected


def kill_decode_worker_after(ended: int):
    """A serve progress callback that kills the decode process once `ended` requests have ended."""
    killed = []

    def progress(done: int, total: int) -> None:
        if done >= ended and not killed:
            child = next(p for p in multiprocessing.active_children() if p.name == "infersim-rank1")
            os.kill(child.pid, signal.SIGKILL)
            killed.append(child.pid)
    return progress


def test_a_decode_worker_killed_mid_run_ends_the_serve_with_one_line_and_a_partial_report(checkpoint, tmp_path,
                                                                                          monkeypatch):
    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-pools-dies", pools=POOLS,
                               workload={"arrival": {"process": "poisson", "rate": 30.0}, "num_requests": 60,
                                         "output_len": {"dist": "uniform", "min": 80, "max": 160}})
    real_serve = executor.serving.disaggregated.serve_pools
    monkeypatch.setattr(executor.serving.disaggregated, "serve_pools", lambda *args, **kwargs: real_serve(
        *args, **{**kwargs, "progress": kill_decode_worker_after(2)}))
    out = tmp_path / "out"
    with deadline(90):
        r = run_cli(["serve", str(path), "--out", str(out), "-q", "--no-plots"])
    assert r.exit_code == 1
    line = [x for x in r.output.splitlines() if x.startswith("infersim: error:")]
    assert len(line) == 1 and "rank 1 died (killed by SIGKILL)" in line[0], r.output
    rq = json.loads((out / "report.json").read_text())["requests"]
    assert 2 <= rq["completed"] < rq["arrived"] < 60
    assert rq["arrived"] == rq["completed"] + rq["rejected"] and rq["rejected_by_reason"] == {STOPPED: rq["rejected"]}


def test_a_worker_that_dies_starting_up_is_one_line(checkpoint, tmp_path, monkeypatch):
    """W: a decode process that died before the serve began (its model load, a spawn that failed) left the error
    path reading the requests of a run that never started: an AttributeError traceback."""
    from executor.distributed.launch import WorkerError

    def dies(*args, **kwargs):
        raise WorkerError("rank 1 died (exited with code 1)", 1)

    monkeypatch.setattr(executor.serving.disaggregated, "serve_pools", dies)
    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-pools-dead", pools=POOLS)
    r = run_cli(["serve", str(path), "--out", str(tmp_path / "out"), "-q", "--no-plots"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    line = [x for x in r.output.splitlines() if x.startswith("infersim: error:")]
    assert len(line) == 1 and "before any request was served" in line[0], r.output


def test_conversations_through_the_pools_are_the_colocated_serve_s_turns(checkpoint, tmp_path):
    """Conversations on a prefill and a decode process: each later turn is sent after the turn before it ended on the
    decode instance, its prompt that turn's prompt and answer, so every turn generates what a colocated serve of
    the same conversations generates; with prefix caching the prefill instance finds the earlier turns' prompts."""
    from executor.serving.serve import serve

    workload = {"num_requests": 5, "arrival": {"process": "poisson", "rate": 40.0},
                "prompt_len": {"dist": "uniform", "min": 10, "max": 30},
                "output_len": {"dist": "uniform", "min": 1, "max": 10},
                "conversation": {"turns": {"dist": "uniform", "min": 2, "max": 4}, "think_time_s": 0.005,
                                 "user_len": {"dist": "uniform", "min": 2, "max": 8}}}
    kv = {"num_blocks": 160, "enable_prefix_caching": True}
    _, pooled = load_scenario(write_tiny_scenario(tmp_path, checkpoint, name="chat-pools", pools=POOLS,
                                                  kv_cache=kv, workload=workload))
    _, colocated = load_scenario(write_tiny_scenario(tmp_path, checkpoint, name="chat", kv_cache=kv,
                                                     workload=workload))
    specs = generate_requests(pooled.workload, pooled.base_dir)
    assert any(s.after >= 0 for s in specs) and any(s.output_len == 1 for s in specs)
    with deadline(120):
        records, traces, run, requests, _, _ = executor.serving.disaggregated.serve_pools(pooled, specs)
    assert len(requests) == len(specs) and all(r.status.value == "finished" for r in requests)
    conv = compute_metrics(records)["conversations"]
    assert conv["conversations"] == conv["answered"] == 5 and conv["turns_mean"] == len(specs) / 5
    by_id = {r.id: r for r in requests}
    for s in specs:
        if s.after >= 0:
            assert by_id[s.id].arrival_s >= by_id[s.after].finish_s + s.think_s - 1e-9
    _, _, engine, alone, _, _ = serve(colocated, specs, "cpu", threads=1)
    assert {r.id: engine.output_ids(r) for r in alone} == run.outputs
    assert traces[0].prefix_hit_tokens > 0


@pytest.mark.parametrize("pools, where", [
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 1}}, "pools.prefill.replicas"),
    ({**POOLS, "decode": {"replicas": 1, "parallel": {"tensor_parallel_size": 2}}}, "pools.decode.parallel"),
])
def test_layouts_the_executor_does_not_run_are_one_line_errors(checkpoint, tmp_path, pools, where):
    _, plan = load_scenario(write_tiny_scenario(tmp_path, checkpoint, pools=pools))
    with pytest.raises(ConfigError) as e:
        check_pools(plan)
    assert e.value.key_path == where


@pytest.mark.slow
@pytest.mark.skipif(not environment.long_tests(), reason="three SmolLM2 loads, ~30 s; the tiny model's twin "
                    "above runs by default: INFERSIM_LONG=1 pytest ...")
def test_smollm2_greedy_output_is_the_colocated_engines(tmp_path):
    """The real model: 12 requests through a prefill and a decode process, token for token as one engine."""
    import yaml

    path = tmp_path / "smollm2-pools.yaml"
    path.write_text(yaml.safe_dump({
        "name": "smollm2-pools", "model": {"base": "SmolLM2-135M", "weight_dtype": "fp32"}, "hardware": "cpu",
        "serving": {"max_num_seqs": 8, "max_model_len": 512}, "kv_cache": {"block_size": 16, "num_blocks": 128},
        "pools": POOLS, "executor": {"threads": 1},
        "workload": {"seed": 3, "arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 12,
                     "prompt_len": {"dist": "uniform", "min": 16, "max": 200},
                     "output_len": {"dist": "uniform", "min": 4, "max": 24}}}))
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    with deadline(300):
        _, _, run, requests, _, _ = executor.serving.disaggregated.serve_pools(plan, specs)
    assert all(r.status.value == "finished" for r in requests)
    assert run.outputs == colocated_outputs(plan, specs)

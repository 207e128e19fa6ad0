"""`infersim serve` with tensor_parallel_size 2 and pipeline_parallel_size 2 on a tiny random-weight checkpoint: every
request accounted for, the step trace with its stages, the report's pipeline section; a worker killed mid-serve
ends it with one line naming the rank and the requests that completed; executor.random_weights."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from executor.distributed.launch import STOPPED, WorkerError
from infersim.api import serve_scenario
from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario
from tests.helpers import tiny_checkpoint, write_tiny_scenario


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_parallel_serve_accounts_for_every_request(tmp_path, checkpoint, parallel):
    out = tmp_path / "out"
    path = write_tiny_scenario(tmp_path, checkpoint, parallel=parallel, kv_cache={"num_blocks": 24})
    report = serve_scenario(path, out, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] == 24 == rq["completed"] + rq["rejected"]
    assert all(reason for reason in rq["rejected_by_reason"])
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == report["engine_steps"] > 0
    if "pipeline_parallel_size" in parallel:
        engines = parallel.get("virtual_engines", 2)
        assert report["pipeline"]["virtual_engines"] == engines and 0 < report["pipeline"]["stage_utilization"] < 1
        assert {s["virtual_engine"] for s in steps} == set(range(engines))
        assert all(len(s["stages"]) == 2 for s in steps)
    else:
        assert "stages" not in steps[0]


def test_a_worker_killed_mid_serve_ends_it_with_its_rank_and_the_completed_requests(tmp_path, checkpoint):
    from executor.serving.serve import serve

    path = write_tiny_scenario(tmp_path, checkpoint, parallel={"tensor_parallel_size": 2},
                               workload={"num_requests": 40, "arrival": {"process": "poisson", "rate": 15.0}})
    _, plan = load_scenario(path)
    killed = []

    def progress(done, total):  # called every half second of the replay
        if not killed and done:
            killed.append(time.monotonic())
            os.kill(_worker_pid(), signal.SIGKILL)

    with pytest.raises(WorkerError) as e:
        serve(plan, generate_requests(plan.workload, plan.base_dir), progress=progress)
    assert str(e.value) == "rank 1 died (killed by SIGKILL)" and e.value.rank == 1
    assert time.monotonic() - killed[0] < 10  # no hang
    done = [r for r in e.value.requests if r.status.value == "finished"]
    assert 0 < len(done) < 40 and all(len(r.token_times) == r.max_tokens for r in done)
    assert all(r.reject_reason == STOPPED for r in e.value.requests if r not in done)  # every request ended


def _worker_pid() -> int:
    """The pid of this process's (one) live infersim worker child."""
    import multiprocessing

    return next(p.pid for p in multiprocessing.active_children() if p.name == "infersim-rank1")


def test_random_weights_serve_the_scenario_s_architecture(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: rnd\nmodel: {num_layers: 2, hidden_size: 64, num_heads: 4, num_kv_heads: 2, "
                    "intermediate_size: 128, vocab_size: 500, weight_dtype: fp32}\nhardware: cpu\n"
                    "executor: {random_weights: true, threads: 1}\nserving: {max_model_len: 128}\n"
                    "kv_cache: {num_blocks: 32}\n"
                    "workload: {num_requests: 6, arrival: {process: poisson, rate: 50.0}, "
                    "prompt_len: {dist: fixed, value: 20}, output_len: {dist: fixed, value: 5}}\n")
    report = serve_scenario(path, None, quiet=True, plots=False)
    assert report["requests"]["completed"] == 6 and report["tpot_s"]["p50"] > 0


def test_real_weights_of_another_shape_are_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: {base: SmolLM2-135M, num_heads: 8, num_kv_heads: 4, head_dim: 64, weight_dtype: fp32}\n"
                    "hardware: cpu\nworkload: {num_requests: 1, arrival: {process: poisson, rate: 1.0}, "
                    "prompt_len: {dist: fixed, value: 8}, output_len: {dist: fixed, value: 2}}\n")
    with pytest.raises(ConfigError) as e:
        serve_scenario(path, None, quiet=True)
    assert e.value.key_path == "model" and "random_weights" in e.value.message

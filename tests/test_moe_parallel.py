"""Mixture-of-experts models over two ranks (executor/distributed/moe_parallel.py): tensor-parallel MoE (each expert's
columns split) and expert parallelism (experts whole, tokens dispatched by all-to-all over gloo) give the single
process's greedy tokens and expert counts on the tiny Mixtral- and Qwen2-MoE-style models; `infersim serve` of
scenarios/executor/tiny_moe_ep2.yaml accounts for every request and traces the tokens each expert computed."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from executor.core.build import make_engine
from executor.distributed.tensor_parallel import check_tensor_parallel, tensor_parallel
from infersim.api import serve_scenario
from sim.config.errors import ConfigError
from tests.parallel_workloads import CASES, outputs, policy
from tests.test_moe import moe_model

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "executor" / "tiny_moe_ep2.yaml"


def expert_outputs(engine) -> tuple[list[list[int]], list[int]]:
    """(greedy outputs of the shared workload, tokens per expert summed over its steps)."""
    out = outputs(engine)
    return out, torch.tensor([r.expert_tokens for r in engine.records]).sum(0).tolist()


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {(name, case): expert_outputs(make_engine(moe_model(name), policy(**knobs)))
            for name in ("mixtral", "qwen2_moe") for case, knobs in CASES.items()}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_two_ranks_give_the_single_process_s_tokens_and_expert_counts(reference, name, expert_parallel):
    model = moe_model(name)
    model.config = replace(model.config, expert_parallel=expert_parallel)
    with tensor_parallel(model, 2, timeout_s=30) as tp:
        block = tp.model.layers[0].mlp
        experts, width = block.experts.gate_up_proj.shape[:2]
        full = model.layers[0].mlp.experts.gate_up_proj.shape
        # expert parallelism: half the experts, whole; tensor-parallel MoE: every expert, half its columns
        assert (experts, width) == ((full[0] // 2, full[1]) if expert_parallel else (full[0], full[1] // 2))
        for case, knobs in CASES.items():
            assert expert_outputs(tp.engine(policy(**knobs))) == reference[name, case], case


def test_expert_parallelism_must_divide_the_experts():
    config = replace(moe_model("qwen2_moe").config, num_heads=6, num_kv_heads=3, head_dim=16, intermediate_size=96,
                     shared_expert_intermediate_size=48, expert_parallel=True)
    with pytest.raises(ValueError, match="expert parallelism over 3 ranks does not divide the 8 experts"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="does not divide an expert's 32 columns"):
        check_tensor_parallel(replace(config, expert_parallel=False), 3)
    check_tensor_parallel(replace(config, moe_intermediate_size=33, num_experts=6), 3)  # EP: experts whole


def test_serve_of_the_ep2_scenario_traces_expert_counts(tmp_path):
    out = tmp_path / "out"
    report = serve_scenario(SCENARIO, out, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] == 24 == rq["completed"] + rq["rejected"] and rq["completed"] > 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == report["engine_steps"] > 0
    for s in steps:  # 3 MoE layers, top-2; the last layer runs the sampling rows only (all rows where none samples)
        tokens = sum(s["new_tokens"])
        assert len(s["expert_tokens"]) == 8
        assert sum(s["expert_tokens"]) in (2 * (2 * tokens + s["num_sampled"]), 2 * 3 * tokens)


@pytest.mark.parametrize("parallel, key", [({"data_parallel_size": 2}, "parallel.data_parallel_size"),
                                           ({"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
                                            "parallel.pipeline_parallel_size")])
def test_layouts_the_executor_does_not_run_are_one_line_errors(tmp_path, parallel, key):
    import yaml

    sc = yaml.safe_load(SCENARIO.read_text())
    sc["parallel"] = {**sc["parallel"], **parallel}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sc))
    with pytest.raises(ConfigError) as e:
        serve_scenario(path, None, quiet=True, plots=False)
    assert e.value.key_path == key

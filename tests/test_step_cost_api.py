"""One step's price for users: `infersim.api.step_time`, `infersim step-cost` and their bad input."""
from __future__ import annotations

import math

import pytest

from infersim import api
from sim.config.errors import ConfigError
from sim.cost.build import make_pricer
from sim.policy.batch import shape_of
from tests.cli_runner import run_cli
from tests.helpers import plan_of, run, scenario

PARTS = ("linear_s", "attention_s", "communication_s", "lm_head_s", "overhead_s", "draft_s", "swap_s")


@pytest.mark.parametrize("over", [{}, {"model": "Llama-3-70B", "hardware": "H100-SXM",
                                       "parallel": {"tensor_parallel_size": 8}},
                                  {"hardware": "L4", "model": "Llama-3-8B"},
                                  {"model": "Llama-2-13B", "parallel": {"pipeline_parallel_size": 2}}])
def test_step_time_is_the_simulators_price_by_part(over):
    data = scenario(**over)
    got = api.step_time(data, [1] * 8 + [300], [900] * 8 + [300])
    want = make_pricer(plan_of(data)).step_s(shape_of([1] * 8 + [300], [900] * 8 + [300]))
    assert got["total_s"] == want
    assert math.fsum(got[p] for p in PARTS) == pytest.approx(got["total_s"], rel=1e-12)
    assert got["linear_s"] > 0 and got["attention_s"] > 0 and got["lm_head_s"] > 0 and got["overhead_s"] > 0
    assert (got["communication_s"] > 0) == (plan_of(data).sharding.tp * plan_of(data).pipeline_parallel_size
                                            > 1)
    assert got["source"] == ("roofline" if over.get("hardware") == "L4" else "gpu_kernels")


def test_a_lone_prompt_s_ttft_is_its_step_time():
    data = scenario(workload={"seed": 0, "arrival": {"process": "constant", "rate": 0.01}, "num_requests": 1,
                              "prompt_len": {"dist": "fixed", "value": 700},
                              "output_len": {"dist": "fixed", "value": 2}})
    report, _, _ = run(data)
    assert report["ttft_s"]["p50"] == pytest.approx(api.step_time(data, [700])["total_s"], rel=1e-12)


def test_a_disaggregated_step_is_priced_by_its_pool():
    data = scenario(model="Llama-3-8B", pools={"prefill": {"replicas": 1, "hardware": "H100-SXM"},
                                                "decode": {"replicas": 1}})
    prefill, decode = api.step_time(data, [1000]), api.step_time(data, [1] * 4, [1200] * 4)
    assert prefill["total_s"] == api.step_time(data, [1000], pool="prefill")["total_s"]
    assert prefill["total_s"] < api.step_time(data, [1000], pool="decode")["total_s"]  # an H100 against an A100
    assert decode["total_s"] == api.step_time(data, [1] * 4, [1200] * 4, pool="decode")["total_s"]


@pytest.mark.parametrize("args, where", [
    (([], None), "--new-tokens"), (([0], None), "--new-tokens"), (([5, 5], [5]), "--context"),
    (([500], [20]), "--context")])
def test_bad_steps_are_one_line_errors(args, where):
    with pytest.raises(ConfigError) as e:
        api.step_time(scenario(), *args)
    assert e.value.key_path == where


def test_the_command_prints_the_typical_steps_and_a_given_one():
    r = run_cli(["step-cost"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "prefill" in r.output and "decode 1 x" in r.output and "priced by: GPU kernel model" in r.output
    r = run_cli(["step-cost", "--new-tokens", "1", "--new-tokens", "256", "--context", "900", "--context",
                 "256"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "step" in r.output and "attention" in r.output
    for bad in (["--new-tokens", "4", "--context", "2"], ["--pool", "decode", "--new-tokens", "4"],
                ["--pool", "decode"]):
        r = run_cli(["step-cost", *bad])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output

"""Tensor- and pipeline-parallel steps priced from a one-device fitted profile (sim/cost/parallel.py): the forward
split, the host work kept, the measured communication added; the pipeline's stages each priced, bulk decode runs
equal to single steps; a profile that lacks what composing needs is refused in one line."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sim.config.errors import ConfigError
from sim.config.sharding import stage_layers
from sim.cost.build import make_cost_model
from sim.cost.fitted import FittedCostModel
from sim.cost.parallel import ParallelFittedCostModel
from sim.policy.batch import shape_of
from tests.helpers import plan_of, run, scenario

PROFILE = json.loads((Path(__file__).parent.parent / "calibration" / "profiles" / "cpu.json").read_text())
COMM = {"fit": {"all_reduce_shm": {"latency_s": 4e-5, "s_per_byte": 3e-10},
                "gather_shm": {"latency_s": 6e-5, "s_per_byte": 1e-10},
                "all_reduce_gloo": {"latency_s": 3e-4, "s_per_byte": 1.4e-9},
                "send_gloo": {"latency_s": 1e-4, "s_per_byte": 7e-10},
                "message_gloo": {"latency_s": 4e-4, "s_per_byte": 0.0}}}
MODEL = {"base": "SmolLM2-135M", "num_heads": 8, "num_kv_heads": 4, "head_dim": 64, "weight_dtype": "fp32"}
WORKLOAD = {"seed": 3, "arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 60,
            "prompt_len": {"dist": "uniform", "min": 32, "max": 256}, "output_len": {"dist": "uniform", "min": 8,
                                                                                      "max": 64}}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """The shipped CPU profile with a forward fit (70% of each term) and measured communication added."""
    d = copy.deepcopy(PROFILE)
    d["fit"]["forward"] = {"coefs": {k: 0.7 * v for k, v in d["fit"]["coefs"].items()}, "knot": d["fit"]["knot"],
                           "ramp_knot": d["fit"].get("ramp_knot", 0)}
    d["comm"] = COMM
    path = tmp_path_factory.mktemp("prof") / "cpu.json"
    path.write_text(json.dumps(d))
    return path


def parallel(profile: Path, **par) -> dict:
    return scenario(model=MODEL, hardware="cpu", parallel=par, cost_model={"profile": str(profile)},
                    serving={"max_num_seqs": 16, "max_model_len": 1024}, kv_cache={"num_blocks": 256},
                    workload=WORKLOAD)


def test_tensor_parallel_step_is_host_plus_a_share_of_the_forward_plus_communication(profile):
    one = make_cost_model(plan_of(parallel(profile)))
    two = make_cost_model(plan_of(parallel(profile, tensor_parallel_size=2)))
    assert isinstance(two, ParallelFittedCostModel)
    for shape in (shape_of([1] * 16, [200] * 16), shape_of([512], [512]), shape_of([1, 1, 64], [90, 300, 64])):
        total = one.step_time(shape)
        f = 0.7 * total  # the forward fit is 70% of every term
        c = COMM["fit"]
        tokens, sampled = shape.num_new_tokens, shape.num_sampled
        comm = c["message_gloo"]["latency_s"] + sum(
            c["all_reduce_shm"]["latency_s"] + c["all_reduce_shm"]["s_per_byte"] * rows * 576 * 4
            for rows in [tokens] * 58 + [sampled] * 2) \
            + c["gather_shm"]["latency_s"] + c["gather_shm"]["s_per_byte"] * sampled * 24576 * 4
        assert two.step_time(shape) == pytest.approx(total - f + f / 2 + comm, rel=1e-9)


def test_pipeline_stages_split_the_layers_and_stage_0_keeps_the_host_work_and_the_head(profile):
    cost = make_cost_model(plan_of(parallel(profile, pipeline_parallel_size=2)))
    shape = shape_of([1] * 8, [300] * 8)
    stages, send, back = cost.pipeline_stages(shape)
    assert stage_layers(30, 2) == [15, 15] and stage_layers(5, 2) == [2, 3]
    assert stages[0] > stages[1] > 0  # host work and the LM head on stage 0
    # every stage runs a forward of its own: the step's fixed cost in full on each, not a share
    one = make_cost_model(plan_of(parallel(profile)))
    assert sum(stages) == pytest.approx(one.step_time(shape) + cost.forward.coefs["step"], rel=1e-9)
    assert cost.step_time(shape) == pytest.approx(sum(stages) + send + back)
    assert send == pytest.approx(1e-4 + 7e-10 * 8 * 576 * 4) and back == pytest.approx(send)
    # a step priced longer by the replica (a drafter, a verify) lengthens stage 0 only
    more, _, _ = cost.pipeline_stages(shape, cost.step_time(shape) + 0.01)
    assert more[0] == pytest.approx(stages[0] + 0.01) and more[1] == stages[1]


def test_a_fitted_pipeline_s_bulk_decode_runs_equal_its_single_steps(profile):
    data = parallel(profile, pipeline_parallel_size=2, virtual_engines=1)
    bulk, _, _ = run(data, bulk=True)
    steps, _, _ = run(data, bulk=False)
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert bulk[key] == steps[key]
    two, _, _ = run(parallel(profile, pipeline_parallel_size=2))
    assert 0 < bulk["pipeline"]["stage_utilization"] < two["pipeline"]["stage_utilization"]


def test_a_profile_without_communication_cannot_price_parallel_steps(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({k: v for k, v in PROFILE.items() if k != "comm"}))  # as profiles were before it
    with pytest.raises(ConfigError) as e:
        plan_of(parallel(path, tensor_parallel_size=2))
    assert e.value.key_path == "parallel.tensor_parallel_size" and "communication" in e.value.message
    assert isinstance(make_cost_model(plan_of(parallel(path))), FittedCostModel)


def test_a_profile_measured_through_the_layout_prices_it_as_it_is(tmp_path):
    d = copy.deepcopy(PROFILE)
    d["parallel"] = {"tensor_parallel_size": 2}
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps(d))
    cost = make_cost_model(plan_of(parallel(path, tensor_parallel_size=2)))
    assert type(cost) is FittedCostModel and cost.coefs == d["fit"]["coefs"]
    for other in ({}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ConfigError) as e:
            plan_of(parallel(path, **other))
        assert "measured through tensor x pipeline parallel 2 x 1" in e.value.message

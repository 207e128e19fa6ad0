"""Expert parallelism's dispatch/combine as each engine runs it (`parallel.all2all_backend`): vLLM's default
allgather_reducescatter moves what the non-EP exchange moves, DeepEP an all-to-all of the routed rows; each
engine's default resolves and is listed among the report's assumptions; bad values are one line."""
from __future__ import annotations

import pytest

from sim.config.errors import ConfigError
from sim.config.hardware import HARDWARE_CATALOG
from sim.cost import routing
from sim.cost.build import make_cost_model
from sim.cost.comm import Interconnect
from sim.policy.batch import shape_of
from tests.helpers import plan_of, scenario
from tests.test_bad_input_more import run_broken
from tests.test_bad_input_more import scenario as bad_scenario


def moe_plan(model="Qwen3-30B-A3B", hardware="H100-SXM", engine="infersim", cost_type="roofline", **parallel):
    return plan_of(scenario(model=model, hardware=hardware, engine=engine, parallel=parallel,
                            cost_model={"type": cost_type}, serving={"max_model_len": 4096}))


def comm(plan, tokens: int) -> float:
    return make_cost_model(plan).communication_s(tokens, tokens)


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_ep_on_allgather_reducescatter_moves_what_the_non_ep_exchange_moves(tokens):
    ep = moe_plan(data_parallel_size=4, enable_expert_parallel=True, all2all_backend="allgather_reducescatter")
    sliced = moe_plan(data_parallel_size=4)
    assert comm(ep, tokens) == pytest.approx(comm(sliced, tokens))
    assert comm(ep, tokens) > 0
    assert comm(ep, tokens) != pytest.approx(comm(moe_plan(data_parallel_size=4, enable_expert_parallel=True), tokens))


def kernel_comm(model: str, hardware: str, dp: int, backend: str, tokens: int) -> float:
    """A step's communication under vLLM's measured NCCL collectives (the GPU kernel model)."""
    return comm(moe_plan(model, hardware, engine="vllm", cost_type="auto", data_parallel_size=dp,
                         enable_expert_parallel=True, all2all_backend=backend), tokens)


def test_an_all_to_all_of_the_routed_rows_is_cheaper_than_gathering_every_token_at_small_batch():
    def cost(backend):  # DeepSeek-V3's decodes, a row a rank: 8 hidden states gathered against ~5 routed rows each
        return kernel_comm("DeepSeek-V3", "H200", 8, backend, 8)
    gathered = cost("allgather_reducescatter")
    for backend in ("all_to_all", "deepep_high_throughput", "deepep_low_latency"):
        assert 0 < cost(backend) < 0.9 * gathered, backend
    assert cost("deepep_low_latency") == cost("all_to_all")  # a row per expert a token chose: one fit (docs/moe.md)


def test_with_more_experts_a_token_than_ranks_only_deepep_s_normal_kernels_move_less_than_gathering():
    def cost(backend):  # Qwen3-30B-A3B's top 8 over 4 ranks: a prefill's 8192 tokens, where the bytes set the time
        return kernel_comm("Qwen3-30B-A3B", "H100-SXM", 4, backend, 8192)
    assert cost("deepep_high_throughput") < cost("allgather_reducescatter") < cost("deepep_low_latency")


@pytest.mark.parametrize("model, hardware, experts, top_k, ep", [("Qwen3-30B-A3B", "H100-SXM", 128, 8, 4),
                                                                 ("DeepSeek-V3", "H200", 256, 8, 8)])
def test_deepep_s_normal_kernels_send_a_token_once_a_rank(model, hardware, experts, top_k, ep):
    def cost(backend):
        return comm(moe_plan(model, hardware, data_parallel_size=ep, enable_expert_parallel=True,
                             all2all_backend=backend), 4096)  # a prefill's worth: the bytes set the time
    ranks = routing.ranks_touched(experts, top_k, ep)
    assert 1 < ranks < min(top_k, ep)
    link = Interconnect.of(HARDWARE_CATALOG[hardware])
    per_rank, per_expert = cost("deepep_high_throughput"), cost("deepep_low_latency")
    plan = moe_plan(model, hardware, data_parallel_size=ep, enable_expert_parallel=True)
    latency = 2 * make_cost_model(plan).blocks.moe_layers * link.gather_hops(ep) * link.latency_s
    assert per_rank < per_expert
    assert (per_rank - latency) / (per_expert - latency) == pytest.approx(ranks / top_k, rel=0.02)


def test_ranks_touched_counts_the_ranks_a_token_s_experts_are_on():
    assert routing.ranks_touched(8, 2, 8) == pytest.approx(2)  # an expert a rank: every choice its own rank
    assert routing.ranks_touched(8, 8, 2) == pytest.approx(2)  # every expert chosen: both ranks
    assert routing.ranks_touched(4, 1, 2) == pytest.approx(1)
    assert routing.ranks_touched(4, 2, 2) == pytest.approx(2 * (1 - 1 / 6))  # both on one rank in 1 of C(4,2)


def test_vllm_s_ep_plan_gathers_by_default_and_its_experts_stay_whole():
    shape = shape_of([1] * 8, [1000] * 8)
    vllm = make_cost_model(moe_plan(engine="vllm", data_parallel_size=4, enable_expert_parallel=True))
    sliced = make_cost_model(moe_plan(engine="vllm", data_parallel_size=4))
    deepep = make_cost_model(moe_plan(engine="vllm", data_parallel_size=4, enable_expert_parallel=True,
                                      all2all_backend="deepep_high_throughput"))
    assert vllm.step_cost(shape).communication_s == sliced.step_cost(shape).communication_s
    assert vllm.step_cost(shape).communication_s != deepep.step_cost(shape).communication_s
    assert vllm.step_cost(shape).experts_s == deepep.step_cost(shape).experts_s  # the experts are whole either way


@pytest.mark.parametrize("engine, backend", [("vllm", "allgather_reducescatter"), ("sglang", "allgather_reducescatter"),
                                             ("trtllm", "allgather_reducescatter"), ("infersim", "all_to_all")])
def test_each_engine_s_default_backend_resolves_and_is_listed_as_assumed(engine, backend):
    plan = moe_plan(engine=engine, data_parallel_size=4, enable_expert_parallel=True)
    assert plan.expert_layout.all2all_backend == backend
    assert plan.engine.to_json()["assumed"]["parallel.all2all_backend"] == backend
    given = moe_plan(engine=engine, data_parallel_size=4, enable_expert_parallel=True,
                     all2all_backend="deepep_low_latency")
    assert given.expert_layout.all2all_backend == "deepep_low_latency"
    assert "parallel.all2all_backend" not in given.engine.assumed  # the scenario's own choice


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2, "enable_expert_parallel": True},
                                      {"data_parallel_size": 4}])
def test_the_backend_is_assumed_only_where_it_prices_an_exchange(parallel):
    assert "parallel.all2all_backend" not in moe_plan(engine="vllm", **parallel).engine.assumed


def test_a_dense_model_s_data_parallel_plan_assumes_no_backend():
    data = scenario(model="Llama-2-7B", hardware="H100-SXM", engine="vllm", parallel={"data_parallel_size": 2},
                    serving={"max_model_len": 4096})
    assert "parallel.all2all_backend" not in plan_of(data).engine.assumed


def test_an_all_to_all_backend_without_expert_parallelism_is_refused():
    with pytest.raises(ConfigError) as e:
        moe_plan(data_parallel_size=4, all2all_backend="deepep_high_throughput")
    assert e.value.key_path.startswith("parallel") and "enable_expert_parallel" in e.value.message


@pytest.mark.parametrize("parallel, needle", [
    ({"all2all_backend": "pplx"}, "allgather_reducescatter"),  # not a backend: the allowed ones named
    ({"all2all_backend": "deepep_low_latency"}, "enable_expert_parallel"),  # routed rows need experts held whole
])
def test_bad_backends_are_one_line_errors(tmp_path, parallel, needle):
    run_broken(tmp_path, bad_scenario(parallel=parallel), "parallel", needle)

"""The serving engine a plan names (sim/config/engines.py, sim/cost/engine.py): the defaults each engine supplies and
the report's list of them, its scheduling (SGLang's prefill batches apart, TensorRT-LLM's whole prompts beside the
decodes), its CUDA graphs (padding, eager launches), async scheduling and TensorRT-LLM's KV memory rule."""
from __future__ import annotations

import pytest

from sim.config.engines import RELEASES, EngineProfile, cuda_graph_sizes, release
from sim.config.errors import ConfigError
from sim.cost.build import describe_cost, make_cost_model
from sim.cost.engine import HostCost
from sim.policy.batch import BatchShape
from tests.helpers import plan_of, run, scenario

H100 = dict(model="Llama-3-8B", hardware="H100-SXM")


def test_each_engine_supplies_its_defaults_and_the_report_names_them():
    vllm = plan_of(scenario(**H100, engine="vllm"))
    assert (vllm.scheduler.max_num_batched_tokens, vllm.scheduler.max_num_seqs) == (8192, 1024)
    assert vllm.scheduler.enable_chunked_prefill and vllm.scheduler.mixed_batches and vllm.enable_prefix_caching
    a100 = plan_of(scenario(model="Llama-3-8B", hardware="A100-80GB", engine="vllm"))  # vLLM's A100 exception
    assert (a100.scheduler.max_num_batched_tokens, a100.scheduler.max_num_seqs) == (2048, 256)
    sglang = plan_of(scenario(**H100, engine="sglang"))
    assert sglang.scheduler.enable_chunked_prefill and not sglang.scheduler.mixed_batches
    assert sglang.block_size == 16 and sglang.scheduler.max_num_batched_tokens == 8192
    trt = plan_of(scenario(**H100, engine="trtllm"))
    assert not trt.scheduler.enable_chunked_prefill and trt.scheduler.mixed_batches and trt.block_size == 32
    assert trt.scheduler.max_num_batched_tokens == 8192  # Llama-3-8B's 8192 positions fit one step
    assumed = describe_cost(vllm)["engine"]["assumed"]
    assert assumed["serving.max_num_seqs"] == 1024 and assumed["kv_cache.enable_prefix_caching"] is True


def test_what_the_scenario_sets_wins_over_the_engine_and_is_not_listed_as_assumed():
    plan = plan_of(scenario(**H100, engine="vllm", serving={"max_num_seqs": 64},
                            kv_cache={"enable_prefix_caching": False}))
    assert plan.scheduler.max_num_seqs == 64 and not plan.enable_prefix_caching
    assumed = plan.engine.assumed
    assert "serving.max_num_seqs" not in assumed and "kv_cache.enable_prefix_caching" not in assumed


def test_a_scenario_naming_no_engine_runs_vllm_on_a_gpu_and_infersim_on_the_cpu():
    data = scenario(**H100)
    data.pop("engine")
    assert plan_of(data).engine.release.engine == "vllm"
    cpu = scenario(model="SmolLM2-135M", hardware="cpu")
    cpu.pop("engine")
    assert plan_of(cpu).engine.release.engine == "infersim"


def test_an_unknown_engine_or_release_is_one_line():
    with pytest.raises(ConfigError, match="allowed: 0.11.0"):
        plan_of(scenario(**H100, engine={"name": "vllm", "version": "9.9"}))
    with pytest.raises(ConfigError):
        plan_of(scenario(**H100, engine="tgi"))
    assert release("vllm", None) is RELEASES["vllm"][-1]


def test_vllm_captures_its_graph_sizes_and_pads_a_step_to_the_next():
    r = release("vllm", "0.19.0")
    sizes = cuda_graph_sizes(r, 256, 8192, 1, None)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512 and 264 not in sizes and 272 in sizes
    profile = EngineProfile(r, sizes, True, True)
    assert profile.graph_tokens(37, True) == 40 and profile.graph_tokens(600, False) == 600
    assert profile.graph_tokens(300, False) == 304  # piecewise graphs pad a mixed step too
    sglang = EngineProfile(release("sglang", None), cuda_graph_sizes(release("sglang", None), 256, 8192, 1, None),
                           True, True)
    assert sglang.graph_tokens(37, True) == 40 and sglang.graph_tokens(37, False) == 37  # decode-only graphs


def test_a_padded_decode_step_costs_what_the_captured_size_costs():
    cost = make_cost_model(plan_of(scenario(**H100, engine="vllm")))
    assert cost.linear_s(40) > cost.linear_s(37)
    ctx = 37 * 500
    assert cost.decode_time(37, ctx) - 37 * 500 * cost.per_kv_token_s(37) == \
        pytest.approx(cost.decode_time(40, 40 * 500) - 40 * 500 * cost.per_kv_token_s(40), rel=0.02)


def test_eager_steps_of_a_small_model_are_bound_by_their_launches():
    small = dict(model="Llama-3.2-1B", hardware="H100-SXM")
    graphs = make_cost_model(plan_of(scenario(**small, engine="vllm")))
    eager = make_cost_model(plan_of(scenario(**small, engine={"name": "vllm", "cuda_graphs": False})))
    assert eager.decode_time(1, 100) > 1.3 * graphs.decode_time(1, 100)
    assert eager.decode_time(256, 256 * 1000) == pytest.approx(graphs.decode_time(256, 256 * 1000), rel=0.05)


def test_async_scheduling_hides_the_host_under_the_device():
    host = HostCost(1e-3, 1e-5, async_scheduling=True)
    assert host.visible_s(10, False, 4e-3) == 0.0 and host.visible_s(10, False, 0.5e-3) == pytest.approx(0.6e-3)
    assert HostCost(1e-3, 1e-5).visible_s(10, False, 4e-3) == pytest.approx(1.1e-3)
    on = make_cost_model(plan_of(scenario(**H100, engine="vllm")))
    off = make_cost_model(plan_of(scenario(**H100, engine={"name": "vllm", "async_scheduling": False})))
    assert off.decode_time(64, 64 * 1000) > on.decode_time(64, 64 * 1000)


def test_decode_time_is_the_step_time_of_its_shape_under_every_engine():
    for engine in ("vllm", "sglang", "trtllm", "infersim", {"name": "vllm", "cuda_graphs": False}):
        for tp in (1, 2):
            cost = make_cost_model(plan_of(scenario(model="Llama-3-8B", hardware="H100-SXM", engine=engine,
                                                    parallel={"tensor_parallel_size": tp})))
            for b, ctx in ((1, 30), (37, 9000), (300, 10**5)):
                assert cost.decode_time(b, ctx) == cost.step_time(BatchShape(b, b, ctx, ctx, b)), (engine, tp, b)


def test_tensorrt_llm_gives_the_kv_cache_a_share_of_what_is_free():
    vllm = plan_of(scenario(**H100, engine="vllm", kv_cache={"gpu_memory_utilization": 0.9}))
    trt = plan_of(scenario(**H100, engine="trtllm", kv_cache={"gpu_memory_utilization": 0.9, "block_size": 16}))
    free = trt.hardware.memory_bytes - trt.weight_bytes - trt.activation_bytes
    assert trt.kv_cache_bytes == pytest.approx(0.9 * free)
    assert trt.kv_cache_bytes > vllm.kv_cache_bytes


WORKLOAD = {"seed": 3, "arrival": {"process": "poisson", "rate": 6.0}, "num_requests": 200,
            "prompt_len": {"dist": "fixed", "value": 1500}, "output_len": {"dist": "fixed", "value": 200}}


def test_prefill_batches_apart_from_the_decodes_as_sglang_runs_them():
    """The same traffic and kernels under vLLM's mixed steps and SGLang's rule (mixed_batches off, its default): its
    prompts never wait behind decodes, so first tokens come sooner, and every decode waits through each prefill batch,
    so its token gaps are longer."""
    common = dict(**H100, workload=WORKLOAD, kv_cache={"enable_prefix_caching": False}, engine="vllm")
    vllm, _, vrec = run(scenario(**common, serving={"max_num_batched_tokens": 2048}))
    sglang, result, srec = run(scenario(**common, serving={"max_num_batched_tokens": 2048, "mixed_batches": False}),
                               bulk=False)
    assert vllm["requests"]["completed"] == sglang["requests"]["completed"] == 200
    assert sglang["ttft_s"]["p50"] < vllm["ttft_s"]["p50"]
    assert sglang["tpot_s"]["p90"] > vllm["tpot_s"]["p90"]


def test_tensorrt_llm_runs_whole_prompts_beside_the_decodes():
    common = dict(**H100, workload=WORKLOAD, kv_cache={"enable_prefix_caching": False}, engine="trtllm")
    trt, _, _ = run(scenario(**common))
    v0 = run(scenario(**common, serving={"mixed_batches": False}))[0]  # whole prompts run alone (vLLM V0)
    assert trt["requests"]["completed"] == v0["requests"]["completed"] == 200
    assert trt["tpot_s"]["p90"] < v0["tpot_s"]["p90"]  # the decodes do not stop for a prompt


BAD_ENGINES = [
    ('"vlm"', "engine.name"), ('{name: vllm, version: "9"}', "engine.version"),
    ("{name: vllm, cuda_graphs: maybe}", "engine.cuda_graphs"), ("{name: vllm, max_cuda_graph_batch: 0}",
                                                                 "engine.max_cuda_graph_batch"),
    ('{version: "0.14.0"}', "engine.name"), ("{name: sglang, foo: 1}", "engine.foo"), ("3", "engine"),
    ("{name: vllm, version: true}", "engine.version"), ("[vllm]", "engine"),
]


@pytest.mark.parametrize("engine, key", BAD_ENGINES)
def test_a_bad_engine_is_one_line_naming_its_key(tmp_path, engine, key):
    from tests.test_bad_input_more import invoke, one_line_error

    path = tmp_path / "s.yaml"
    path.write_text(f"model: Llama-3-8B\nhardware: H100-SXM\nengine: {engine}\nworkload: {{arrival: {{process: poisson, "
                    "rate: 1}, num_requests: 5, prompt_len: {dist: fixed, value: 10}, output_len: {dist: fixed, "
                    "value: 5}}\n")
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, key + ":")


def test_a_release_may_be_named_by_its_minor_version():
    assert release("vllm", "0.19").version == "0.19.0"
    assert plan_of(scenario(**H100, engine={"name": "vllm", "version": 0.19})).engine.release.version == "0.19.0"


def test_tensorrt_llm_reserves_each_request_to_its_last_token_and_never_preempts():
    """A KV cache too small for the batch's decodes: vLLM admits on the prompt's blocks and preempts as decodes grow;
    TensorRT-LLM's GUARANTEED_NO_EVICT admits only what fits to its last token, so nothing is preempted (and fewer
    run at once); every request completes either way."""
    tight = dict(**H100, workload={**WORKLOAD, "output_len": {"dist": "fixed", "value": 800}},
                 kv_cache={"num_blocks": 400, "block_size": 16, "enable_prefix_caching": False},
                 serving={"enable_chunked_prefill": True, "max_num_batched_tokens": 2048})
    vllm = run(scenario(**tight, engine="vllm"))[0]
    trt = run(scenario(**tight, engine="trtllm"))[0]
    assert vllm["requests"]["completed"] == trt["requests"]["completed"] == 200
    assert vllm["kv_cache"]["preemptions"] > 0 and trt["kv_cache"]["preemptions"] == 0
    off = run(scenario(**{**tight, "serving": {**tight["serving"], "reserve_output": False}}, engine="trtllm"))[0]
    assert off["kv_cache"]["preemptions"] > 0

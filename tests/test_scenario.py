"""Scenario resolution: catalogs, overrides, HF config.json, memory budget."""
from __future__ import annotations

import json

import pytest

from sim.config.errors import ConfigError
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.models import MODEL_CATALOG
from tests.helpers import plan_of, scenario

SMOL_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
               "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
               "max_position_embeddings": 8192, "rope_theta": 100000, "tie_word_embeddings": True,
               "torch_dtype": "bfloat16", "vocab_size": 49152}


def test_model_from_hf_config_json_matches_catalog(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL_CONFIG))
    plan = plan_of(scenario(model={"hf_config": str(tmp_path / "config.json")}))
    cat = MODEL_CATALOG["SmolLM2-135M"]
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size", "intermediate_size",
                  "vocab_size", "tie_word_embeddings", "weight_dtype", "num_params", "kv_bytes_per_token"):
        assert getattr(plan.model, field) == getattr(cat, field), field


def test_overrides_on_a_catalog_base():
    plan = plan_of(scenario(model={"base": "Llama-2-7B", "weight_dtype": "int4"},
                            hardware={"base": "A100-80GB", "price_per_hour": 9.0}))
    assert plan.model.weight_bytes < 0.3 * MODEL_CATALOG["Llama-2-7B"].weight_bytes
    assert plan.hardware.price_per_hour == 9.0
    assert plan.hardware.memory_bandwidth == HARDWARE_CATALOG["A100-80GB"].memory_bandwidth


def test_kv_blocks_follow_the_memory_budget():
    plan = plan_of(scenario(hardware="A100-80GB"))
    model, hw = plan.model, plan.hardware
    kv = hw.memory_bytes * 0.9 - model.weight_bytes - plan.activation_bytes
    assert plan.num_blocks == int(kv // (16 * model.kv_bytes_per_token))
    contiguous = plan_of(scenario(hardware="A100-80GB", kv_cache={"allocator": "contiguous"}))
    assert contiguous.block_size == 4096 and contiguous.num_blocks == int(kv // (4096 * model.kv_bytes_per_token))


def test_long_context_models_chunk_their_prompts_by_default():
    """vLLM's rule: chunked prefill is on by default past a 32k context. Without it Llama-3.1-8B's step budget was a
    whole 131,072-token prompt: 11.1 GiB of activations reserved on an A100-80GB, a quarter of the KV taken away,
    and the model refused on an L4 as needing TP 2."""
    long = plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB"))
    assert long.scheduler.enable_chunked_prefill and long.scheduler.max_num_batched_tokens == 2048
    off = plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB", serving={"enable_chunked_prefill": False}))
    assert not off.scheduler.enable_chunked_prefill and off.scheduler.max_num_batched_tokens == 131072
    assert off.activation_bytes > 10 * 2**30 > 2**30 > long.activation_bytes
    assert long.num_blocks > 1.2 * off.num_blocks
    at_32k = plan_of(scenario(model="Mistral-7B", hardware="A100-80GB"))  # 32,768: not past it
    assert not at_32k.scheduler.enable_chunked_prefill
    short = plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB", serving={"max_model_len": 8192}))
    assert not short.scheduler.enable_chunked_prefill
    static = plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB",
                              serving={"batching": "static", "max_model_len": 8192}))
    assert not static.scheduler.enable_chunked_prefill
    with pytest.raises(ConfigError) as e:  # on an L4 the KV cannot hold one 131k sequence: vLLM's refusal too
        plan_of(scenario(model="Llama-3.1-8B", hardware="L4"))
    assert e.value.key_path == "serving.max_model_len"


@pytest.mark.parametrize("serving", [{"prefill_chunk_size": 512}, {"prefill_chunk_size": 512, "max_model_len": 8192}])
def test_a_prompt_chunk_where_chunked_prefill_is_off_by_default(serving):
    """prefill_chunk_size with chunked prefill unset: read past a 32k context, refused where nothing reads it."""
    if "max_model_len" not in serving:
        assert plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB", serving=serving)) \
            .scheduler.prefill_chunk_size == 512
        return
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model="Llama-3.1-8B", hardware="A100-80GB", serving=serving))
    assert e.value.key_path == "serving.prefill_chunk_size" and "max_model_len 8192" in e.value.message


@pytest.mark.parametrize("overrides, path", [
    ({"model": "Llama-2-70B", "hardware": "L4"}, "hardware"),
    ({"model": {"base": "Llama-2-7B", "num_kv_heads": 5}}, "model.num_kv_heads"),
    ({"serving": {"max_num_batched_tokens": 1024}}, "serving.max_num_batched_tokens"),
    ({"model": "GPT-5"}, "model"),
    ({"hardware": "TPU-v9"}, "hardware"),
])
def test_impossible_configs_name_the_key(overrides, path):
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(**overrides))
    assert e.value.key_path == path
    assert "\n" not in e.value.one_line()


@pytest.mark.parametrize("section, key", [
    ("kv_cache", "swap_space_gib"), ("serving", "waiting_served_ratio"), ("cost_model", "step_overhead_s"),
    ("hardware", "memory_gib"), ("speculative", "verify_cost_ratio"), ("workload", "duration_s")])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_no_number_is_infinite_or_nan(section, key, value):
    """Every float a user writes is finite: .inf or .nan is a one-line error at its key, not NaN figures later."""
    extra = {"kv_cache": {"preemption": "swap", key: value}, "serving": {key: value},
             "cost_model": {key: value}, "hardware": {"base": "A100-80GB", key: value},
             "speculative": {"acceptance_rate": 0.5, key: value}}
    kw = {section: extra[section]} if section != "workload" else {}
    data = scenario(**kw)
    if section == "workload":
        data["workload"] = {k: v for k, v in data["workload"].items() if k != "num_requests"} | {key: value}
    with pytest.raises(ConfigError) as e:
        plan_of(data)
    assert e.value.key_path == f"{section}.{key}" and "finite" in e.value.message


@pytest.mark.parametrize("change, key_path", [
    ({"replicas": 1_000_000}, "replicas"),
    ({"model": {"base": 12345}}, "model.base"),
    ({"hardware": {"base": "cpu", "memory_gib": 1e6}}, "hardware"),
    ({"workload": {"num_requests": 10**12}}, "workload.num_requests"),
    ({"workload": {"num_requests": None, "duration_s": 1e9}}, "workload"),
    ({"workload": {"prompt_len": {"dist": "uniform", "min": 1, "max": 10**30}}}, "workload.prompt_len.max"),
    ({"workload": {"output_len": {"dist": "lognormal", "median": 1e300, "sigma": 1}}}, "workload.output_len.median"),
])
def test_limits_are_checked_before_anything_is_allocated(change, key_path):
    """What a scenario may ask of the tool is bounded (sim/config/limits.py): past a limit, one line at the key."""
    data = scenario(model="SmolLM2-135M", hardware="cpu")
    for k, v in change.items():
        if k == "workload":
            data["workload"] = {kk: vv for kk, vv in {**data["workload"], **v}.items() if vv is not None}
        else:
            data[k] = v
    with pytest.raises(ConfigError) as e:
        plan_of(data)
    assert e.value.key_path == key_path and "\n" not in e.value.message and len(e.value.one_line()) < 300


@pytest.mark.parametrize("path", ["/dev/zero", "/etc/passwd"])
def test_a_trace_that_is_no_trace_is_refused_without_echoing_it(path):
    from sim.config.generator import generate_requests

    data = scenario(model="SmolLM2-135M", hardware="cpu")
    data["workload"] = {"trace": {"path": path}}
    with pytest.raises(ConfigError) as e:
        generate_requests(plan_of(data).workload)
    assert e.value.key_path == "workload.trace.path" and "root:" not in e.value.message

"""Model compression in the simulator: weight and KV bytes per dtype, 2:4 sparsity, and whether the hardware
computes faster (fp8 tensor cores, sparse tensor cores) or only streams fewer bytes (weight-only quantization)."""
from __future__ import annotations

import pytest

from sim.config.errors import ConfigError
from sim.cost.build import make_cost_model
from sim.policy.batch import BatchShape
from tests.helpers import plan_of, scenario

PREFILL = BatchShape(num_seqs=4, num_new_tokens=8192, sum_context=8192, attn_pairs=4 * 2048 * 2049 // 2,
                     num_sampled=4, num_prefill=4)  # compute-bound: the linear layers' FLOPs decide
DECODE = BatchShape(num_seqs=8, num_new_tokens=8, sum_context=8 * 512, attn_pairs=8 * 512, num_sampled=8)  # streams


def model(base: str = "Llama-3-8B", **kw) -> dict:
    return {"base": base, **kw}


def times(hardware: str, **model_kw) -> tuple[float, float]:
    cost = make_cost_model(plan_of(scenario(model=model(**model_kw), hardware=hardware)))
    return cost.step_time(PREFILL), cost.step_time(DECODE)


def test_fp8_runs_on_fp8_tensor_cores_on_h100_and_only_streams_fewer_bytes_on_a100():
    p16, d16 = times("H100-SXM", weight_dtype="bf16")
    p8, d8 = times("H100-SXM", weight_dtype="fp8")
    assert p8 < 0.7 * p16 and d8 < 0.75 * d16  # compute at twice the rate, half the weight bytes
    a16, ad16 = times("A100-80GB", weight_dtype="bf16")
    a8, ad8 = times("A100-80GB", weight_dtype="fp8")
    assert a8 > a16 and ad8 < 0.75 * ad16  # Ampere has no fp8: dequantize, multiply in 16 bits


def test_int8_weights_on_an_a100_cut_memory_traffic_not_compute():
    p16, d16 = times("A100-80GB", weight_dtype="fp16")
    p8, d8 = times("A100-80GB", weight_dtype="int8")
    p4, d4 = times("A100-80GB", weight_dtype="int4")
    # weight-only: the same 16-bit multiply plus dequantization; a prefill's weight stream is under 0.1% of it
    assert p8 == pytest.approx(p4, rel=1e-3) and p8 > p16
    assert d4 < d8 < 0.75 * d16


def test_llama2_70b_needs_two_a100s_in_fp16_and_int8_fits_two_with_room_for_kv():
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model="Llama-2-70B", hardware="A100-80GB"))
    assert "tensor_parallel_size of 2 or more" in e.value.message
    fp16 = plan_of(scenario(model="Llama-2-70B", hardware="A100-80GB", parallel={"tensor_parallel_size": 2}))
    int8 = plan_of(scenario(model=model("Llama-2-70B", weight_dtype="int8"), hardware="A100-80GB",
                            parallel={"tensor_parallel_size": 2}))
    assert int8.weight_bytes < 0.52 * fp16.weight_bytes
    assert int8.kv_cache_bytes / 2**30 > 30 > 3 * fp16.kv_cache_bytes / 2**30  # GiB of KV per device
    assert int8.num_blocks > 3 * fp16.num_blocks


def test_int4_roughly_doubles_the_kv_room_of_int8_where_weights_dominate():
    hw = {"base": "H100-SXM", "memory_gib": 110}
    int8 = plan_of(scenario(model=model("Llama-2-70B", weight_dtype="int8"), hardware=hw))
    int4 = plan_of(scenario(model=model("Llama-2-70B", weight_dtype="int4"), hardware=hw))
    assert 1.7 < int4.kv_cache_bytes / int8.kv_cache_bytes < 2.3


def test_int8_kv_cache_holds_about_twice_the_tokens():
    fp16 = plan_of(scenario(model="Llama-2-7B"))
    int8 = plan_of(scenario(model=model("Llama-2-7B", kv_dtype="int8")))
    scale = 1 + 4 / 128  # a 4-byte scale per token and head of 128 values, as the executor stores it
    assert int8.kv_bytes_per_token == pytest.approx(fp16.kv_bytes_per_token / 2 * scale, rel=1e-9)
    assert int8.num_blocks == pytest.approx(2 / scale * fp16.num_blocks, rel=0.02)


def test_two_four_sparsity_speeds_compute_on_sparse_tensor_cores_and_nothing_on_the_cpu():
    dense, dense_d = times("A100-80GB")
    sparse, sparse_d = times("A100-80GB", sparsity="2:4")
    assert sparse < 0.65 * dense and sparse_d < 0.7 * dense_d  # half the FLOPs and 0.56x the weight bytes
    gpu = plan_of(scenario(model=model("Llama-3-8B", sparsity="2:4"), hardware="A100-80GB"))
    assert gpu.weight_bytes < 0.65 * plan_of(scenario(model="Llama-3-8B", hardware="A100-80GB")).weight_bytes
    cpu = {"model": model("SmolLM2-135M"), "hardware": "cpu"}
    cpu_sparse = {"model": model("SmolLM2-135M", sparsity="2:4"), "hardware": "cpu"}
    a, b = (make_cost_model(plan_of(scenario(**d))) for d in (cpu, cpu_sparse))
    assert a.step_time(DECODE) == b.step_time(DECODE)  # the dense fallback: no time saved, no bytes saved
    assert plan_of(scenario(**cpu)).weight_bytes == plan_of(scenario(**cpu_sparse)).weight_bytes


def test_a_distilled_small_model_against_the_big_one_quantized():
    """The planner's comparison: Llama-3-70B in int4 on one H100 against Llama-3.1-8B (its distillation target
    class) in bf16: the small model decodes faster and holds more KV."""
    big = plan_of(scenario(model=model("Llama-3-70B", weight_dtype="int4"), hardware="H100-SXM"))
    small = plan_of(scenario(model="Llama-3.1-8B", hardware="H100-SXM"))
    assert small.num_blocks * small.block_size > 2 * big.num_blocks * big.block_size
    assert make_cost_model(small).step_time(DECODE) < make_cost_model(big).step_time(DECODE) / 2


def test_a_checkpoint_s_model_may_say_how_it_is_served_compressed(tmp_path):
    import json

    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": 2048, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = plan_of(scenario(model={"hf_config": str(tmp_path)}))
    small = plan_of(scenario(model={"hf_config": str(tmp_path), "weight_dtype": "int8", "kv_dtype": "int8",
                                    "sparsity": "2:4"}))
    assert (small.model.weight_dtype, small.model.kv_dtype, small.model.sparsity) == ("int8", "int8", "2:4")
    assert small.model.num_layers == plain.model.num_layers == 4 and small.model_checkpoint == plain.model_checkpoint
    assert small.model.kv_bytes_per_token < plain.model.kv_bytes_per_token / 3
    for bad, where in (({"num_layers": 3}, "model"), ({"weight_dtype": "int3"}, "model.weight_dtype")):
        with pytest.raises(ConfigError) as e:
            plan_of(scenario(model={"hf_config": str(tmp_path), **bad}))
        assert e.value.key_path == where

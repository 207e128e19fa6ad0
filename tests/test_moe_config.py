"""Mixture-of-experts and latent-attention models: sizes against the published figures, Hugging Face configs, the
routing statistics, and a replica's data- and expert-parallel layout (sim/config/moe.py, expert_parallel.py)."""
from __future__ import annotations

import json

import pytest

from sim.config import moe
from sim.config.errors import ConfigError
from sim.config.hf_config import load_hf_config
from sim.config.models import MODEL_CATALOG, ModelSpec
from sim.config.sharding import shard
from sim.cost import routing
from tests.helpers import plan_of, scenario

# published (total, active) parameters in billions, as written: Mistral AI's Mixtral posts, Qwen3's model cards, the
# DeepSeek-V3 report. Two are cut rather than rounded (Qwen3-30B-A3B's 3.35B is "3.3B", DeepSeek-V3's 37.55B "37B"):
# each must match within 1% or one unit of its last written digit
PUBLISHED = {"Mixtral-8x7B": ("46.7", "12.9"), "Mixtral-8x22B": ("141", "39"), "Qwen3-30B-A3B": ("30.5", "3.3"),
             "Qwen3-235B-A22B": ("235", "22"), "DeepSeek-V3": ("671", "37")}


def within_the_figure(count: int, written: str) -> bool:
    unit = 10.0 ** -len(written.partition(".")[2])  # the last written digit's
    return abs(count / 1e9 - float(written)) <= max(0.01 * float(written), unit)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_total_and_active_parameters_match_the_published_figures(name):
    m, (total, active) = MODEL_CATALOG[name], PUBLISHED[name]
    assert within_the_figure(m.num_params, total) and within_the_figure(m.active_params, active), \
        (m.num_params, m.active_params)
    assert m.num_params == pytest.approx(float(total) * 1e9, rel=0.01)
    assert m.weight_bytes == pytest.approx(m.linear_params * m.bytes_per_linear_param() + 2 * m.embedding_params * 2)


def test_dense_models_keep_their_formulas():
    m = MODEL_CATALOG["Llama-3-8B"]
    assert not moe.has_experts(m) and not moe.uses_mla(m) and m.active_params == m.num_params == 8_030_261_248
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert moe.decoder_params(m).total == m.linear_params


def test_mla_caches_the_latent_and_rotary_key_per_layer_not_per_head():
    m = MODEL_CATALOG["DeepSeek-V3"]
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert moe.kv_bytes_per_device_token(m, shard(m, 8)) == m.kv_bytes_per_token  # every TP rank holds the whole latent
    assert moe.kv_bytes_per_device_token(MODEL_CATALOG["Mixtral-8x7B"], shard(MODEL_CATALOG["Mixtral-8x7B"], 2)) == 32 * 8 * 128 * 2 * 2 / 2
    assert sum(moe.is_moe_layer(m, i) for i in range(m.num_layers)) == 58  # first_k_dense_replace 3


def test_qwen_moe_layer_rule():
    m = ModelSpec(num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=100,
                  num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [i for i in range(8) if moe.is_moe_layer(m, i)] == [1, 5, 7]


def test_distinct_experts_and_tokens_per_expert():
    assert routing.distinct_experts(8, 2, 1) == pytest.approx(2)
    assert routing.distinct_experts(128, 8, 4096) == pytest.approx(128)
    assert routing.distinct_experts(128, 8, 4) == pytest.approx(128 * (1 - (120 / 128) ** 4))
    assert routing.tokens_per_expert(8, 2, 1) == pytest.approx(1)
    assert routing.tokens_per_expert(8, 2, 1000) == pytest.approx(250)
    assert routing.busiest_expert_tokens(8, 2, 1000, 1.5) == pytest.approx(375)
    assert routing.busiest_expert_tokens(8, 2, 1, 3.0) == 1  # never more than every token


BAD_SPECS = [({"num_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok 9 with 8 routed experts"),
             ({"num_experts": 8}, "num_experts_per_tok 0 with 8 routed experts"),
             ({"num_experts_per_tok": 2}, "num_experts_per_tok 2 without routed experts"),
             ({"num_experts": 4, "num_experts_per_tok": 1, "shared_expert_gate": True}, "shared_expert_gate"),
             ({"kv_lora_rank": 64}, "qk_rope_head_dim missing beside kv_lora_rank"),
             ({"q_lora_rank": 64}, "kv_lora_rank missing"),
             ({"num_experts": 4, "num_experts_per_tok": 1, "first_k_dense_replace": 99}, "no MoE layer")]


@pytest.mark.parametrize("change, needle", BAD_SPECS)
def test_bad_moe_specs_are_one_line_errors(change, needle):
    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "vocab_size": 100, **change}
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model=model))
    assert needle in e.value.message and e.value.key_path == "model" and "\n" not in str(e.value)


# -- Hugging Face configs: the public config.json numbers --------------------------------------------------------------
HF = {
    "Mixtral-8x7B": {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "rope_theta": 1e6, "torch_dtype": "bfloat16"},
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
                      "max_position_embeddings": 40960, "rope_theta": 1e6, "torch_dtype": "bfloat16"},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                            "activation_scheme": "dynamic"}},
}


@pytest.mark.parametrize("name", list(HF))
def test_hf_configs_read_as_the_catalog_entries(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF[name]))
    spec, ref = load_hf_config(path), MODEL_CATALOG[name]
    assert (spec.num_params, spec.active_params, spec.kv_bytes_per_token, spec.weight_dtype, spec.qk_norm) == \
        (ref.num_params, ref.active_params, ref.kv_bytes_per_token, ref.weight_dtype, ref.qk_norm)


def test_qwen2_moe_shared_expert_and_its_gate(tmp_path):
    config = {**HF["Qwen3-30B-A3B"], "model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_hf_config(tmp_path / "config.json")
    assert spec.shared_expert_gate and moe.shared_expert_params(spec) == 3 * 2048 * 5632 + 2048
    qkv_bias = (32 + 2 * 4) * 128  # Qwen2-MoE's q, k and v biases
    qk_norms = 2 * 128  # Qwen3's per-head q and k norms, which Qwen2-MoE has not
    assert spec.active_params == \
        MODEL_CATALOG["Qwen3-30B-A3B"].active_params + 48 * (3 * 2048 * 5632 + 2048 + qkv_bias - qk_norms)


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "deepseek_v3", "moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": "none"}, "mlp_only_layers 'none': a list of layer numbers"),
    ({"model_type": "mixtral", "num_experts_per_tok": 9}, "num_experts_per_tok 9 with 8 routed experts"),
    ({"model_type": "olmo"}, "model_type 'olmo' is not modelled; allowed: llama, mistral")])
def test_bad_moe_hf_configs(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps({**HF["Mixtral-8x7B"], **change}))
    with pytest.raises(ConfigError) as e:
        load_hf_config(tmp_path / "config.json")
    assert needle in e.value.message, e.value.message


# -- the replica's layout --------------------------------------------------------------------------------------------
def moe_scenario(model: str, hardware: str, **parallel) -> dict:
    return scenario(model=model, hardware=hardware, parallel=parallel, serving={"max_model_len": 8192})


def test_weights_a_device_holds():
    tp = plan_of(moe_scenario("DeepSeek-V3", "H200", tensor_parallel_size=8))
    ep = plan_of(moe_scenario("DeepSeek-V3", "H200", data_parallel_size=8, enable_expert_parallel=True))
    m, p = tp.model, moe.decoder_params(tp.model)
    routed = p.routed * m.bytes_per_linear_param()
    # experts: a slice of each over TP, or 32 whole ones over EP; attention and dense layers whole on each DP rank
    whole = p.router + p.norms + m.num_layers * moe.replicated_attention_params(m)  # on every TP rank (vLLM)
    assert tp.weight_bytes == pytest.approx(m.weight_bytes / 8 + whole * 7 / 8 * m.bytes_per_linear_param())
    assert ep.weight_bytes - routed / 8 == pytest.approx((p.dense) * m.bytes_per_linear_param()
                                                         + 2 * m.embedding_params * 2)
    mixtral_tp = plan_of(moe_scenario("Mixtral-8x7B", "H100-SXM", tensor_parallel_size=2))
    mixtral_ep = plan_of(moe_scenario("Mixtral-8x7B", "H100-SXM", tensor_parallel_size=2, enable_expert_parallel=True))
    assert mixtral_ep.weight_bytes == pytest.approx(mixtral_tp.weight_bytes)  # 4 whole experts or half of each


def test_a_data_parallel_replica_runs_its_ranks_batches_as_one_engine():
    one = plan_of(moe_scenario("Qwen3-30B-A3B", "H100-SXM", tensor_parallel_size=2, enable_expert_parallel=True))
    four = plan_of(moe_scenario("Qwen3-30B-A3B", "H100-SXM", tensor_parallel_size=2, data_parallel_size=4,
                                enable_expert_parallel=True))
    assert four.devices_per_replica == 8 and four.scheduler.max_num_seqs == 4 * one.scheduler.max_num_seqs
    assert four.num_blocks > 3 * one.num_blocks  # each rank's KV (its experts are a quarter of one's)
    assert four.scheduler.prefill_chunk_size == one.scheduler.prefill_chunk_size


def test_without_expert_parallelism_data_parallel_ranks_slice_every_expert_over_all_devices():
    # vLLM's FusedMoEParallelConfig.make: MoE tp_size = DP × TP, ep_size 1
    one = plan_of(moe_scenario("Qwen3-30B-A3B", "H100-SXM", tensor_parallel_size=2))
    four = plan_of(moe_scenario("Qwen3-30B-A3B", "H100-SXM", tensor_parallel_size=2, data_parallel_size=4))
    ep = plan_of(moe_scenario("Qwen3-30B-A3B", "H100-SXM", tensor_parallel_size=2, data_parallel_size=4,
                              enable_expert_parallel=True))
    routed = moe.decoder_params(one.model).routed * one.model.bytes_per_linear_param()
    assert four.expert_layout.expert_slices == 8 and one.expert_layout.expert_slices == 2
    assert one.weight_bytes - four.weight_bytes == pytest.approx(routed / 2 - routed / 8)  # a quarter of the experts
    assert four.weight_bytes == pytest.approx(ep.weight_bytes)  # 1/8 of each expert or 16 whole of 128: same bytes
    assert four.num_blocks == ep.num_blocks > 4 * one.num_blocks  # 4 ranks' KV, each with more room than one's


def test_a_model_whose_rank_could_not_hold_it_whole_fits_with_its_experts_sliced_over_the_ranks():
    dp = plan_of(moe_scenario("DeepSeek-V3", "H200", data_parallel_size=8))  # 671B in fp8: once refused on 141 GB
    assert dp.weight_bytes < dp.model.weight_bytes / 6  # a rank no longer holds the whole model (625 GiB)
    assert dp.weight_bytes / 2**30 == pytest.approx(93.8, abs=0.1) and dp.num_blocks > 0


@pytest.mark.parametrize("model, hardware, parallel, where, needle", [
    ("Llama-3-8B", "H100-SXM", {"enable_expert_parallel": True}, "parallel.enable_expert_parallel", "is dense"),
    ("Mixtral-8x7B", "H100-SXM", {"tensor_parallel_size": 2, "data_parallel_size": 3, "enable_expert_parallel": True},
     "parallel.data_parallel_size", "expert-parallel size 6"),
    ("DeepSeek-V3", "H100-SXM", {"data_parallel_size": 8}, "parallel.data_parallel_size",
     "each of the 8 data-parallel ranks holds DeepSeek-V3's attention and dense layers"),
    ("Llama-3-70B", "H100-SXM", {"data_parallel_size": 2}, "parallel.data_parallel_size",
     "each of the 2 data-parallel ranks holds all of Llama-3-70B"),
    ("Mixtral-8x7B", "H100-SXM", {"data_parallel_size": 3}, "parallel.data_parallel_size",
     "does not divide the experts' width 14336 of Mixtral-8x7B"),
    ("Mixtral-8x7B", "H100-SXM", {"data_parallel_size": 2, "pipeline_parallel_size": 2},
     "parallel.data_parallel_size", "pipeline stages")])
def test_bad_layouts_are_one_line_errors(model, hardware, parallel, where, needle):
    with pytest.raises(ConfigError) as e:
        plan_of(moe_scenario(model, hardware, **parallel))
    assert e.value.key_path == where and needle in e.value.message, e.value.one_line()


@pytest.mark.parametrize("text, where, needle", [
    ("model: {base: Mixtral-8x7B, num_experts_per_tok: 9}\nhardware: H100-SXM\nparallel: {tensor_parallel_size: 2}\n",
     "model", "num_experts_per_tok 9 with 8 routed experts"),
    ("model: Qwen3-30B-A3B\nhardware: H100-SXM\nparallel: {tensor_parallel_size: 3, enable_expert_parallel: true}\n",
     "parallel.tensor_parallel_size", "does not divide the 32 attention heads"),
    ("model: Mixtral-8x7B\nhardware: H100-SXM\nparallel: {tensor_parallel_size: 2, data_parallel_size: 3, "
     "enable_expert_parallel: true}\n", "parallel.data_parallel_size", "does not divide the 8 experts"),
    ("model: Llama-3-8B\nhardware: H100-SXM\nparallel: {enable_expert_parallel: true}\n",
     "parallel.enable_expert_parallel", "is dense"),
    ("model: Mixtral-8x7B\nhardware: H100-SXM\nparallel: {data_parallel_size: 3}\n", "parallel.data_parallel_size",
     "does not divide the experts' width 14336")])
def test_bad_moe_scenarios_exit_2_with_one_line(tmp_path, text, where, needle):
    from tests.cli_runner import run_cli

    path = tmp_path / "s.yaml"
    path.write_text(text + "workload: {arrival: {process: poisson, rate: 1}, num_requests: 2, "
                           "prompt_len: {dist: fixed, value: 8}, output_len: {dist: fixed, value: 8}}\n")
    r = run_cli(["run", str(path), "-q", "--no-plots", "--out", str(tmp_path / "out")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"{path}: {where}: " in lines[0] and needle in lines[0], lines[0]

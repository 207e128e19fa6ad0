"""Bad configs of each new layer kind (sliding window, chunked local, linear attention, FP4 weights, the hybrid KV
cache manager): every case exits 2 with one line naming the file and the key, through the CLI in-process, as
tests/test_bad_input*.py run theirs."""
from __future__ import annotations

import json

import pytest

from tests.test_bad_input_more import invoke, one_line_error, write

WORKLOAD = {"seed": 0, "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 3,
            "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8}}
SMALL = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
         "vocab_size": 1000}
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}
TYPES = ["linear_attention"] * 3 + ["full_attention"]


def run_scenario(tmp_path, model, hardware="H100-SXM", **sections):
    data = {"name": "layers", "model": model, "hardware": hardware, "workload": WORKLOAD, **sections}
    path = write(tmp_path / "s.yaml", data)
    return path, invoke("run", path, "-q", "--no-plots")


SPEC_CASES = {
    "layer-types-length": ({**SMALL, "layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
    "layer-type-unknown": ({**SMALL, "layer_types": ["global_attention"] * 4}, "model.layer_types"),
    "sliding-without-window": ({**SMALL, "layer_types": ["sliding_attention", "full_attention"] * 2},
                               "sliding_window missing"),
    "window-zero": ({**SMALL, "sliding_window": 0}, "model.sliding_window"),
    "window-without-layers": ({**SMALL, "layer_types": ["full_attention"] * 4, "sliding_window": 128},
                              "sliding_window 128 without sliding_attention layers"),
    "chunked-without-size": ({**SMALL, "layer_types": ["chunked_attention"] * 3 + ["full_attention"]},
                             "attention_chunk_size missing"),
    "linear-without-keys": ({**SMALL, "layer_types": TYPES, "linear_num_key_heads": 2},
                            "linear_num_value_heads missing"),
    "linear-keys-stray": ({**SMALL, **LINEAR}, "linear_num_key_heads without linear_attention layers"),
    "linear-heads-uneven": ({**SMALL, **LINEAR, "layer_types": TYPES, "linear_num_value_heads": 3},
                            "linear_num_key_heads (2) must divide linear_num_value_heads (3)"),
    "mla-with-windows": ({**SMALL, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
                          "v_head_dim": 32, "layer_types": ["sliding_attention"] * 4, "sliding_window": 64},
                         "with latent attention"),
    "expert-dtype-dense": ({**SMALL, "expert_weight_dtype": "mxfp4"}, "expert_weight_dtype mxfp4 without routed"),
    "weight-dtype-fp3": ({**SMALL, "weight_dtype": "fp3"}, "model.weight_dtype"),
    "layer-norms-0": ({**SMALL, "layer_norms": 0}, "model.layer_norms"),
}


@pytest.mark.parametrize("model, needle", list(SPEC_CASES.values()), ids=list(SPEC_CASES))
def test_bad_layer_specs(tmp_path, model, needle):
    path, r = run_scenario(tmp_path, model)
    one_line_error(r, path, needle)


PLAN_CASES = {
    "static-batching": ("gpt-oss-20b", {"serving": {"batching": "static"}}, "serving.batching"),
    "contiguous": ("gpt-oss-20b", {"kv_cache": {"allocator": "contiguous"}, "serving": {"max_model_len": 4096}},
                   "kv_cache.allocator"),
    "prefix-with-linear-unchunked": ("Qwen3-Next-80B-A3B", {"kv_cache": {"enable_prefix_caching": True},
                                                            "serving": {"enable_chunked_prefill": False,
                                                                        "max_model_len": 8192},
                                                            "parallel": {"tensor_parallel_size": 4}},
                                     "serving.enable_chunked_prefill"),
    "prefix-with-linear-small-chunk": ("Qwen3-Next-80B-A3B", {"kv_cache": {"enable_prefix_caching": True},
                                                              "serving": {"enable_chunked_prefill": True,
                                                                          "prefill_chunk_size": 256},
                                                              "parallel": {"tensor_parallel_size": 4}},
                                       "serving.prefill_chunk_size"),
    "speculative-with-linear": ("Qwen3-Next-80B-A3B", {"parallel": {"tensor_parallel_size": 4},
                                                       "speculative": {"method": "ngram", "acceptance_rate": 0.5}},
                                "speculative"),
    "linear-heads-over-tp": ({"base": "Qwen3-Next-80B-A3B", "linear_num_key_heads": 6, "linear_num_value_heads": 12,
                              "num_heads": 24, "num_kv_heads": 8}, {"parallel": {"tensor_parallel_size": 8}},
                             "parallel.tensor_parallel_size"),
}


@pytest.mark.parametrize("model, sections, key", list(PLAN_CASES.values()), ids=list(PLAN_CASES))
def test_bad_hybrid_plans(tmp_path, model, sections, key):
    path, r = run_scenario(tmp_path, model, "H200", **sections)
    one_line_error(r, path, key)


HF_CASES = {
    "gpt-oss-without-window": ({"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
                                "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window missing"),
    "qwen3-next-without-linear-dims": ({"model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 64, "full_attention_interval": 2},
                                       "linear_num_key_heads missing"),
    "qwen3-next-interval-text": ({"model_type": "qwen3_next", "full_attention_interval": "4"},
                                 "full_attention_interval '4'"),
    "llama4-no-text-config": ({"model_type": "llama4"}, "text_config missing"),
    "llama4-short-no-rope-layers": ({"model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1,
                                     "no_rope_layers": [1]}, "no_rope_layers has 1 entries"),
    "layer-types-not-a-list": ({"model_type": "qwen3", "layer_types": "full_attention"}, "layer_types 'full"),
    "nvfp4-unserved": ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
                       "model.weight_dtype nvfp4"),
}


@pytest.mark.parametrize("change, needle", list(HF_CASES.values()), ids=list(HF_CASES))
def test_bad_hf_configs_of_new_families(tmp_path, change, needle):
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "bfloat16", **change}
    write(tmp_path / "ckpt" / "config.json", json.dumps(config))
    path, r = run_scenario(tmp_path, {"hf_config": "ckpt"}, "cpu")
    one_line_error(r, path, "model.hf_config", needle)


TINY = {**SMALL, "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
EXECUTOR_CASES = {
    "sliding-window": {**TINY, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16},
    "linear-attention": {**SMALL, **LINEAR, "layer_types": TYPES},
    "chunked-local": {**SMALL, "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
                      "attention_chunk_size": 64},
    "mla": {**SMALL, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32},
    "sinks": {**SMALL, "attention_sinks": True},
    "mxfp4-experts": {**TINY, "weight_dtype": "bf16", "expert_weight_dtype": "mxfp4"},
}


@pytest.mark.parametrize("model", list(EXECUTOR_CASES.values()), ids=list(EXECUTOR_CASES))
def test_the_executor_serves_every_layer_kind(tmp_path, model):
    """Each kind runs on the executor's hybrid model (executor/model/hybrid.py), random weights, three requests."""
    workload = {**WORKLOAD, "arrival": {"process": "poisson", "rate": 100.0}}  # a serve replays arrivals in real time
    data = {"name": "layers", "model": model, "hardware": "cpu", "workload": workload,
            "executor": {"random_weights": True, "threads": 1}, "serving": {"max_model_len": 256},
            "kv_cache": {"num_blocks": 64}}
    path = write(tmp_path / "s.yaml", data)
    r = invoke("serve", path, "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output[-800:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["requests"]["completed"] == 3


REFUSED = {  # (model, other sections, the key the error names)
    "gemma-norms": ({**SMALL, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16,
                     "layer_norms": 4}, {}, "model"),
    "nvfp4": ({**TINY, "weight_dtype": "nvfp4"}, {}, "model"),
    "dense-mlp-bias": ({**SMALL, "mlp_bias": True}, {}, "model"),
    "hybrid-tp": ({**SMALL, "attention_sinks": True}, {"parallel": {"tensor_parallel_size": 2}}, "parallel"),
    "hybrid-int8": ({**SMALL, **LINEAR, "layer_types": TYPES, "weight_dtype": "int8"}, {}, "model.weight_dtype"),
}


@pytest.mark.parametrize("case", list(REFUSED.values()), ids=list(REFUSED))
def test_the_executor_refuses_what_it_cannot_run_in_one_line(tmp_path, case):
    model, sections, key = case
    data = {"name": "layers", "model": model, "hardware": "cpu", "workload": WORKLOAD,
            "executor": {"random_weights": True}, **sections}
    path = write(tmp_path / "s.yaml", data)
    one_line_error(invoke("serve", path, "-q"), path, key, "the executor")

"""Layer kinds in the model spec (sim/config/layers.py) and config.json by family (sim/config/hf_config.py): each
family's real config reads as its published size and layer pattern, the new catalog entries are their config.json,
and the published memory behaviour of each kind: gpt-oss-120b's KV bytes a token and the sequences one H100 holds,
Qwen3-Next's state flat in the context, Llama-4's chunked-local layers."""
from __future__ import annotations

import json

import pytest

from sim.config import layers
from sim.config.hf_config import load_hf_config
from sim.config.models import MODEL_CATALOG, ModelSpec
from sim.policy.build import make_allocator
from sim.policy.request import Request
from tests.helpers import plan_of, run, scenario

# config.json of each family's widely served model, transcribed from huggingface.co (the fields the spec reads; the
# rest, tokens ids and rope scaling, left out). Each with its published total parameters (billions, as written).
ALTERNATE = ["sliding_attention", "full_attention"]
HF = {
    # Qwen/Qwen3-8B, Qwen/Qwen3-32B: 8.2B, 32.8B
    "Qwen3-8B": ({"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
                  "max_position_embeddings": 40960, "rope_theta": 1000000, "attention_bias": False,
                  "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "8.2"),
    "Qwen3-32B": ({"model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "rope_theta": 1000000, "attention_bias": False,
                   "sliding_window": None, "use_sliding_window": False, "max_window_layers": 64,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "32.8"),
    # openai/gpt-oss-120b, gpt-oss-20b: 116.83B, 20.91B (the model card's table)
    **{name: ({"model_type": "gpt_oss", "num_hidden_layers": n, "hidden_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "vocab_size": 201088,
               "max_position_embeddings": 131072, "rope_theta": 150000, "attention_bias": True,
               "num_local_experts": experts, "num_experts_per_tok": 4, "experts_per_token": 4,
               "layer_types": ALTERNATE * (n // 2), "sliding_window": 128, "swiglu_limit": 7.0,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}},
              total)
       for name, n, experts, total in (("gpt-oss-120b", 36, 128, "116.83"), ("gpt-oss-20b", 24, 32, "20.91"))},
    # Qwen/Qwen3-Next-80B-A3B-Instruct: 80B (79B non-embedding)
    "Qwen3-Next-80B-A3B": ({"model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048,
                            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                            "intermediate_size": 5120, "vocab_size": 151936, "max_position_embeddings": 262144,
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
                            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
                            "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                            "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
                            "norm_topk_prob": True, "use_sliding_window": False, "tie_word_embeddings": False,
                            "torch_dtype": "bfloat16"}, "80"),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct, Llama-4-Maverick-17B-128E-Instruct: 109B and 400B with their vision
    # encoders (about 1B: the text models 107.8B and 400.7B); their text_config
    **{name: ({"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "vocab_size": 202048, "max_position_embeddings": max_pos, "rope_theta": 500000.0,
        "attention_chunk_size": 8192, "num_local_experts": experts, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": step, "use_qk_norm": step == 1, "attention_bias": False,
        "tie_word_embeddings": False}}, total)
       for name, experts, step, max_pos, total in (("Llama-4-Scout", 16, 1, 10485760, "107.8"),
                                                   ("Llama-4-Maverick", 128, 2, 1048576, "400.7"))},
    # moonshotai/Kimi-K2-Instruct (deepseek_v3-shaped, fp8 blocks): 1T (1.03T)
    "Kimi-K2": ({"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64,
                 "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                 "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
                 "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                 "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 163840, "max_position_embeddings": 131072,
                 "rope_theta": 50000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
                 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}}, "1026"),
}
# families with no catalog entry: google/gemma-2-9b (9.24B), google/gemma-3-27b-it (its text model, 27.0B; 27.4B
# with vision), microsoft/Phi-3-mini-4k-instruct (3.82B), Qwen/Qwen2.5-7B-Instruct (7.61B),
# mistralai/Mistral-7B-v0.1 (7.24B)
FAMILIES = {
    "gemma2": ({"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584, "num_attention_heads": 16,
                "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
                "max_position_embeddings": 8192, "rope_theta": 10000.0, "sliding_window": 4096,
                "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32"},
               "9.24", {"sliding_window": 21, "full": 21}, 4096),
    "gemma3": ({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504, "query_pre_attn_scalar": 168,
        "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}},
               "27.0", {"sliding_window": 52, "full": 10}, 1024),
    "phi3": ({"model_type": "phi3", "num_hidden_layers": 32, "hidden_size": 3072, "num_attention_heads": 32,
              "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
              "max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 2047,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "3.82", {"sliding_window": 32}, 2047),
    "qwen2": ({"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
               "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
               "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": 131072,
               "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}, "7.61", {"full": 28}, None),
    "mistral": ({"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                 "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "7.24", {"sliding_window": 32}, 4096),
}


def read(tmp_path, config: dict) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_hf_config(tmp_path / "config.json")


def within(count: int, written: str) -> bool:
    return abs(count / 1e9 - float(written)) <= max(0.01 * float(written), 10.0 ** -len(written.partition(".")[2]))


@pytest.mark.parametrize("name", list(HF))
def test_config_json_reads_as_the_catalog_entry(tmp_path, name):
    config, total = HF[name]
    spec, ref = read(tmp_path, config), MODEL_CATALOG[name]
    assert spec.model_dump(exclude={"name"}) == ref.model_dump(exclude={"name"})
    assert within(ref.num_params, total), ref.num_params


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_reads_its_size_and_layer_pattern(tmp_path, family):
    config, total, kinds, window = FAMILIES[family]
    spec = read(tmp_path, config)
    assert within(spec.num_params, total), spec.num_params
    assert dict(layers.kind_counts(spec)) == kinds and spec.sliding_window == window


def test_gemma_and_qwen3_next_layer_order():
    gemma3 = ModelSpec(**{**MODEL_CATALOG["Qwen3-8B"].model_dump(), "num_layers": 12, "sliding_window": 1024,
                          "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2})
    assert [layer.attention.kind for layer in gemma3.layers[:6]] == ["sliding_window"] * 5 + ["full"]
    nxt = MODEL_CATALOG["Qwen3-Next-80B-A3B"]
    assert [layer.attention.kind for layer in nxt.layers[:4]] == ["linear"] * 3 + ["full"]  # HF: (i + 1) % 4
    runs = layers.layer_runs(nxt.layers)
    assert len(runs) == 24 and [n for _, n in runs[:2]] == [3, 1]  # the compact form
    scout, maverick = MODEL_CATALOG["Llama-4-Scout"], MODEL_CATALOG["Llama-4-Maverick"]
    assert [layer.attention.kind for layer in scout.layers[:4]] == ["chunked_local"] * 3 + ["full"]
    assert [layer.ffn.kind for layer in maverick.layers[:4]] == ["dense", "moe"] * 2
    assert all(layer.ffn.kind == "moe" for layer in scout.layers)


def test_published_parameters_of_the_new_entries():
    """Totals and active counts as published: OpenAI's active figures count the LM head and not the embedding
    (5.13B and 3.61B); Llama-4's 17B active counts both; Qwen3-Next's "3B activated" neither (3.25B)."""
    m = MODEL_CATALOG
    emb = {name: m[name].embedding_params for name in m}
    assert within(m["gpt-oss-120b"].active_params - emb["gpt-oss-120b"], "5.13")
    assert within(m["gpt-oss-20b"].active_params - emb["gpt-oss-20b"], "3.61")
    assert within(m["Llama-4-Scout"].active_params, "17") and within(m["Llama-4-Maverick"].active_params, "17")
    assert within(m["Qwen3-Next-80B-A3B"].active_params - 2 * emb["Qwen3-Next-80B-A3B"], "3")
    assert within(m["Kimi-K2"].active_params, "32")
    # the model card's parts: MLP 114.71B, attention 0.96B, embedding + unembedding 1.16B
    parts = m["gpt-oss-120b"].decoder_parts
    assert within(parts.routed + parts.router, "114.71") and within(parts.attention, "0.96")


def test_weight_bytes_by_dtype():
    """gpt-oss: MXFP4 experts (4.25 bits a weight: a byte of scale per 32) beside bf16 attention, router and
    embeddings, as the checkpoint ships them (~61 GiB, the card's "fits a single 80 GB GPU")."""
    m = MODEL_CATALOG["gpt-oss-120b"]
    parts = m.decoder_parts
    expected = parts.routed * 4.25 / 8 + (m.linear_params - parts.routed) * 2 + 2 * m.embedding_params * 2
    assert m.weight_bytes == pytest.approx(expected) and 60 < m.weight_bytes / 2**30 < 62
    nvfp4 = ModelSpec(**{**MODEL_CATALOG["Qwen3-8B"].model_dump(), "weight_dtype": "nvfp4"})
    assert nvfp4.weight_bytes == pytest.approx(nvfp4.linear_params * 4.5 / 8 + 2 * nvfp4.embedding_params * 2)
    assert nvfp4.act_dtype == "bf16"


# -- published memory behaviour ------------------------------------------------------------------------------------------
def held_at(kv, context: int) -> list[int]:
    """Blocks each kind's groups hold for one sequence decoding at `context` tokens (fresh, as after a swap-in)."""
    r = Request(0, 0.0, context, 1)
    r.num_computed = context
    kv.allocate(r, context + 1)
    used = list(kv.used)
    kv.free(r)
    return used


def gpt_oss_plan(model="gpt-oss-120b", **kv):
    return plan_of(scenario(model=model, hardware="H100-SXM", serving={"max_model_len": 8192}, kv_cache=kv))


def test_gpt_oss_kv_bytes_a_token_and_the_window():
    """36 layers of 8 KV heads × 64 dims, half of them a 128-token window: 2 × 8 × 64 × 2 bytes = 2 KiB a token and
    layer; the 18 full layers grow 36 KiB a token, the 18 sliding ones stop at 128 tokens (4.5 MiB a sequence)."""
    m = MODEL_CATALOG["gpt-oss-120b"]
    full, sliding = m.layers[1].attention, m.layers[0].attention
    assert layers.kv_bytes_per_token(m, full) == 2 * 8 * 64 * 2 == 2048
    assert m.kv_bytes_per_token == 36 * 2048  # every caching layer at a full layer's K/V (the cost side bounds the windows)
    for context in (100, 128, 10_000, 100_000):
        assert layers.decode_read_bytes(m, full, context) == context * 2048
        assert layers.decode_read_bytes(m, sliding, context) == min(context, 128) * 2048
    plan = gpt_oss_plan()
    g = plan.kv_groups
    assert (g.group_size, g.block_size, g.block_bytes) == (18, 16, 18 * 16 * 2048)
    assert g.bytes_per_token_by_kind() == {"sliding_window": 18 * 2048, "full": 18 * 2048}
    kv = make_allocator(plan)
    for context in (1000, 8000):  # past the window the sliding group holds 9 blocks, the full group all
        assert held_at(kv, context) == [-(-(context + 1) // 16) - max(0, context - 127) // 16, -(-(context + 1) // 16)]
        assert held_at(kv, context)[0] <= 9


def test_sequences_one_h100_holds_against_a_dense_model_of_the_same_active_size():
    """gpt-oss-120b on one H100: ~61 GiB of weights leave ~10.5 GiB of KV; an 8k-token sequence holds 512 + 8
    blocks of 18 layers (288 + 4.5 MiB), so 36 fit (18 if the window were not freed). A dense model of its active
    size (gpt-oss's attention, one SwiGLU of 11,584: 5.7B like gpt-oss's 5.71B) keeps 10.6 GiB of weights and 61 GiB
    of KV, every layer full: 107 sequences of 8k. The experts' memory, not the KV, bounds gpt-oss's batch."""
    plan = gpt_oss_plan()
    gpt_seqs = plan.num_blocks // sum(held_at(make_allocator(plan), 8191))
    assert held_at(make_allocator(plan), 8191) == [8, 512] and gpt_seqs == 36
    oss = MODEL_CATALOG["gpt-oss-120b"]
    dense = ModelSpec(name="dense-5.7B", num_layers=36, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                      intermediate_size=11584, vocab_size=201088, max_position_embeddings=131072, weight_dtype="bf16")
    assert dense.active_params == pytest.approx(oss.active_params, rel=0.01)
    dplan = plan_of(scenario(model=dense.model_dump(), hardware="H100-SXM", serving={"max_model_len": 8192}))
    assert dplan.kv_groups is None and dplan.kv_bytes_per_token == oss.kv_bytes_per_token
    dense_seqs = dplan.num_blocks // 512
    assert dense_seqs == 107 and dense_seqs > 2.5 * gpt_seqs
    # an 8k sequence's KV: gpt-oss 51% of the dense twin's (its sliding layers hold 8 blocks, not 512)
    assert (512 + 8) * plan.block_bytes / (512 * dplan.block_bytes) == pytest.approx(520 / 1024)


def test_qwen3_next_state_is_flat_in_the_context():
    """Qwen3-Next at TP 4: a Gated DeltaNet layer's state on a rank is (3 × 2,048 conv + 8 × 128 × 128 recurrent) ×
    2 bytes = 274,432 bytes, whatever the context; vLLM raises the attention block to 272 tokens so its page (272 × 2
    × 256 × 2 bytes on the rank's KV head) holds one. A sequence keeps 3 state blocks (36 layers in groups of 12) and
    the 12 full layers' blocks, 1 per 272 tokens."""
    plan = plan_of(scenario(model="Qwen3-Next-80B-A3B", hardware="H100-SXM", parallel={"tensor_parallel_size": 4},
                            serving={"max_model_len": 131072}))
    g = plan.kv_groups
    assert g.state_bytes == (3 * 2048 + 8 * 128 * 128) * 2 == 274_432 and g.block_size == 272
    assert g.page_bytes == 272 * 2 * 256 * 2 and g.group_size == 12
    kv = make_allocator(plan)
    for context in (1_000, 32_000, 130_000):
        assert held_at(kv, context) == [3, -(-(context + 1) // 272)]
    assert layers.decode_read_bytes(plan.model, layers.Attention("linear"), 100_000) == \
        layers.decode_read_bytes(plan.model, layers.Attention("linear"), 10) == 4 * 274_432


def test_llama4_chunked_local_layers_hold_the_current_chunk():
    """Llama-4 Scout: 36 of 48 layers attend their 8,192-token chunk; at 100k tokens a sequence's chunked groups hold
    the current chunk's 107 blocks each (3 groups of 12 layers), the full group all 6,251: 6,572 blocks against
    25,004 were every layer full."""
    plan = plan_of(scenario(model="Llama-4-Scout", hardware="H200", parallel={"tensor_parallel_size": 8},
                            serving={"max_model_len": 131072}))
    kv = make_allocator(plan)
    assert held_at(kv, 100_000) == [3 * 107, 6251] and 4 * 6251 == 25_004
    m = MODEL_CATALOG["Llama-4-Scout"]
    chunked = m.layers[0].attention
    assert layers.attended_tokens(chunked, 8192) == 8192 and layers.attended_tokens(chunked, 8193) == 1
    assert layers.decode_read_bytes(m, chunked, 100_000) == (100_000 - 12 * 8192) * 2 * 8 * 128 * 2


def test_the_report_shows_bytes_by_layer_type_and_blocks_by_group():
    report, _, _ = run(scenario(model="gpt-oss-20b", hardware="H100-SXM", serving={"max_model_len": 8192}))
    kv = report["kv_cache"]
    assert kv["bytes_per_token_by_layer_type"] == {"sliding_window": 12 * 2048, "full": 12 * 2048}
    assert kv["layers_per_group"] == 12 and kv["block_bytes"] == 12 * 16 * 2048
    groups = kv["groups"]
    assert groups["sliding_window"]["window"] == 128 and groups["full"]["groups"] == 1
    assert 0 < groups["sliding_window"]["peak_blocks"] < groups["full"]["peak_blocks"]
    assert report["memory_gib"]["kv_cache"] == pytest.approx(kv["num_blocks"] * kv["block_bytes"] / 2**30)
    assert report["requests"]["completed"] == report["requests"]["arrived"]

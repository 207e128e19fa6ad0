"""A scenario's model spec (sim.config.models.ModelSpec) as the executor's model config, and back.

`model_config(spec)` is what `executor.random_weights` builds for a spec: a LlamaConfig where every layer is full
attention without sinks, biases or gates (the llama-family model, executor/model/llama.py), else a HybridConfig
(executor/model/hybrid.py) whose family follows the spec's parts: latent attention → DeepSeek-V2's, linear layers →
Qwen3-Next's (zero-centred norms), sinks or expert biases → gpt-oss's (router over the top-k logits, clamped SwiGLU),
anything else (a plain sliding-window or chunked model) the spec's parts as they are. `model_spec(config)` is the
inverse the tests and the profile sweep use to plan a twin's KV groups.
"""
from __future__ import annotations

from executor.model.hybrid import HybridConfig
from executor.model.llama import LlamaConfig
from sim.config.errors import ConfigError
from sim.config.layers import kind_counts
from sim.config.models import ModelSpec
from sim.config.moe import shared_width

# ModelSpec keys a HybridConfig carries under the same name
_SAME = ("sliding_window", "attention_chunk_size", "linear_num_key_heads", "linear_num_value_heads",
         "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "q_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias", "qkv_bias", "mlp_bias",
         "attention_sinks", "attn_output_gate")


def needs_hybrid(spec: ModelSpec) -> bool:
    """Whether the llama-family model cannot hold the spec: another attention kind, sinks, biases or gates."""
    return bool(set(kind_counts(spec)) - {"full"} or spec.attention_sinks or spec.attn_output_gate
                or spec.attention_bias or spec.qkv_bias or spec.mlp_bias)


def family_of(spec: ModelSpec) -> str:
    if spec.kv_lora_rank:
        return "deepseek_v2"
    if "linear" in kind_counts(spec):
        return "qwen3_next"
    return "gpt_oss" if spec.attention_sinks or spec.mlp_bias else "custom"


def model_config(spec: ModelSpec) -> LlamaConfig:
    """The executor's config of a spec (see the module docstring)."""
    m = spec
    common = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                  num_kv_heads=m.num_kv_heads, head_dim=m.head_size, intermediate_size=m.intermediate_size,
                  vocab_size=m.vocab_size, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
                  max_position_embeddings=m.max_position_embeddings, num_experts=m.num_experts,
                  num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
                  shared_expert_intermediate_size=shared_width(m) if m.num_experts else 0,
                  shared_expert_gate=m.shared_expert_gate, norm_topk_prob=m.norm_topk_prob,
                  first_k_dense_replace=m.first_k_dense_replace, decoder_sparse_step=m.decoder_sparse_step,
                  mlp_only_layers=tuple(m.mlp_only_layers), qk_norm=m.qk_norm)
    if not needs_hybrid(m) and not m.kv_lora_rank:
        return LlamaConfig(**common)
    family = family_of(m)
    extra = {k: getattr(m, k) for k in _SAME}
    extra.update(family=family, layer_types=tuple(m.layer_types or ()), kv_lora_rank=m.kv_lora_rank or 0,
                 norm_offset=family == "qwen3_next", rope_interleaved=family == "deepseek_v2")
    if m.layer_types is None and m.sliding_window:  # every layer sliding (Mistral v0.1, Phi-3)
        extra["layer_types"] = ("sliding_attention",) * m.num_layers
    if family == "gpt_oss" and m.num_experts:
        extra.update(router="topk_softmax", expert_act="clamped_swiglu")
    if family == "deepseek_v2":
        extra.update(router="deepseek", head_dim=(m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0))
    return HybridConfig(**{**common, **extra})


def model_spec(config: LlamaConfig, name: str = "twin", weight_dtype: str = "fp32") -> ModelSpec:
    """The model spec of an executor config (its KV groups, memory and costs as the simulator plans them)."""
    c = config
    fields = dict(name=name, num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                  vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
                  weight_dtype=weight_dtype, tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope_theta,
                  num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                  moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                  first_k_dense_replace=c.first_k_dense_replace, decoder_sparse_step=c.decoder_sparse_step,
                  mlp_only_layers=list(c.mlp_only_layers), qk_norm=c.qk_norm,
                  shared_expert_intermediate_size=c.shared_expert_intermediate_size or None,
                  shared_expert_gate=c.shared_expert_gate)
    if isinstance(c, HybridConfig):
        fields.update({k: (None if getattr(c, k) == 0 and type(getattr(c, k)) is int else getattr(c, k))
                       for k in _SAME})  # 0: the part is absent
        if c.layer_types and not c.kv_lora_rank:
            fields["layer_types"] = list(c.layer_types)
        if c.kv_lora_rank:
            fields.update(kv_lora_rank=c.kv_lora_rank, head_dim=None)
    return ModelSpec(**{k: v for k, v in fields.items() if v is not None})


# weight dtypes the executor computes in or dequantizes from; MXFP4 experts are expanded at load (executor/model/mxfp4.py)
EXECUTED_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
EXECUTED_EXPERT_DTYPES = (*EXECUTED_DTYPES, "mxfp4")


def check_executable(plan) -> None:
    """A one-line ConfigError for what the executor cannot run of a plan's model: Gemma's four norms a layer, biases on
    a dense MLP, FP4 weights but MXFP4 experts; and what a hybrid model (another attention kind, sinks, biases, gates,
    latent attention) does not run with: parallel layouts, speculative decoding, compressed weights or KV."""
    m = plan.model
    dtypes = sorted({m.weight_dtype} - set(EXECUTED_DTYPES) | {m.expert_weight_dtype or "fp32"}
                    - set(EXECUTED_EXPERT_DTYPES))
    what = "4-norm layers (Gemma)" if m.layer_norms != 2 else "biases on a dense MLP" \
        if m.mlp_bias and not m.num_experts else f"{dtypes[0]} weights" if dtypes else None
    if what:
        raise ConfigError(f"the executor's layers have no {what} ({m.name}); allowed: `infersim run` (the simulator "
                          "plans it), or a model without it", "model")
    if not (needs_hybrid(m) or m.kv_lora_rank):
        return
    kinds = ", ".join(sorted(set(kind_counts(m)) | ({"sinks"} if m.attention_sinks else set())))
    parallel = plan.sharding.tp * plan.pipeline_parallel_size > 1
    for refused, key, allowed in ((parallel, "parallel", "one process (tensor and pipeline parallel size 1)"),
                                  (plan.speculative is not None, "speculative", "no speculative section"),
                                  (m.weight_dtype in ("int8", "int4", "fp8") or m.kv_dtype == "int8"
                                   or m.sparsity != "none", "model.weight_dtype",
                                   "fp32 or bf16 weights and KV, no sparsity")):
        if refused:
            raise ConfigError(f"the executor runs {m.name}'s layers ({kinds}) eagerly in one process, uncompressed; "
                              f"allowed: {allowed}", key)


def random_model(spec: ModelSpec, seed: int, device="cpu", dtype=None):
    """The spec's architecture with seeded random weights: the llama-family model (executor.model.tiny's
    initialisation) or a HybridModel (executor.model.families.init_random); MXFP4 experts take MXFP4's values."""
    import torch

    from executor.model import families, mxfp4
    from executor.model.hybrid import HybridModel
    from executor.model.tiny import tiny_model

    config = model_config(spec)
    if not isinstance(config, HybridConfig):
        return tiny_model(seed=seed, config=config, device=device, dtype=dtype)
    with torch.device(device):
        model = families.init_random(HybridModel(config), seed)
    if spec.expert_weight_dtype == "mxfp4":  # the experts' values rounded to MXFP4, expanded at load
        mxfp4.pack_experts(model)
        mxfp4.dequantize_experts(model)
    return model if dtype is None else model.to(dtype)

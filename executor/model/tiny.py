"""Tiny random-weight llama models for fast tests, and their transformers twins."""

from __future__ import annotations

import torch

from executor.model.llama import LlamaConfig, LlamaModel


def tiny_config(num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 4,
                head_dim: int | None = None, intermediate_size: int = 128, vocab_size: int = 256,
                rope_theta: float = 10000.0, rope_scaling: dict | None = None, tie_word_embeddings: bool = False,
                max_position_embeddings: int = 512, rms_norm_eps: float = 1e-5, **moe) -> LlamaConfig:
    """A small LlamaConfig; set num_kv_heads < num_heads for GQA, 1 for MQA; `moe`: LlamaConfig's MoE fields
    (num_experts, num_experts_per_tok, ...)."""
    return LlamaConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, **moe,
    )


def llama3_rope_scaling(original_max_position_embeddings: int = 64, factor: float = 8.0) -> dict:
    """A llama3-style rope_scaling dict, shrunk so tiny models exercise all three frequency bands."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max_position_embeddings}


def tiny_model(seed: int = 0, config: LlamaConfig | None = None, attn_backend="sdpa", device: str | None = None,
               dtype: torch.dtype | None = None, **config_overrides) -> LlamaModel:
    """A LlamaModel with seeded random weights scaled so attention is far from uniform. `device`: built and filled
    there (a GPU-sized model never passes through host memory; the values are that device's generator's), then
    cast to `dtype`."""
    config = config or tiny_config(**config_overrides)
    device = torch.device(device or "cpu")
    with device:
        model = LlamaModel(config, attn_backend=attn_backend)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, device=device))
            elif p.dim() >= 2:
                # Embeddings ~N(0,1); linear weights (a MoE block's experts: [experts, out, in]) ~N(0, 1/fan_in)
                # keep activations O(1).
                std = 1.0 if name == "embed_tokens.weight" else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(std))
    return (model if dtype is None else model.to(dtype)).eval()


def to_transformers(model: LlamaModel, attn_implementation: str = "eager", family: str = "llama"):
    """A transformers causal LM (fp32, eval) holding exactly `model`'s weights: LlamaForCausalLM, or for a MoE
    model the `family` "mixtral", "qwen2_moe" or "qwen3_moe" (moe_config)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if family == "llama":
        hf = LlamaForCausalLM(model.config.to_hf()).to(torch.float32)
    else:
        hf = AutoModelForCausalLM.from_config(moe_config(model.config, family)).to(torch.float32)
    hf.config._attn_implementation = attn_implementation
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def moe_config(config: LlamaConfig, family: str):
    """The transformers config of a MoE LlamaConfig: "mixtral" (experts of intermediate_size, no dense layers, no
    shared expert), "qwen2_moe" (no attention biases) or "qwen3_moe" (per-head q/k norms, no shared expert);
    ValueError where the family cannot hold it."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    c = config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
                  eos_token_id=c.eos_token_id, num_experts_per_tok=c.num_experts_per_tok)
    if family == "mixtral":
        dense = [i for i in range(c.num_layers) if not c.is_moe(i)]
        if dense or c.shared_expert_intermediate_size or not c.norm_topk_prob \
                or c.moe_intermediate_size not in (None, c.intermediate_size):
            raise ValueError("a Mixtral config has every layer MoE, experts of intermediate_size, renormalized "
                             "top-k and no shared expert")
        return MixtralConfig(intermediate_size=c.intermediate_size, num_local_experts=c.num_experts,
                             router_jitter_noise=0.0, sliding_window=None, **common)
    if c.qk_norm != (family == "qwen3_moe"):
        raise ValueError("per-head q/k norms are Qwen3-MoE's alone")
    if family == "qwen3_moe":
        if c.first_k_dense_replace or c.shared_expert_intermediate_size:
            raise ValueError("a Qwen3-MoE config has no leading dense layers and no shared expert")
        return Qwen3MoeConfig(intermediate_size=c.intermediate_size, num_experts=c.num_experts,
                              moe_intermediate_size=c.moe_intermediate_size or c.intermediate_size,
                              norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                              mlp_only_layers=list(c.mlp_only_layers), attention_bias=False,
                              use_sliding_window=False, **common)
    if family == "qwen2_moe":
        if c.first_k_dense_replace or bool(c.shared_expert_intermediate_size) != c.shared_expert_gate:
            raise ValueError("a Qwen2-MoE config has no leading dense layers and gates its shared expert")
        return Qwen2MoeConfig(intermediate_size=c.intermediate_size, num_experts=c.num_experts,
                              moe_intermediate_size=c.moe_intermediate_size or c.intermediate_size,
                              shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                              norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                              mlp_only_layers=list(c.mlp_only_layers), qkv_bias=False, use_sliding_window=False,
                              **common)
    raise ValueError(f"unknown MoE family {family!r}; allowed: mixtral, qwen2_moe, qwen3_moe")

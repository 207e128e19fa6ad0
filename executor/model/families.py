"""The hybrid model's families as Hugging Face names them: gpt-oss (`gpt_oss`), Qwen3-Next (`qwen3_next`) and
DeepSeek-V2 (`deepseek_v2`): their config.json fields to and from a HybridConfig, their weights' names and layouts to
and from the model's, seeded random weights, and tiny twins beside transformers' own implementation (the tests'
reference).

What differs from the model's own layout: q, k and v (and gate, up) are fused into one projection here; gpt-oss's
experts are stored [E, H, 2I] with gate and up columns interleaved (ours: [E, 2I, H], gate rows first) and its router
is `mlp.router`; DeepSeek's shared experts are `mlp.shared_experts`.
"""
from __future__ import annotations

import torch

from executor.model.hybrid import HybridConfig, HybridModel

FAMILIES = ("gpt_oss", "qwen3_next", "deepseek_v2")


def _rope(hf) -> tuple[float, dict | None, float]:
    """(theta, the scaling dict or None, partial rotary factor) of a transformers config (v5 rope_parameters)."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
    partial = rope.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    return float(theta), (None if kind == "default" else {"rope_type": kind, **rope}), float(partial)


def from_hf(hf) -> HybridConfig:
    """A HybridConfig from a transformers config of one of FAMILIES (ValueError naming the model_type otherwise)."""
    family = getattr(hf, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not a hybrid family; allowed: {', '.join(FAMILIES)}")
    theta, scaling, partial = _rope(hf)
    eos = getattr(hf, "eos_token_id", None)
    common = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                  num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                  head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                  intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps,
                  rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
                  tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                  max_position_embeddings=hf.max_position_embeddings, bos_token_id=getattr(hf, "bos_token_id", None),
                  eos_token_id=eos, family=family, num_experts_per_tok=hf.num_experts_per_tok or 0)
    extra = {"gpt_oss": _gpt_oss, "qwen3_next": _qwen3_next, "deepseek_v2": _deepseek_v2}[family](hf)
    return HybridConfig(**{**common, **extra})


def _gpt_oss(hf) -> dict:
    return dict(layer_types=tuple(hf.layer_types), sliding_window=hf.sliding_window, attention_sinks=True,
                attention_bias=bool(hf.attention_bias), num_experts=hf.num_local_experts,
                moe_intermediate_size=hf.intermediate_size, router="topk_softmax", expert_act="clamped_swiglu",
                swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)), swiglu_limit=float(hf.swiglu_limit),
                mlp_bias=True)


def _qwen3_next(hf) -> dict:
    return dict(layer_types=tuple(hf.layer_types), attn_output_gate=True, qk_norm=True, norm_offset=True,
                linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
                linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
                linear_conv_kernel_dim=hf.linear_conv_kernel_dim, num_experts=hf.num_experts,
                moe_intermediate_size=hf.moe_intermediate_size,
                shared_expert_intermediate_size=hf.shared_expert_intermediate_size or 0,
                shared_expert_gate=bool(hf.shared_expert_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob),
                decoder_sparse_step=hf.decoder_sparse_step or 1, mlp_only_layers=tuple(hf.mlp_only_layers or ()))


def _deepseek_v2(hf) -> dict:
    # a head's query and key: its non-rotary and rotary parts (transformers' head_dim is the rotary part alone)
    return dict(head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, q_lora_rank=hf.q_lora_rank,
                kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rope_interleaved=True,
                attention_bias=bool(hf.attention_bias), num_experts=hf.n_routed_experts,
                moe_intermediate_size=hf.moe_intermediate_size,
                shared_expert_intermediate_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size,
                first_k_dense_replace=hf.first_k_dense_replace, router="deepseek",
                routed_scaling_factor=float(hf.routed_scaling_factor), topk_method=hf.topk_method or "greedy",
                n_group=hf.n_group or 1, topk_group=hf.topk_group or 1)


def to_hf_config(c: HybridConfig):
    """The transformers config of a HybridConfig of one of FAMILIES."""
    from transformers import DeepseekV2Config, GptOssConfig, Qwen3NextConfig

    rope = {"rope_theta": c.rope_theta, **(c.rope_scaling or {"rope_type": "default"})}
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                  num_experts_per_tok=c.num_experts_per_tok)
    if c.family == "gpt_oss":
        return GptOssConfig(**common, head_dim=c.head_dim, intermediate_size=c.moe_intermediate_size,
                            sliding_window=c.sliding_window, layer_types=list(c.layer_types),
                            num_local_experts=c.num_experts, swiglu_limit=c.swiglu_limit,
                            attention_bias=c.attention_bias, rope_parameters=rope)
    if c.family == "qwen3_next":
        return Qwen3NextConfig(**common, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                               layer_types=list(c.layer_types), rope_parameters={
                                   **rope, "partial_rotary_factor": c.partial_rotary_factor},
                               linear_num_key_heads=c.linear_num_key_heads,
                               linear_num_value_heads=c.linear_num_value_heads,
                               linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
                               linear_conv_kernel_dim=c.linear_conv_kernel_dim, num_experts=c.num_experts,
                               moe_intermediate_size=c.moe_intermediate_size,
                               shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                               norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                               mlp_only_layers=list(c.mlp_only_layers))
    return DeepseekV2Config(**common, intermediate_size=c.intermediate_size, q_lora_rank=c.q_lora_rank,
                            kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                            qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                            n_routed_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
                            n_shared_experts=c.shared_expert_intermediate_size // c.moe_intermediate_size,
                            first_k_dense_replace=c.first_k_dense_replace,
                            routed_scaling_factor=c.routed_scaling_factor, topk_method=c.topk_method,
                            n_group=c.n_group, topk_group=c.topk_group, attention_bias=c.attention_bias,
                            rope_parameters=rope)


# -- weights ------------------------------------------------------------------------------------------------------------
def _halves(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved gate/up columns (last dim) as gate columns, then up columns."""
    return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)


def _interleave(w: torch.Tensor) -> torch.Tensor:
    """The inverse of _halves."""
    gate, up = w.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def hf_to_ours(c: HybridConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state_dict of a family as this model's state_dict."""
    out = {}
    for key, value in sd.items():
        name = key.removeprefix("model.")
        if not _fused(c, name):
            out[_our_name(c, name)] = _our_value(c, name, value)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if c.kind(i) not in ("linear", "mla"):
            for part in ("weight", "bias"):
                if p + f"self_attn.q_proj.{part}" in sd:
                    out[f"layers.{i}.self_attn.qkv_proj.{part}"] = torch.cat(
                        [sd[p + f"self_attn.{n}_proj.{part}"] for n in "qkv"])
        for mlp in ("mlp.", "mlp.shared_expert.", "mlp.shared_experts."):
            if p + mlp + "gate_proj.weight" in sd:
                ours = "mlp." if mlp == "mlp." else "mlp.shared_expert."
                out[f"layers.{i}.{ours}gate_up_proj.weight"] = torch.cat([sd[p + mlp + "gate_proj.weight"],
                                                                          sd[p + mlp + "up_proj.weight"]])
    return out


def _fused(c: HybridConfig, name: str) -> bool:
    """Whether a transformers weight is one part of a projection fused here (q|k|v of an attention layer, gate|up)."""
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return True
    return any(f".self_attn.{n}_proj." in name for n in "qkv") and c.kind(int(name.split(".")[1])) != "mla"


def _our_name(c: HybridConfig, name: str) -> str:
    return name.replace(".mlp.router.", ".mlp.gate.").replace(".shared_experts.", ".shared_expert.")


def _our_value(c: HybridConfig, name: str, value: torch.Tensor) -> torch.Tensor:
    if c.family != "gpt_oss" or ".experts." not in name:
        return value
    if name.endswith("gate_up_proj"):
        return _halves(value).transpose(1, 2)
    if name.endswith("gate_up_proj_bias"):
        return _halves(value)
    return value.transpose(1, 2) if name.endswith("down_proj") else value


def ours_to_hf(c: HybridConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This model's state_dict under a family's transformers names and layouts (the inverse of hf_to_ours)."""
    out = {}
    for name, value in sd.items():
        key = name if name == "lm_head.weight" else "model." + name
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)
            parts = value.split([q, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim])
            for n, part in zip("qkv", parts):
                out[key.replace("qkv_proj", f"{n}_proj")] = part
            continue
        if name.endswith("gate_up_proj.weight"):
            shared = "shared_experts" if c.family == "deepseek_v2" else "shared_expert"
            key = key.replace("shared_expert.", shared + ".")
            gate, up = value.chunk(2)
            out[key.replace("gate_up_proj", "gate_proj")], out[key.replace("gate_up_proj", "up_proj")] = gate, up
            continue
        if c.family == "deepseek_v2":
            key = key.replace(".shared_expert.", ".shared_experts.")
        if c.family == "gpt_oss":
            key = key.replace(".mlp.gate.", ".mlp.router.")
            if ".experts." in name:
                value = _interleave(value.transpose(1, 2)) if name.endswith("gate_up_proj") else \
                    _interleave(value) if name.endswith("gate_up_proj_bias") else \
                    value.transpose(1, 2) if name.endswith("down_proj") else value
        out[key] = value
    return out


def load_hf_state_dict(model: HybridModel, sd: dict[str, torch.Tensor]) -> None:
    """Copy a transformers state_dict of the model's family in."""
    ours = hf_to_ours(model.config, sd)
    if model.config.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}")


def hf_state_dict(model: HybridModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in ours_to_hf(model.config, model.state_dict()).items()}


def init_random(model: HybridModel, seed: int) -> HybridModel:
    """Seeded random weights that keep activations O(1) and make every part matter: norms near 1 (zero-centred ones
    near 0), projections N(0, 1/fan_in), embeddings N(0, 1), biases and sinks of a visible size, Gated DeltaNet's
    decay A ~ U(1, 16) and dt_bias near 1."""
    gen = torch.Generator().manual_seed(seed)
    offset = model.config.norm_offset
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") and offset:
                p.copy_(0.2 * noise)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen).mul(15).add(1).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise if name == "embed_tokens.weight" else noise.mul(p.shape[-1] ** -0.5))
    return model.eval()


def to_transformers(model: HybridModel):
    """transformers' own model of the family (fp32, eval, eager attention) holding exactly `model`'s weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(to_hf_config(model.config)).to(torch.float32)
    hf.config._attn_implementation = "eager"
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()


# the twins the tests compare: each family's parts at a tiny size (a 4-token sliding window, 3 linear + 1 full, MLA
# with a dense first layer)
TWINS = {
    "gpt_oss": dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=32,
                    layer_types=("sliding_attention", "full_attention") * 2, sliding_window=8, attention_sinks=True,
                    attention_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    router="topk_softmax", expert_act="clamped_swiglu", swiglu_limit=1.5, mlp_bias=True,
                    rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 64}),
    "qwen3_next": dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), attn_output_gate=True,
                       qk_norm=True, norm_offset=True, partial_rotary_factor=0.25, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, shared_expert_gate=True, norm_topk_prob=True,
                       mlp_only_layers=(2,), rms_norm_eps=1e-6),
    "deepseek_v2": dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=24,
                        intermediate_size=96, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, rope_interleaved=True, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64, first_k_dense_replace=1,
                        router="deepseek", routed_scaling_factor=1.5, topk_method="group_limited_greedy", n_group=2,
                        topk_group=1, rms_norm_eps=1e-6),
}


def tiny_twin(family: str, seed: int = 0, **overrides) -> HybridModel:
    """A tiny random-weight model of `family` (TWINS' shapes, `overrides` on top)."""
    fields = {"vocab_size": 300, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
              **TWINS[family], **overrides}
    return init_random(HybridModel(HybridConfig(family=family, **fields)), seed)

"""The sizes of a model spec's parts: which layers are MoE, the parameters of each part of a decoder layer (attention
of each kind, MLPs, routed and shared experts, router, norms) summed over its typed blocks (sim/config/layers.py), in
all and per token, and the KV cache of a multi-head latent (MLA). (How a step's tokens spread over the experts is the
cost side's: sim/cost/routing.py.)

Parameters of one decoder layer, as Hugging Face's modelling code holds them:
- attention: q, k, v, o (GQA); MLA (DeepSeek-V2/V3): q_a (hidden → q_lora_rank) and its norm then q_b (→ heads ×
  (qk_nope + qk_rope)), or one q projection without q_lora_rank; kv_a_proj_with_mqa (hidden → kv_lora_rank +
  qk_rope), its norm, kv_b (kv_lora_rank → heads × (qk_nope + v)); o (heads × v → hidden);
- a dense layer's SwiGLU MLP (3 × hidden × intermediate_size), or a MoE layer's routed experts (each 3 × hidden ×
  moe_intermediate_size), shared experts (3 × hidden × their width, plus Qwen2-MoE's one-output gate) and the
  router (hidden × experts);
- a Gated DeltaNet (linear attention) layer's projections, convolution and gated norm (Qwen3-Next);
- two RMSNorms (Gemma: four).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any

from sim.config.sharding import Sharding

ModelSpec = Any  # sim.config.models.ModelSpec, which reads its sizes from here


def is_moe_layer(m: ModelSpec, i: int) -> bool:
    """Layer `i` runs routed experts (Qwen2-MoE's rule, with DeepSeek's first dense layers)."""
    return (m.num_experts > 0 and i >= m.first_k_dense_replace and i not in m.mlp_only_layers
            and (i + 1) % m.decoder_sparse_step == 0)


def moe_layers(m: ModelSpec) -> int:
    """How many of the decoder layers are MoE."""
    return sum(is_moe_layer(m, i) for i in range(m.num_layers))


def uses_mla(m: ModelSpec) -> bool:
    """Multi-head latent attention: the cache holds one latent and one rotary key per token and layer."""
    return m.kv_lora_rank is not None


def has_experts(m: ModelSpec) -> bool:
    """Routed experts in some layer (a mixture of experts)."""
    return m.num_experts > 0


def expert_width(m: ModelSpec) -> int:
    """One routed expert's FFN width."""
    return m.moe_intermediate_size or m.intermediate_size


def shared_width(m: ModelSpec) -> int:
    """The shared experts' FFN width in all (0: none)."""
    if m.shared_expert_intermediate_size is not None:
        return m.shared_expert_intermediate_size
    return m.num_shared_experts * expert_width(m)


MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def check(m: ModelSpec) -> None:
    """ValueError naming the key of an inconsistent MoE or MLA spec (called by ModelSpec's validation)."""
    e, k = m.num_experts, m.num_experts_per_tok
    if e == 0:
        stray = [key for key in ("num_experts_per_tok", "num_shared_experts", "shared_expert_intermediate_size",
                                 "expert_weight_dtype") if getattr(m, key)]
        if stray:
            raise ValueError(f"{stray[0]} {getattr(m, stray[0])} without routed experts; allowed: with num_experts "
                             "1 or more, or 0 (a dense model)")
    elif not 1 <= k <= e:
        raise ValueError(f"num_experts_per_tok {k} with {e} routed experts; allowed: 1 to {e}")
    if m.shared_expert_gate and not shared_width(m):
        raise ValueError("shared_expert_gate without shared experts; allowed: with num_shared_experts or "
                         "shared_expert_intermediate_size")
    bad = [i for i in m.mlp_only_layers if i >= m.num_layers]
    if bad:
        raise ValueError(f"mlp_only_layers {bad[0]}: no such layer; allowed: 0 to {m.num_layers - 1}")
    if e and not moe_layers(m):
        raise ValueError(f"no MoE layer among the {m.num_layers} (first_k_dense_replace {m.first_k_dense_replace}, "
                         f"decoder_sparse_step {m.decoder_sparse_step}, mlp_only_layers); allowed: at least one")
    given = [key for key in MLA_KEYS if getattr(m, key) is not None]
    if given and len(given) < len(MLA_KEYS) or (m.q_lora_rank is not None and not given):
        missing = next(key for key in MLA_KEYS if getattr(m, key) is None)
        raise ValueError(f"{missing} missing beside {(given or ['q_lora_rank'])[0]}; allowed: all of "
                         f"{', '.join(MLA_KEYS)} (q_lora_rank optional) for latent attention, or none")


# -- parameters ------------------------------------------------------------------------------------------------------
def qk_head_dim(m: ModelSpec) -> int:
    """Dimensions a query and a key head meet in (MLA: the no-position part and the rotary part)."""
    return m.qk_nope_head_dim + m.qk_rope_head_dim if uses_mla(m) else m.head_size


def v_head_dim(m: ModelSpec) -> int:
    return m.v_head_dim if uses_mla(m) else m.head_size


def attention_projections(m: ModelSpec) -> dict[str, int]:
    """Each attention projection's parameters (and MLA's two low-rank norms, as `*_norm`)."""
    h, heads = m.hidden_size, m.num_heads
    if not uses_mla(m):
        d = m.head_size
        return {"q": h * heads * d, "k": h * m.num_kv_heads * d, "v": h * m.num_kv_heads * d, "o": heads * d * h}
    qk, r = qk_head_dim(m), m.kv_lora_rank
    q = {"q_a": h * m.q_lora_rank, "q_a_norm": m.q_lora_rank, "q_b": m.q_lora_rank * heads * qk} \
        if m.q_lora_rank else {"q": h * heads * qk}
    return {**q, "kv_a": h * (r + m.qk_rope_head_dim), "kv_a_norm": r,
            "kv_b": r * heads * (m.qk_nope_head_dim + m.v_head_dim), "o": heads * m.v_head_dim * h}


def attention_params(m: ModelSpec) -> int:
    return sum(attention_projections(m).values())


def replicated_attention_params(m: ModelSpec) -> int:
    """Attention parameters every tensor-parallel rank holds whole (vLLM: MLA's q_a and kv_a are ReplicatedLinear)."""
    p = attention_projections(m)
    return sum(p.get(k, 0) for k in ("q_a", "q_a_norm", "kv_a", "kv_a_norm"))


def mlp_params(m: ModelSpec, width: int) -> int:
    """One SwiGLU MLP of `width` (gate, up, down), with their biases where mlp_bias is set."""
    return 3 * m.hidden_size * width + (2 * width + m.hidden_size if m.mlp_bias else 0)


def expert_params(m: ModelSpec) -> int:
    """One routed expert (gate, up, down)."""
    return mlp_params(m, expert_width(m))


def shared_expert_params(m: ModelSpec) -> int:
    """The shared experts of one MoE layer, with Qwen2-MoE's gate."""
    width = shared_width(m)
    return 3 * m.hidden_size * width + (m.hidden_size if m.shared_expert_gate and width else 0)


def router_params(m: ModelSpec) -> int:
    return m.hidden_size * m.num_experts + (m.num_experts if m.mlp_bias else 0)


def attention_layer_params(m: ModelSpec, attention) -> int:
    """One layer's attention parameters: projections, biases, sinks, q/k norms; Gated DeltaNet's for linear layers
    (Hugging Face's Qwen3NextGatedDeltaNet), the latent projections for MLA (sim/config/moe.py)."""
    if attention.kind == "mla":
        return attention_params(m)
    if attention.kind == "linear":
        return gated_delta_net_params(m)
    h, heads, kv, d = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_size
    params = attention_params(m) + (h * heads * d if attention.output_gate else 0)
    if m.attention_bias or m.qkv_bias:  # q, k and v biases; Llama's and gpt-oss's attention_bias also o's
        params += (heads + 2 * kv) * d + (h if m.attention_bias else 0)
    return params + (heads if attention.sinks else 0) + (2 * d if attention.qk_norm else 0)


def gated_delta_net_params(m: ModelSpec) -> int:
    """A Gated DeltaNet layer: in_proj_qkvz, in_proj_ba (per value head: beta and the decay), the depthwise causal
    convolution over q, k and v, dt_bias and A_log per value head, the gated RMSNorm, out_proj."""
    h = m.hidden_size
    key_dim = m.linear_num_key_heads * m.linear_key_head_dim
    value_dim = m.linear_num_value_heads * m.linear_value_head_dim
    heads = m.linear_num_value_heads
    return h * (2 * key_dim + 2 * value_dim) + h * 2 * heads + (2 * key_dim + value_dim) * m.linear_conv_kernel_dim \
        + 2 * heads + m.linear_value_head_dim + value_dim * h


@dataclass(eq=False, repr=False)
class DecoderParams:
    """A spec's decoder parameters summed over its layers, by part."""

    attention: int
    dense_mlp: int  # the dense layers' MLPs
    routed: int  # every routed expert of every MoE layer
    routed_active: int  # the top-k experts of each MoE layer: what one token multiplies through
    shared: int
    router: int
    norms: int

    @property
    def total(self) -> int:
        return self.attention + self.dense_mlp + self.routed + self.shared + self.router + self.norms

    @property
    def active(self) -> int:
        """Parameters one token multiplies through."""
        return self.attention + self.dense_mlp + self.routed_active + self.shared + self.router + self.norms

    @property
    def dense(self) -> int:
        """Everything but the routed experts: what every token runs and every step reads."""
        return self.total - self.routed


def decoder_params(m: ModelSpec) -> DecoderParams:
    """The decoder layers' parameters by part, summed over the layers' blocks (sim/config/layers.py)."""
    runs = [(layer, len(list(same))) for layer, same in groupby(m.layers)]
    n_moe = sum(n for layer, n in runs if layer.ffn.kind == "moe")
    return DecoderParams(attention=sum(n * attention_layer_params(m, layer.attention) for layer, n in runs),
                         dense_mlp=sum(n * mlp_params(m, layer.ffn.width) for layer, n in runs
                                       if layer.ffn.kind == "dense"),
                         routed=n_moe * m.num_experts * expert_params(m),
                         routed_active=n_moe * m.num_experts_per_tok * expert_params(m),
                         shared=n_moe * shared_expert_params(m), router=n_moe * router_params(m),
                         norms=m.num_layers * m.layer_norms * m.hidden_size)


def active_params(m: ModelSpec) -> int:
    """Parameters one token runs through, embedding and LM head included (how "active" sizes are published)."""
    lm_head = 0 if m.tie_word_embeddings else m.embedding_params
    return decoder_params(m).active + m.embedding_params + lm_head + m.hidden_size


# -- KV cache ----------------------------------------------------------------------------------------------------------
def latent_kv_elements(m: ModelSpec) -> int:
    """MLA's cache per token and layer: the latent and the rotary key, shared by every head."""
    return m.kv_lora_rank + m.qk_rope_head_dim


def latent_kv_bytes_per_token(m: ModelSpec) -> float:
    """An MLA model's KV bytes a token on all layers: the latent and the rotary key of each."""
    return m.num_layers * latent_kv_elements(m) * m.kv_bytes_per_element


def kv_bytes_per_device_token(m: ModelSpec, sharding: Sharding) -> float:
    """A token's KV bytes on one tensor-parallel rank of `sharding`: its KV heads' share (a copy of one where there are
    fewer KV heads than ranks), or the whole MLA latent (vLLM keeps all of it on every rank: one latent serves every
    head)."""
    if uses_mla(m):
        return m.kv_bytes_per_token
    return sharding.kv_bytes(m.kv_bytes_per_token)

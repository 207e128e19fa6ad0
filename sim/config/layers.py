"""A model's decoder layers as typed blocks: each layer's attention kind and FFN kind, derived from the model spec's
keys (Hugging Face names: `layer_types`, `sliding_window`, `attention_chunk_size`, the `linear_*` keys, the MoE layer
rule). Memory, the KV allocator's groups (sim/config/kv_groups.py) and the cost models read a model through them.

Attention kinds, and what one sequence keeps of each (vLLM's KV cache specs):
- `full`: K and V of every token (FullAttentionSpec);
- `sliding_window` W: a query attends itself and the W - 1 tokens before it; K/V that fell out of the window is freed
  (SlidingWindowSpec);
- `chunked_local` C: a query attends the tokens of its own chunk of C (positions C·k to C·k + C - 1) up to itself;
  the chunks before it are freed (ChunkedLocalAttentionSpec, Llama-4);
- `linear`: no per-token cache, a fixed state per sequence: Gated DeltaNet's convolution state (kernel - 1 columns
  of q, k and v) and recurrent state (value heads × key dim × value dim) (MambaSpec, Qwen3-Next);
- `mla`: one latent and one rotary key per token, shared by every head (MLAAttentionSpec, DeepSeek).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from sim.config.moe import expert_width, is_moe_layer, uses_mla

ModelSpec = Any  # sim.config.models.ModelSpec, which reads its layers from here

# config.json's layer_types -> attention kinds
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding_window", "chunked_attention": "chunked_local",
               "linear_attention": "linear"}
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")
WINDOWED = ("sliding_window", "chunked_local")  # kinds whose cache stops growing


@dataclass(frozen=True, slots=True)
class Attention:
    """One layer's attention block."""

    kind: str  # full | sliding_window | chunked_local | linear | mla
    window: int = 0  # sliding_window: tokens a query attends (itself included); chunked_local: the chunk; else 0
    sinks: bool = False  # a learned sink logit per head (gpt-oss)
    qk_norm: bool = False  # RMSNorms on each query and key head (Qwen3, Gemma-3, Qwen3-Next)
    output_gate: bool = False  # a sigmoid gate on the attention output from a second query projection (Qwen3-Next)


@dataclass(frozen=True, slots=True)
class FFN:
    """One layer's feed-forward block: a dense SwiGLU MLP, or routed experts (with shared ones, sim/config/moe.py)."""

    kind: str  # dense | moe
    width: int  # the dense MLP's intermediate size, or one routed expert's


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer."""

    attention: Attention
    ffn: FFN


def layer_specs(m: ModelSpec) -> tuple[LayerSpec, ...]:
    """The model's layers, first to last (equal layers are one shared object)."""
    flags = {"sinks": m.attention_sinks, "qk_norm": m.qk_norm, "output_gate": m.attn_output_gate}
    made: dict[tuple, LayerSpec] = {}
    out = []
    for i in range(m.num_layers):
        kind = "mla" if uses_mla(m) else attention_kind(m, i)
        window = m.sliding_window if kind == "sliding_window" else \
            m.attention_chunk_size if kind == "chunked_local" else 0
        moe = is_moe_layer(m, i)
        key = (kind, moe)
        if key not in made:
            attention = Attention(kind, window, **flags) if kind != "linear" else Attention(kind)
            made[key] = LayerSpec(attention, FFN("moe", expert_width(m)) if moe else FFN("dense", m.intermediate_size))
        out.append(made[key])
    return tuple(out)


def attention_kind(m: ModelSpec, i: int) -> str:
    """Layer i's attention kind from layer_types; without it, every layer sliding where sliding_window is set (Mistral
    v0.1, Phi-3), else full."""
    if m.layer_types is not None:
        return LAYER_TYPES[m.layer_types[i]]
    return "sliding_window" if m.sliding_window is not None else "full"


def layer_runs(layers: tuple[LayerSpec, ...]) -> tuple[tuple[LayerSpec, int], ...]:
    """The compact form: (layer, how many in a row) for each run of equal consecutive layers."""
    runs: list[list] = []
    for layer in layers:
        if runs and runs[-1][0] == layer:
            runs[-1][1] += 1
        else:
            runs.append([layer, 1])
    return tuple((layer, n) for layer, n in runs)


def kind_counts(m: ModelSpec) -> Counter:
    """Layers of each attention kind."""
    return Counter(layer.attention.kind for layer in m.layers)


def describe(m: ModelSpec) -> str:
    """The layers' attention kinds in a few words: "36", or "18 sliding 128 + 18 full"."""
    counts = kind_counts(m)
    if set(counts) == {"full"}:
        return str(m.num_layers)
    names = {"sliding_window": f"sliding {m.sliding_window}", "chunked_local": f"chunked {m.attention_chunk_size}"}
    return " + ".join(f"{n} {names.get(kind, kind)}" for kind, n in counts.items())


def check(m: ModelSpec) -> None:
    """ValueError naming the key of an inconsistent per-layer attention spec (called by ModelSpec's validation)."""
    types = m.layer_types
    if types is not None and len(types) != m.num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_layers {m.num_layers}; allowed: one per layer")
    present = set(types) if types is not None else {"sliding_attention" if m.sliding_window else "full_attention"}
    if m.kv_lora_rank is not None and present != {"full_attention"}:
        raise ValueError("layer_types other than full_attention with latent attention (kv_lora_rank); allowed: "
                         "full_attention on every layer of an MLA model")
    for layer_type, key in (("sliding_attention", "sliding_window"), ("chunked_attention", "attention_chunk_size")):
        if layer_type in present and getattr(m, key) is None:
            raise ValueError(f"{key} missing for the {layer_type} layers; allowed: the window in tokens")
        if layer_type not in present and getattr(m, key) is not None and types is not None:
            raise ValueError(f"{key} {getattr(m, key)} without {layer_type} layers in layer_types; allowed: leave it "
                             f"out (null), or {layer_type} layers")
    given = [key for key in LINEAR_KEYS if getattr(m, key) is not None]
    if "linear_attention" in present and len(given) < len(LINEAR_KEYS):
        missing = next(key for key in LINEAR_KEYS if getattr(m, key) is None)
        raise ValueError(f"{missing} missing for the linear_attention layers; allowed: all of {', '.join(LINEAR_KEYS)}")
    if given and "linear_attention" not in present:
        raise ValueError(f"{given[0]} without linear_attention layers; allowed: layer_types with linear_attention, "
                         "or no linear_* keys")
    if given and m.linear_num_value_heads % m.linear_num_key_heads:
        raise ValueError(f"linear_num_key_heads ({m.linear_num_key_heads}) must divide linear_num_value_heads "
                         f"({m.linear_num_value_heads})")


# -- bytes a sequence keeps, reads and writes, by kind (a whole model's, not one device's) ------------------------------
def kv_bytes_per_token(m: ModelSpec, attention: Attention) -> float:
    """K/V bytes one layer of this kind caches per token (0 for linear attention, which keeps a state instead)."""
    if attention.kind == "linear":
        return 0.0
    if attention.kind == "mla":
        return (m.kv_lora_rank + m.qk_rope_head_dim) * m.kv_bytes_per_element
    return 2 * m.num_kv_heads * m.head_size * m.kv_bytes_per_element


def state_elements(m: ModelSpec) -> tuple[int, int]:
    """Gated DeltaNet's per-sequence state of one layer, in elements: (convolution state: kernel - 1 columns of the
    q, k and v channels, recurrent state: value heads × key head dim × value head dim)."""
    conv_dim = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    return (m.linear_conv_kernel_dim - 1) * conv_dim, \
        m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim


def state_bytes(m: ModelSpec, attention: Attention) -> float:
    """Bytes of the fixed state one sequence keeps in one layer of this kind (0 but for linear attention); held in
    the activation dtype (vLLM's mamba_cache_dtype auto), whatever the KV cache's dtype."""
    if attention.kind != "linear":
        return 0.0
    return sum(state_elements(m)) * m.act_bytes


def attended_tokens(attention: Attention, context: int) -> int:
    """Keys a query at position context - 1 (the context's last token) attends (0 for linear attention)."""
    if attention.kind == "sliding_window":
        return min(context, attention.window)
    if attention.kind == "chunked_local":
        return (context - 1) % attention.window + 1
    return 0 if attention.kind == "linear" else context


def decode_read_bytes(m: ModelSpec, attention: Attention, context: int) -> float:
    """Bytes one decode row at `context` tokens (its new one included) reads in one layer: the K/V it attends, or the
    linear-attention state it updates."""
    if attention.kind == "linear":
        return state_bytes(m, attention)
    return attended_tokens(attention, context) * kv_bytes_per_token(m, attention)


def decode_write_bytes(m: ModelSpec, attention: Attention) -> float:
    """Bytes one decode row writes in one layer: its token's K/V, or the whole linear-attention state."""
    if attention.kind == "linear":
        return state_bytes(m, attention)
    return kv_bytes_per_token(m, attention)


def cached_layers(m: ModelSpec) -> int:
    """Layers that cache K/V per token (every kind but linear attention)."""
    return m.num_layers - kind_counts(m)["linear"]

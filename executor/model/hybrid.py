"""A decoder whose layers differ by kind, in plain torch: the models fleets serve beside the llamas (nano-vllm style,
one module per part).

Each layer's attention is one of sim/config/layers.py's kinds — full, sliding window W, chunked local C (a
`WindowAttention`: biases, learned sinks, Qwen3-Next's sigmoid output gate and q/k norms, partial rotary), linear
(`GatedDeltaNet`, executor/model/linear_attention.py) or latent (`LatentAttention`, executor/model/mla.py) — and its FFN a
SwiGLU MLP or a mixture of experts (executor/model/moe.py: Qwen's, gpt-oss's or DeepSeek's router; SwiGLU or gpt-oss's
clamped SwiGLU with biases). The KV cache is executor/model/hybrid_cache.py's, laid out by the groups the shared
hybrid allocator hands out blocks for. `HybridConfig` carries the layer kinds with Hugging Face's names; its families
(gpt_oss, qwen3_next, deepseek_v2) and their transformers twins are executor/model/families.py's.

The forward takes the engine's flat packed step like LlamaModel's (prefill chunks and decodes mixed) and runs eagerly:
no native decode loop and no CUDA graphs (the engine runs these models eagerly).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.hybrid_cache import CacheLayout, HybridKVCache, HybridMetadata, group_layers
from executor.model.layers import (
    MLP,
    Embedding,
    Linear,
    RMSNorm,
    linear,
    rope_attention_factor,
    rope_inv_freq,
    tune_native_rows,
)
from executor.model.linear_attention import GatedDeltaNet
from executor.model.llama import LlamaConfig
from executor.model.mla import LatentAttention
from executor.model.moe import Activation, Routing, SparseMoeBlock
from executor.model.window_attention import kind_attention
from sim.config.kv_groups import group_size as kv_group_size
from sim.config.layers import LAYER_TYPES


@dataclass
class HybridConfig(LlamaConfig):
    """A LlamaConfig with per-layer attention kinds and the parts the newer families add (Hugging Face's names)."""

    family: str = "custom"  # gpt_oss | qwen3_next | deepseek_v2 | custom (built from a scenario's model spec)
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention | chunked_attention | ...
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    attention_sinks: bool = False
    attention_bias: bool = False  # q, k, v and o
    qkv_bias: bool = False  # q, k and v only (Qwen2)
    attn_output_gate: bool = False  # a second query projection gates the attention output (Qwen3-Next)
    norm_offset: bool = False  # RMSNorms scale by 1 + weight (Qwen3-Next)
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False  # rotate pairs (DeepSeek's complex form), not halves
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0  # > 0: every layer latent attention (MLA)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router: str = "softmax"  # softmax | topk_softmax (gpt-oss) | deepseek
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    expert_act: str = "silu"  # silu | clamped_swiglu (gpt-oss)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_bias: bool = False  # the router's and the experts' biases (gpt-oss)

    def kind(self, layer: int) -> str:
        """Layer `layer`'s attention kind (sim/config/layers.py's names)."""
        if self.kv_lora_rank:
            return "mla"
        return LAYER_TYPES[self.layer_types[layer]] if self.layer_types else "full"

    def window(self, layer: int) -> int:
        kind = self.kind(layer)
        return self.sliding_window if kind == "sliding_window" else \
            self.attention_chunk_size if kind == "chunked_local" else 0

    def cache_kind(self, layer: int) -> tuple[str, int]:
        """(kind, window) as the KV cache groups it: latent attention caches per token, like full attention."""
        kind = self.kind(layer)
        return ("full" if kind == "mla" else kind), self.window(layer)


class Rotary(nn.Module):
    """cos/sin tables of the first `dim` dims of a head, YaRN's attention factor folded in; `angles(positions)` gives
    a step's `RopeAt`, which rotates halves (Llama's rotate_half) or interleaved pairs (DeepSeek)."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None, interleaved: bool):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(dim, theta, scaling))
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self.dim, self.interleaved = dim, interleaved

    def angles(self, positions: torch.Tensor) -> "RopeAt":
        return RopeAt(self.cos[positions][:, None], self.sin[positions][:, None], self.dim, self.interleaved)


@dataclass
class RopeAt:
    """A step's rotary angles, cos/sin [T, 1, dim/2]: calling it rotates x [T, heads, d ≥ dim] (its first dim dims)."""

    cos: torch.Tensor
    sin: torch.Tensor
    dim: int
    interleaved: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.dim].float(), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1)
        return torch.cat((out.to(x.dtype), rest), dim=-1) if rest.shape[-1] else out.to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by 1 + weight (Qwen3-Next's, weights stored zero-centred)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: HybridConfig, dim: int, eps: float | None = None) -> RMSNorm:
    return (OffsetRMSNorm if config.norm_offset else RMSNorm)(dim, config.rms_norm_eps if eps is None else eps)


class WindowAttention(nn.Module):
    """Self-attention of kind full, sliding window or chunked local over the hybrid cache: fused q|k|v projection
    (biases where `attention_bias`; with `attn_output_gate` the query projection also gives each head's gate, its
    second half), q/k norms, rotary on the first rotary dims, K/V written to the step's slots, `kind_attention`
    (sinks where `attention_sinks`), the gate's sigmoid, the output projection."""

    def __init__(self, c: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.kind, self.window = layer_idx, c.kind(layer_idx), c.window(layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim, self.gated = c.num_heads, c.num_kv_heads, c.head_dim, \
            c.attn_output_gate
        self.q_size, self.kv_size = c.num_heads * c.head_dim * (2 if self.gated else 1), c.num_kv_heads * c.head_dim
        self.qkv_proj = linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias or c.qkv_bias)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = make_norm(c, c.head_dim) if c.qk_norm else None
        self.k_norm = make_norm(c, c.head_dim) if c.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: RopeAt, meta: HybridMetadata, cache: HybridKVCache) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:  # per head: its query, then its gate
            q, gate = q.reshape(t, h, 2 * d).chunk(2, dim=-1)
        q, k, v = q.reshape(t, h, d), k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        slot = cache.layout.layers[self.layer_idx]
        gm = meta.attention(slot.kind, slot.group)
        k_pool, v_pool = cache.write_kv(self.layer_idx, gm.slot_mapping, k, v)
        o = kind_attention(q, k_pool, v_pool, gm, self.scale, self.kind, self.window, self.sinks)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, h * d))


def moe_of(c: HybridConfig) -> SparseMoeBlock:
    """A layer's mixture of experts with the family's router and expert activation."""
    return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok,
                          c.moe_intermediate_size or c.intermediate_size, c.norm_topk_prob,
                          c.shared_expert_intermediate_size, c.shared_expert_gate, c.local_experts,
                          routing=Routing(c.router, c.routed_scaling_factor, c.topk_method, c.n_group, c.topk_group),
                          bias=c.mlp_bias, act=Activation(c.expert_act, c.swiglu_alpha, c.swiglu_limit))


class HybridLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then + mlp(norm(x)). The mixer is `self_attn` (a WindowAttention or a
    LatentAttention) or `linear_attn` (a GatedDeltaNet), as Hugging Face names them."""

    def __init__(self, c: HybridConfig, layer_idx: int):
        super().__init__()
        self.kind = c.kind(layer_idx)
        self.input_layernorm = make_norm(c, c.hidden_size)
        self.post_attention_layernorm = make_norm(c, c.hidden_size)
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                                             c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                                             layer_idx, c.rms_norm_eps)
        elif self.kind == "mla":
            self.self_attn = LatentAttention(c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank,
                                             c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, layer_idx,
                                             c.attention_bias, c.rope_scaling)
        else:
            self.self_attn = WindowAttention(c, layer_idx)
        self.mlp = moe_of(c) if c.is_moe(layer_idx) else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, rope: RopeAt, meta: HybridMetadata, cache: HybridKVCache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == "linear":
            slot = cache.layout.layers[self.linear_attn.layer_idx]
            h = self.linear_attn(h, meta, cache, slot.kind, slot.group)
        elif self.kind == "mla":
            attn = self.self_attn
            slot = cache.layout.layers[attn.layer_idx]
            h = attn(h, rope, meta.attention(slot.kind, slot.group), cache.latent_pool(attn.layer_idx,
                                                                                       attn.latent_width))
        else:
            h = self.self_attn(h, rope, meta, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    """Decoder + LM head over a HybridKVCache (`make_cache`); the engine's model interface (forward over a packed
    step, compute_logits, take_expert_counts)."""

    def __init__(self, config: HybridConfig, attn_backend="sdpa"):
        super().__init__()
        c = self.config = config
        self.attn_backend = attn_backend  # kept for the engine's interface: these layers attend in torch
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        rot = c.qk_rope_head_dim if c.kv_lora_rank else int(c.head_dim * c.partial_rotary_factor)
        self.rotary = Rotary(rot, c.max_position_embeddings, c.rope_theta, c.rope_scaling, c.rope_interleaved)
        self.layers = nn.ModuleList(HybridLayer(c, i) for i in range(c.num_layers))
        self.norm = make_norm(c, c.hidden_size)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: HybridMetadata, kv_caches: HybridKVCache, last_of=None,
                attention=None, hidden=None, final: bool = True) -> torch.Tensor:
        """The final-normed hidden states of the step's tokens [T, hidden], or of the last token of the sequences
        in `last_of` only. (`attention`, `hidden` and `final` are the graph and pipeline hooks of LlamaModel,
        not taken here.)"""
        if attention is not None or hidden is not None or not final:
            raise NotImplementedError("a hybrid model runs eagerly in one process: no graphs, no pipeline stages")
        x = self.embed_tokens(input_ids)
        rope = self.rotary.angles(positions)
        for layer in self.layers:
            x = layer(x, rope, meta, kv_caches)
        if last_of is not None:
            x = x[[meta.cu_query_lens[i + 1] - 1 for i in last_of]]
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_rows)

    def tune_projections(self) -> dict[tuple, int]:
        """Kernel copies of every fp32 CPU projection made now, the native kernel's row limit measured per shape
        (executor.model.layers.tune_native_rows, as LlamaModel's)."""
        return tune_native_rows(self)

    def take_expert_counts(self) -> list[int] | None:
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return sum(b.take_counts() for b in blocks).tolist() if blocks else None

    def layout(self, allocator) -> CacheLayout:
        """The cache's groups under `allocator`: a hybrid allocator's kinds and group size, checked against these
        layers; under the plain allocator one group of every layer, each token's K/V kept in every layer (vLLM's
        --disable-hybrid-kv-cache-manager: a window's blocks are never freed, its layers still read only the window),
        which a linear layer's state cannot be."""
        c = self.config
        kinds = [c.cache_kind(i) for i in range(c.num_layers)]
        hybrid = getattr(allocator, "hybrid", False)
        size = allocator.groups.group_size if hybrid else c.num_layers
        if not hybrid:
            if ("linear", 0) in kinds:
                raise ValueError("linear-attention layers keep a state per sequence: they need the hybrid allocator")
            kinds = [("full", 0)] * c.num_layers
        order, slots = group_layers(kinds, size)
        if hybrid:
            theirs = tuple((name, window) for name, (_, window, _) in zip(allocator.kind_names, allocator.kinds))
            counts = tuple(n for _, _, n in allocator.kinds)
            mine = tuple(max(s.group for s in slots if s.kind == k) + 1 for k in range(len(order)))
            if theirs != order or counts != mine:
                raise ValueError(f"the allocator's KV groups {theirs} x {counts} are not this model's {order} x {mine}")
        return CacheLayout(order, slots, size, max(self._page(i, allocator.block_size) for i in range(c.num_layers)),
                           bool(getattr(allocator, "align", False)))

    def _page(self, layer: int, block_size: int) -> int:
        """Elements one block of layer `layer` takes: K and V of block_size tokens, latents, or a linear state."""
        module = self.layers[layer]
        if module.kind == "linear":
            return module.linear_attn.state_elements
        if module.kind == "mla":
            return block_size * module.self_attn.latent_width
        return 2 * block_size * self.config.num_kv_heads * self.config.head_dim

    def make_cache(self, allocator, num_blocks: int, dtype: torch.dtype, device) -> HybridKVCache:
        """The KV cache of `num_blocks` blocks the allocator hands out (its block size, its groups)."""
        return HybridKVCache(self.layout(allocator), num_blocks, allocator.block_size, dtype, device)


def kv_group_layers(config: HybridConfig) -> int:
    """Layers a KV cache group holds for this model (vLLM's rule, sim/config/kv_groups.py)."""
    counts: dict[tuple[str, int], int] = {}
    for i in range(config.num_layers):
        counts[config.cache_kind(i)] = counts.get(config.cache_kind(i), 0) + 1
    return kv_group_size(list(counts.values()))

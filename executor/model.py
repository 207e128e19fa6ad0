"""A llama-family decoder in plain torch with a serving-engine forward (nano-vllm style).

`forward` takes the flat packed tokens of a step (prefill chunks and decodes mixed), writes
their K/V into the paged cache and attends through it; `compute_logits` runs the LM head only
on the rows the caller needs (a prefill needs just its last position).
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs per layer.
On CPU in fp32 every projection runs oneDNN's GEMM on a weight reordered once into its blocked layout
(`Linear`): plain `F.linear` hands MKL the [out, in] weight to re-pack on every call, which costs more
than the multiply itself when few rows decode (2-4x at 1-64 rows) and ~15% at thousands of rows. At a few rows
a projection is a stream of its weight, and the native kernel (executor/native.py) reads it at a higher rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor import native
from executor.attention import AttentionMetadata, get_backend
from executor.cache_engine import KVCache


@dataclass
class LlamaConfig:
    """Shape and numerics of a llama-family model (names follow the serving literature)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or HF's {"rope_type": "linear" | "llama3", "factor": ..., ...}
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """Read a transformers LlamaConfig (v4 rope_theta/rope_scaling or v5 rope_parameters)."""
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
            raise NotImplementedError("projection biases are not supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {hf.hidden_act!r} is not supported")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        heads = hf.num_attention_heads
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_id=getattr(hf, "eos_token_id", None),
        )

    def to_hf(self):
        """The equivalent transformers LlamaConfig (for reference comparisons)."""
        from transformers import LlamaConfig as HFLlamaConfig

        return HFLlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim/2], with HF's "linear" or "llama3" scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def _mkldnn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# Switch off to run every projection through F.linear (for comparisons).
USE_MKLDNN_LINEAR = _mkldnn_linear_available()
# Switch off to run projections of a few rows through oneDNN too instead of the native weight-streaming kernel.
USE_NATIVE_LINEAR = True
# Switch off to run a layer's elementwise work (residual add + RMSNorm, RoPE + KV write, SiLU·up) as torch ops
# even where the native kernels are built.
USE_NATIVE_OPS = True
# Switch off for the straightforward per-op forward (fresh tensors, separate rope for q and k, ...).
FUSED_OPS = True


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state_dict) that, for fp32 CPU inference, multiplies by a copy
    of the weight prepacked for oneDNN, or for a few rows by one in the native kernel's panel layout. The
    copies are remade whenever the weight changes (in-place updates bump its version; `.to()` replaces it).

    `splits` (output sizes summing to out_features): return one tensor per part, each its own GEMM on
    that slice of the weight, so each comes out contiguous (a fused GEMM's column chunks are strided,
    and elementwise ops on strided [T, I] views run ~3x slower)."""

    # caches of the weight's parts in a kernel's layout, as (weight key, copies): oneDNN's, the native panels
    _packed: tuple | None = None
    _panels: tuple | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, splits: list[int] | None = None,
                 **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        if splits is not None and sum(splits) != out_features:
            raise ValueError(f"splits {splits} do not add up to {out_features}")
        self.splits = list(splits) if splits else None

    def _parts(self) -> list[torch.Tensor]:
        w = self.weight
        return list(w.split(self.splits)) if self.splits else [w]

    def _fp32_cpu_inference(self, x: torch.Tensor) -> bool:
        """What both fast paths need: no bias, fp32 on the CPU, and no gradient through the weight."""
        w = self.weight
        return (self.bias is None and x.device.type == "cpu" and w.dtype == torch.float32
                and x.dtype == torch.float32 and not (torch.is_grad_enabled() and w.requires_grad))

    def _use_mkldnn(self, x: torch.Tensor) -> bool:
        return USE_MKLDNN_LINEAR and self._fp32_cpu_inference(x)

    def _use_native(self, x: torch.Tensor) -> bool:
        # cheapest tests first: this runs for every projection of every step (the panels are contiguous copies,
        # so of the weight only its dtype and device matter)
        return (USE_NATIVE_LINEAR and x.dim() == 2 and x.shape[0] <= native.linear_max_rows() and x.is_contiguous()
                and self._fp32_cpu_inference(x))

    def _copies(self, name: str, make) -> list:
        """The weight's parts through `make`, kept in attribute `name` until the weight changes (in-place updates
        bump its version; `.to()` replaces it)."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape), tuple(self.splits or ()))
        cached = getattr(self, name)
        if cached is None or cached[0] != key:
            cached = (key, [make(p.detach().contiguous()) for p in self._parts()])
            setattr(self, name, cached)
        return cached[1]

    def forward(self, x: torch.Tensor):
        if self._use_native(x):  # a few rows: stream the weight once, from its panel copy
            outs = tuple(native.linear_small(x, p) for p in self._copies("_panels", native.pack_weight))
            return outs if self.splits else outs[0]
        if not self._use_mkldnn(x):
            if not self.splits:
                return F.linear(x, self.weight, self.bias)
            biases = self.bias.split(self.splits) if self.bias is not None else [None] * len(self.splits)
            return tuple(F.linear(x, w, b) for w, b in zip(self._parts(), biases))
        packed = self._copies("_packed", lambda p: torch.ops.mkldnn._reorder_linear_weight(p, 4096))
        outs = tuple(torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed)
        return outs if self.splits else outs[0]

    def __getstate__(self):  # the packed copies are caches: never pickled or deep-copied
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        for name in ("_packed", "_panels"):
            state.pop(name, None)
        return state


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, indexed by each token's position (rotate-half layout)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim/2], broadcastable over heads."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


@dataclass
class Rope:
    """A step's rotary angles: per-token cos/sin [T, 1, D/2] for the torch path, or (native) the tables and
    each token's position for the fused native kernel, which also does the layer's other elementwise work."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    positions: torch.Tensor
    rotary: RotaryEmbedding
    native: bool = False


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the position angles (HF's rotate_half convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope for fp32 in 4 kernels writing one fresh contiguous [T, heads, head_dim] tensor
    (x may be a strided view, e.g. the q|k columns of the fused qkv output)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FUSED_OPS and x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one call, same math in fp32
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim ** -0.5

    def forward(self, x, rope: Rope, meta: AttentionMetadata, kv_cache: KVCache, backend,
                rows: tuple[torch.Tensor, AttentionMetadata] | None = None) -> torch.Tensor:
        """Attention output for every token, or with `rows` = (token rows, their metadata as single-query
        sequences) for those rows only (K/V of every token are still written to the cache)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_pool, v_pool = kv_cache.layer(self.layer_idx)
        if rope.native:  # rotate q and k, write k and v to their slots: one pass over qkv
            q = native.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.rotary.cos,
                                     rope.rotary.sin, rope.positions, k_pool, v_pool, meta.slot_mapping)
        else:
            cos, sin = rope.cos, rope.sin
            if FUSED_OPS and qkv.dtype == torch.float32:  # rotate q and k together
                qk = apply_rope_into(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                v = qkv[:, self.q_size + self.kv_size:]
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
                k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
            kv_cache.write(self.layer_idx, meta.slot_mapping, k, v.view(t, self.num_kv_heads, self.head_dim))
        if rows is not None:
            q, meta = q[rows[0]], rows[1]
        o = backend(q, k_pool, v_pool, meta, scale=self.scale)
        return self.o_proj(o.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * i, bias=False, splits=[i, i])
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)  # two contiguous GEMM outputs, owned here: updated in place
        if fused:
            return self.down_proj(native.silu_mul(gate, up))
        if FUSED_OPS and not torch.is_grad_enabled():
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, meta, kv_cache, backend, rows=None, delta=None):
        """(residual stream, pending output). `x` is the model's own residual stream: updated in place under
        FUSED_OPS. With `rows` (see Attention.forward) only those rows go on past attention and come back.

        Native path (rope.native): `delta`, the previous layer's output, is added to `x` here, fused with this
        layer's first norm, and this layer's output comes back as the pending one for the next layer to add;
        on the torch paths it is added here and the pending output is None."""
        if rope.native:
            h = native.add_rms_norm(x, delta, self.input_layernorm.weight, self.input_layernorm.eps)
            a = self.self_attn(h, rope, meta, kv_cache, backend, rows)
            if rows is not None:
                x = x[rows[0]]
            h = native.add_rms_norm(x, a, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
            return x, self.mlp(h, fused=True)
        if rows is not None:
            x = x[rows[0]] + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend, rows)
            return x.add_(self.mlp(self.post_attention_layernorm(x))), None
        if FUSED_OPS and not torch.is_grad_enabled():
            x.add_(self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend))
            return x.add_(self.mlp(self.post_attention_layernorm(x))), None
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x)), None


class LlamaModel(nn.Module):
    """Decoder + LM head. `attn_backend` is a name from executor.attention ("naive", "sdpa",
    "flash", "paged") or a backend callable; change it any time via the attribute."""

    def __init__(self, config: LlamaConfig, attn_backend="sdpa"):
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCache, last_of: list[int] | None = None, attention=None) -> torch.Tensor:
        """Run one step over T packed tokens; returns the final-normed hidden states [T, hidden].

        `last_of`: indices of sequences whose last new token is all the caller needs (the rows that
        sample); then the result is [len(last_of), hidden], and the last layer computes attention, MLP
        and norm for those rows only — every other row's last-layer output only ever fed its own logits
        (its K/V, which later tokens read, are still written). `attention`: a backend for this call instead of
        the model's (a CUDA graph's static-shape decode attention)."""
        backend = attention or (get_backend(self.attn_backend) if isinstance(self.attn_backend, str)
                                else self.attn_backend)
        x = self.embed_tokens(input_ids)
        k_pool, _ = kv_caches.layer(0)
        if USE_NATIVE_OPS and FUSED_OPS and x.dtype == k_pool.dtype == torch.float32 \
                and native.usable(x, k_pool, self.rotary.cos, positions, meta.slot_mapping):
            rope = Rope(None, None, positions, self.rotary, native=True)
        else:
            rope = Rope(*self.rotary(positions), positions, self.rotary)
        rows, idx = None, None
        if last_of is not None:
            idx = [meta.cu_query_lens[i + 1] - 1 for i in last_of]
            if idx != sorted(set(idx)):
                raise ValueError("last_of must list distinct sequences in batch order")
            if idx and len(idx) < x.shape[0]:
                index = torch.tensor(idx, dtype=torch.long, device=x.device)
                rows = (index, AttentionMetadata([1] * len(idx), [meta.context_lens[i] for i in last_of],
                                                 [meta.block_tables[i] for i in last_of],
                                                 meta.slot_mapping[index], meta.block_size))
        delta = None
        for layer in self.layers[:-1]:
            x, delta = layer(x, rope, meta, kv_caches, backend, delta=delta)
        x, delta = self.layers[-1](x, rope, meta, kv_caches, backend, rows, delta)
        if idx is not None and rows is None and len(idx) < x.shape[0]:  # no row samples: none returned
            x, delta = x[:0], None if delta is None else delta[:0]
        return native.add_rms_norm(x, delta, self.norm.weight, self.norm.eps) if rope.native else self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the given hidden rows only."""
        return self.lm_head(hidden_rows)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a transformers LlamaForCausalLM state_dict in (fusing q/k/v and gate/up)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.weight.copy_(sd["model.norm.weight"])
            if not self.config.tie_word_embeddings:
                self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                layer.self_attn.qkv_proj.weight.copy_(torch.cat(attn))
                layer.self_attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
                mlp = [sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
                layer.mlp.gate_up_proj.weight.copy_(torch.cat(mlp))
                layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under transformers' LlamaForCausalLM names (q/k/v and gate/up split)."""
        c = self.config
        sd = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight,
              "lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            sizes = [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
            q, k, v = layer.self_attn.qkv_proj.weight.split(sizes)
            gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
            sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                       p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                       p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                       p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                       p + "input_layernorm.weight": layer.input_layernorm.weight,
                       p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
        return {k: v.detach().clone() for k, v in sd.items()}

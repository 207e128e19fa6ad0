"""The model's building blocks: linear projections, token embedding, RMSNorm, rotary embedding, paged attention
and the gated MLP, each a module of its own that a model composes.

This is where variants plug in: a tensor-parallel (column/row-parallel), pipeline or quantized (int8/int4,
executor/model/quantize.py) layer subclasses or replaces the class here, or a built module (`layer.mlp.down_proj = ...`),
and the model and the engine above are unchanged. Every layer is built from plain sizes, never from a model config.

On CPU in fp32 every projection runs oneDNN's GEMM on a weight reordered once into its blocked layout
(`Linear`): plain `F.linear` hands MKL the [out, in] weight to re-pack on every call, which costs more
than the multiply itself when few rows decode (2-4x at 1-64 rows) and ~15% at thousands of rows. At a few rows
a projection is a stream of its weight, and the native kernel (executor/model/native.py) reads it at a higher rate.
Where one hands over to the other depends on the machine and the weight's shape (on an AMD EPYC: ~32-48 rows at
1024 inputs, ~100-190 at 576), so `tune_native_rows` measures it once per shape when a runner is built; a fixed
128 left a 0.5B model's 48-128-row prompt steps 1.1-1.3x slower than oneDNN and its step time jumping at 128 rows.
The switches below are read on every call: tests and benches flip them to compare the paths.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor.model import native
from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache


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
# Rows tune_native_rows tries, in order (it keeps the last at which the native kernel is no slower), and the weight
# bytes it streams per timing: more than any last-level cache here, as a step streams them.
NATIVE_ROWS_CANDIDATES = (16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
TUNE_BYTES = 96 << 20


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
    # most rows the native kernel takes (tune_native_rows sets it per shape); None: native.linear_max_rows()
    native_max_rows: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, splits: list[int] | None = None,
                 **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        if splits is not None and sum(splits) != out_features:
            raise ValueError(f"splits {splits} do not add up to {out_features}")
        self.splits = list(splits) if splits else None

    def _parts(self) -> list[torch.Tensor]:
        w = self.weight
        return list(w.split(self.splits)) if self.splits else [w]

    def fp32_cpu_weight(self) -> bool:
        """Whether the weight is one the CPU kernels take: fp32 on the CPU, no bias (what their copies are made of)."""
        w = self.weight
        return self.bias is None and w.dtype == torch.float32 and w.device.type == "cpu"

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
        return (USE_NATIVE_LINEAR and x.dim() == 2 and x.shape[0] <= self.native_rows() and x.is_contiguous()
                and self._fp32_cpu_inference(x))

    def native_rows(self) -> int:
        """Rows up to which this projection runs through the native kernel (0 without the kernels)."""
        return native.linear_max_rows() if self.native_max_rows is None or not native.available() \
            else self.native_max_rows

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
            return self._native(x)
        return self._dense(x)

    def _native(self, x: torch.Tensor):
        outs = tuple(native.linear_small(x, p) for p in self._copies("_panels", native.pack_weight))
        return outs if self.splits else outs[0]

    def _dense(self, x: torch.Tensor):
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


class BiasedLinear(Linear):
    """A Linear with a bias (gpt-oss's attention and router, Qwen2's q, k and v) whose weight still takes Linear's CPU
    fast paths: they multiply, the bias is added after (F.linear's path, which fuses it, ran 2-3x slower)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=True)

    def fp32_cpu_weight(self) -> bool:
        w = self.weight
        return w.dtype == torch.float32 and w.device.type == "cpu"

    def _fp32_cpu_inference(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (x.device.type == "cpu" and w.dtype == torch.float32 and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and w.requires_grad))

    def forward(self, x: torch.Tensor):
        if self._use_native(x):
            return self._native(x) + self.bias
        if self._use_mkldnn(x):  # oneDNN's product of the prepacked weight, without the bias
            return self._dense(x) + self.bias
        return F.linear(x, self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    """A projection: a BiasedLinear where it has a bias, else a Linear."""
    return BiasedLinear(in_features, out_features) if bias else Linear(in_features, out_features)


def tune_native_rows(model: nn.Module) -> dict[tuple, int]:
    """Make every fp32 CPU projection's kernel copies now (the first step to need oneDNN's otherwise reorders every
    weight inside a served step: 4.4 s on a 0.5B model) and, per shape, set the most rows up to which the native
    kernel takes a projection: the last of NATIVE_ROWS_CANDIDATES at which it ran no slower than the GEMM path
    over ~TUNE_BYTES of the model's own weights of that shape (best of three, each path). Returns {(in, out,
    splits): rows} of the shapes measured: those with a projection not yet tuned (so a second call costs nothing);
    {} where the native kernel is off or not built."""
    if not (USE_NATIVE_LINEAR and native.available()):
        return {}
    groups: dict[tuple, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.fp32_cpu_weight():
            groups.setdefault((m.in_features, m.out_features, tuple(m.splits or ())), []).append(m)
    found = {}
    with torch.inference_mode():
        for shape, mods in groups.items():
            if all(m.native_max_rows is not None for m in mods):
                continue
            probe = torch.zeros(1, shape[0])
            for m in mods:  # both copies of every weight, whichever path its steps will take
                m._native(probe)
                m._dense(probe)
            sample = mods[:max(1, -(-TUNE_BYTES // (4 * shape[0] * shape[1])))]
            rows = _crossover(sample, shape[0])
            for m in mods:
                m.native_max_rows = rows
            found[shape] = rows
    return found


def _crossover(mods: list[Linear], k: int) -> int:
    def best_s(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    rows = NATIVE_ROWS_CANDIDATES[0]
    for m_rows in NATIVE_ROWS_CANDIDATES:
        x = torch.full((m_rows, k), 0.01)  # values do not change the time; no draw from the seeded generator
        if best_s(lambda: [m._native(x) for m in mods]) > best_s(lambda: [m._dense(x) for m in mods]):
            break
        rows = m_rows
    return rows


class Embedding(nn.Embedding):
    """The token embedding (nn.Embedding, same state_dict): its own class so a vocab-parallel one can replace it."""


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

    def fused_add(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x += delta in place (None: nothing to add), then the norm of x as a new tensor: one native pass
        (x [T, C] contiguous fp32, the native kernels built)."""
        return native.add_rms_norm(x, delta, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim/2], with HF's "linear", "llama3" or "yarn" scaling."""
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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss, DeepSeek): frequencies above `beta_fast` rotations over the original context kept, those below
    `beta_slow` interpolated by `factor`, a linear ramp between (over the dimension index, optionally truncated)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` into the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (0.1 · ln(factor) + 1, or DeepSeek's mscale ratio); 1.0 otherwise."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale 0.1 · mscale · ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, indexed by each token's position (rotate-half layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)  # YaRN scales cos and sin; 1.0 for every other kind
        self.register_buffer("cos", freqs.cos() if factor == 1.0 else freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() if factor == 1.0 else freqs.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim/2], broadcastable over heads."""
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def angles(self, positions: torch.Tensor, x: torch.Tensor, k_pool: torch.Tensor,
               slot_mapping: torch.Tensor) -> Rope:
        """A step's Rope: the fused native path where its kernels take the step's hidden states `x`, cache pool
        and slots (fp32 on the CPU; the pool fp32 or the KV cache's int8 rows), else per-token cos/sin for the
        torch path."""
        if USE_NATIVE_OPS and FUSED_OPS and x.dtype == torch.float32 and native.kv_pool_usable(k_pool) \
                and native.usable(x, self.cos, positions, slot_mapping) \
                and (k_pool.dtype == torch.float32 or self.cos.shape[1] * 2 <= native.KV_MAX_HEAD_DIM):
            return Rope(None, None, positions, self, native=True)
        return Rope(*self(positions), positions, self)


@dataclass
class Rope:
    """A step's rotary angles: per-token cos/sin [T, 1, D/2] for the torch path, or (native) the tables and
    each token's position for the fused native kernel, which also does the layer's other elementwise work."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    positions: torch.Tensor
    rotary: RotaryEmbedding
    native: bool = False


class Attention(nn.Module):
    """Self-attention over the paged KV cache: fused qkv projection, RoPE, the K/V write to the step's slots,
    the attention backend, output projection. `qk_norm_eps`: an RMSNorm over each query and key head before RoPE
    (Qwen3's q_norm and k_norm)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, hidden_size, bias=False)
        self.scale = head_dim ** -0.5
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x, rope: Rope, meta: AttentionMetadata, kv_cache: KVCache, backend,
                rows: tuple[torch.Tensor, AttentionMetadata] | None = None) -> torch.Tensor:
        """Attention output for every token, or with `rows` = (token rows, their metadata as single-query
        sequences) for those rows only (K/V of every token are still written to the cache)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_pool, v_pool = kv_cache.layer(self.layer_idx)
        if rope.native and self.q_norm is None:  # rotate q and k, write k and v to their slots: one pass over qkv
            q = native.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.rotary.cos,
                                     rope.rotary.sin, rope.positions, k_pool, v_pool, meta.slot_mapping)
        else:
            cos, sin = (rope.cos, rope.sin) if rope.cos is not None else rope.rotary(rope.positions)
            if self.q_norm is not None:  # each head normed before its rotation
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = apply_rope(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)
                k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)
            elif FUSED_OPS and qkv.dtype == torch.float32:  # rotate q and k together
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
    """SwiGLU: down(silu(gate(x)) · up(x)), gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * i, bias=False, splits=[i, i])
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The MLP's output; `fused`: silu·up in one native pass (the layer's native elementwise path)."""
        gate, up = self.gate_up_proj(x)  # two contiguous GEMM outputs, owned here: updated in place
        if fused:
            return self.down_proj(native.silu_mul(gate, up))
        if FUSED_OPS and not torch.is_grad_enabled():
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.silu(gate) * up)

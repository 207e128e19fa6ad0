"""Weight-only quantization of a model's linear layers (the decoder's qkv / o / gate·up / down projections and the LM
head), in place: `quantize_weights(model, "int8" | "int4" | "fp8")`, and what the weights then occupy
(`weight_bytes`).

- int8: symmetric, one fp32 scale per output channel (w ≈ q · s, q in [-127, 127]).
- int4: asymmetric, per group of `group_size` (default 32) input features and output channel an fp16 scale and
  min (w ≈ q · s + m, q in [0, 15]: llama.cpp's Q4_1, 5 bits a weight). Asymmetric because the kernel's
  dequantization is one FMA either way, so the zero point costs nothing at run time. Groups of 32 because on
  SmolLM2-135M groups of 128 cost +69% perplexity and 64 +53%, against +0.03% for 32 (bench/quant_kernels.py;
  its shipped weights are themselves Q4_1 in groups of 32, which 32 reproduces), at the same decode speed when
  measured (the float tile was compute-bound; the 1-2-row VNNI tile added since streams at memory speed, where 32's
  scales are 1 of 5 bits a weight: not re-measured). A K that the group size does not divide ends in a shorter
  group. The LM head of an int4 model is int8 (`lm_head_dtype`), as llama.cpp's Q4 mixes keep the output matrix
  at 6-8 bits: at int4 it alone cost +8% perplexity.
- fp8 (CUDA GPUs with fp8 matmuls only): e4m3 weights with a scale per output channel, activations scaled per
  tensor at run time, torch._scaled_mm.

int8 / int4 weights are stored once, already in the native kernel's panel layout (`[N / width][K][width]` columns,
executor/model/kernels.cpp: `linear_quantized`), which the torch path unpacks with plain tensor ops, so results never
depend on the native library. On the CPU a projection of up to `QUANT_MAX_ROWS_BY_PANEL` rows (decodes, verify rows,
prompts of up to 2048 tokens) runs the native kernel, which dequantizes in registers as the weight streams past;
more rows dequantize the weight to fp32 once per call and multiply with MKL, where the FLOPs, not the bytes, decide.

The token embedding stays fp32: a step reads only its tokens' rows. A tied LM head (SmolLM2) gets its own quantized
copy of the embedding matrix, as llama.cpp's Q8_0 / Q4 files quantize the output matrix.

`outlier_threshold` (LLM.int8()'s mixed decomposition): the input features whose activation magnitude exceeds it on
a calibration prompt (by default 128 seeded random token ids; `calibration_ids` to pass real text) keep their weight
columns in fp32; the quantized weight multiplies the other features. Activation-based, as in LLM.int8(), because
the outliers are a property of the activations (a few hidden dimensions carry them for every token), not of the
weight columns that read them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.model import native
from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache

WEIGHT_DTYPES = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128, 256)
# A CPU projection with at most this many rows runs the native kernel, more rows dequantize and multiply with MKL
# (by panel width). AVX-512: all of SmolLM2's projections at 256 / 512 / 1024 rows took 359 / 734 / 1468 ms in the
# int8 kernel, 447 / 829 / 1606 dequantized + MKL, 571 / 914 / 1550 dequantized + reordered for oneDNN (fp32 oneDNN:
# 345 / 658 / 1313); the dequantizing pass over the whole weight only pays off with thousands of rows. AVX2's
# 6-row tiles: the fp32 kernel's switch.
QUANT_MAX_ROWS_BY_PANEL = {32: 2048, 16: 32}
# Switch off to run every quantized projection through the torch path (dequantize, then matmul).
USE_NATIVE_QUANT = True
CALIBRATION_TOKENS = 128
FP8_MAX = 448.0  # the largest e4m3 value


def _panel_width() -> int:
    """Columns per panel: the native kernels' (16 on AVX2 builds) where they are built, else AVX-512's 32."""
    lib = native.library()
    return lib.panel_columns if lib is not None else 32


def quantize_int8(w: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (panels int8 [ceil(N / width), K, width], scales fp32 [ceil(N / width) · width]); padding
    columns are zero with scale 0."""
    n, k = w.shape
    np_ = -(-n // width)
    w = F.pad(w.float(), (0, 0, 0, np_ * width - n))
    scale = w.abs().amax(1) / 127.0
    q = torch.where(scale[:, None] > 0, torch.round(w / scale[:, None].clamp_min(1e-30)), 0.0).clamp_(-127, 127)
    panels = q.to(torch.int8).view(np_, width, k).transpose(1, 2).contiguous()
    return panels, scale.contiguous()


def quantize_int4(w: torch.Tensor, width: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (panels uint8 [ceil(N / width), K, width / 2], byte j of row k holding column j in its low nibble
    and column j + width / 2 in its high one; scales [ceil(N / width), ceil(K / group_size), 2, width]: (scale,
    min) per group and column, fp16 kept as int16 bits (so a model's `.to(dtype)` leaves them alone))."""
    n, k = w.shape
    np_, groups, half = -(-n // width), -(-k // group_size), width // 2
    w = F.pad(w.float(), (0, groups * group_size - k, 0, np_ * width - n)).view(np_ * width, groups, group_size)
    real = (torch.arange(groups * group_size) < k).view(1, groups, group_size)  # a short last group's real rows
    lo = torch.where(real, w, float("inf")).amin(-1)
    hi = torch.where(real, w, float("-inf")).amax(-1)
    scale, low = ((hi - lo) / 15.0).half(), lo.half()
    if not (torch.isfinite(scale).all() and torch.isfinite(low).all()):
        raise ValueError("int4 scales overflow fp16: weights beyond ±65504")
    s, m = scale.float()[..., None], low.float()[..., None]
    q = torch.where(s > 0, torch.round((w - m) / s.clamp_min(1e-30)), 0.0).clamp_(0, 15).to(torch.uint8)
    q = q.view(np_ * width, groups * group_size)[:, :k].reshape(np_, width, k).transpose(1, 2)  # [np, K, width]
    panels = (q[..., :half] | (q[..., half:] << 4)).contiguous()
    scales = torch.stack([scale.view(np_, width, groups), low.view(np_, width, groups)], dim=2)  # [np, width, 2, G]
    return panels, scales.permute(0, 3, 2, 1).contiguous().view(torch.int16)


def dequantize_panels(panels: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, n: int,
                      k: int) -> torch.Tensor:
    """The weight [n, k] (fp32) of int8 or int4 panels, in torch (the native library's dequantize_panels is the
    fast form, transposed)."""
    np_, width = panels.shape[0], panels.shape[-1] * (1 if bits == 8 else 2)
    if bits == 8:
        w = panels.float() * scales.view(np_, 1, width)
    else:
        q = torch.cat([panels & 15, panels >> 4], dim=-1).float()  # [np, K, width]
        halves = scales.view(torch.float16)
        s, m = (halves[:, :, i].float().repeat_interleave(group_size, dim=1)[:, :k] for i in (0, 1))
        w = q * s + m
    return w.transpose(1, 2).reshape(np_ * width, k)[:n]


class QuantizedWeight(nn.Module):
    """One weight [n, k] quantized to int8 or int4 in panel layout, and y = x wᵀ with it; with `outliers` (input
    feature indices) those features' columns are kept in fp32 and multiplied apart. With `split` (a multiple of the
    panel width) y comes back as its two column ranges, each contiguous (a fused gate|up weight)."""

    def __init__(self, weight: torch.Tensor, bits: int, group_size: int = 32, outliers: torch.Tensor | None = None,
                 split: int | None = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, not {bits}")
        if bits == 4 and group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, not {group_size}")
        self.n, self.k = weight.shape
        self.bits, self.group_size, self.width = bits, group_size, _panel_width()
        if split is not None and (split % self.width or not 0 < split < self.n):
            raise ValueError(f"split {split} is not a multiple of the panel width {self.width} inside {self.n} columns")
        self.split = split
        w = weight.detach().float().cpu()
        self.register_buffer("outlier_index", None)
        self.register_buffer("outlier_weight", None)
        if outliers is not None and outliers.numel():
            outliers = outliers.to(torch.long).cpu()
            self.register_buffer("outlier_index", outliers.to(weight.device))
            self.register_buffer("outlier_weight", w[:, outliers].t().contiguous().to(weight.device))  # [c, n]
            w = w.clone()
            w[:, outliers] = 0.0  # out of the quantized weight's ranges
        panels, scales = quantize_int8(w, self.width) if bits == 8 else quantize_int4(w, self.width, group_size)
        self.register_buffer("panels", panels.to(weight.device))
        self.register_buffer("scales", scales.to(weight.device))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the layer multiplies by it, [n, k] (outlier columns in fp32)."""
        w = dequantize_panels(self.panels, self.scales, self.bits, self.group_size, self.n, self.k)
        if self.outlier_index is not None:
            w[:, self.outlier_index] = self.outlier_weight.t().float()
        return w.to(dtype)

    _kernel: tuple | None = None  # (function, panels' and scales' addresses, most rows): the decode fast path

    def _apply(self, fn, *args, **kwargs):  # .to() / .cpu() / share_memory_() may move the buffers
        self._kernel = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # the addresses are this object's: never pickled or deep-copied
        state = dict(self.__dict__)
        state.pop("_kernel", None)
        return state

    def _native(self, x: torch.Tensor) -> bool:
        lib = native.library()
        return (USE_NATIVE_QUANT and lib is not None and x.device.type == "cpu" and x.dtype == torch.float32
                and self.width == lib.panel_columns and self.scales.dtype in (torch.float32, torch.int16))

    def _decode_kernel(self) -> tuple | None:
        """The native call's fixed arguments, made once: a decode step runs ~150 projections, where Python's
        per-call work (~15 us each through forward) was a fifth of an int4 step."""
        lib = native.library()
        if (lib is None or self.outlier_index is not None or self.panels.device.type != "cpu"
                or self.width != lib.panel_columns or self.scales.dtype not in (torch.float32, torch.int16)):
            return None
        return (lib.linear_quantized, self.panels.data_ptr(), self.scales.data_ptr(),
                QUANT_MAX_ROWS_BY_PANEL.get(self.width, 32))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] @ wᵀ: the module's forward, without nn.Module's call overhead on the decode fast path (a
        contiguous fp32 CPU [M, k] of up to QUANT_MAX_ROWS_BY_PANEL rows, no outlier columns)."""
        if USE_NATIVE_QUANT and x.dtype is torch.float32 and x.dim() == 2 and x.device.type == "cpu":
            if self._kernel is None:
                self._kernel = self._decode_kernel() or ()
            if self._kernel and x.shape[0] <= self._kernel[3] and x.is_contiguous():
                fn, panels, scales, _ = self._kernel
                m, split = x.shape[0], self.split
                if split is None:
                    y = torch.empty((m, self.n))
                    fn(x.data_ptr(), m, self.k, panels, scales, self.bits, self.group_size, self.n, y.data_ptr(),
                       self.n, 0, self.n)
                    return y
                y, y2 = torch.empty((m, split)), torch.empty((m, self.n - split))
                fn(x.data_ptr(), m, self.k, panels, scales, self.bits, self.group_size, self.n, y.data_ptr(), split,
                   y2.data_ptr(), split)
                return y, y2
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        xq = x2
        if self.outlier_index is not None:  # the outlier features go to the fp32 columns only
            xq = x2.clone()
            xq[:, self.outlier_index] = 0.0
        if self._native(x2):
            xq = xq.contiguous()
            if xq.shape[0] <= QUANT_MAX_ROWS_BY_PANEL.get(self.width, 32):
                y = native.linear_quantized(xq, self.panels, self.scales, self.bits, self.group_size, self.n)
            else:
                y = xq @ native.dequantize_panels(self.panels, self.scales, self.bits, self.group_size, self.n,
                                                  self.k)
        else:
            w = dequantize_panels(self.panels, self.scales, self.bits, self.group_size, self.n, self.k)
            y = F.linear(xq, w.to(x.dtype))
        if self.outlier_index is not None:
            y = y.addmm_(x2[:, self.outlier_index], self.outlier_weight.to(y.dtype))
        if self.split is not None:
            return (y[:, :self.split].contiguous().view(*lead, self.split),
                    y[:, self.split:].contiguous().view(*lead, self.n - self.split))
        return y.view(*lead, self.n)


class Fp8Weight(nn.Module):
    """One weight [n, k] in float8 e4m3 with a scale per output channel, multiplied by torch._scaled_mm with the
    activations scaled per tensor (a CUDA GPU with fp8 matmuls: compute capability 8.9 or later)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.n, self.k = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(1) / FP8_MAX).clamp_min(1e-12)
        self.register_buffer("weight_fp8", (w / scale[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("scales", scale.view(1, -1))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_fp8.float() * self.scales.t()).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        x_scale = (x2.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
        x8 = (x2.float() / x_scale).to(torch.float8_e4m3fn)
        one = torch.ones((), device=x.device)
        y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)
        return (y * self.scales).to(x.dtype).view(*lead, self.n)


class QuantizedLinear(nn.Module):
    """A drop-in for executor.model.layers.Linear (no bias) with a quantized weight; `splits` as Linear's (one quantized
    weight and one output per part). `weight` gives the dequantized weight (for code that reads it: drafters,
    sharding)."""

    def __init__(self, linear: nn.Linear, weight_dtype: str, group_size: int = 32,
                 outliers: torch.Tensor | None = None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("quantized layers take no bias")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = weight_dtype
        self.splits = getattr(linear, "splits", None)
        w = linear.weight.detach()
        parts = w.split(self.splits) if self.splits else [w]
        self.fused = False
        if weight_dtype == "fp8":
            self.parts = nn.ModuleList(Fp8Weight(p) for p in parts)
        elif self.splits and len(self.splits) == 2 and self.splits[0] % _panel_width() == 0:
            # gate|up as one weight, its halves written to two outputs by one kernel call (30 fewer calls a step)
            bits = 8 if weight_dtype == "int8" else 4
            self.parts = nn.ModuleList([QuantizedWeight(w, bits, group_size, outliers, split=self.splits[0])])
            self.fused = True
        else:
            bits = 8 if weight_dtype == "int8" else 4
            self.parts = nn.ModuleList(QuantizedWeight(p, bits, group_size, outliers) for p in parts)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    def forward(self, x: torch.Tensor):
        parts = self.parts._modules.values()  # plain methods, not module calls: this runs ~120 times a decode step
        if not self.splits or self.fused:
            return next(iter(parts)).matmul(x)
        return tuple(p.matmul(x) for p in parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight_dtype={self.weight_dtype}"


def _targets(model) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear layer to quantize: each decoder layer's projections, then the LM head."""
    out = []
    for layer in model.layers:
        out += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                (layer.mlp, "down_proj")]
    return out + [(model, "lm_head")]


@torch.inference_mode()
def activation_absmax(model, ids: list[int]) -> dict[nn.Module, torch.Tensor]:
    """Per linear layer to quantize, the largest |activation| of each input feature over one forward of the prompt
    `ids` (and the LM head over its hidden states)."""
    found: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
        found[module] = torch.maximum(found[module], x) if module in found else x

    hooks = [getattr(parent, name).register_forward_pre_hook(record) for parent, name in _targets(model)]
    try:
        p = next(model.parameters())
        t, bs = len(ids), 16
        cache = KVCache.for_model(model.config, -(-t // bs), bs, p.dtype, p.device)
        meta = AttentionMetadata.build([t], [t], [list(range(-(-t // bs)))], bs, p.device)
        hidden = model(torch.tensor(ids, device=p.device), meta.positions(), meta, cache)
        model.compute_logits(hidden)
    finally:
        for h in hooks:
            h.remove()
    return found


def quantize_weights(model, weight_dtype: str, group_size: int = 32, outlier_threshold: float | None = None,
                     calibration_ids: list[int] | None = None, lm_head_dtype: str | None = None):
    """Replace `model`'s linear layers (every decoder projection and the LM head) by quantized ones, in place, and
    return the model. weight_dtype: "int8" (per-channel), "int4" (groups of `group_size` along K, asymmetric) or
    "fp8" (CUDA GPUs with fp8 matmuls). `lm_head_dtype`: the LM head's (default: int8 for an int4 model, else
    weight_dtype). `outlier_threshold`: input features whose activation magnitude on the calibration prompt
    (`calibration_ids`, default 128 seeded random token ids) exceeds it keep fp32 weight columns (LLM.int8()'s mixed
    decomposition; int8 / int4 only)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r} is not supported; allowed: {', '.join(WEIGHT_DTYPES)}")
    p = next(model.parameters())
    if weight_dtype == "fp8":
        if p.device.type != "cuda" or not hasattr(torch, "_scaled_mm") \
                or torch.cuda.get_device_capability(p.device) < (8, 9):
            raise ValueError("fp8 weights need a CUDA GPU with fp8 matmuls (compute capability 8.9+, "
                             "torch._scaled_mm); allowed here: int8, int4")
        if outlier_threshold is not None:
            raise ValueError("outlier_threshold applies to int8 / int4 weights, not fp8")
    if weight_dtype == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, not {group_size}")
    head_dtype = lm_head_dtype or ("int8" if weight_dtype == "int4" else weight_dtype)
    if head_dtype not in WEIGHT_DTYPES or (head_dtype == "fp8") != (weight_dtype == "fp8"):
        raise ValueError(f"lm_head_dtype {head_dtype!r} with {weight_dtype} weights is not supported; allowed: int8 or "
                         "int4 beside int8 / int4 weights, fp8 beside fp8")
    absmax = {}
    if outlier_threshold is not None:
        if calibration_ids is None:
            gen = torch.Generator().manual_seed(0)
            calibration_ids = torch.randint(model.config.vocab_size, (CALIBRATION_TOKENS,), generator=gen).tolist()
        absmax = activation_absmax(model, calibration_ids)
    for parent, name in _targets(model):
        linear = getattr(parent, name)
        if isinstance(linear, QuantizedLinear):
            raise ValueError(f"{name} is already quantized ({linear.weight_dtype})")
        outliers = None
        if linear in absmax:
            outliers = (absmax[linear] > outlier_threshold).nonzero().squeeze(1)
        dtype = head_dtype if name == "lm_head" else weight_dtype
        setattr(parent, name, QuantizedLinear(linear, dtype, group_size, outliers))
    return model


def outlier_columns(model) -> int:
    """Input features kept in fp32 across the model's quantized weights (each part of a split layer counted)."""
    return sum(m.outlier_index.numel() for m in model.modules()
               if isinstance(m, QuantizedWeight) and m.outlier_index is not None)


def weight_bytes(model) -> int:
    """Bytes the model's weights occupy: every parameter and persistent buffer (quantized values, their scales,
    fp32 outlier columns, the fp32 embedding and norms), a tensor shared by two names (a tied head) once. Caches of
    a weight in a kernel's layout (Linear's prepacked copies) are not weights and are not counted."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


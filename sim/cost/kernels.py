"""The GPU kernel model: how long the kernels of a decoder step take on a device, fitted to real measurements.

Its parameters (sim/data/gpu_kernels.json) are fitted by calibration/kernel_fit.py to measured kernels: Vidur's
public profiles of A100, H100 and A40 GPUs (per decoder-layer op, by model shape, tensor-parallel size and token
count) and a sweep of GEMMs, attention and elementwise passes timed on an H200 (calibration/gpu_kernels.py);
collectives to Vidur's NCCL measurements on DGX A100 / H100 and PCIe boards. Sources and the fits' accuracy:
docs/cost-model.md#the-gpu-kernel-model.

- A GEMM of M tokens, N outputs, K inputs takes floor + (t_mem^p + t_compute^p)^(1/p): t_mem streams the weights
  (and the activations) at an achieved bandwidth, t_compute = 2·M·N·K / (flops · M / (M + m_half)) — a small-M GEMM
  fills too few tiles to reach the large-GEMM rate; p sets how sharply one bound hands over to the other.
- An elementwise pass (a norm, rotary, the gated activation, a residual add): floor + bytes / bandwidth.
- Attention: prefill = floor per sequence + FLOPs / flops + a cost per key (the last query tile walks them all);
  decode = floor + KV bytes / bandwidth.
- A grouped expert GEMM (a MoE layer's gate/up or down over the experts a step touches, `torch._grouped_mm`): the
  GEMM form over them all, streaming each touched expert's weights once and computing every touched expert as if it
  had the busiest expert's tokens (the busiest sets the time; under uniform routing that is the tokens' own count).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from sim.config.sharding import LayerShape, shard

KERNELS_PATH = Path(__file__).resolve().parents[1] / "data" / "gpu_kernels.json"


@dataclass(frozen=True)
class GemmFit:
    """Achieved speed of one device's GEMMs in one dtype."""

    floor_s: float  # the shortest GEMM kernel
    bandwidth: float  # bytes/s, streaming weights and activations
    flops: float  # FLOP/s of a large GEMM
    sharpness: float  # p of the smooth max of the memory and compute times
    m_half: float  # tokens at which the achieved rate is half `flops`

    def time(self, m, n, k, weight_bytes: float = 2.0, act_bytes: float = 2.0, compute_scale: float = 1.0):
        """Seconds for x[m, k] @ w[n, k]ᵀ (floats or numpy arrays); `compute_scale` multiplies the FLOP rate
        (2:4 sparse tensor cores, dequantizing kernels)."""
        t_mem = (n * k * weight_bytes + (m * k + m * n) * act_bytes) / self.bandwidth
        t_compute = 2.0 * n * k * (m + self.m_half) / (self.flops * compute_scale)  # 2mnk at flops·m/(m+m_half)
        p = self.sharpness
        return self.floor_s + (t_mem ** p + t_compute ** p) ** (1.0 / p)


def grouped_gemm_time(fit: GemmFit, tokens, touched, busiest, n, k, weight_bytes: float = 2.0,
                      act_bytes: float = 2.0, compute_scale: float = 1.0):
    """Seconds for a grouped GEMM of `tokens` routed rows in all over `touched` experts (each x[m_e, k] @ w_e[n, k]ᵀ),
    the busiest expert computing `busiest` rows (floats or numpy arrays)."""
    t_mem = (touched * n * k * weight_bytes + tokens * (k + n) * act_bytes) / fit.bandwidth
    t_compute = 2.0 * n * k * touched * (busiest + fit.m_half) / (fit.flops * compute_scale)
    p = fit.sharpness
    return fit.floor_s + (t_mem ** p + t_compute ** p) ** (1.0 / p)


def pass_time(fit: dict, nbytes: float) -> float:
    """Seconds for an elementwise pass moving `nbytes` ({"floor_s", "bandwidth"})."""
    return fit["floor_s"] + nbytes / fit["bandwidth"]


@dataclass(frozen=True)
class DeviceKernels:
    """One device's fitted kernels: GEMMs by dtype ("fp16": 16-bit, "fp8"), elementwise passes by kind
    (input_norm, post_norm, rope, act, add), attention (None where not measured), the NCCL system its collectives
    were measured on, and how each part not measured on this device was carried over from one that was."""

    device: str
    source: str  # "vidur": fitted to Vidur's profiles; "measured": to a calibration.gpu_kernels run; "derived"
    gemm: dict[str, GemmFit]
    passes: dict[str, dict]
    attention: dict | None = None
    collectives: str | None = None
    notes: dict = field(default_factory=dict)
    measured_on: str = ""  # the device whose kernels the fits come from (this one, or the one carried over)
    grouped: GemmFit | None = None  # grouped expert GEMMs (16-bit), where measured or carried over

    def to_json(self) -> dict:
        return {"device": self.device, "source": self.source, "gemm": {k: asdict(v) for k, v in self.gemm.items()},
                "passes": self.passes, "attention": self.attention, "collectives": self.collectives,
                "notes": self.notes, "measured_on": self.measured_on or self.device,
                **({"grouped": asdict(self.grouped)} if self.grouped is not None else {})}

    @classmethod
    def from_json(cls, data: dict) -> "DeviceKernels":
        return cls(data["device"], data["source"], {k: GemmFit(**v) for k, v in data["gemm"].items()},
                   data["passes"], data.get("attention"), data.get("collectives"), data.get("notes", {}),
                   data.get("measured_on", data["device"]),
                   GemmFit(**data["grouped"]) if data.get("grouped") else None)


def layer_gemms(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, tp: int, tokens: int,
                gated: bool = True) -> list[tuple[str, int, int, int]]:
    """(op, M, N, K) of one decoder layer's GEMMs on one of `tp` devices (Megatron sharding: heads and the MLP's
    columns split, KV heads replicated where there are fewer than devices)."""
    s = shard(LayerShape(heads, kv_heads, inter), tp)
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    up = (2 if gated else 1) * s.intermediate
    return [("qkv", tokens, q + 2 * kv, hidden), ("o", tokens, hidden, q), ("gate_up", tokens, up, hidden),
            ("down", tokens, hidden, s.intermediate)]


def layer_passes(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, tp: int, tokens: int,
                 gated: bool = True, act_bytes: int = 2) -> dict[str, float]:
    """Bytes each elementwise pass of one decoder layer reads and writes on one of `tp` devices: the two norms over
    the (replicated) hidden state, rotary over the queries and keys, the gated activation, one residual add."""
    s = shard(LayerShape(heads, kv_heads, inter), tp)
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    return {"input_norm": 2 * tokens * hidden * act_bytes, "post_norm": 2 * tokens * hidden * act_bytes,
            "rope": 2 * tokens * (q + kv) * act_bytes, "act": (3 if gated else 2) * tokens * s.intermediate * act_bytes,
            "add": 3 * tokens * hidden * act_bytes}


@lru_cache(maxsize=4)
def load_kernels(path: Path = KERNELS_PATH) -> tuple[dict[str, DeviceKernels], dict]:
    """(fitted devices by catalog name, fitted collectives by system) from the shipped file."""
    data = json.loads(Path(path).read_text())
    return {name: DeviceKernels.from_json(d) for name, d in data["devices"].items()}, data["collectives"]


@lru_cache(maxsize=4)
def load_accuracy(path: Path = KERNELS_PATH) -> dict:
    """The fits' error on what they left out, by device, and the roofline's on the same measurements."""
    return json.loads(Path(path).read_text()).get("accuracy", {})


def custom_all_reduce(kernels: DeviceKernels, engine):
    """The engine's custom all-reduce on this device as `f(nbytes, devices) -> seconds | None`, or None where its
    timings were not measured (then NCCL prices every all-reduce)."""
    return None

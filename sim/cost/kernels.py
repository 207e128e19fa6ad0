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
import re
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from sim.config.hardware import kernels_file
from sim.config.sharding import LayerShape, shard

KERNELS_PATH = Path(__file__).resolve().parents[1] / "data" / "gpu_kernels.json"
# one file per device ({"source", "engines", "accuracy"}): a run parses its own device's, not all nine (~19 M instructions)
ENGINE_KERNELS_DIR = Path(__file__).resolve().parents[1] / "data" / "engine_kernels"
KERNEL_ENGINES = ("vllm", "sglang", "trtllm")  # the engines AIConfigurator measured


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
class AttentionFit:
    """An engine's attention kernels on one device, per layer, as AIConfigurator timed them (one sequence's prompt
    with no cached prefix; decode rows over their KV cache), in a form the data supports better than `attention`'s:

    - prefill: floor + per (sequence x KV head) + FLOPs / flops + per key x (k0 + (k_head · heads + k_kv ·
      kv_heads) · head_dim / 128) — besides the last query tile walking every key, each key costs K/V traffic
      per KV head and Q/O traffic per query head;
    - decode: floor + per (row x KV head) + KV bytes / (bandwidth · x / (x + parallel_half)), x = rows x KV heads:
      each (row, KV head) is a thread block with a fixed cost, and the kernel reaches its bandwidth once enough of
      them (with the keys split across blocks) fill the GPU."""

    prefill_floor_s: float  # once per step with prompt chunks
    prefill_s_per_seq_kv_head: float
    prefill_flops: float
    prefill_s_per_key: float
    prefill_s_per_key_head: float  # per key and query head at head_dim 128
    prefill_s_per_key_kv_head: float  # per key and KV head at head_dim 128
    decode_floor_s: float  # once per step that decodes
    decode_s_per_row_kv_head: float
    decode_bandwidth: float  # bytes/s of KV read at full occupancy
    decode_parallel_half: float  # rows x KV heads at which the KV read runs at half `decode_bandwidth`

    def prefill_s(self, batch, isl, heads, kv_heads, head_dim):
        """One layer's attention over `batch` fresh prompts of `isl` tokens (floats or numpy arrays)."""
        flops = 4 * heads * head_dim * batch * isl * (isl + 1) / 2
        return (self.prefill_floor_s + self.prefill_s_per_seq_kv_head * batch * kv_heads + flops / self.prefill_flops
                + batch * isl * self.s_per_key(heads, kv_heads, head_dim))

    def s_per_key(self, heads, kv_heads, head_dim):
        """A prompt key's cost besides its FLOPs."""
        return self.prefill_s_per_key + (self.prefill_s_per_key_head * heads
                                         + self.prefill_s_per_key_kv_head * kv_heads) * head_dim / 128

    def decode_s(self, rows, kv_len, kv_heads, kv_bytes_per_token):
        """One layer's attention of `rows` decode rows of `kv_len` keys each, `kv_bytes_per_token` the K and V one
        token keeps on this device in this layer (floats or numpy arrays)."""
        return (self.decode_floor_s + self.decode_s_per_row_kv_head * rows * kv_heads
                + rows * kv_len * self.s_per_kv_byte(rows, kv_heads) * kv_bytes_per_token)

    def s_per_kv_byte(self, rows, kv_heads):
        """Seconds per byte of KV a decode step of `rows` rows reads."""
        x = rows * kv_heads
        return (x + self.decode_parallel_half) / (x * self.decode_bandwidth)

    def terms(self, heads: int, kv_heads: int, head_dim: int, kv_bytes_per_token: float) -> AttentionTerms:
        """The per-layer coefficients of a model shard's steps (heads and KV heads on one device)."""
        return AttentionTerms(self, kv_heads, kv_bytes_per_token, prefill_floor_s=self.prefill_floor_s,
                              s_per_prefill_seq=self.prefill_s_per_seq_kv_head * kv_heads,
                              s_per_prefill_pair=4 * heads * head_dim / self.prefill_flops,
                              s_per_prefill_key=self.s_per_key(heads, kv_heads, head_dim),
                              decode_floor_s=self.decode_floor_s, s_per_decode_row=self.decode_s_per_row_kv_head * kv_heads)


@dataclass(frozen=True, repr=False)
class AttentionTerms:
    """One layer's attention in a step, for one model shard, split as a step's price adds it up: floors once per
    step, a cost per prompt chunk, per causal (query, key) pair and per key of the chunks' context, per decode row,
    and per KV token the decode rows read (which falls with the rows as they fill the GPU)."""

    fit: AttentionFit
    kv_heads: int
    kv_bytes_per_token: float
    prefill_floor_s: float
    s_per_prefill_seq: float
    s_per_prefill_pair: float
    s_per_prefill_key: float
    decode_floor_s: float
    s_per_decode_row: float

    def per_kv_token_s(self, decode_rows: int) -> float:
        """Seconds per KV token read in a step of `decode_rows` decode rows."""
        return self.kv_bytes_per_token * self.fit.s_per_kv_byte(decode_rows, self.kv_heads) if decode_rows else 0.0


@dataclass(frozen=True, repr=False)
class DeviceKernels:
    """One device's fitted kernels: GEMMs by dtype ("fp16": 16-bit, "fp8": per-tensor fp8, "fp8_block": 128x128
    block-scaled fp8, "fp4": NVFP4), elementwise passes by kind (input_norm, post_norm, rope, act, add), attention
    (None where not measured), the NCCL system its collectives were measured on, and how each part not measured on
    this device was carried over from one that was. An engine's kernels (`engine_kernels`) also name the engine and
    version, fit its attention in `attention_fit`'s form besides `attention`'s, and give its own all-reduce
    (`custom_all_reduce`: by CUDA-graph mode and device count, a fit and the largest message it takes)."""

    device: str
    source: str  # "vidur": Vidur's profiles; "measured": a calibration.gpu_kernels run; "derived"; "aic": AIConfigurator
    gemm: dict[str, GemmFit]
    passes: dict[str, dict]
    attention: dict | None = None
    collectives: str | None = None
    notes: dict = field(default_factory=dict)
    measured_on: str = ""  # the device whose kernels the fits come from (this one, or the one carried over)
    grouped: GemmFit | None = None  # grouped expert GEMMs (16-bit), where measured or carried over
    engine: str = ""  # the serving engine whose kernels these are ("": the engine-agnostic default)
    version: str = ""
    attention_fit: AttentionFit | None = None
    custom_all_reduce: dict | None = None  # {"graph" | "eager": {"<devices>": {latency_s, bandwidth, ..., max_bytes}}}
    grouped_mxfp4: GemmFit | None = None  # the engine's MXFP4 expert kernel (weights 4.25 bits), where measured

    def to_json(self) -> dict:
        extra = {"engine": self.engine, "version": self.version,
                 "attention_fit": asdict(self.attention_fit) if self.attention_fit else None,
                 "custom_all_reduce": self.custom_all_reduce,
                 "grouped_mxfp4": asdict(self.grouped_mxfp4) if self.grouped_mxfp4 else None}
        return {"device": self.device, "source": self.source, "gemm": {k: asdict(v) for k, v in self.gemm.items()},
                "passes": self.passes, "attention": self.attention, "collectives": self.collectives,
                "notes": self.notes, "measured_on": self.measured_on or self.device,
                **({"grouped": asdict(self.grouped)} if self.grouped is not None else {}),
                **{k: v for k, v in extra.items() if v}}

    @classmethod
    def from_json(cls, data: dict) -> "DeviceKernels":
        return cls(data["device"], data["source"], {k: GemmFit(**v) for k, v in data["gemm"].items()},
                   data["passes"], data.get("attention"), data.get("collectives"), data.get("notes", {}),
                   data.get("measured_on", data["device"]),
                   GemmFit(**data["grouped"]) if data.get("grouped") else None, data.get("engine", ""),
                   data.get("version", ""), AttentionFit(**data["attention_fit"]) if data.get("attention_fit") else None,
                   data.get("custom_all_reduce"),
                   GemmFit(**data["grouped_mxfp4"]) if data.get("grouped_mxfp4") else None)


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
    data = kernels_file(path)
    return {name: DeviceKernels.from_json(d) for name, d in data["devices"].items()}, data["collectives"]


@lru_cache(maxsize=4)
def load_accuracy(path: Path = KERNELS_PATH) -> dict:
    """The fits' error on what they left out, by device, and the roofline's on the same measurements."""
    return kernels_file(path).get("accuracy", {})


def version_key(version: str) -> tuple:
    """A release string ("0.24.0", "1.3.0rc20", "0.5.6.post2") as a sortable key; one it cannot read sorts first."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:\.?(a|b|rc)(\d+))?(?:\.?post(\d+))?", version.strip().lower())
    if m is None:
        return ((), (0, 0, 0), 0)
    pre = (0, ("a", "b", "rc").index(m[2]), int(m[3])) if m[2] else (1, 0, 0)
    return tuple(int(x) for x in m[1].split(".")), pre, int(m[4] or 0)


@lru_cache(maxsize=4)
def engine_devices(folder: Path = ENGINE_KERNELS_DIR) -> tuple[str, ...]:
    """The devices whose engines' kernels were measured (a file each in `folder`), sorted."""
    return tuple(sorted(p.stem for p in Path(folder).glob("*.json")))


@lru_cache(maxsize=16)
def device_engines(device: str, folder: Path = ENGINE_KERNELS_DIR) -> dict:
    """One device's engines' fitted kernels by engine and version, and their accuracy (sim/data/engine_kernels/
    DEVICE.json: {"source", "engines", "accuracy"}); {} where none were measured."""
    if device not in engine_devices(folder):  # a user's device name never becomes a path
        return {}
    return json.loads((Path(folder) / f"{device}.json").read_text())


def load_engine_kernels(folder: Path = ENGINE_KERNELS_DIR) -> dict:
    """Every device's engines' fitted kernels, {"source", "devices": {device: {engine: ...}}, "accuracy": {device:
    {engine: ...}}}, read from the per-device files (a run reads only its device's: `device_engines`)."""
    files = {device: device_engines(device, folder) for device in engine_devices(folder)}
    return {"source": next(iter(files.values()))["source"] if files else "",
            "devices": {d: f["engines"] for d, f in files.items()}, "accuracy": {d: f["accuracy"] for d, f in files.items()}}


def engine_versions(device: str, engine: str) -> list[str]:
    """The versions of `engine` whose kernels were measured on `device`, newest first (empty: none)."""
    entry = device_engines(device).get("engines", {}).get(engine)
    return sorted(entry["versions"], key=version_key, reverse=True) if entry else []


def _pick_version(entry: dict, asked: str | None) -> tuple[str, str]:
    """(the measured version whose kernels run, a note on how it was chosen)."""
    if asked is None:
        return entry["default"], "the newest version measured"
    if asked in entry["versions"]:
        return asked, "as asked"
    if asked in entry.get("aliases", {}):
        return entry["aliases"][asked], f"{asked} runs these kernels (AIConfigurator reuses their data for it)"
    older = [v for v in entry["versions"] if version_key(v) <= version_key(asked)]
    chosen = max(older, key=version_key) if older else min(entry["versions"], key=version_key)
    return chosen, f"{asked} was not measured: the nearest {'older' if older else 'newer'} version measured"


@lru_cache(maxsize=64)
def engine_kernels(device: str, engine: str, version: str | None = None) -> DeviceKernels | None:
    """The kernels `engine` runs on catalog device `device` (version: the newest measured by default; one not
    measured runs the nearest older measured version's), fitted to AIConfigurator's engine-collected timings; None
    where that engine was not measured on that device. Elementwise passes (not measured per engine) are the device's
    default fits; `notes` say where each part came from."""
    entry = device_engines(device).get("engines", {}).get(engine)
    if entry is None:
        return None
    chosen, how = _pick_version(entry, version)
    k = DeviceKernels.from_json({**entry["versions"][chosen], "passes": load_kernels()[0][device].passes})
    return replace(k, notes={**k.notes, "version": f"{engine} {chosen}: {how}",
                             "passes": f"{device}'s default fits (not measured per engine)"})


def kernel_accuracy(device: str, engine: str) -> dict:
    """The engine's kernel fits' error on what their fit left out, by op family (bench/gpu_truth.py's measure)."""
    return device_engines(device).get("accuracy", {}).get(engine, {})


def kernel_report(k: DeviceKernels, has_experts: bool = False, attention_form: str = "today",
                  mxfp4_experts: bool = False) -> dict:
    """For a report's cost_model: per op family, where the kernels that price it came from (the engine, version,
    kernel and source) and their error on what their fit left out — an engine's kernels' own, per family; a default
    device's, its one entry. `attention_form`: "today" (`attention`, what sim/cost/gpu.py prices with) or "fit"
    (`attention_fit`); `has_experts`: the model routes experts (their grouped GEMMs are reported), `mxfp4_experts` in
    MXFP4 (the engine's kernel for them, where it was timed)."""
    acc = kernel_accuracy(k.device, k.engine) if k.engine else {}
    suffix = "_today_form" if attention_form == "today" else ""
    families = {f"gemm.{d}": {"source": k.notes.get(f"gemm.{d}", k.source), "error": acc.get(f"gemm_layer.{d}")}
                for d in k.gemm}
    families["attention"] = {"source": k.notes.get("attention", k.source), "form": attention_form,
                             "error": {part: acc.get(f"attention.{part}{suffix}") for part in ("prefill", "decode")}
                             if acc else None}
    if has_experts and not (mxfp4_experts and k.grouped_mxfp4 is not None):
        families["moe"] = {"source": k.notes.get("grouped", k.source), "error": acc.get("moe")}
    elif has_experts:
        families["moe"] = {"source": k.notes.get("grouped_mxfp4"), "error": acc.get("moe_mxfp4")}
    families["all_reduce"] = {"source": k.notes.get("custom_all_reduce", k.notes.get("collectives", k.collectives)),
                              "error": {"engine": acc.get("custom_all_reduce"), "nccl": acc.get("nccl_all_reduce")}
                              if acc else None}
    out = {"engine": k.engine or None, "version": k.version or None, "families": families}
    if not k.engine:
        out["error"] = load_accuracy().get(k.measured_on)
    return out

"""Native CPU kernels (executor/model/kernels.cpp): small-batch linear layers (fp32, and int8 / int4 weights dequantized in
registers), paged attention for decode and verify rows (fp32 or int8 KV), and a layer's elementwise work fused into
single passes (residual add + RMSNorm, RoPE + KV-cache write, SiLU·up); and `decode_layers`, which runs all of a
decode step's decoder layers through those kernels in one call (executor/model/llama.py's native decode loop).

Built on first use with the system C++ compiler (`c++ -O3 -march=native -fopenmp`, about a second) into a
per-machine cache and called through ctypes; the OpenMP runtime is the libgomp torch already loaded, so the
kernels share torch's threads. Optional: without a compiler, with INFERSIM_NATIVE=0, or off CPU / fp32, the
executor runs its torch paths, which compute the same thing (tests compare the two).

The instruction set is chosen at run time, per process: INFERSIM_ISA=auto (the default: -march=native, the best
the CPU has), avx2 (exactly AVX2 + FMA + F16C, what an AMD Zen 2/3 offers, so its paths can be measured on an
AVX-512 host) or avx512. Each is a separate build of the same source, cached apart: the kernels choose their
paths with the preprocessor (#ifdef __AVX512F__, ...), so one build per instruction set keeps every path
compiled with its own vector width, register count and tile sizes, where per-function target attributes would
need every template and vector type twice.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from sim.config import environment
from sim.config.errors import ConfigError

SOURCE = Path(__file__).with_name("kernels.cpp")
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # the default (auto) build's
# The instruction sets INFERSIM_ISA may force: the CPU flags each needs (/proc/cpuinfo's names) and the compiler
# flags its build takes. avx512 builds for the CPU itself (any AVX-512 extras it has, VNNI and VBMI among them);
# avx2 for exactly the three extensions an AVX2-only host's kernels use, never AVX-512 or AVX-VNNI.
ISA_CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c")}
ISA_ARCH_FLAGS = {"avx512": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
# A projection with at most this many rows goes through linear_small, more rows through oneDNN's blocked GEMM.
# By panel width: AVX-512's 32-column panels match or beat oneDNN up to ~200 rows on the Xeon (1.1-1.5x at
# 8-128 rows; bench/native_kernels.py), so every decode batch, verify step and small chunk runs natively; AVX2's
# 16-column panels hold half the rows per tile, so the earlier dot-product kernel's 32 stays.
LINEAR_MAX_ROWS_BY_PANEL = {32: 128, 16: 32}
# Head dims prefill_attention is compiled for (each a template instance of the kernel).
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)
# rope_write_kv's largest head_dim with an int8 KV cache (its stack buffer for a rotated key).
KV_MAX_HEAD_DIM = 1024


def _cache_dir() -> Path:
    """$INFERSIM_CACHE_DIR (default ~/.cache/infersim)/native, beside the other caches."""
    return environment.cache_dir() / "native"


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags (-march=native builds for exactly those)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo's names; empty where it cannot be read)."""
    for line in _cpu_model().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def best_isa(flags: set[str]) -> str:
    """The widest instruction set of ISA_CPU_FLAGS that `flags` hold all of, else "native" (no AVX2)."""
    return next((isa for isa, need in ISA_CPU_FLAGS.items() if set(need) <= flags), "native")


def isa_build(requested: str, flags: set[str]) -> tuple[str, list[str]]:
    """(the instruction set's name, the compiler flags) of INFERSIM_ISA's `requested` on a CPU with `flags`: auto
    is -march=native, named after the best set the CPU has; a forced set the CPU lacks is a ConfigError."""
    if requested == "auto":
        return best_isa(flags), [*BASE_FLAGS, "-march=native"]
    missing = [f for f in ISA_CPU_FLAGS[requested] if f not in flags]
    if missing:
        raise ConfigError(f"INFERSIM_ISA={requested}: this CPU lacks {', '.join(missing)}; allowed here: auto, "
                          + ", ".join(i for i, need in ISA_CPU_FLAGS.items() if set(need) <= flags))
    return requested, [*BASE_FLAGS, *ISA_ARCH_FLAGS[requested]]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels for INFERSIM_ISA (read once per process; `library.cache_clear()` to read it again),
    built if needed; None where they cannot be (no compiler, disabled)."""
    if not environment.native_enabled():
        return None
    name, flags = isa_build(environment.isa(), cpu_flags())
    compiler = environment.cxx() or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags, platform.machine(), _cpu_model(),
                                                          torch.__version__]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"kernels-{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            try:
                subprocess.run([compiler, *flags, "-o", str(out), str(SOURCE)], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", b"") or str(e).encode()
                why = detail.decode(errors="replace")[:200]
                warnings.warn(f"infersim: native kernels not built ({compiler}: {why}); the executor runs its torch "
                              "paths", RuntimeWarning, stacklevel=2)
                return None
            os.replace(out, path)  # atomic: a concurrent process sees no half-written library
    lib = load(path)
    lib.isa = name
    return lib


def isa() -> str | None:
    """The instruction set the loaded kernels were built for ("avx512", "avx2" or "native"), None without them."""
    lib = library()
    return lib.isa if lib is not None else None


def load(path: Path) -> ctypes.CDLL:
    """A compiled kernels library at `path`, loaded with every function's argument and result types declared
    (`library()` loads the cached build through it; bench/kernel_ab.py loads two builds side by side)."""
    lib = ctypes.CDLL(str(path))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.linear_small.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64]
    lib.linear_small.restype = None
    lib.pack_panels.argtypes = [ptr, i64, i64, ptr]
    lib.pack_panels.restype = None
    lib.panel_width.argtypes = []
    lib.panel_width.restype = i64
    lib.panel_columns = lib.panel_width()  # asked once: every projection's dispatch reads it
    b = ctypes.c_bool
    lib.linear_quantized.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.linear_quantized.restype = None
    lib.dequantize_panels.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr]
    lib.dequantize_panels.restype = None
    lib.paged_attention.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, f32, b]
    lib.paged_attention.restype = None
    lib.prefill_attention.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, f32, b]
    lib.prefill_attention.restype = ctypes.c_bool
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
    lib.rope_write_kv.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, b]
    lib.silu_mul.argtypes = [ptr, ptr, ptr, i64]
    lib.argmax_rows.argtypes = [ptr, i64, i64, ptr]
    for fn in (lib.add_rms_norm, lib.rope_write_kv, lib.silu_mul, lib.argmax_rows):
        fn.restype = None
    if hasattr(lib, "decode_layers"):  # (bench/kernel_ab.py may load a build from before it)
        lib.decode_layer_fields.argtypes = []
        lib.decode_layer_fields.restype = i64
        lib.decode_layers.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, ptr, ptr, ptr,
                                      b, i64, ptr, i64, ptr, f32]
        lib.decode_layers.restype = None
    return lib


def available() -> bool:
    """Whether the native kernels are built and usable."""
    return library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels take contiguous CPU tensors: fp32 data, int64 indices."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.int64) and t.is_contiguous()
               for t in tensors) and available()


def kv_pool_usable(pool: torch.Tensor) -> bool:
    """The attention kernels read a contiguous CPU block pool of fp32, or of the KV cache's int8 rows."""
    return pool.device.type == "cpu" and pool.dtype in (torch.float32, torch.int8) and pool.is_contiguous() \
        and available()


def linear_max_rows() -> int:
    """Rows up to which a projection runs through linear_small (0 without the kernels)."""
    lib = library()
    return LINEAR_MAX_ROWS_BY_PANEL.get(lib.panel_columns, 32) if lib is not None else 0


@dataclass(frozen=True)
class Panels:
    """A weight [N, K] repacked for linear_small: column panels [ceil(N / width)][K][width], zero-padded."""

    data: torch.Tensor
    n: int
    k: int


def pack_weight(weight: torch.Tensor) -> Panels:
    """The weight [N, K] (contiguous fp32 CPU) in linear_small's panel layout (a copy)."""
    lib = library()
    n, k = weight.shape
    width = lib.panel_columns
    data = torch.empty(-(-n // width) * k * width, dtype=torch.float32)
    lib.pack_panels(weight.data_ptr(), n, k, data.data_ptr())
    return Panels(data, n, k)


def linear_small(x: torch.Tensor, weight: Panels) -> torch.Tensor:
    """x [M, K] @ weightᵀ -> [M, N] with the weight packed by pack_weight, streamed once for up to a dozen
    rows (for a few rows: decodes, verify rows)."""
    m, k = x.shape
    if k != weight.k:
        raise ValueError(f"x has {k} columns, the packed weight {weight.k}")
    y = torch.empty((m, weight.n), dtype=x.dtype)
    library().linear_small(x.data_ptr(), m, k, weight.data.data_ptr(), weight.n, y.data_ptr(), weight.n)
    return y


def linear_quantized(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                     n: int, split: int | None = None):
    """x [M, K] (contiguous fp32) @ wᵀ -> [M, n] for a weight quantized into panels (executor/model/quantize.py's
    layout: int8 with a scale per column, or int4 with an fp16 (scale, min) per group of K and column),
    dequantized in registers as it streams past. With `split` (a multiple of the panel width): the two contiguous
    outputs [M, split] and [M, n - split] of one call."""
    m, k = x.shape
    y = torch.empty((m, n if split is None else split), dtype=torch.float32)
    y2 = None if split is None else torch.empty((m, n - split), dtype=torch.float32)
    library().linear_quantized(x.data_ptr(), m, k, panels.data_ptr(), scales.data_ptr(), bits, group_size, n,
                               y.data_ptr(), y.shape[1], 0 if y2 is None else y2.data_ptr(), split or n)
    return y if y2 is None else (y, y2)


def dequantize_panels(panels: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, n: int,
                      k: int) -> torch.Tensor:
    """The quantized weight of linear_quantized as fp32 [k, n] (its transpose: a panel's rows are contiguous)."""
    out = torch.empty((k, n), dtype=torch.float32)
    library().dequantize_panels(panels.data_ptr(), scales.data_ptr(), bits, group_size, n, k, out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of rows of n query slots, q [B, n, H, D], read straight from the block pools
    [num_blocks, block_size, kvh, D] through block_tables [B, max_blocks] (int64); slot i of a row is at
    position context_len - n + i and sees keys up to it, or where `visible` [B, n, n] (uint8) says so among
    the row's last n keys (candidate trees). Slots that see nothing (padding) come out zero. The pools may hold
    the KV cache's int8 rows (executor/model/cache_engine.py: [.., kvh, D + 4] int8)."""
    b, n, h, d = q.shape
    out = torch.empty_like(q)
    library().paged_attention(q.data_ptr(), out.data_ptr(), b, n, h, d, k_pool.data_ptr(), v_pool.data_ptr(),
                              k_pool.shape[1], k_pool.shape[2], block_tables.data_ptr(), block_tables.shape[1],
                              context_lens.data_ptr(), 0 if visible is None else visible.data_ptr(), scale,
                              k_pool.dtype == torch.int8)
    return out


def prefill_attention(q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      q_start: torch.Tensor, q_len: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float) -> None:
    """Causal attention of prompt rows into `out`: q, out [T, H, D] are a step's packed tokens; sequence s has
    q_len[s] rows from token q_start[s], at positions context_lens[s] - q_len[s] + i, and sees its keys through
    block_tables [S, max_blocks] in the pools [num_blocks, block_size, kvh, D] (all int64 / fp32, contiguous; or
    pools of the KV cache's int8 rows). Rows of other sequences in `out` are left as they are."""
    _, h, d = q.shape
    if not library().prefill_attention(q.data_ptr(), out.data_ptr(), q_len.shape[0], q_start.data_ptr(),
                                       q_len.data_ptr(), context_lens.data_ptr(), h, d, k_pool.data_ptr(),
                                       v_pool.data_ptr(), k_pool.shape[1], k_pool.shape[2], block_tables.data_ptr(),
                                       block_tables.shape[1], scale, k_pool.dtype == torch.int8):
        raise ValueError(f"head_dim {d} is not one of {PREFILL_HEAD_DIMS}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then RMSNorm(x)·weight as a new tensor; x [T, C] contiguous fp32."""
    t, c = x.shape
    out = torch.empty_like(x)
    library().add_rms_norm(x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), t, c, eps)
    return out


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k of the fused qkv rows [T, (H + 2·kvh)·D] by their positions' angles (tables
    [max_pos, D/2]); k and v go straight to their cache slots (quantized where the pools hold the KV cache's int8
    rows), q is returned [T, H, D]."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype)
    kv_int8 = k_pool.dtype == torch.int8
    if kv_int8 and head_dim > KV_MAX_HEAD_DIM:
        raise ValueError(f"int8 KV takes head_dim up to {KV_MAX_HEAD_DIM} natively, not {head_dim}")
    library().rope_write_kv(qkv.data_ptr(), t, num_heads, num_kv_heads, head_dim, cos_table.data_ptr(),
                            sin_table.data_ptr(), positions.data_ptr(), q.data_ptr(), k_pool.data_ptr(),
                            v_pool.data_ptr(), slot_mapping.data_ptr(), kv_int8)
    return q


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up in one pass (same shapes, contiguous)."""
    out = torch.empty_like(gate)
    library().silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


# decode_layers' descriptor: kinds of a projection part (none, fp32 panels, int8 / int4 quantized panels), parts per
# projection and int64 fields per part (kind, weight, scales, n, k, group size, split)
PART_NONE, PART_FP32, PART_INT8, PART_INT4 = 0, 32, 8, 4
DECODE_PARTS, DECODE_PART_FIELDS = 2, 7


def decode_descriptor(layers: list[tuple[torch.Tensor, torch.Tensor, list, list, list, list]]) -> torch.Tensor:
    """decode_layers' flat int64 descriptor: per layer (input norm weight, post-attention norm weight, then the qkv,
    o, gate|up and down projections, each a list of up to DECODE_PARTS parts (kind, weight, scales or None, n, k,
    group size, split or 0)). The tensors must outlive the descriptor (it holds their addresses)."""
    fields = []
    for norm1, norm2, *projections in layers:
        fields += [norm1.data_ptr(), norm2.data_ptr()]
        for parts in projections:
            if not 1 <= len(parts) <= DECODE_PARTS:
                raise ValueError(f"a projection of {len(parts)} parts; decode_layers takes 1..{DECODE_PARTS}")
            for kind, w, scales, n, k, gs, split in parts:
                fields += [kind, w.data_ptr(), 0 if scales is None else scales.data_ptr(), n, k, gs, split]
            fields += [PART_NONE] * DECODE_PART_FIELDS * (DECODE_PARTS - len(parts))
    desc = torch.tensor(fields, dtype=torch.int64)
    if desc.numel() != len(layers) * library().decode_layer_fields():
        raise ValueError("descriptor layout differs from the library's")
    return desc


def decode_layers(desc: torch.Tensor, num_layers: int, x: torch.Tensor, delta: torch.Tensor, shape: tuple,
                  eps: float, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, pools: torch.Tensor, kv_int8: bool, block_size: int,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> None:
    """Every decoder layer of a step of one-token rows in one native call (kernels.cpp: decode_layers): x [T, C]
    (the residual stream) is updated in place and the last layer's output, still to be added, written to delta
    [T, C]. shape: (heads, kv heads, head_dim, intermediate size); pools: int64 [2 · layers], each layer's k and v
    pool's address; block_tables [T, max_blocks], context_lens [T] as paged_attention takes them."""
    t, c = x.shape
    heads, kv_heads, head_dim, inter = shape
    library().decode_layers(desc.data_ptr(), num_layers, x.data_ptr(), delta.data_ptr(), t, c, heads, kv_heads,
                            head_dim, inter, eps, cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr(),
                            slot_mapping.data_ptr(), pools.data_ptr(), kv_int8, block_size, block_tables.data_ptr(),
                            block_tables.shape[1], context_lens.data_ptr(), scale)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a contiguous fp32 x [M, V], as int64 [M]."""
    m, v = x.shape
    out = torch.empty(m, dtype=torch.int64)
    library().argmax_rows(x.data_ptr(), m, v, out.data_ptr())
    return out

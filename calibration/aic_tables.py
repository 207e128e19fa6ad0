"""Compact tables of NVIDIA AIConfigurator's engine-collected kernel timings, for the GPU kernel model's per-engine
fits (calibration/aic_fit.py). Fitting time only: it reads the parquet files of a git mirror of
github.com/ai-dynamo/aiconfigurator (Apache-2.0) with pyarrow and pandas, neither of which infersim needs to run.

    python -m calibration.aic_tables --mirror /work/.mirror/ai-dynamo+aiconfigurator/repo

writes calibration/data/gpu/aic/ (what each file holds and how it was reduced: its README.md). AIConfigurator times
each kernel as the engine runs it — vLLM, SGLang and TensorRT-LLM each at several versions, on each GPU — at
`systems/data/<gpu>/<op>/<engine>/<version>/*.parquet`; a version folder holding `reuse.yaml` instead of a table
points at another version's data (its "donor").
"""
from __future__ import annotations

import argparse
import io
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from sim.cost.kernels import KERNEL_ENGINES, layer_gemms, version_key

DATA_ROOT = "aic-core/src/aiconfigurator_core/systems/data"
OUT = Path(__file__).resolve().parent / "data" / "gpu" / "aic"
# AIConfigurator's systems -> the hardware catalog's names
DEVICES = {"a100_sxm": "A100-80GB", "h100_sxm": "H100-SXM", "h200_sxm": "H200", "l40s": "L40S", "b200_sxm": "B200",
           "gb200": "GB200", "b300_sxm": "B300", "gb300": "GB300", "rtx_pro_6000_server": "RTX-PRO-6000"}
ENGINES = KERNEL_ENGINES
# per device and engine, the newest versions that measured something themselves; their attention and collectives are
# kept, GEMMs and MoE layers of the newest only (they change little between versions: the same cuBLAS, CUTLASS and
# DeepGEMM kernels)
KEEP_VERSIONS = 2
NEWEST_ONLY = ("gemm", "moe")
# The attention kernels each engine runs by default, in order of preference (the first one a table has): vLLM's
# FlashAttention-3 on Hopper, FlashInfer's TRT-LLM kernels on Blackwell, FlashAttention-2 on Ampere / Ada; SGLang's
# fa3 on Hopper, trtllm_mha on Blackwell, FlashInfer on Ada; TensorRT-LLM's own.
ATTENTION_KERNELS = {
    "vllm": ("vllm_flash_attn_fa3", "vllm_flashinfer_trtllmprefill", "vllm_flashinfer_trtllmdecode",
             "vllm_flash_attn_fa2", "vllm_flash_attn", "vllm_flashinfer"),
    "sglang": ("fa3", "trtllm_mha", "flashinfer", "flash_attention", "triton"),
    "trtllm": ("torch_flow",)}
FITTED_TABLES = ("gemm_perf", "context_attention_perf", "generation_attention_perf", "custom_allreduce_perf",
                 "moe_perf")
GEMM_DTYPES = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block", "nvfp4": "fp4"}
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GEMM_BACKGROUND = (2048, 4096, 8192)  # every (N, K) pair of these is kept besides the models' shapes
CONTEXT_BATCH = (1, 4, 16, 64)
CONTEXT_ISL = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_BATCH = (1, 4, 16, 64, 256, 1024)
DECODE_KV = (2, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MOE_PARALLEL = ((1, 1), (2, 1), (8, 1), (1, 2), (1, 8))  # (moe_tp, moe_ep)
COMM_BYTES = tuple(2 ** i for i in range(8, 31))  # 256 B to 1 GiB

# Dense decoder shapes (public config.json: hidden, heads, kv heads, head_dim, intermediate): the held-out groups of
# bench/gpu_truth.py's leave-one-model-out checks. A model shares its projections with those of the same shape
# (Llama-3-8B: Mistral-7B, Llama-3.1-8B, Mixtral's attention; Llama-3-70B: Llama-2-70B).
MODELS = {"Llama-2-7B": (4096, 32, 32, 128, 11008), "Llama-2-13B": (5120, 40, 40, 128, 13824),
          "Llama-3-8B": (4096, 32, 8, 128, 14336), "Llama-3-70B": (8192, 64, 8, 128, 28672),
          "Llama-3.2-1B": (2048, 32, 8, 64, 8192), "Llama-3.2-3B": (3072, 24, 8, 128, 8192),
          "CodeLlama-34B": (8192, 64, 8, 128, 22016), "Qwen2.5-7B": (3584, 28, 4, 128, 18944),
          "Qwen3-8B": (4096, 32, 8, 128, 12288), "Qwen3-14B": (5120, 40, 8, 128, 17408),
          "Qwen3-32B": (5120, 64, 8, 128, 25600), "Mistral-Small-24B": (5120, 32, 8, 128, 32768),
          "Phi-3-mini": (3072, 32, 32, 96, 8192)}
TP = (1, 2, 4, 8)
# mixtures of experts AIConfigurator timed, by expert shape (hidden, expert intermediate, top-k, experts); the rest
# are named by their shape
MOE_MODELS = {(4096, 14336, 2, 8): "Mixtral-8x7B", (6144, 16384, 2, 8): "Mixtral-8x22B",
              (2048, 768, 8, 128): "Qwen3-30B-A3B", (4096, 1536, 8, 128): "Qwen3-235B-A22B",
              (5120, 8192, 1, 16): "Llama-4-Scout", (5120, 8192, 1, 128): "Llama-4-Maverick",
              (7168, 2048, 8, 256): "DeepSeek-V3"}


class Mirror:
    """Files of a git mirror's HEAD (no work tree)."""

    def __init__(self, git_dir: Path):
        self.git_dir = git_dir
        self.commit = self._git("rev-parse", "HEAD").decode().strip()

    def _git(self, *args: str) -> bytes:
        return subprocess.run(["git", "-C", str(self.git_dir), *args], check=True, capture_output=True).stdout

    def ls(self, path: str) -> list[str]:
        """Names directly under `path` (empty where it is not a folder)."""
        try:
            out = self._git("ls-tree", "--name-only", f"HEAD:{path}")
        except subprocess.CalledProcessError:
            return []
        return out.decode().split()

    def table(self, path: str):
        """A parquet file as a pandas DataFrame."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        return pq.read_table(pa.BufferReader(self._git("show", f"HEAD:{path}"))).to_pandas()

    def yaml(self, path: str) -> dict:
        return yaml.safe_load(io.BytesIO(self._git("show", f"HEAD:{path}")))


_key = version_key


def version_rows(mirror: Mirror) -> list[dict]:
    """Every (device, op family, engine, version) folder of the mirror and, per table, whose data it holds: its own
    or, through reuse.yaml, a donor version's."""
    rows = []
    for system, device in DEVICES.items():
        for family in ("gemm", "attention", "comm", "moe"):
            for engine in (*ENGINES, "nccl"):
                base = f"{DATA_ROOT}/{system}/{family}/{engine}"
                for version in sorted(mirror.ls(base), key=_key):
                    files = mirror.ls(f"{base}/{version}")
                    reuse = mirror.yaml(f"{base}/{version}/reuse.yaml")["reuse"] if "reuse.yaml" in files else []
                    tables = {f.removesuffix(".parquet"): version for f in files if f.endswith(".parquet")}
                    tables.update({r["table"]: str(r["from_version"]) for r in reuse if r["table"] not in tables})
                    for table, data_version in sorted(tables.items()):
                        rows.append({"device": device, "family": family, "engine": engine, "version": version,
                                     "table": table, "data_version": data_version})
    return rows


def kept_versions(rows: list[dict]) -> dict[tuple[str, str], list[str]]:
    """Per (device, engine) the KEEP_VERSIONS newest versions that measured one of the tables fitted, newest first."""
    own: dict[tuple[str, str], set] = {}
    for r in rows:
        if r["engine"] in ENGINES and r["version"] == r["data_version"] and r["table"] in FITTED_TABLES:
            own.setdefault((r["device"], r["engine"]), set()).add(r["version"])
    return {k: sorted(v, key=_key, reverse=True)[:KEEP_VERSIONS] for k, v in own.items()}


def resolve(rows: list[dict], device: str, family: str, engine: str, table: str, version: str) -> str | None:
    """The version whose data `version` runs for one table: its own folder's (or donor's), else the newest older
    version's that has it, else the oldest that has it."""
    have = {r["version"]: r["data_version"] for r in rows
            if (r["device"], r["family"], r["engine"], r["table"]) == (device, family, engine, table)}
    if not have:
        return None
    if version in have:
        return have[version]
    older = [v for v in have if _key(v) <= _key(version)]
    return have[max(older, key=_key)] if older else have[min(have, key=_key)]


# -- shapes kept -----------------------------------------------------------------------------------------------------
def nearest(values, x: float):
    """The grid value nearest x on a log scale."""
    return min(values, key=lambda v: abs(np.log(v / x)))


def model_gemm_shapes(model: str, grid) -> set[tuple[int, int]]:
    """The grid (N, K) nearest each projection of one model's layer at TP 1-8."""
    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    out = set()
    for tp in (tp for tp in TP if heads % tp == 0):
        for _, _, n, k in layer_gemms(hidden, heads, kv_heads, head_dim, inter, tp, 1):
            out.add((nearest(grid, n), nearest(grid, k)))
    return out


def model_heads(model: str) -> set[tuple[int, int]]:
    """(query heads, KV heads) of one model's attention on one device at TP 1-8 (KV heads replicated past their
    count)."""
    _, heads, kv_heads, _, _ = MODELS[model]
    return {(heads // tp, max(1, kv_heads // tp)) for tp in TP if heads % tp == 0}


def _sig(x: float) -> str:
    return "" if x is None or not np.isfinite(x) else f"{x:.4g}"


def moe_model(hidden: int, inter: int, topk: int, experts: int) -> str:
    """A mixture of experts' name from its expert shape."""
    return MOE_MODELS.get((hidden, inter, topk, experts), f"h{hidden}-i{inter}-top{topk}-e{experts}")


# -- tables ----------------------------------------------------------------------------------------------------------
class Tables:
    """The mirror's tables of the kept versions, each read once."""

    def __init__(self, mirror: Mirror):
        self.mirror = mirror
        self.rows = version_rows(mirror)
        self.kept = kept_versions(self.rows)
        self.systems = {device: system for system, device in DEVICES.items()}

    @lru_cache(maxsize=8)
    def read(self, device: str, family: str, engine: str, version: str, table: str):
        return self.mirror.table(f"{DATA_ROOT}/{self.systems[device]}/{family}/{engine}/{version}/{table}.parquet")

    def each(self, family: str, table: str, newest_only: bool | None = None):
        """(device, engine, data version, DataFrame) of each table the kept versions run, once (the newest version's
        only for NEWEST_ONLY families, unless `newest_only` says otherwise)."""
        newest_only = family in NEWEST_ONLY if newest_only is None else newest_only
        for (device, engine), versions in sorted(self.kept.items()):
            versions = versions[:1] if newest_only else versions
            data = {resolve(self.rows, device, family, engine, table, v) for v in versions} - {None}
            for version in sorted(data, key=_key):
                yield device, engine, version, self.read(device, family, engine, version, table)


def _wide(frame, keys: list[str], column: str, values, prefix: str, meta: dict) -> list[dict]:
    """One row per `keys` with the latencies (ms -> µs) at each of `values` of `column` as columns."""
    frame = frame[frame[column].isin(values)].drop_duplicates([*keys, column])  # first wins, as AIConfigurator reads
    out = []
    for key, group in frame.groupby(keys, sort=True):
        times = dict(zip(group[column], group["latency"] * 1e3))
        out.append({**meta, **dict(zip(keys, key)), **{f"{prefix}{v}": _sig(times.get(v)) for v in values}})
    return out


def gemm_rows(tables: Tables) -> list[dict]:
    """GEMMs by dtype: the models' projection shapes (nearest grid point, TP 1-8) and a background grid."""
    out = []
    for device, engine, version, t in tables.each("gemm", "gemm_perf"):
        t = t[t.gemm_dtype.isin(GEMM_DTYPES)].copy()
        t["dtype"] = t.gemm_dtype.map(GEMM_DTYPES)
        grid = sorted(set(t.n) | set(t.k))
        keep = {(n, k) for n in GEMM_BACKGROUND for k in GEMM_BACKGROUND}
        keep |= {s for m in MODELS for s in model_gemm_shapes(m, grid)}
        t = t[[(n, k) in keep for n, k in zip(t.n, t.k)]]
        for dtype, group in t.groupby("dtype", sort=True):
            kernel = "+".join(sorted(group.kernel_source.unique()))
            meta = {"device": device, "engine": engine, "version": version,
                    "dtype": dtype, "kernel": kernel}
            out += _wide(group, ["n", "k"], "m", GEMM_M, "m", meta)
    return out


def _attention_kernel(t, engine: str) -> str | None:
    present = set(t.kernel_source)
    return next((k for k in ATTENTION_KERNELS[engine] if k in present), None)


def attention_rows(tables: Tables, table: str, batches, column: str, values, prefix: str) -> list[dict]:
    """Context or generation attention of the engine's default kernel: no sliding window, head_dim 128, a 16-bit KV
    cache, the models' (query heads, KV heads) at TP 1-8."""
    heads = set().union(*(model_heads(m) for m in MODELS))
    out = []
    for device, engine, version, t in tables.each("attention", table):
        kernel = _attention_kernel(t, engine)
        t = t[(t.kernel_source == kernel) & (t.head_dim == 128) & (t.kv_cache_dtype == "bfloat16") & t.batch_size.isin(batches)].copy()
        if "window_size" in t:
            t = t[t.window_size == 0]
        t["kv_len"] = t.isl + t.step  # generation: the step's keys (the prompt and the tokens decoded since)
        t = t[[(h, kv) in heads for h, kv in zip(t.num_heads, t.num_key_value_heads)]]
        meta = {"device": device, "engine": engine, "version": version,
                "kernel": kernel}
        t = t.rename(columns={"kv_cache_dtype": "kv_dtype", "num_heads": "heads", "num_key_value_heads": "kv_heads",
                              "batch_size": "batch"})
        out += _wide(t, ["kv_dtype", "head_dim", "heads", "kv_heads", "batch"], column, values, prefix, meta)
    return out


def comm_rows(tables: Tables) -> list[dict]:
    """Each engine's own all-reduce (custom one-/two-shot kernels where it uses them, in CUDA-graph and eager mode)
    and NCCL's collectives (nccl-tests, the device's newest NCCL), by message bytes (bf16 / half elements x 2)."""
    out = []
    for device, engine, version, t in tables.each("comm", "custom_allreduce_perf"):
        t = t.assign(mode=np.where(t.kernel_source.str.contains("eager", case=False), "eager", "graph"),
                     bytes=2 * t.message_size, op="all_reduce", gpus=t.num_gpus)
        meta = {"device": device, "source": engine, "version": version}
        out += _wide(t, ["op", "mode", "gpus"], "bytes", COMM_BYTES, "b", meta)
    for device in sorted(tables.systems):
        versions = [r["version"] for r in tables.rows if r["device"] == device and r["engine"] == "nccl"]
        if versions:
            version = max(versions, key=_key)
            t = tables.read(device, "comm", "nccl", version, "nccl_perf")
            t = t[t.nccl_dtype == "half"].assign(mode="", bytes=lambda f: 2 * f.message_size, gpus=lambda f: f.num_gpus)
            meta = {"device": device, "source": "nccl", "version": version}
            out += _wide(t.rename(columns={"op_name": "op"}), ["op", "mode", "gpus"], "bytes", COMM_BYTES, "b", meta)
    return out


def moe_rows(tables: Tables) -> list[dict]:
    """The engine's fused MoE layer (routing, gate/up, activation, down, combine) in bf16 under balanced routing:
    the newest kept version that timed it."""
    out, done = [], set()
    for device, engine, version, t in sorted(tables.each("moe", "moe_perf", newest_only=False),
                                             key=lambda x: (x[0], x[1], _key(x[2])), reverse=True):
        t = t[(t.moe_dtype == "bfloat16") & (t.distribution == "balanced")]
        t = t[[p in MOE_PARALLEL for p in zip(t.moe_tp_size, t.moe_ep_size)]]
        if t.empty or (device, engine) in done:
            continue
        done.add((device, engine))
        kernel = t.kernel_source.value_counts().index[0]  # the engine's default runner: most of its rows
        t = t[t.kernel_source == kernel].rename(columns={"hidden_size": "hidden", "inter_size": "inter",
                                                         "num_experts": "experts", "moe_tp_size": "tp",
                                                         "moe_ep_size": "ep"})
        meta = {"device": device, "engine": engine, "version": version, "kernel": kernel}
        out += _wide(t, ["hidden", "inter", "topk", "experts", "tp", "ep"], "num_tokens", MOE_TOKENS, "t", meta)
    return sorted(out, key=lambda r: (r["device"], r["engine"]))


MXFP4_DTYPES = ("w4a16_mxfp4", "w4a8_mxfp4_mxfp8")  # in order of preference: MXFP4 weights, bf16 (or MXFP8) rows


def moe_mxfp4_rows(tables: Tables) -> list[dict]:
    """The engine's MoE layer with MXFP4 experts (gpt-oss's, the only shapes timed) under balanced routing, in the
    first of MXFP4_DTYPES it timed: the newest kept version that timed one. Hopper and Ada dequantize the weights to
    bf16 in the kernel (w4a16); TensorRT-LLM on Blackwell multiplies MXFP8 activations (w4a8)."""
    out, done = [], set()
    for device, engine, version, t in sorted(tables.each("moe", "moe_perf", newest_only=False),
                                             key=lambda x: (x[0], x[1], _key(x[2])), reverse=True):
        dtypes = [d for d in MXFP4_DTYPES if d in set(t.moe_dtype)]
        if not dtypes or (device, engine) in done:
            continue
        t = t[(t.moe_dtype == dtypes[0]) & (t.distribution == "balanced")]
        t = t[[p in MOE_PARALLEL for p in zip(t.moe_tp_size, t.moe_ep_size)]]
        if t.empty:
            continue
        done.add((device, engine))
        kernel = t.kernel_source.value_counts().index[0]
        t = t[t.kernel_source == kernel].rename(columns={"hidden_size": "hidden", "inter_size": "inter",
                                                         "num_experts": "experts", "moe_tp_size": "tp",
                                                         "moe_ep_size": "ep"})
        meta = {"device": device, "engine": engine, "version": version, "kernel": kernel, "dtype": dtypes[0]}
        out += _wide(t, ["hidden", "inter", "topk", "experts", "tp", "ep"], "num_tokens", MOE_TOKENS, "t", meta)
    return sorted(out, key=lambda r: (r["device"], r["engine"]))


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows (dicts with the same keys) as CSV."""
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mirror", type=Path, required=True, help="a git mirror of ai-dynamo/aiconfigurator")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    tables = Tables(Mirror(args.mirror))
    args.out.mkdir(parents=True, exist_ok=True)
    outputs = {
        "versions.csv": tables.rows,
        "gemm.csv": gemm_rows(tables),
        "context_attention.csv": attention_rows(tables, "context_attention_perf", CONTEXT_BATCH, "isl", CONTEXT_ISL,
                                                "s"),
        "generation_attention.csv": attention_rows(tables, "generation_attention_perf", DECODE_BATCH, "kv_len",
                                                   DECODE_KV, "kv"),
        "comm.csv": comm_rows(tables),
        "moe.csv": moe_rows(tables),
        "moe_mxfp4.csv": moe_mxfp4_rows(tables),
    }
    for name, rows in outputs.items():
        write_csv(args.out / name, rows)
        print(f"{name}: {len(rows)} rows, {(args.out / name).stat().st_size / 1e3:.0f} kB")
    (args.out / "SOURCE").write_text(f"github.com/ai-dynamo/aiconfigurator {tables.mirror.commit}\n")


if __name__ == "__main__":
    main()

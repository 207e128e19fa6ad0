"""Fit the GPU kernel model (sim/cost/kernels.py) to NVIDIA AIConfigurator's engine-collected kernel timings: the
compact tables of calibration/data/gpu/aic/ (written from a mirror of github.com/ai-dynamo/aiconfigurator by
calibration.aic_tables; how they were reduced: their README.md).

    python -m calibration.aic_fit     # writes sim/data/engine_kernels/ (a file per device), adds to sim/data/gpu_kernels.json the
                                      # devices only AIConfigurator measured and its NCCL systems

Per device, engine (vLLM, SGLang, TensorRT-LLM) and version:
- GEMMs by dtype (bf16 as "fp16", per-tensor "fp8", 128x128-block "fp8_block", NVFP4 "fp4"): the GEMM form of
  calibration/kernel_fit.py. A dtype timed host-bound (no CUDA graph: vLLM's block-fp8 GEMMs, 2-24x its bf16 GEMMs
  at M <= 16) is replaced by the same dtype of another engine on the device (the same DeepGEMM / CUTLASS kernels).
- attention, the engine's default kernel (FlashAttention-3, FlashInfer, TRT-LLM's ...), fitted twice: in today's
  form (`attention`: a floor per prompt, FLOPs, a cost per key; decode a floor and a bandwidth within one wave of
  the multiprocessors and past it) and in `AttentionFit`'s, which the data supports better (a floor per step, per
  (sequence or row) x KV head, keys priced by the heads that read them, decode bandwidth rising with occupancy).
  Decode points whose KV fits in the L2 cache are left out: AIConfigurator re-reads the same KV, which a serving
  step never does (it reads each layer's KV once a step, long evicted).
- the MoE layer (routing, grouped gate/up and down GEMMs, combine; bf16, balanced routing) as grouped expert GEMMs;
- the engine's own all-reduce, in CUDA-graph and eager mode per device count, up to the largest message at which it
  still beats NCCL by 10% (past it the engine's curve is NCCL's).
Per device: NCCL's all-reduce, all-gather, reduce-scatter and all-to-all (nccl-tests) as a collectives system
"aic_<system>".

Accuracy (stored with the fits, recomputed by bench/gpu_truth.py): leave one model out — GEMMs: the grid shapes
nearest one model's projections at TP 1-8 held out; attention: the (query heads, KV heads) of one model at TP 1-8;
MoE: one model's expert shape; collectives: every other message size held out.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import numpy as np

from calibration.aic_tables import (
    DEVICES,
    ENGINES,
    MODELS,
    TP,
    kept_versions,
    model_gemm_shapes,
    model_heads,
    nearest,
    resolve,
)
from calibration.kernel_fit import DATA, _fit, fit_collective, fit_gemm, read_table, stats
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.models import BYTES_PER_PARAM
from sim.cost.kernels import (
    ENGINE_KERNELS_DIR,
    KERNELS_PATH,
    AttentionFit,
    DeviceKernels,
    GemmFit,
    grouped_gemm_time,
    layer_gemms,
    version_key,
)

AIC = DATA / "aic"
SYSTEMS = {device: system for system, device in DEVICES.items()}
GEMM_KEYS = {"bf16": "fp16", "fp8": "fp8", "fp8_block": "fp8_block", "fp4": "fp4"}
# bytes a weight takes: fp8 blocks carry one fp32 scale per 128x128, NVFP4 one fp8 scale per 16 weights
MXFP4_BYTES = BYTES_PER_PARAM["mxfp4"]  # 4 bits and an 8-bit scale a block of 32
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp8_block": 1.0 + 4 / 128 ** 2, "fp4": 0.5 + 1 / 16}
HOST_BOUND = 2.0  # a dtype's small-M GEMMs this many times its bf16 ones: timed with the host in the loop
CUSTOM_AR_GAIN = 0.9  # the engine's all-reduce counts as its own kernel while under 90% of NCCL's time
HEAD_DIM = 128  # the attention tables' (calibration.aic_tables)
# streaming multiprocessors (the legacy decode form's one-wave threshold) and L2 cache bytes, from NVIDIA's
# architecture whitepapers and datasheets (Blackwell parts approximate)
DEVICE_INFO = {"A100-80GB": (108, 40e6), "H100-SXM": (132, 50e6), "H200": (132, 50e6), "L40S": (142, 96e6),
               "B200": (148, 126e6), "GB200": (148, 126e6), "B300": (160, 126e6), "GB300": (160, 126e6),
               "RTX-PRO-6000": (188, 128e6)}


# -- the tables --------------------------------------------------------------------------------------------------------
def points(rows: list[dict], prefix: str) -> list[tuple[dict, int, float]]:
    """(row, x, seconds) of every measured cell of wide rows whose columns are `prefix` + x (µs)."""
    out = []
    for r in rows:
        for key, v in r.items():
            if key.startswith(prefix) and key[len(prefix):].isdigit() and v != "":
                out.append((r, int(key[len(prefix):]), v * 1e-6))
    return out


class AicTables:
    """The compact tables, read once, and which data each engine version runs."""

    def __init__(self, root: Path = AIC):
        self.root = root
        self._tables: dict[str, list[dict]] = {}
        self._indexes: dict[str, dict] = {}

    @cached_property
    def versions(self) -> list[dict]:
        return read_table(self.root / "versions.csv")

    @cached_property
    def kept(self) -> dict[tuple[str, str], list[str]]:
        return kept_versions(self.versions)

    def table(self, name: str) -> list[dict]:
        """The rows of `name`.csv."""
        if name not in self._tables:
            self._tables[name] = read_table(self.root / f"{name}.csv")
        return self._tables[name]

    def _index(self, name: str) -> dict[tuple[str, str], dict[str, list[dict]]]:
        """{(device, engine or source): {data version: rows}} of one table."""
        if name not in self._indexes:
            index: dict = defaultdict(lambda: defaultdict(list))
            for r in self.table(name):
                index[(r["device"], r.get("engine", r.get("source")))][str(r["version"])].append(r)
            self._indexes[name] = index
        return self._indexes[name]

    def rows(self, name: str, family: str, table: str, device: str, engine: str, version: str) -> tuple[list, str]:
        """(the rows `version` of `engine` runs from one table, the data version they are) — the newest kept data
        where the version's own is not in the compact tables (GEMMs and MoE layers keep the newest only)."""
        mine = self._index(name).get((device, engine), {})
        if not mine:
            return [], ""
        data = resolve(self.versions, device, family, engine, table, version)
        data = data if data in mine else max(mine, key=version_key)
        return mine[data], data


# -- GEMMs -------------------------------------------------------------------------------------------------------------
def gemm_points(rows: list[dict]) -> tuple[np.ndarray, ...]:
    """(m, n, k, seconds) arrays of wide GEMM rows."""
    pts = points(rows, "m")
    return tuple(np.array(v, float) for v in zip(*[(m, r["n"], r["k"], t) for r, m, t in pts]))


def host_bound_ratio(rows: list[dict], bf16: list[dict]) -> float:
    """Median over shapes with N, K >= 2048 of this dtype's time over bf16's at M <= 16."""
    ref = {(r["n"], r["k"], m): t for r, m, t in points(bf16, "m")}
    ratios = [t / ref[(r["n"], r["k"], m)] for r, m, t in points(rows, "m")
              if m <= 16 and r["n"] >= 2048 and r["k"] >= 2048 and (r["n"], r["k"], m) in ref]
    return float(np.median(ratios)) if ratios else float("nan")


def gemm_tables(t: AicTables, device: str, engine: str, version: str) -> dict[str, tuple[list[dict], str]]:
    """{dtype: (the GEMM rows the engine version's fit uses, where they come from)}: its own, but a dtype timed
    host-bound is another engine's on the device (or left out)."""
    rows, data = t.rows("gemm", "gemm", "gemm_perf", device, engine, version)
    by_dtype = defaultdict(list)
    for r in rows:
        by_dtype[r["dtype"]].append(r)
    out = {}
    for dtype, rs in sorted(by_dtype.items()):
        ratio = host_bound_ratio(rs, by_dtype["bf16"]) if dtype != "bf16" else 1.0
        if ratio <= HOST_BOUND:
            out[dtype] = rs, f"AIConfigurator, {engine} {data} on {device} ({rs[0]['kernel']})"
            continue
        carried, source = _carried_gemm(t, device, engine, dtype)
        if carried is not None:
            out[dtype] = carried, (f"AIConfigurator: {engine} {data}'s {dtype} GEMMs were timed host-bound "
                                   f"({ratio:.1f}x its bf16 at M <= 16: no CUDA graph); {source}'s "
                                   f"({carried[0]['kernel']}) instead")
    return out


def fit_gemms(t: AicTables, device: str, engine: str, version: str) -> tuple[dict, dict]:
    """({kernel-model dtype key: GemmFit}, notes) of one engine version's GEMMs."""
    fits, notes = {}, {}
    for dtype, (rows, source) in gemm_tables(t, device, engine, version).items():
        fits[GEMM_KEYS[dtype]] = fit_gemm(*gemm_points(rows), weight_bytes=WEIGHT_BYTES[dtype])
        notes[f"gemm.{GEMM_KEYS[dtype]}"] = source
    return fits, notes


def _carried_gemm(t: AicTables, device: str, engine: str, dtype: str) -> tuple[list | None, str]:
    """Another engine's GEMMs of this dtype on the device, timed as the GPU runs them."""
    for other in (e for e in ENGINES if e != engine):
        versions = t.kept.get((device, other), [])
        if not versions:
            continue
        rows, data = t.rows("gemm", "gemm", "gemm_perf", device, other, versions[0])
        rs = [r for r in rows if r["dtype"] == dtype]
        if rs and host_bound_ratio(rs, [r for r in rows if r["dtype"] == "bf16"]) <= HOST_BOUND:
            return rs, f"{other} {data}"
    return None, ""


# -- attention ---------------------------------------------------------------------------------------------------------
def _arrays(pts) -> tuple[np.ndarray, ...]:
    """(batch, x, heads, kv heads, seconds) of attention points."""
    return tuple(np.array(v, float) for v in zip(*[(r["batch"], x, r["heads"], r["kv_heads"], s) for r, x, s in pts]))


def decode_points(pts, device: str) -> list:
    """Generation points but those whose KV sits in the L2 cache and whose time it sets."""
    _, l2 = DEVICE_INFO[device]
    bw = HARDWARE_CATALOG[device].memory_bandwidth
    out = []
    for r, kv_len, s in pts:
        nbytes = 2 * r["batch"] * kv_len * r["kv_heads"] * HEAD_DIM * 2
        if nbytes >= 1.5 * l2 or nbytes / bw <= 0.2 * s:
            out.append((r, kv_len, s))
    return out


def fit_prefill(pts) -> dict:
    """AttentionFit's prefill parameters to context points."""
    b, s, h, kv, t = _arrays(pts)

    def model(p):
        fit = AttentionFit(p[0] * 1e-6, p[1] * 1e-9, p[2] * 1e12, p[3] * 1e-9, p[4] * 1e-9, p[5] * 1e-9,
                           0, 0, 1, 1)
        return fit.prefill_s(b, s, h, kv, HEAD_DIM)
    p = _fit(lambda p: np.log(model(p)) - np.log(t), [10, 30, 300, 3, 0.1, 0.1], [0] * 6,
             [1e3, 1e4, 1e4, 1e4, 1e3, 1e3])
    return {"prefill_floor_s": p[0] * 1e-6, "prefill_s_per_seq_kv_head": p[1] * 1e-9, "prefill_flops": p[2] * 1e12,
            "prefill_s_per_key": p[3] * 1e-9, "prefill_s_per_key_head": p[4] * 1e-9,
            "prefill_s_per_key_kv_head": p[5] * 1e-9}


def fit_decode(pts) -> dict:
    """AttentionFit's decode parameters to generation points (16-bit KV)."""
    b, s, _, kv, t = _arrays(pts)

    def model(p):
        fit = AttentionFit(0, 0, 1, 0, 0, 0, p[0] * 1e-6, p[1] * 1e-9, p[2] * 1e12, p[3])
        return fit.decode_s(b, s, kv, 2 * kv * HEAD_DIM * 2)
    p = _fit(lambda p: np.log(model(p)) - np.log(t), [10, 20, 3, 2], [0, 0, 0.01, 0], [1e3, 1e4, 100, 1e4])
    return {"decode_floor_s": p[0] * 1e-6, "decode_s_per_row_kv_head": p[1] * 1e-9, "decode_bandwidth": p[2] * 1e12,
            "decode_parallel_half": float(p[3])}


def legacy_prefill_s(att: dict, b, s, h, _kv=None):
    """Today's prefill form: a floor per prompt, FLOPs, a cost per key (sim/cost/gpu.py)."""
    return att["prefill_floor_s"] * b + 4 * h * HEAD_DIM * b * s * (s + 1) / 2 / att["prefill_flops"] + \
        att["prefill_s_per_key"] * b * s


def legacy_decode_s(att: dict, b, s, kv):
    """Today's decode form: a floor and the KV at one bandwidth within a wave of the multiprocessors, another past."""
    bw = np.where(b * kv <= att["sms"], att["decode_bandwidth_one_wave"], att["decode_bandwidth"])
    return att["decode_floor_s"] + 2 * b * s * kv * HEAD_DIM * 2 / bw


def fit_legacy(pre, dec, sms: int) -> dict:
    """Today's attention form fitted to an engine's kernels: prefill on batches of up to 4 prompts (a step's few
    chunks; its floor is per prompt), decode on every point."""
    b, s, h, _, t = _arrays([p for p in pre if p[0]["batch"] <= 4])

    def pmodel(p):
        return legacy_prefill_s({"prefill_floor_s": p[0] * 1e-6, "prefill_flops": p[1] * 1e12,
                                 "prefill_s_per_key": p[2] * 1e-9}, b, s, h)
    pp = _fit(lambda p: np.log(pmodel(p)) - np.log(t), [10, 300, 5], [0, 1, 0], [1e3, 1e4, 1e4])
    b, s, _, kv, t = _arrays(dec)

    def dmodel(p):
        return legacy_decode_s({"decode_floor_s": p[0] * 1e-6, "decode_bandwidth_one_wave": p[1] * 1e12,
                                "decode_bandwidth": p[2] * 1e12, "sms": sms}, b, s, kv)
    pd = _fit(lambda p: np.log(dmodel(p)) - np.log(t), [10, 3, 3], [0, 0.01, 0.01], [1e3, 100, 100])
    return {"prefill_floor_s": pp[0] * 1e-6, "prefill_flops": pp[1] * 1e12, "prefill_s_per_key": pp[2] * 1e-9,
            "decode_floor_s": pd[0] * 1e-6, "decode_bandwidth_one_wave": pd[1] * 1e12,
            "decode_bandwidth": pd[2] * 1e12, "sms": sms}


def fit_attention(t: AicTables, device: str, engine: str, version: str) -> tuple[dict | None, AttentionFit | None,
                                                                                 dict]:
    """(today's form, AttentionFit, notes) of one engine version's attention."""
    ctx, cdata = t.rows("context_attention", "attention", "context_attention_perf", device, engine, version)
    gen, gdata = t.rows("generation_attention", "attention", "generation_attention_perf", device, engine, version)
    if not ctx or not gen:
        return None, None, {}
    pre, dec = points(ctx, "s"), decode_points(points(gen, "kv"), device)
    fit = AttentionFit(**fit_prefill(pre), **fit_decode(dec))
    legacy = fit_legacy(pre, dec, DEVICE_INFO[device][0])
    note = (f"AIConfigurator, {engine} {cdata} / {gdata} on {device}: {ctx[0]['kernel']} prefill, {gen[0]['kernel']} "
            "decode (16-bit KV, head_dim 128)")
    return legacy, fit, {"attention": note}


# -- MoE ---------------------------------------------------------------------------------------------------------------
def moe_shapes(pts) -> tuple[np.ndarray, ...]:
    """(rows routed to a device, experts touched, the busiest expert's rows, gate/up N, K, down N, K, seconds) of MoE
    points under balanced routing: a device holds experts / ep of them, each expert's intermediate split tp ways."""
    cols = defaultdict(list)
    for r, tokens, s in pts:
        local = r["experts"] / r["ep"]
        routed = tokens * r["topk"] / r["ep"]
        inter = r["inter"] / r["tp"]
        cols["rows"].append(routed)
        cols["touched"].append(min(local, max(1.0, routed)))
        cols["busiest"].append(max(1.0, np.ceil(tokens * r["topk"] / r["experts"])))
        cols["up_n"].append(2 * inter), cols["up_k"].append(r["hidden"])
        cols["down_n"].append(r["hidden"]), cols["down_k"].append(inter)
        cols["t"].append(s)
    return tuple(np.array(cols[k], float) for k in ("rows", "touched", "busiest", "up_n", "up_k", "down_n", "down_k",
                                                    "t"))


def moe_time(fit: GemmFit, shapes, weight_bytes: float = 2.0) -> np.ndarray:
    """The MoE layer as the grouped gate/up and down GEMMs over the experts it touches, its weights `weight_bytes` each."""
    rows, touched, busiest, up_n, up_k, down_n, down_k, _ = shapes
    return grouped_gemm_time(fit, rows, touched, busiest, up_n, up_k, weight_bytes) + \
        grouped_gemm_time(fit, rows, touched, busiest, down_n, down_k, weight_bytes)


def fit_moe(pts, weight_bytes: float = 2.0) -> GemmFit:
    """The grouped expert GEMM fit to an engine's MoE layers: bf16 experts, or MXFP4's (`weight_bytes` 4.25 bits)."""
    shapes = moe_shapes(pts)

    def model(p):
        return moe_time(GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, p[3], p[4]), shapes, weight_bytes)
    p = _fit(lambda p: np.log(model(p)) - np.log(shapes[-1]), [10, 2, 300, 2, 32], [0, 0.05, 5, 1, 0],
             [500, 20, 5000, 8, 4096])
    return GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, float(p[3]), float(p[4]))


# -- collectives -------------------------------------------------------------------------------------------------------
def comm_curve(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds) of one wide comm row."""
    pts = points([row], "b")
    return np.array([x for _, x, _ in pts], float), np.array([s for _, _, s in pts])


def nccl_fits(t: AicTables, device: str) -> dict:
    """{collective: {"<n>x<n>": fit}} of the device's NCCL runs (one node)."""
    out: dict = defaultdict(dict)
    for r in t.table("comm"):
        if r["device"] == device and r["source"] == "nccl":
            out[r["op"]][f"{r['gpus']}x{r['gpus']}"] = fit_collective(*comm_curve(r))
    return dict(out)


def custom_limit(engine_row: dict, nccl_row: dict | None) -> float | None:
    """The largest message at which the engine's own (CUDA-graph) all-reduce still beats NCCL: the end of the run of
    sizes, from the smallest, at which it takes under 90% of NCCL's time (a size's ratio the median of it and its
    neighbours', one outlier no end). Past it the engine's curve is NCCL's, whether it calls NCCL there or its own
    kernel no faster (vLLM on B200s beats NCCL again at 1-32 MiB, past a stretch where it does not: priced as NCCL)."""
    if nccl_row is None:
        return None
    ref = dict(zip(*comm_curve(nccl_row)))
    sizes, times = comm_curve(engine_row)
    pairs = [(x, s / ref[x]) for x, s in zip(sizes, times) if x in ref]
    ratios = [r for _, r in pairs]
    limit = None
    for i, (x, _) in enumerate(pairs):
        lo = max(0, min(i - 1, len(ratios) - 3))  # three sizes around this one (at the ends, the three nearest)
        if np.median(ratios[lo:lo + 3]) >= CUSTOM_AR_GAIN:
            break
        limit = float(x)
    return limit


def fit_custom_all_reduce(t: AicTables, device: str, engine: str, version: str) -> tuple[dict | None, dict]:
    """({mode: {devices: CustomAllReduceFit fields}}, notes) of the engine's own all-reduce."""
    rows, data = t.rows("comm", "comm", "custom_allreduce_perf", device, engine, version)
    nccl = {r["gpus"]: r for r in t.table("comm") if r["device"] == device and r["source"] == "nccl"
            and r["op"] == "all_reduce"}
    limits = {r["gpus"]: custom_limit(r, nccl.get(r["gpus"])) for r in rows if r["mode"] == "graph"}
    out: dict = defaultdict(dict)
    for r in rows:
        limit = limits.get(r["gpus"])
        if limit is None:
            continue
        sizes, times = comm_curve(r)
        keep = sizes <= limit
        out[r["mode"]][str(r["gpus"])] = {**fit_collective(sizes[keep], times[keep]), "max_bytes": limit}
    if not out:
        return None, {}
    spans = ", ".join(f"{n} GPUs up to {limits[int(n)] / 2**20:g} MiB" for n in sorted(out["graph"], key=int))
    return dict(out), {"custom_all_reduce": f"AIConfigurator, {engine} {data}'s all-reduce on {device}: {spans}; "
                                            "NCCL past that"}


# -- an engine's kernels -----------------------------------------------------------------------------------------------
def fit_engine(t: AicTables, device: str, engine: str, version: str, passes: dict) -> DeviceKernels:
    """One engine version's kernels on one device."""
    gemm, notes = fit_gemms(t, device, engine, version)
    legacy, att_fit, att_notes = fit_attention(t, device, engine, version)
    custom, comm_notes = fit_custom_all_reduce(t, device, engine, version)
    moe_rows, moe_data = t.rows("moe", "moe", "moe_perf", device, engine, version)
    grouped = fit_moe(points(moe_rows, "t")) if moe_rows else None
    if grouped is not None:
        notes["grouped"] = f"AIConfigurator, {engine} {moe_data}'s MoE layer on {device} ({moe_rows[0]['kernel']})"
    mxfp4, mxfp4_notes = fit_mxfp4_moe(t, device, engine, version)
    notes["collectives"] = f"NCCL on {device} (AIConfigurator's nccl-tests runs)"
    return DeviceKernels(device, "aic", gemm, passes, legacy, f"aic_{SYSTEMS[device]}",
                         {**notes, **mxfp4_notes, **att_notes, **comm_notes}, device, grouped, engine, version, att_fit,
                         custom, mxfp4)


def fit_mxfp4_moe(t: AicTables, device: str, engine: str, version: str) -> tuple[GemmFit | None, dict]:
    """(the engine's MoE layer with MXFP4 experts as grouped GEMMs of 4.25-bit weights, its note), where timed."""
    rows, data = t.rows("moe_mxfp4", "moe", "moe_perf", device, engine, version)
    if not rows:
        return None, {}
    return fit_moe(points(rows, "t"), MXFP4_BYTES), {
        "grouped_mxfp4": f"AIConfigurator, {engine} {data}'s MoE layer with MXFP4 experts ({rows[0]['dtype']}) on "
                         f"{device} ({rows[0]['kernel']}), gpt-oss's expert shapes"}


# -- accuracy: leave one model out -------------------------------------------------------------------------------------
def gemm_lomo(rows: list[dict], dtype: str) -> tuple[list[float], list[float]]:
    """Each model's GEMMs (the grid shapes nearest its projections at TP 1-8) predicted by the fit to every other
    shape: (relative errors per GEMM, per layer — its four projections summed at each TP and M)."""
    m, n, k, t = gemm_points(rows)
    grid = sorted(set(n) | set(k))
    measured = {(a, b, c): s for a, b, c, s in zip(m, n, k, t)}
    per_gemm, per_layer = [], []
    for model in MODELS:
        group = model_gemm_shapes(model, grid)
        held = np.array([(a, b) in group for a, b in zip(n, k)])
        if not held.any() or (~held).sum() <= 20:
            continue
        fit = fit_gemm(m[~held], n[~held], k[~held], t[~held], weight_bytes=WEIGHT_BYTES[dtype])
        per_gemm += list(fit.time(m[held], n[held], k[held], WEIGHT_BYTES[dtype]) / t[held] - 1)
        for layer in model_layers(model, grid):
            for mm in sorted(set(m)):
                if all((mm, *s) in measured for s in layer):
                    real = sum(measured[(mm, *s)] for s in layer)
                    per_layer.append(sum(fit.time(mm, *s, WEIGHT_BYTES[dtype]) for s in layer) / real - 1)
    return per_gemm, per_layer


def model_layers(model: str, grid) -> list[list[tuple[int, int]]]:
    """A model's layer at each TP as its four projections' nearest grid (N, K)."""
    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    return [[(nearest(grid, n), nearest(grid, k)) for _, _, n, k in layer_gemms(hidden, heads, kv_heads, head_dim,
                                                                                  inter, tp, 1)]
            for tp in TP if heads % tp == 0]


def _held(pts, model: str) -> np.ndarray:
    heads = model_heads(model)
    return np.array([(r["heads"], r["kv_heads"]) in heads for r, _, _ in pts])


def attention_lomo(pre, dec, sms: int) -> dict[str, list[float]]:
    """Relative errors of each model's attention (its query and KV heads per device at TP 1-8) predicted by the fit
    to the other head configurations: prefill of up to 4 prompts (a step's few chunks) and decode, in AttentionFit's
    form and today's."""
    errs = defaultdict(list)
    for model in MODELS:
        hp, hd = _held(pre, model), _held(dec, model)
        if not hp.any() or not hd.any():
            continue
        train_p = [p for p, h in zip(pre, hp) if not h]
        train_d = [p for p, h in zip(dec, hd) if not h]
        fit = AttentionFit(**fit_prefill(train_p), **fit_decode(train_d))
        legacy = fit_legacy(train_p, train_d, sms)
        b, s, h, kv, t = _arrays([p for p, x in zip(pre, hp) if x and p[0]["batch"] <= 4])
        errs["prefill"] += list(fit.prefill_s(b, s, h, kv, HEAD_DIM) / t - 1)
        errs["prefill_today_form"] += list(legacy_prefill_s(legacy, b, s, h) / t - 1)
        b, s, _, kv, t = _arrays([p for p, x in zip(dec, hd) if x])
        errs["decode"] += list(fit.decode_s(b, s, kv, 2 * kv * HEAD_DIM * 2) / t - 1)
        errs["decode_today_form"] += list(legacy_decode_s(legacy, b, s, kv) / t - 1)
    return dict(errs)


def moe_lomo(pts, weight_bytes: float = 2.0) -> list[float]:
    """Relative errors of each expert shape's MoE layers predicted by the fit to the other shapes."""
    keys = [(r["hidden"], r["inter"], r["topk"], r["experts"]) for r, _, _ in pts]
    errs = []
    for shape in sorted(set(keys)):
        held = [k == shape for k in keys]
        fit = fit_moe([p for p, h in zip(pts, held) if not h], weight_bytes)
        shapes = moe_shapes([p for p, h in zip(pts, held) if h])
        errs += list(moe_time(fit, shapes, weight_bytes) / shapes[-1] - 1)
    return errs


def every_other_size(sizes: np.ndarray, times: np.ndarray) -> list[float]:
    """Relative errors on every other message size of a collective fitted to the rest."""
    if len(sizes) < 6:
        return []
    fit = fit_collective(sizes[::2], times[::2])
    p = fit["sharpness"]
    pred = (fit["latency_s"] ** p + (sizes[1::2] / fit["bandwidth"]) ** p) ** (1 / p)
    return list(pred / times[1::2] - 1)


def custom_holdout(t: AicTables, device: str, engine: str, version: str) -> list[float]:
    """The engine's CUDA-graph all-reduce within its range, every other size held out."""
    rows, _ = t.rows("comm", "comm", "custom_allreduce_perf", device, engine, version)
    custom, _ = fit_custom_all_reduce(t, device, engine, version)
    errs = []
    for r in rows:
        fit = (custom or {}).get(r["mode"], {}).get(str(r["gpus"]))
        if r["mode"] == "graph" and fit is not None:
            sizes, times = comm_curve(r)
            keep = sizes <= fit["max_bytes"]
            errs += every_other_size(sizes[keep], times[keep])
    return errs


def nccl_holdout(t: AicTables, device: str) -> list[float]:
    """NCCL's all-reduce on the device, every other size held out."""
    return [e for r in t.table("comm") if (r["device"], r["source"], r["op"]) == (device, "nccl", "all_reduce")
            for e in every_other_size(*comm_curve(r))]


def summary(errs: list[float], what: str) -> dict:
    med, p90 = stats(errs)
    return {"what": what, "median_pct": round(med, 1), "p90_pct": round(p90, 1), "n": len(errs)}


WHAT = {"gemm": "GEMMs of one model's shapes (nearest grid points, TP 1-8, M 1-16,384) held out",
        "gemm_layer": "a decoder layer's four GEMMs summed, one model's shapes (nearest grid points, TP 1-8, M "
                      "1-16,384) held out",
        "prefill": "prefill attention of up to 4 prompts, one model's (heads, KV heads) at TP 1-8 held out",
        "decode": "decode attention, one model's (heads, KV heads) at TP 1-8 held out (KV beyond the L2 cache)",
        "moe": "MoE layers (bf16, balanced routing), one model's expert shape held out",
        "moe_mxfp4": "MoE layers with MXFP4 experts (balanced routing), gpt-oss-20b's or -120b's held out",
        "custom_all_reduce": "the engine's CUDA-graph all-reduce within its range, every other size held out",
        "nccl_all_reduce": "NCCL all-reduce on one node, every other size held out"}


def what(part: str) -> str:
    """What an op family's error measures ("gemm.fp8", "attention.decode_today_form", "moe" ...)."""
    family, _, rest = part.partition(".")
    return WHAT[rest.removesuffix("_today_form") if family == "attention" else family]


def engine_errors(t: AicTables, device: str, engine: str, version: str) -> dict[str, list[float]]:
    """Per op family (gemm.<dtype>, attention.prefill / .decode and their _today_form, moe, custom_all_reduce), the
    relative errors of the fits on what they left out."""
    out = {}
    for dtype, (rows, _) in gemm_tables(t, device, engine, version).items():
        out[f"gemm.{GEMM_KEYS[dtype]}"], out[f"gemm_layer.{GEMM_KEYS[dtype]}"] = gemm_lomo(rows, dtype)
    ctx, _ = t.rows("context_attention", "attention", "context_attention_perf", device, engine, version)
    gen, _ = t.rows("generation_attention", "attention", "generation_attention_perf", device, engine, version)
    if ctx and gen:
        att = attention_lomo(points(ctx, "s"), decode_points(points(gen, "kv"), device), DEVICE_INFO[device][0])
        out.update({f"attention.{part}": errs for part, errs in att.items()})
    moe_rows, _ = t.rows("moe", "moe", "moe_perf", device, engine, version)
    if moe_rows:
        out["moe"] = moe_lomo(points(moe_rows, "t"))
    mxfp4_rows, _ = t.rows("moe_mxfp4", "moe", "moe_perf", device, engine, version)
    if mxfp4_rows:
        out["moe_mxfp4"] = moe_lomo(points(mxfp4_rows, "t"), MXFP4_BYTES)
    out["custom_all_reduce"] = custom_holdout(t, device, engine, version)
    return {k: v for k, v in out.items() if v}


def engine_accuracy(t: AicTables, device: str, engine: str, version: str) -> dict[str, dict]:
    """Per op family, the fits' error on what they left out (and NCCL's all-reduce on the device)."""
    out = {part: summary(errs, what(part)) for part, errs in engine_errors(t, device, engine, version).items()}
    nccl = nccl_holdout(t, device)
    if nccl:
        out["nccl_all_reduce"] = summary(nccl, WHAT["nccl_all_reduce"])
    return out


# -- the shipped files -------------------------------------------------------------------------------------------------
def derived_passes(device: str, reference: DeviceKernels) -> dict:
    """Elementwise passes (AIConfigurator does not time them) for a device without its own: the reference's (the
    H200's, timed here) at the device's HBM bandwidth."""
    scale = HARDWARE_CATALOG[device].memory_bandwidth / HARDWARE_CATALOG[reference.device].memory_bandwidth
    return {op: {**f, "bandwidth": f["bandwidth"] * scale} for op, f in reference.passes.items()}


def aliases(t: AicTables, device: str, engine: str, kept: list[str]) -> dict[str, str]:
    """Versions AIConfigurator lists whose attention data is a kept version's (reuse.yaml), by version."""
    out = {}
    versions = {r["version"] for r in t.versions if (r["device"], r["engine"]) == (device, engine)}
    for v in sorted(set(map(str, versions)) - set(kept), key=version_key):
        for table in ("context_attention_perf", "gemm_perf", "custom_allreduce_perf"):
            family = {"context_attention_perf": "attention", "gemm_perf": "gemm"}.get(table, "comm")
            data = resolve(t.versions, device, family, engine, table, v)
            if data in kept:
                out[v] = data
                break
    return out


def fit_engines(t: AicTables, defaults: dict) -> dict:
    """The engines' kernels (`write_engine_kernels` splits them by device): every device's engines at their kept
    versions, and their accuracy."""
    reference = DeviceKernels.from_json(defaults["H200"])
    engines, accuracy = {}, {}
    for device in DEVICES.values():
        passes = defaults[device]["passes"] if device in defaults else derived_passes(device, reference)
        for engine in ENGINES:
            kept = t.kept.get((device, engine))
            if not kept:
                continue
            fits = {v: fit_engine(t, device, engine, v, passes) for v in kept}
            engines.setdefault(device, {})[engine] = {
                "default": kept[0], "aliases": aliases(t, device, engine, kept),
                "versions": {v: {k: x for k, x in k.to_json().items() if k != "passes"} for v, k in fits.items()}}
            accuracy.setdefault(device, {})[engine] = engine_accuracy(t, device, engine, kept[0])
            print(f"{device} {engine} {', '.join(kept)}", flush=True)
    return {"source": (t.root / "SOURCE").read_text().strip(), "devices": engines, "accuracy": accuracy}


DEFAULT_ENGINE = "vllm"  # a device only AIConfigurator measured runs vLLM's kernels when no engine is named


def default_kernels(t: AicTables, device: str, reference: DeviceKernels) -> tuple[dict, dict]:
    """(the default kernels of a device only AIConfigurator measured, their accuracy entry): vLLM's newest, with
    NCCL's all-reduces and the reference's elementwise passes at the device's bandwidth."""
    version = t.kept[(device, DEFAULT_ENGINE)][0]
    k = fit_engine(t, device, DEFAULT_ENGINE, version, derived_passes(device, reference))
    notes = {**{p: n for p, n in k.notes.items() if p != "custom_all_reduce"},
             "all": f"vLLM {version}'s kernels as AIConfigurator timed them (no engine named: NCCL all-reduces); "
                    f"elementwise passes the {reference.device}'s at this device's HBM bandwidth"}
    k = replace(k, engine="", version="", custom_all_reduce=None, notes=notes)
    rows, _ = gemm_tables(t, device, DEFAULT_ENGINE, version)["bf16"]
    med, p90 = stats(gemm_lomo(rows, "bf16")[1])
    return k.to_json(), {"what": f"vLLM {version}'s bf16 GEMMs: {WHAT['gemm_layer']}", "median_pct": round(med, 1),
                         "p90_pct": round(p90, 1)}


def add_devices(data: dict, t: AicTables | None = None) -> list[str]:
    """Add to gpu_kernels.json's content (`data`, as calibration.kernel_fit fits it) the default kernels and accuracy
    of the devices only AIConfigurator measured, and its NCCL systems; the devices added."""
    t = t or AicTables()
    reference = DeviceKernels.from_json(data["devices"]["H200"])
    new = [device for device in DEVICES.values() if device not in data["devices"]]
    for device in new:
        data["devices"][device], data["accuracy"][device] = default_kernels(t, device, reference)
    for device, system in SYSTEMS.items():
        data["collectives"][f"aic_{system}"] = nccl_fits(t, device)
    data["devices"] = dict(sorted(data["devices"].items()))
    return new


def without_aic(data: dict) -> dict:
    """gpu_kernels.json's content without what add_devices adds (the part calibration.kernel_fit fits)."""
    return {"devices": {k: v for k, v in data["devices"].items() if v["source"] != "aic"},
            "accuracy": {k: v for k, v in data["accuracy"].items() if k not in data["devices"]
                         or data["devices"][k]["source"] != "aic"},
            "collectives": {k: v for k, v in data["collectives"].items() if not k.startswith("aic_")}}


def write_engine_kernels(data: dict, folder: Path) -> None:
    """`fit_engines`'s content as sim/cost/kernels.py reads it: a file per device in `folder` (a run parses only its
    own device's), each {"source", "engines", "accuracy"}; a device no longer fitted loses its file."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.json"):
        if stale.stem not in data["devices"]:
            stale.unlink()
    for device, engines in data["devices"].items():
        entry = {"source": data["source"], "engines": engines, "accuracy": data["accuracy"].get(device, {})}
        (folder / f"{device}.json").write_text(json.dumps(entry, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=Path, default=KERNELS_PATH)
    ap.add_argument("--out", type=Path, default=ENGINE_KERNELS_DIR, help="a folder: a file per device")
    args = ap.parse_args()
    t = AicTables()
    data = without_aic(json.loads(args.kernels.read_text()))
    new = add_devices(data, t)
    args.kernels.write_text(json.dumps(data, indent=1) + "\n")
    write_engine_kernels(fit_engines(t, data["devices"]), args.out)
    print(f"wrote {args.out} and {args.kernels} (+ {', '.join(new)})")


if __name__ == "__main__":
    main()

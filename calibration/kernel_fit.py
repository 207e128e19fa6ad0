"""Fit the simulator's GPU kernel model (sim/cost/kernels.py) to measured kernels, and keep the measurements it was
fitted to as compact tables (calibration/data/gpu/, sources and licences in its README).

    python -m calibration.kernel_fit                      # refit sim/data/gpu_kernels.json from the compact tables
    python -m calibration.kernel_fit --vidur PATH         # first rebuild the Vidur tables from a checkout of
                                                          # microsoft/vidur (its data/profiling)
    python -m calibration.kernel_fit --kernels K.json --device NAME   # add a GPU timed by calibration.gpu_kernels

(The devices only NVIDIA's AIConfigurator measured, and the engines' kernels: calibration/aic_fit.py, whose
additions to sim/data/gpu_kernels.json a refit here keeps.)

Every fit is least squares on log time (relative error: a 5 µs kernel weighs as much as a 5 ms one):
- a GEMM of M tokens, N outputs, K inputs: floor + (t_mem^p + t_compute^p)^(1/p), t_mem = bytes / bandwidth, t_compute
  = 2·M·N·K / (flops · M / (M + m_half)) — streaming the weights below the knee, a rate that climbs with M above it;
- an elementwise pass (norms, rotary, activation, residual add): floor + bytes / bandwidth, one fit per kind;
- prefill attention: floor per sequence + FLOPs / flops + per key (the last query tile walks every key);
- decode attention: floor + KV bytes / bandwidth;
- a collective over n devices: (latency^p + (bytes / bandwidth)^p)^(1/p), one fit per system, collective and n;
- a grouped expert GEMM (torch._grouped_mm over the experts a step's tokens touched): the GEMM form over all of them,
  each touched expert's weights streamed once, every expert computing the busiest one's rows.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from sim.config.hardware import HARDWARE_CATALOG
from sim.config.models import ModelSpec
from sim.cost.build import tensor_parallel_blocks
from sim.cost.kernels import (
    KERNELS_PATH,
    DeviceKernels,
    GemmFit,
    grouped_gemm_time,
    layer_gemms,
    layer_passes,
    pass_time,
)
from sim.cost.roofline import RooflineCostModel

DATA = Path(__file__).resolve().parent / "data" / "gpu"
LINEAR_OPS = DATA / "linear_ops.csv"
COLLECTIVES = DATA / "collectives.csv"
GEMMS = DATA / "gemm.csv"
ATTENTION = DATA / "attention.csv"
ELEMENTWISE = DATA / "elementwise.csv"
MOE = DATA / "moe.csv"

# Vidur's op names -> ours; `add` is one residual add a layer (Vidur's block time counts it once)
VIDUR_OPS = {"attn_pre_proj": "qkv", "attn_post_proj": "o", "mlp_up_proj": "gate_up", "mlp_down_proj": "down",
             "input_layernorm": "input_norm", "post_attention_layernorm": "post_norm", "attn_rope": "rope",
             "mlp_act": "act", "add": "add"}
GEMM_OPS = ("qkv", "o", "gate_up", "down")
PASS_OPS = ("input_norm", "post_norm", "rope", "act", "add")
# token counts kept from Vidur's sweeps (1 to 32,768 in steps of 8 to 256): enough to judge the fit anywhere
KEEP_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
               8192, 12288, 16384, 24576, 32768)
KEEP_BYTES = 48  # collective sizes kept per configuration, log-spaced from 2 KiB to 64 MiB
COMM_WINDOW = 1.06  # a kept size's time: the median of the measured sizes within this factor of it
# Vidur's systems -> the link they measured: SXM boards through NVSwitch, PCIe boards with NVLink bridges in pairs,
# and two DGX nodes over InfiniBand (devices_per_node < workers)
VIDUR_SYSTEMS = {"a100_dgx": "A100 DGX (NVSwitch; InfiniBand between nodes)", "h100_dgx": "H100 DGX (NVSwitch)",
                 "a100_pairwise_nvlink": "A100 PCIe, NVLink bridges in pairs",
                 "h100_pairwise_nvlink": "H100 PCIe, NVLink bridges in pairs",
                 "a40_pairwise_nvlink": "A40 PCIe, NVLink bridges in pairs"}
VIDUR_DEVICES = {"a100": "A100-80GB", "h100": "H100-SXM", "a40": "A40"}


# -- the compact tables --------------------------------------------------------------------------------------------
def read_table(path: Path) -> list[dict]:
    """A compact table's rows, numbers as numbers."""
    def num(v):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    with open(path, newline="") as f:
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_table(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue())


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def vidur_tables(root: Path) -> tuple[list[dict], list[dict]]:
    """(linear op rows, collective rows) from Vidur's data/profiling: per device, model shape, TP size and token count
    the median of each decoder-layer op in µs (duplicates of a shape averaged), and per system, collective, workers and
    size the median time in µs at KEEP_BYTES log-spaced sizes."""
    ops = []
    for path in sorted((root / "compute").glob("*/*/*/mlp.csv")):
        device = VIDUR_DEVICES[path.parts[-4]]
        model = path.parts[-2]
        groups = defaultdict(list)
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                groups[(int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))].append(r)
        for (tp, tokens), rows in sorted(groups.items()):
            if tokens not in KEEP_TOKENS:
                continue
            r = rows[0]
            row = {"source": "vidur", "device": device, "model": model, "heads": int(r["n_head"]),
                   "kv_heads": int(r["n_kv_head"]), "hidden": int(r["n_embd"]),
                   "intermediate": int(r["n_expanded_embd"]), "gated": int(r["use_gated_mlp"] == "True"), "tp": tp,
                   "tokens": tokens}
            for theirs, ours in VIDUR_OPS.items():
                key = f"time_stats.{theirs}.median"
                vals = [float(x[key]) * 1e3 for x in rows if x.get(key)]  # ms -> µs
                row[f"{ours}_us"] = _sig(float(np.mean(vals))) if vals else ""
            ops.append(row)
    comm = []
    targets = np.geomspace(2048, 64 * 2**20, KEEP_BYTES)
    for path in sorted((root / "network").glob("*/*.csv")):
        system = path.parts[-2]
        if system not in VIDUR_SYSTEMS or path.stem not in ("all_reduce", "send_recv"):
            continue
        groups = defaultdict(list)
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                med = next(k for k in r if k.endswith(".median"))
                groups[(int(r["num_workers"]), int(r["devices_per_node"]))].append((int(r["size"]), float(r[med])))
        for (workers, per_node), pts in sorted(groups.items()):
            sizes, times = np.array([s for s, _ in pts], float), np.array([t for _, t in pts])
            for target in targets:
                size = int(sizes[np.argmin(np.abs(np.log(sizes) - math.log(target)))])
                # the medians of sizes within ±6%: below 1 MiB adjacent sizes' medians jump between two levels
                # (25 or 62 µs on 8 A100s), so one size's median is a coin toss between them
                near = times[(sizes >= size / COMM_WINDOW) & (sizes <= size * COMM_WINDOW)]
                comm.append({"source": "vidur", "system": system, "collective": path.stem, "workers": workers,
                             "devices_per_node": per_node, "bytes": size, "us": _sig(float(np.median(near)) * 1e3)})
    comm = [dict(t) for t in {tuple(r.items()): r for r in comm}.values()]  # a size nearest two targets: once
    return ops, sorted(comm, key=lambda r: (r["system"], r["collective"], r["workers"], r["devices_per_node"],
                                            r["bytes"]))


def kernel_tables(path: Path, device: str) -> dict[str, list[dict]]:
    """Tables from a calibration.gpu_kernels run: GEMMs, attention, elementwise passes, MoE expert GEMMs."""
    data = json.loads(path.read_text())
    recs = data["records"]
    src = {"source": "measured", "device": device}
    gemm = [{**src, "dtype": r["dtype"], "m": r["m"], "n": r["n"], "k": r["k"], "label": r["label"],
             "us": _sig(r["s"] * 1e6)} for r in recs if r["op"] == "gemm"]
    attn = [{**src, "kind": "prefill", "batch": r["batch"], "seq": r["seq"], "past": r["past"], "heads": r["heads"],
             "kv_heads": r["heads"], "head_dim": r["head_dim"], "us": _sig(r["s"] * 1e6)}
            for r in recs if r["op"] == "attn_prefill"]
    attn += [{**src, "kind": "decode", "batch": r["batch"], "seq": 1, "past": r["context"], "heads": r["heads"],
              "kv_heads": r["kv_heads"], "head_dim": r["head_dim"], "us": _sig(r["s"] * 1e6)}
             for r in recs if r["op"] == "attn_decode"]
    elem = [{**src, "kind": r["kind"], "tokens": r["tokens"], "width": r["width"], "bytes": r["bytes"],
             "us": _sig(r["s"] * 1e6)} for r in recs if r["op"] == "elementwise"]
    moe = [{**src, **{k: r[k] for k in ("model", "kind", "impl", "tokens", "top_k", "experts", "active_experts",
                                         "hidden", "inter")}, "us": _sig(r["s"] * 1e6)}
           for r in recs if r["op"] == "moe"]
    return {"gemm": gemm, "attention": attn, "elementwise": elem, "moe": moe}


# -- accuracy: predicting what was left out of the fit --------------------------------------------------------------
# Vidur's model folders -> the catalog entry of the same shape (the rest are shapes the catalog does not have)
CATALOGUED = {"Llama-2-7b-hf": "Llama-2-7B", "Llama-2-70b-hf": "Llama-2-70B", "Meta-Llama-3-8B": "Llama-3-8B",
              "Meta-Llama-3-70B": "Llama-3-70B"}


def predicted_linear(k: DeviceKernels, row: dict) -> float:
    """The kernel model's time for the ops this row measured."""
    args = (row["hidden"], row["heads"], row["kv_heads"], row["hidden"] // row["heads"], row["intermediate"],
            row["tp"], row["tokens"], bool(row["gated"]))
    t = sum(k.gemm["fp16"].time(m, n, kk) for op, m, n, kk in layer_gemms(*args) if row[f"{op}_us"] != "")
    return t + sum(pass_time(k.passes[op], b) for op, b in layer_passes(*args).items() if row[f"{op}_us"] != "")


def measured_linear(row: dict) -> float:
    return sum(v for key, v in row.items() if key.endswith("_us") and v != "") * 1e-6


def roofline_linear(row: dict) -> float:
    """The roofline's linear-layer time of one decoder layer (its embedding and LM head left out)."""
    hw = HARDWARE_CATALOG[row["device"]]
    model = ModelSpec(num_layers=1, hidden_size=row["hidden"], num_heads=row["heads"], num_kv_heads=row["kv_heads"],
                      intermediate_size=row["intermediate"], vocab_size=1, weight_dtype="fp16")
    r = RooflineCostModel(tensor_parallel_blocks(model, row["tp"]), hw)
    weights = model.params_per_layer * 2 / (hw.memory_bandwidth * 0.8) / row["tp"]
    return max(row["tokens"] * r.s_per_linear_token, weights + row["tokens"] * r.s_per_act_token)


def stats(err) -> tuple[float, float]:
    e = np.abs(np.asarray(err)) * 100
    return float(np.median(e)), float(np.percentile(e, 90))


def linear_truth(ops: list[dict]) -> dict:
    """Leave-one-model-out relative errors of the kernel model and the roofline, by (device, model, tp)."""
    out = {}
    for device in sorted({r["device"] for r in ops}):
        rows = linear_rows(ops, device)
        for model in sorted({r["model"] for r in rows}):
            gemm, passes = fit_linear(linear_rows(ops, device, exclude_model=model))
            k = DeviceKernels(device, "vidur", {"fp16": gemm}, passes)
            for r in (r for r in rows if r["model"] == model):
                real = measured_linear(r)
                key = (device, model, r["tp"])
                out.setdefault(key, ([], []))
                out[key][0].append(predicted_linear(k, r) / real - 1)
                out[key][1].append(roofline_linear(r) / real - 1)
    return out


def gemm_truth(rows: list[dict]) -> list[float]:
    """A GEMM sweep's per-layer projections (rows labelled "<model> tp<n> <op>"), leaving each model out of the fit
    and predicting the sum of its layer's four GEMMs at every (TP, M)."""
    layers = defaultdict(dict)  # (model, tp) -> {(n, k): {m: s}}
    for r in rows:
        parts = str(r.get("label", "")).split()
        if len(parts) == 3 and parts[1].startswith("tp"):
            layers[(parts[0], parts[1])].setdefault((r["n"], r["k"]), {})[r["m"]] = r["us"] * 1e-6
    errs = []
    for model in sorted({m for m, _ in layers}):
        rest = [r for r in rows if not str(r.get("label", "")).startswith(model + " ")]
        fit = fit_gemm(*zip(*[(r["m"], r["n"], r["k"], r["us"] * 1e-6) for r in rest]))
        for (m_, _), shapes in sorted(layers.items()):
            if m_ != model:
                continue
            for m in sorted(set.intersection(*(set(t) for t in shapes.values()))):
                pred = sum(fit.time(m, n, kk) for n, kk in shapes)
                errs.append(pred / sum(t[m] for t in shapes.values()) - 1)
    return errs


def accuracy(ops: list[dict], gemms: list[dict]) -> dict:
    """Per device, |error| % (median, p90) of the kernel model on what was left out of its fit — a decoder layer's
    linear ops (Vidur's devices) or its four GEMMs (a sweep's) — and of the roofline on the same linear ops."""
    out = {}
    lin = linear_truth(ops)
    for device in sorted({d for d, _, _ in lin}):
        k = [e for (d, _, _), (ks, _) in lin.items() if d == device for e in ks]
        r = [e for (d, _, _), (_, rs) in lin.items() if d == device for e in rs]
        out[device] = {"what": "decoder-layer linear ops, leave one model out", "median_pct": round(stats(k)[0], 1),
                       "p90_pct": round(stats(k)[1], 1), "roofline_median_pct": round(stats(r)[0], 1),
                       "roofline_p90_pct": round(stats(r)[1], 1)}
    every = [e for _, rs in lin.values() for e in rs]
    out["roofline"] = {"what": "the measured GPUs' decoder-layer linear ops", "median_pct": round(stats(every)[0], 1),
                       "p90_pct": round(stats(every)[1], 1)}
    for device in sorted({r["device"] for r in gemms}):
        e = gemm_truth([r for r in gemms if r["device"] == device and r["dtype"] == "bf16"])
        out[device] = {"what": "a decoder layer's four GEMMs, leave one model out",
                       "median_pct": round(stats(e)[0], 1), "p90_pct": round(stats(e)[1], 1)}
    return out


# -- fits ----------------------------------------------------------------------------------------------------------
def _fit(residual, x0, lo, hi, **kw) -> np.ndarray:
    return least_squares(residual, x0, bounds=(lo, hi), **kw).x


def fit_gemm(m, n, k, t, weight_bytes: float = 2.0) -> GemmFit:
    """GemmFit to GEMM times t (seconds) of shapes (m, n, k)."""
    m, n, k, t = (np.asarray(v, float) for v in (m, n, k, t))

    def model(p):
        return GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, p[3], p[4]).time(m, n, k, weight_bytes)
    p = _fit(lambda p: np.log(model(p)) - np.log(t), [5, 1.5, 200, 2, 64], [0, 0.05, 5, 1, 0], [50, 20, 5000, 8, 4096])
    return GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, float(p[3]), float(p[4]))


def fit_pass(nbytes, t) -> dict:
    """An elementwise pass: {"floor_s", "bandwidth"} for times t of passes moving `nbytes`."""
    nbytes, t = np.asarray(nbytes, float), np.asarray(t, float)
    p = _fit(lambda p: np.log(p[0] * 1e-6 + nbytes / (p[1] * 1e12)) - np.log(t), [3, 1], [0, 0.005], [100, 50])
    return {"floor_s": p[0] * 1e-6, "bandwidth": p[1] * 1e12}


def fit_collective(nbytes, t) -> dict:
    """{"latency_s", "bandwidth", "sharpness"}: time = (latency^p + (bytes / bandwidth)^p)^(1/p)."""
    nbytes, t = np.asarray(nbytes, float), np.asarray(t, float)

    def model(p):
        return ((p[0] * 1e-6) ** p[2] + (nbytes / (p[1] * 1e9)) ** p[2]) ** (1 / p[2])
    # a robust loss: small messages' times jump between two levels (scheduling), which squares would split the
    # difference between
    p = _fit(lambda p: np.log(model(p)) - np.log(t), [20, 100, 1.5], [0.1, 0.1, 1], [1e4, 1e4, 10],
             loss="soft_l1", f_scale=0.05)
    return {"latency_s": p[0] * 1e-6, "bandwidth": p[1] * 1e9, "sharpness": float(p[2])}


def fit_attention(rows: list[dict], sms: int) -> dict:
    """Prefill: floor per sequence + FLOPs / flops + per key; decode: floor + KV bytes / bandwidth (16-bit KV), at one
    bandwidth while the decode's sequences x KV heads fit in one wave of the device's `sms` multiprocessors (the
    kernel splits each sequence's keys to fill them) and another past it (one sequence a block: FlashAttention-2 read
    2.6 TB/s on an H200 there, 4.2 within a wave)."""
    pre = [r for r in rows if r["kind"] == "prefill"]
    b, n, past, h, d, t = (np.array([r[k] for r in pre], float) for k in ("batch", "seq", "past", "heads",
                                                                            "head_dim", "us"))
    flops = 4 * h * d * b * (n * past + n * (n + 1) / 2)
    keys = b * (past + n)  # each sequence's last query tile walks all its keys, whatever the heads

    def pmodel(p):
        return p[0] * 1e-6 * b + flops / (p[1] * 1e12) + p[2] * 1e-9 * keys
    pp = _fit(lambda p: np.log(pmodel(p)) - np.log(t * 1e-6), [4, 300, 20], [0, 1, 0], [1e3, 1e4, 1e4])
    dec = [r for r in rows if r["kind"] == "decode"]
    kv = np.array([2 * r["batch"] * r["past"] * r["kv_heads"] * r["head_dim"] * 2 for r in dec], float)
    one_wave = np.array([r["batch"] * r["kv_heads"] <= sms for r in dec])
    td = np.array([r["us"] for r in dec], float) * 1e-6

    def dmodel(p):
        return p[0] * 1e-6 + kv / (np.where(one_wave, p[1], p[2]) * 1e12)
    pd = _fit(lambda p: np.log(dmodel(p)) - np.log(td), [5, 3, 3], [0, 0.01, 0.01], [1e3, 100, 100])
    return {"prefill_floor_s": pp[0] * 1e-6, "prefill_flops": pp[1] * 1e12, "prefill_s_per_key": pp[2] * 1e-9,
            "decode_floor_s": pd[0] * 1e-6, "decode_bandwidth_one_wave": pd[1] * 1e12, "decode_bandwidth": pd[2] * 1e12,
            "sms": sms}


def grouped_shapes(rows: list[dict]) -> tuple[np.ndarray, ...]:
    """(routed rows, touched experts, busiest expert's rows, N, K, seconds) of grouped expert GEMM rows (moe.csv):
    gate/up maps hidden to 2 × inter, down inter to hidden; uniform routing, so the busiest has the mean."""
    tokens = np.array([r["tokens"] * r["top_k"] for r in rows], float)
    touched = np.array([r["active_experts"] for r in rows], float)
    up = np.array([r["kind"] == "gate_up" for r in rows])
    hidden, inter = (np.array([r[k] for r in rows], float) for k in ("hidden", "inter"))
    return (tokens, touched, tokens / touched, np.where(up, 2 * inter, hidden), np.where(up, hidden, inter),
            np.array([r["us"] for r in rows], float) * 1e-6)


def fit_grouped(rows: list[dict]) -> GemmFit:
    """The grouped expert GEMM fit (bf16) to moe.csv's rows."""
    tokens, touched, busiest, n, k, t = grouped_shapes(rows)

    def model(p):
        return grouped_gemm_time(GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, p[3], p[4]), tokens, touched, busiest,
                                 n, k)
    p = _fit(lambda p: np.log(model(p)) - np.log(t), [5, 3, 500, 2, 32], [0, 0.05, 5, 1, 0], [100, 20, 5000, 8, 4096])
    return GemmFit(p[0] * 1e-6, p[1] * 1e12, p[2] * 1e12, float(p[3]), float(p[4]))


def grouped_truth(rows: list[dict]) -> list[float]:
    """Leave one model out: each model's grouped GEMMs predicted by the fit to the others'; relative errors."""
    errs = []
    for model in sorted({r["model"] for r in rows}):
        fit = fit_grouped([r for r in rows if r["model"] != model])
        tokens, touched, busiest, n, k, t = grouped_shapes([r for r in rows if r["model"] == model])
        errs += list(grouped_gemm_time(fit, tokens, touched, busiest, n, k) / t - 1)
    return errs


def linear_rows(rows: list[dict], device: str, exclude_model: str | None = None) -> list[dict]:
    return [r for r in rows if r["device"] == device and r["model"] != exclude_model]


def fit_linear(rows: list[dict]) -> tuple[GemmFit, dict]:
    """The GEMM fit and the pass fits of one device from Vidur-style per-layer op rows."""
    m, n, k, t = [], [], [], []
    for r in rows:
        for (op, mm, nn, kk) in layer_gemms(r["hidden"], r["heads"], r["kv_heads"], r["hidden"] // r["heads"],
                                             r["intermediate"], r["tp"], r["tokens"], bool(r["gated"])):
            if r.get(f"{op}_us") not in ("", None):
                m.append(mm), n.append(nn), k.append(kk), t.append(r[f"{op}_us"] * 1e-6)
    gemm = fit_gemm(m, n, k, t)
    passes = {}
    for op in PASS_OPS:
        nbytes, t = [], []
        for r in rows:
            if r.get(f"{op}_us") in ("", None):
                continue
            sizes = layer_passes(r["hidden"], r["heads"], r["kv_heads"], r["hidden"] // r["heads"], r["intermediate"],
                                 r["tp"], r["tokens"], bool(r["gated"]))
            nbytes.append(sizes[op]), t.append(r[f"{op}_us"] * 1e-6)
        if nbytes:
            passes[op] = fit_pass(nbytes, t)
    return gemm, passes


def fit_elementwise(rows: list[dict]) -> dict:
    """Pass fits from a gpu_kernels run's elementwise kinds: norms from rms_norm, the activation from silu_mul, the
    residual add from add, rotary (not timed) as the activation's two-kernel pass."""
    by_kind = {kind: fit_pass([r["bytes"] for r in rows if r["kind"] == kind],
                              [r["us"] * 1e-6 for r in rows if r["kind"] == kind]) for kind in {r["kind"] for r in rows}}
    return {"input_norm": by_kind["rms_norm"], "post_norm": by_kind["rms_norm"], "rope": by_kind["silu_mul"],
            "act": by_kind["silu_mul"], "add": by_kind["add"]}


def fit_collectives(rows: list[dict]) -> dict:
    """{system: {collective: {"workers x devices_per_node": fit}}}."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["system"], r["collective"], r["workers"], r["devices_per_node"])].append(r)
    out: dict = defaultdict(lambda: defaultdict(dict))
    for (system, coll, workers, per_node), rs in sorted(groups.items()):
        out[system][coll][f"{workers}x{per_node}"] = fit_collective([r["bytes"] for r in rs],
                                                                     [r["us"] * 1e-6 for r in rs])
    return json.loads(json.dumps(out))


def fit_all() -> dict:
    """sim/data/gpu_kernels.json's content from the compact tables."""
    ops = read_table(LINEAR_OPS)
    devices = {}
    for device in sorted({r["device"] for r in ops}):
        gemm, passes = fit_linear(linear_rows(ops, device))
        devices[device] = DeviceKernels(device, "vidur", {"fp16": gemm}, passes).to_json()
    if GEMMS.exists():
        gemm_rows = read_table(GEMMS)
        for device in sorted({r["device"] for r in gemm_rows}):
            rs = [r for r in gemm_rows if r["device"] == device]
            fits = {}
            for dtype, wbytes in (("bf16", 2.0), ("fp8", 1.0)):
                sel = [r for r in rs if r["dtype"] == dtype]
                if sel:
                    fits["fp16" if dtype == "bf16" else dtype] = fit_gemm(*zip(*[(r["m"], r["n"], r["k"], r["us"] * 1e-6)
                                                                               for r in sel]), weight_bytes=wbytes)
            elem = [r for r in read_table(ELEMENTWISE) if r["device"] == device]
            attn = [r for r in read_table(ATTENTION) if r["device"] == device]
            devices[device] = DeviceKernels(device, "measured", fits, fit_elementwise(elem),
                                            fit_attention(attn, SMS[device]) if attn else None).to_json()
    moe = read_table(MOE) if MOE.exists() else []
    for device in sorted({r["device"] for r in moe}):
        devices[device]["grouped"] = asdict(fit_grouped([r for r in moe if r["device"] == device]))
    gemm_rows = read_table(GEMMS) if GEMMS.exists() else []
    out = accuracy(ops, gemm_rows)
    if moe:
        e = grouped_truth(moe)
        out["grouped_gemm"] = {"what": "grouped expert GEMMs (H200), leave one model out",
                               "median_pct": round(stats(e)[0], 1), "p90_pct": round(stats(e)[1], 1)}
    return {"devices": derive(devices), "accuracy": out, "collectives": fit_collectives(read_table(COLLECTIVES))}


# the NCCL system each device's collectives were measured on (the H200's HGX board has the H100's NVSwitch fabric)
SYSTEMS = {"A100-80GB": "a100_dgx", "A100-40GB": "a100_dgx", "H100-SXM": "h100_dgx", "H200": "h100_dgx",
           "A40": "a40_pairwise_nvlink"}
FA2_AMPERE_EFFICIENCY = 0.6  # FlashAttention-2's forward reaches 50-73% of an A100's peak (Dao, 2023): the middle
SMS = {"A100-80GB": 108, "A100-40GB": 108, "H100-SXM": 132, "H200": 132, "A40": 84}  # streaming multiprocessors


def derive(devices: dict) -> dict:
    """Carry what a device's own measurements lack over from one that has it, saying how in its notes: attention
    from the H200's (the same FLOP rate on Hopper; on Ampere FlashAttention-2's published efficiency; decode at the
    H200's fraction of the device's own streaming bandwidth), fp8 GEMMs on Hopper at the H200's fp8/bf16 FLOP ratio,
    and the A100-40GB from the A100-80GB with its memory-bound rates scaled by the two parts' bandwidths."""
    out = {name: DeviceKernels.from_json(d) for name, d in devices.items()}
    ref = out["H200"]
    ref_att, ref_gemm = ref.attention, ref.gemm["fp16"]
    for name, k in list(out.items()):
        notes, gemm, att = dict(k.notes), dict(k.gemm), k.attention
        hw = HARDWARE_CATALOG.get(name)
        if att is None:
            hopper = hw is not None and "fp8" in hw.peak_flops
            stream = gemm["fp16"].bandwidth / ref_gemm.bandwidth
            flops = ref_att["prefill_flops"] if hopper else FA2_AMPERE_EFFICIENCY * hw.flops("fp16")
            att = {**ref_att, "prefill_flops": flops, "decode_bandwidth": ref_att["decode_bandwidth"] * stream,
                   "decode_bandwidth_one_wave": ref_att["decode_bandwidth_one_wave"] * stream, "sms": SMS[name]}
            notes["attention"] = ("H200's SDPA (FlashAttention-2) fit; decode at the H200's fractions of the "
                                  "GEMM streaming bandwidth" + ("" if hopper else f"; prefill at "
                                  f"{FA2_AMPERE_EFFICIENCY:.0%} of peak (FlashAttention-2 paper: 50-73% on A100)"))
        grouped = k.grouped
        if grouped is None and ref.grouped is not None:  # this device's GEMM rates over the H200's, on its fit
            g, f16 = ref.grouped, gemm["fp16"]
            grouped = GemmFit(g.floor_s, g.bandwidth * f16.bandwidth / ref_gemm.bandwidth,
                              g.flops * f16.flops / ref_gemm.flops, g.sharpness, g.m_half)
            notes["grouped"] = "the H200's grouped expert GEMM fit at this device's GEMM bandwidth and FLOP rate"
        if "fp8" not in gemm and hw is not None and "fp8" in hw.peak_flops and "fp8" in ref.gemm:
            f8, f16 = ref.gemm["fp8"], ref_gemm
            gemm["fp8"] = GemmFit(f8.floor_s, gemm["fp16"].bandwidth, gemm["fp16"].flops * f8.flops / f16.flops,
                                  f8.sharpness, f8.m_half)
            notes["gemm.fp8"] = "this device's bf16 fit at the H200's measured fp8/bf16 FLOP ratio"
        out[name] = DeviceKernels(name, k.source, gemm, k.passes, att, SYSTEMS.get(name), notes, name, grouped)
    a100 = out["A100-80GB"]
    scale = HARDWARE_CATALOG["A100-40GB"].memory_bandwidth / HARDWARE_CATALOG["A100-80GB"].memory_bandwidth
    out["A100-40GB"] = DeviceKernels(
        "A100-40GB", "derived",
        {d: GemmFit(g.floor_s, g.bandwidth * scale, g.flops, g.sharpness, g.m_half) for d, g in a100.gemm.items()},
        {op: {**f, "bandwidth": f["bandwidth"] * scale} for op, f in a100.passes.items()},
        {**a100.attention, "decode_bandwidth": a100.attention["decode_bandwidth"] * scale,
         "decode_bandwidth_one_wave": a100.attention["decode_bandwidth_one_wave"] * scale}, SYSTEMS["A100-40GB"],
        {"all": f"A100-80GB's fits, memory-bound rates x {scale:.3f} (1.555 / 2.039 TB/s HBM)"}, "A100-80GB",
        GemmFit(a100.grouped.floor_s, a100.grouped.bandwidth * scale, a100.grouped.flops, a100.grouped.sharpness,
                a100.grouped.m_half) if a100.grouped is not None else None)
    return {name: k.to_json() for name, k in sorted(out.items())}


def keep_aic(fitted: dict, path: Path) -> dict:
    """`fitted` with what calibration.aic_fit added to the file at `path` (the devices only AIConfigurator measured,
    their accuracy, its NCCL systems), so refitting the measured devices keeps them."""
    if not path.exists():
        return fitted
    old = json.loads(path.read_text())
    aic = [d for d, k in old["devices"].items() if k["source"] == "aic" and d not in fitted["devices"]]
    fitted["devices"] = dict(sorted({**fitted["devices"], **{d: old["devices"][d] for d in aic}}.items()))
    fitted["accuracy"].update({d: v for d, v in old["accuracy"].items() if d in aic})
    fitted["collectives"].update({k: v for k, v in old["collectives"].items() if k.startswith("aic_")})
    return fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vidur", type=Path, help="a checkout of microsoft/vidur: rebuild its compact tables first")
    ap.add_argument("--kernels", type=Path, help="a calibration.gpu_kernels JSON: add its tables first")
    ap.add_argument("--device", help="the hardware catalog name of the GPU --kernels timed")
    ap.add_argument("--out", type=Path, default=KERNELS_PATH)
    args = ap.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    if args.vidur:
        ops, comm = vidur_tables(args.vidur / "data" / "profiling")
        write_table(LINEAR_OPS, ops)
        write_table(COLLECTIVES, comm)
    if args.kernels:
        if not args.device:
            ap.error("--kernels needs --device (the hardware catalog name)")
        for name, rows in kernel_tables(args.kernels, args.device).items():
            path = DATA / f"{name}.csv"
            kept = [r for r in read_table(path) if r["device"] != args.device] if path.exists() else []
            write_table(path, kept + rows)
    fitted = keep_aic(fit_all(), args.out)
    args.out.write_text(json.dumps(fitted, indent=1) + "\n")
    print(f"wrote {args.out}: {', '.join(fitted['devices'])}; collectives of {', '.join(fitted['collectives'])}")


if __name__ == "__main__":
    main()

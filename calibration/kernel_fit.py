"""Fit the simulator's GPU kernel model (sim/cost/kernels.py) to measured kernels, and keep the measurements it was
fitted to as compact tables (calibration/data/gpu/, sources and licences in its README).

    python -m calibration.kernel_fit                      # refit sim/data/gpu_kernels.json from the compact tables
    python -m calibration.kernel_fit --vidur PATH         # first rebuild the Vidur tables from a checkout of
                                                          # microsoft/vidur (its data/profiling)
    python -m calibration.kernel_fit --kernels K.json --device NAME   # add a GPU timed by calibration.gpu_kernels

Every fit is least squares on log time (relative error: a 5 µs kernel weighs as much as a 5 ms one):
- a GEMM of M tokens, N outputs, K inputs: floor + (t_mem^p + t_compute^p)^(1/p), t_mem = bytes / bandwidth, t_compute
  = 2·M·N·K / (flops · M / (M + m_half)) — streaming the weights below the knee, a rate that climbs with M above it;
- an elementwise pass (norms, rotary, activation, residual add): floor + bytes / bandwidth, one fit per kind;
- prefill attention: floor per sequence + FLOPs / flops + per key (the last query tile walks every key);
- decode attention: floor + KV bytes / bandwidth;
- a collective over n devices: (latency^p + (bytes / bandwidth)^p)^(1/p), one fit per system, collective and n.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from sim.cost.kernels import KERNELS_PATH, DeviceKernels, GemmFit, layer_gemms, layer_passes

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
    gemm = [{**src, "dtype": r["dtype"], "m": r["m"], "n": r["n"], "k": r["k"], "us": _sig(r["s"] * 1e6)}
            for r in recs if r["op"] == "gemm"]
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


def fit_attention(rows: list[dict]) -> dict:
    """Prefill: floor per sequence + FLOPs / flops + per key; decode: floor + KV bytes / bandwidth (16-bit KV)."""
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
    td = np.array([r["us"] for r in dec], float) * 1e-6
    pd = _fit(lambda p: np.log(p[0] * 1e-6 + kv / (p[1] * 1e12)) - np.log(td), [5, 3], [0, 0.01], [1e3, 100])
    return {"prefill_floor_s": pp[0] * 1e-6, "prefill_flops": pp[1] * 1e12, "prefill_s_per_key": pp[2] * 1e-9,
            "decode_floor_s": pd[0] * 1e-6, "decode_bandwidth": pd[1] * 1e12}


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
                                            fit_attention(attn) if attn else None).to_json()
    return {"devices": devices, "collectives": fit_collectives(read_table(COLLECTIVES))}


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
    fitted = fit_all()
    args.out.write_text(json.dumps(fitted, indent=1) + "\n")
    print(f"wrote {args.out}: {', '.join(fitted['devices'])}; collectives of {', '.join(fitted['collectives'])}")


if __name__ == "__main__":
    main()

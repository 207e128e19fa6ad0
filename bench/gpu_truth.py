"""How well the GPU kernel model predicts real GPU measurements it was not fitted to, against the datasheet roofline.

- Linear layers (Vidur's profiles of A100, H100 and A40: a decoder layer's QKV/O/MLP projections, norms, rotary,
  activation and residual add, per step of T tokens, TP 1-8), leave one model out: for each device and model, the
  kernel model is fitted to the device's other models and predicts this one's every (TP, T). Four of the eight
  shapes are not in infersim's catalog (CodeLlama-34B, InternLM-20B, Qwen-72B, Phi-2).
- H200 GEMMs (timed here, docs/runs/2026-12-04-h200): the same, leaving out each model's projections.
- H200 grouped expert GEMMs (torch._grouped_mm, calibration/data/gpu/moe.csv: Mixtral-8x7B, Qwen3-30B-A3B and a
  DeepSeek-V3 EP8 shard): each model's predicted by the fit to the other two.
- TP all-reduce and send/recv (Vidur's NCCL measurements on DGX A100 / H100 and PCIe boards, one node): fitted to
  every other message size of each configuration, judged on the sizes in between.
- The roofline is judged on the same rows as it prices them today (compute_efficiency 0.6, memory_efficiency 0.8,
  the catalog's links).
- NVIDIA AIConfigurator's engine-collected kernels (calibration/data/gpu/aic: vLLM, SGLang, TensorRT-LLM, each at its
  newest version, on A100, H100, H200, L40S, B200, GB200, B300, GB300, RTX PRO 6000), leave one model out: GEMMs by
  dtype (the grid shapes nearest one model's projections at TP 1-8 held out; 13 dense models), context and generation
  attention (one model's query / KV heads per device at TP 1-8 held out; prefill of up to 4 prompts, decode past the L2
  cache), in the engines' fitted form and in today's (`attention`'s: what sim/cost/gpu.py prices with), MoE layers
  (one model's expert shape held out), the engine's own all-reduce and NCCL's (every other size held out).

Usage: python bench/gpu_truth.py [--no-aic]   (AIConfigurator's part: ~1-2 minutes on a quiet machine)
"""
from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from calibration.aic_fit import AicTables, engine_errors, nccl_holdout
from calibration.kernel_fit import (
    CATALOGUED,
    COLLECTIVES,
    GEMMS,
    LINEAR_OPS,
    MOE,
    fit_collective,
    gemm_truth,
    grouped_truth,
    linear_truth,
    read_table,
    stats,
)
from sim.config.hardware import HARDWARE_CATALOG, HardwareSpec

# Vidur's NCCL systems -> the catalog device whose links they measured
SYSTEM_DEVICE = {"a100_dgx": "A100-80GB", "h100_dgx": "H100-SXM"}
# the catalog's links before they were measured: the datasheets' bidirectional NVLink sums, a 3 µs hop
DATASHEET_LINKS = {"A100-80GB": {"interconnect_bandwidth": 600e9, "interconnect_latency_s": 3e-6},
                   "H100-SXM": {"interconnect_bandwidth": 900e9, "interconnect_latency_s": 3e-6}}


def roofline_all_reduce(hw: HardwareSpec, nbytes: float, n: int) -> float:
    """The roofline's TP all-reduce: 2(n−1)/n · bytes / link + 2 link latencies (switch) or 2(n−1) (ring)."""
    hops = 2 if hw.interconnect_topology == "switch" else 2 * (n - 1)
    return 2 * (n - 1) / n * nbytes / hw.interconnect_bandwidth + hops * hw.interconnect_latency_s


def collective_truth(rows: list[dict]) -> dict:
    """Per (system, collective, n) on one node: errors on every other size after fitting the rest, and the
    roofline's measured/predicted ratio for all-reduces through a catalog device's links."""
    out = {}
    groups = {}
    for r in rows:
        if r["workers"] == r["devices_per_node"]:
            groups.setdefault((r["system"], r["collective"], r["workers"]), []).append(r)
    for key, rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["bytes"])
        fit_rows, held = rs[::2], rs[1::2]
        f = fit_collective([r["bytes"] for r in fit_rows], [r["us"] * 1e-6 for r in fit_rows])
        pred = [(f["latency_s"] ** f["sharpness"] + (r["bytes"] / f["bandwidth"]) ** f["sharpness"])
                ** (1 / f["sharpness"]) for r in held]
        errs = [p / (r["us"] * 1e-6) - 1 for p, r in zip(pred, held)]
        ratio = before = None
        if key[1] == "all_reduce" and key[0] in SYSTEM_DEVICE:
            hw = HARDWARE_CATALOG[SYSTEM_DEVICE[key[0]]]
            ratio = [r["us"] * 1e-6 / roofline_all_reduce(hw, r["bytes"], key[2]) for r in rs]
            old = hw.model_copy(update=DATASHEET_LINKS[hw.name])
            before = [r["us"] * 1e-6 / roofline_all_reduce(old, r["bytes"], key[2]) for r in rs]
        out[key] = (errs, ratio, before)
    return out


AIC_COLUMNS = ("gemm.fp16", "gemm_layer.fp16", "gemm.fp8", "gemm.fp8_block", "gemm.fp4", "attention.prefill",
               "attention.prefill_today_form", "attention.decode", "attention.decode_today_form", "moe",
               "custom_all_reduce")
AIC_HEADLINES = {"gemm.fp16": "gemm_bf16", "gemm_layer.fp16": "gemm_layer_bf16", "gemm.fp8": "gemm_fp8",
                 "gemm_layer.fp8": "gemm_layer_fp8", "gemm.fp8_block": "gemm_fp8_block",
                 "gemm.fp4": "gemm_fp4", "attention.prefill": "prefill_attention",
                 "attention.prefill_today_form": "prefill_attention_today_form", "attention.decode": "decode_attention",
                 "attention.decode_today_form": "decode_attention_today_form", "moe": "moe",
                 "custom_all_reduce": "custom_allreduce", "nccl_all_reduce": "nccl_allreduce"}


def _name(column: str) -> str:
    """A short column heading: gemm bf16, layer bf16, prefill, prefill now ..."""
    family, _, part = column.partition(".")
    part = {"fp16": "bf16"}.get(part, part).replace("_today_form", " now")
    return {"gemm": f"gemm {part}", "gemm_layer": f"layer {part}"}.get(family, part or family)[:11]


def _cell(errs) -> str:
    return "%5.1f/%5.1f" % stats(errs) if errs else "     -     "


def aic_truth() -> dict[str, list[float]]:
    """AIConfigurator's kernels, leave one model out: a table by device and engine, one by device (the engines
    pooled); the errors pooled over every device and engine, by op family."""
    t = AicTables()
    by_device: dict = defaultdict(lambda: defaultdict(list))
    print("\nAIConfigurator's engine kernels, each engine's newest version, leave one model out (|error| % median/p90)")
    print(f"{'device':13} {'engine':7} {'version':10} " + " ".join(f"{_name(c):>11}" for c in AIC_COLUMNS))
    for (device, engine), versions in sorted(t.kept.items()):
        errs = engine_errors(t, device, engine, versions[0])
        print(f"{device:13} {engine:7} {versions[0]:10} " + " ".join(f"{_cell(errs.get(c)):>11}" for c in AIC_COLUMNS),
              flush=True)
        for part, e in errs.items():
            by_device[device][part] += e
    print("\nBy GPU, the engines pooled (|error| % median/p90; nccl: NCCL's all-reduce)")
    print(f"{'device':13} " + " ".join(f"{_name(c):>11}" for c in (*AIC_COLUMNS, "nccl")))
    pooled: dict = defaultdict(list)
    for device, parts in sorted(by_device.items()):
        parts["nccl_all_reduce"] = nccl_holdout(t, device)
        print(f"{device:13} " + " ".join(f"{_cell(parts.get(c)):>11}" for c in (*AIC_COLUMNS, "nccl_all_reduce")))
        for part, e in parts.items():
            pooled[part] += e
    return pooled


def main() -> None:
    ops = read_table(LINEAR_OPS)
    lin = linear_truth(ops)
    print("Linear layers, leave one model out (|error| % median / p90; kernel model vs roofline)")
    print(f"{'device':10} {'model':26} {'tp':>3} {'rows':>5} {'kernel':>14} {'roofline':>14}")
    for (device, model, tp), (k, r) in sorted(lin.items()):
        print(f"{device:10} {model:26} {tp:>3} {len(k):>5} {'%5.1f / %5.1f' % stats(k):>14} "
              f"{'%5.1f / %5.1f' % stats(r):>14}")
    for device in sorted({d for d, _, _ in lin}):
        for tp in (1, 2, 4, 8):
            k = [e for (d, _, t), (ks, _) in lin.items() if d == device and t == tp for e in ks]
            r = [e for (d, _, t), (_, rs) in lin.items() if d == device and t == tp for e in rs]
            if k:
                print(f"  {device:10} TP{tp}: kernel {'%5.1f / %5.1f' % stats(k)}   roofline "
                      f"{'%5.1f / %5.1f' % stats(r)}  (roofline median signed {np.median(r) * 100:+.1f}%)")
    every = [e for ks, _ in lin.values() for e in ks]
    roof = [e for _, rs in lin.values() for e in rs]
    unlisted = [e for (_, m, _), (ks, _) in lin.items() if m not in CATALOGUED for e in ks]
    gemm = gemm_truth([r for r in read_table(GEMMS) if r["dtype"] == "bf16"])
    print(f"\nH200 GEMMs (a layer's four projections), leave one model out: {'%.1f / %.1f' % stats(gemm)} "
          f"over {len(gemm)} (model, TP, M)")
    coll = collective_truth(read_table(COLLECTIVES))
    print("\nCollectives on one node, fitted to every other size (|error| % median / p90); roofline measured/predicted")
    for (system, c, n), (errs, ratio, before) in coll.items():
        extra = f"   roofline: real is {np.median(ratio):.1f}x its time (median; {np.median(before):.1f}x with the " \
                "datasheet links)" if ratio else ""
        print(f"  {system:22} {c:10} n={n}: {'%5.1f / %5.1f' % stats(errs)}{extra}")
    ar = [e for (_, c, _), (errs, _, _) in coll.items() if c == "all_reduce" for e in errs]
    ratios = [x for (_, c, _), (_, ratio, _) in coll.items() if ratio for x in ratio]
    befores = [x for (_, c, _), (_, _, before) in coll.items() if before for x in before]
    sr = [e for (_, c, _), (errs, _, _) in coll.items() if c == "send_recv" for e in errs]
    print()
    print(f"linear_abs_err_median_pct: {stats(every)[0]:.1f}")
    print(f"linear_abs_err_p90_pct: {stats(every)[1]:.1f}")
    print(f"linear_abs_err_median_pct_uncatalogued_shapes: {stats(unlisted)[0]:.1f}")
    print(f"linear_abs_err_p90_pct_uncatalogued_shapes: {stats(unlisted)[1]:.1f}")
    print(f"roofline_linear_abs_err_median_pct: {stats(roof)[0]:.1f}")
    print(f"roofline_linear_abs_err_p90_pct: {stats(roof)[1]:.1f}")
    print(f"h200_gemm_abs_err_median_pct: {stats(gemm)[0]:.1f}")
    print(f"h200_gemm_abs_err_p90_pct: {stats(gemm)[1]:.1f}")
    print(f"allreduce_abs_err_median_pct: {stats(ar)[0]:.1f}")
    print(f"allreduce_abs_err_p90_pct: {stats(ar)[1]:.1f}")
    print(f"send_recv_abs_err_median_pct: {stats(sr)[0]:.1f}")
    moe = grouped_truth(read_table(MOE))
    print(f"moe_abs_err_median_pct: {stats(moe)[0]:.1f}")
    print(f"moe_abs_err_p90_pct: {stats(moe)[1]:.1f}")
    print(f"roofline_allreduce_real_over_predicted_median: {np.median(ratios):.1f}")
    print(f"roofline_allreduce_real_over_predicted_median_datasheet_links: {np.median(befores):.1f}")
    if "--no-aic" not in sys.argv:
        pooled = aic_truth()
        print()
        for part, name in AIC_HEADLINES.items():
            if pooled.get(part):
                print(f"aic_{name}_abs_err_median_pct: {stats(pooled[part])[0]:.1f}")
                print(f"aic_{name}_abs_err_p90_pct: {stats(pooled[part])[1]:.1f}")


if __name__ == "__main__":
    main()

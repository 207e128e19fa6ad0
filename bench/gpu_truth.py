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

Usage: python bench/gpu_truth.py
"""
from __future__ import annotations

import numpy as np

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


if __name__ == "__main__":
    main()

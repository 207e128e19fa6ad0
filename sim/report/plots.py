"""PNG plots for a report: latency CDFs, KV-cache use and batch size over time (drawn by sim/report/png.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.report.metrics import RequestRecords, per_request_latency, spread_indices
from sim.report.png import Canvas

MAX_POINTS = 4000
# figure fractions, as matplotlib's subplots_adjust takes them
MARGINS = {"left": 0.06, "right": 0.99, "bottom": 0.17, "top": 0.91, "wspace": 0.3}
WIDE_MARGINS = {"left": 0.09, "right": 0.99, "bottom": 0.17, "top": 0.96}


def cdf(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of x (NaN left out): at most MAX_POINTS of its sorted values and the fraction at each."""
    x = np.sort(x[~np.isnan(x)])
    pick = spread_indices(len(x), MAX_POINTS)
    return x[pick], (pick + 1) / max(len(x), 1)


def _thin(a: np.ndarray) -> np.ndarray:
    return a[:: max(1, len(a) // MAX_POINTS)]


def write_plots(out_dir: Path, rec: RequestRecords, replicas: list) -> list[Path]:
    """Write latency_cdf.png, kv_cache.png and batch_size.png; returns their paths."""
    lat = per_request_latency(rec)
    fig = Canvas(16, 3.6)
    for ax, (key, title) in zip(fig.subplots(4, **MARGINS), (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                                                             ("e2e", "E2E latency"))):
        if key == "itl":
            ax.plot(rec.itl.cdf_s * 1000, rec.itl.cdf_fraction, label=title)
        else:
            x, fraction = cdf(lat[key])
            ax.plot(x * 1000, fraction, label=title)
        ax.title, ax.xlabel = title, "ms"
        ax.ylabel = "fraction of requests" if key != "itl" else "fraction of gaps"
    paths = [fig.save(out_dir / "latency_cdf.png")]

    for name, col, ylabel in (("kv_cache.png", 2, "KV blocks used (%)"), ("batch_size.png", 1, "running sequences")):
        fig = Canvas(9, 3.6)
        ax = fig.subplots(1, **WIDE_MARGINS)[0]
        for i, r in enumerate(replicas):
            a = _thin(r.samples)
            y = a[:, col] / r.num_blocks * 100 if col == 2 else a[:, col]
            ax.step(a[:, 0], y, label=f"replica {i}", lw=0.8)
            if col == 1 and len(replicas) == 1:
                ax.step(a[:, 0], a[:, 4], label="waiting", lw=0.8, alpha=0.7)
        ax.xlabel, ax.ylabel = "time (s)", ylabel
        ax.legend = len(replicas) > 1 or col == 1
        paths.append(fig.save(out_dir / name))
    return paths

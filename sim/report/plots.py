"""PNG plots for a report: latency CDFs, KV-cache use and batch size over time."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sim.report.metrics import RequestRecords, per_request_latency

MAX_POINTS = 4000
DPI = 90
# fixed margins instead of tight_layout, which draws every figure twice to measure its labels
MARGINS = {"left": 0.06, "right": 0.99, "bottom": 0.15, "top": 0.91, "wspace": 0.3}
WIDE_MARGINS = {"left": 0.09, "right": 0.99, "bottom": 0.15, "top": 0.96}
# zlib level 1: a fraction of the default's encoding time for plots of lines on white, a slightly larger file
PNG = {"compress_level": 1}


def _cdf(ax, x: np.ndarray, label: str) -> None:
    """The empirical CDF of x, at most MAX_POINTS points drawn."""
    x = np.sort(x[~np.isnan(x)])
    if len(x):
        pick = np.unique(np.linspace(0, len(x) - 1, min(len(x), MAX_POINTS)).astype(np.int64))
        ax.plot(x[pick] * 1000, (pick + 1) / len(x), label=label)


def _thin(a: np.ndarray) -> np.ndarray:
    return a[:: max(1, len(a) // MAX_POINTS)]


def _save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG (the Agg canvas directly: pyplot's figure manager is not needed to draw a file)."""
    FigureCanvasAgg(fig).print_png(path, pil_kwargs=PNG)
    return path


def write_plots(out_dir: Path, rec: RequestRecords, replicas: list) -> list[Path]:
    """Write latency_cdf.png, kv_cache.png and batch_size.png; returns their paths."""
    lat = per_request_latency(rec)
    fig = Figure(figsize=(16, 3.6), dpi=DPI)
    fig.subplots_adjust(**MARGINS)
    for ax, (key, title) in zip(fig.subplots(1, 4), (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                                                     ("e2e", "E2E latency"))):
        if key == "itl":
            ax.plot(rec.itl.cdf_s * 1000, rec.itl.cdf_fraction, label=title)
        else:
            _cdf(ax, lat[key], title)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
    paths = [_save(fig, out_dir / "latency_cdf.png")]

    for name, col, ylabel in (("kv_cache.png", 2, "KV blocks used (%)"), ("batch_size.png", 1, "running sequences")):
        fig = Figure(figsize=(9, 3.6), dpi=DPI)
        fig.subplots_adjust(**WIDE_MARGINS)
        ax = fig.subplots()
        for i, r in enumerate(replicas):
            a = _thin(r.samples)
            y = a[:, col] / r.num_blocks * 100 if col == 2 else a[:, col]
            ax.step(a[:, 0], y, where="post", label=f"replica {i}", lw=0.8)
            if col == 1 and len(replicas) == 1:
                ax.step(a[:, 0], a[:, 4], where="post", label="waiting", lw=0.8, alpha=0.7)
        ax.set(xlabel="time (s)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(replicas) > 1 or col == 1:
            ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / name))
    return paths

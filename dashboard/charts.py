"""Plotly figures: latency CDFs against the SLO, KV use and batch size over time, the search's Pareto front, errors
per metric. The same content as the report's PNGs (sim/report/plots.py), in seconds and interactive."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sim.report.metrics import RequestRecords, per_request_latency
from sim.report.trace import ReplicaTrace

MAX_POINTS = 2000  # per line: a browser draws a few thousand points per trace without lag
MAX_REPLICAS = 8  # lines per over-time panel
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"))
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

Curves = dict[str, tuple[np.ndarray, np.ndarray]]  # latency name → (seconds, fraction of requests)


def record_curves(rec: RequestRecords) -> Curves:
    """Each latency's empirical CDF over the completed requests, thinned to MAX_POINTS."""
    lat = per_request_latency(rec)
    out = {}
    for key, _ in LATENCIES:
        x = np.sort(lat[key][~np.isnan(lat[key])])
        pick = np.unique(np.linspace(0, len(x) - 1, min(len(x), MAX_POINTS)).astype(np.int64))
        out[key] = (x[pick], (pick + 1) / max(1, len(x)))
    return out


def quantile_curves(levels: list[float], values: dict) -> Curves:
    """CDFs from latencies at quantile levels (validation.json's latency_cdf: `ttft_s` etc., None: no request)."""
    return {key: (np.asarray(values[f"{key}_s"]), np.asarray(levels)) for key, _ in LATENCIES
            if values.get(f"{key}_s") is not None}


def latency_cdfs(curves: dict[str, Curves], slo: dict | None = None, height: int = 330) -> go.Figure:
    """TTFT, TPOT and E2E CDFs side by side, one line per label, the SLO's targets and quantile dashed."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=[title for _, title in LATENCIES], horizontal_spacing=0.06)
    for i, (label, c) in enumerate(curves.items()):
        for col, (key, _) in enumerate(LATENCIES, 1):
            if key in c and len(c[key][0]):
                fig.add_trace(go.Scatter(x=c[key][0], y=c[key][1], mode="lines", name=label, legendgroup=label,
                                         showlegend=col == 1, line={"color": COLORS[i % len(COLORS)]}),
                              row=1, col=col)
    slo = slo or {}
    for col, key in ((1, "ttft_s"), (2, "tpot_s")):
        if slo.get(key):
            fig.add_vline(x=slo[key], line_dash="dash", line_color="red", row=1, col=col,
                          annotation_text=f"SLO {slo[key]:g} s", annotation_position="bottom right")
    if slo.get("quantile"):
        fig.add_hline(y=slo["quantile"], line_dash="dot", line_color="gray", row=1, col="all")
    fig.update_xaxes(title_text="seconds", rangemode="tozero")
    fig.update_yaxes(range=[0, 1.02])
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    fig.update_layout(height=height, margin={"l": 10, "r": 10, "t": 60, "b": 10}, showlegend=len(curves) > 1,
                      legend={"orientation": "h", "y": -0.25})
    return fig


def _thin(a: np.ndarray) -> np.ndarray:
    return a[:: max(1, len(a) // MAX_POINTS)]


def over_time(traces: list[ReplicaTrace]) -> go.Figure:
    """KV blocks used (% of each replica's) and running sequences (and waiting, with one replica) over time."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("KV cache blocks used (%)", "Batch: running sequences"))
    for i, t in enumerate(traces[:MAX_REPLICAS]):
        a = _thin(t.samples)
        name = f"{t.pool} {i}" if t.pool else f"replica {i}"
        style = {"color": COLORS[i % len(COLORS)], "width": 1}
        fig.add_trace(go.Scatter(x=a[:, 0], y=a[:, 2] / max(1, t.num_blocks) * 100, mode="lines", line=style,
                                 line_shape="hv", name=name, legendgroup=name), row=1, col=1)
        fig.add_trace(go.Scatter(x=a[:, 0], y=a[:, 1], mode="lines", line=style, line_shape="hv", name=name,
                                 legendgroup=name, showlegend=False), row=2, col=1)
        if len(traces) == 1:
            fig.add_trace(go.Scatter(x=a[:, 0], y=a[:, 4], mode="lines", line={"color": "gray", "width": 1},
                                     line_shape="hv", name="waiting"), row=2, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=2, col=1)
    fig.update_layout(height=440, margin={"l": 10, "r": 10, "t": 60, "b": 10}, legend={"orientation": "h"})
    return fig


def pareto(points: list[dict], x_title: str, y_title: str, hline: float | None = None
           ) -> tuple[go.Figure, list[list[int]]]:
    """Configurations as points (`x`, `y`, `label`, `row`), those on the Pareto front (`front`) joined, the
    recommended one (`best`) starred; also, per trace, each point's row (to map a selected point back)."""
    fig, rows = go.Figure(), []
    groups = (([p for p in points if not p["front"]], "other configurations", "markers",
               {"color": "#9aa5b1", "size": 8}),
              (sorted((p for p in points if p["front"]), key=lambda p: p["x"]), "Pareto front", "markers+lines",
               {"color": "#1f77b4", "size": 10}),
              ([p for p in points if p.get("best")], "recommended", "markers",
               {"color": "#d62728", "size": 18, "symbol": "star"}))
    for group, name, mode, marker in groups:
        fig.add_trace(go.Scatter(x=[p["x"] for p in group], y=[p["y"] for p in group], mode=mode, name=name,
                                 marker=marker, text=[p["label"] for p in group], customdata=[p["row"] for p in group],
                                 hovertemplate="%{text}<br>%{x:.4g}, %{y:.4g}<extra></extra>"))
        rows.append([p["row"] for p in group])
    if hline is not None:
        fig.add_hline(y=hline, line_dash="dash", line_color="#2ca02c", annotation_text=f"target {hline:.3g}")
    fig.update_layout(xaxis_title=x_title, yaxis_title=y_title, height=400, clickmode="event+select",
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, legend={"orientation": "h"})
    return fig, rows


def errors_by_metric(errors: dict[str, dict[str, float | None]]) -> go.Figure:
    """Signed % error of sim vs real per metric, one bar group per validation file."""
    fig = go.Figure()
    for i, (label, row) in enumerate(errors.items()):
        fig.add_trace(go.Bar(x=list(row), y=[v if v is not None else np.nan for v in row.values()], name=label,
                             marker_color=COLORS[i % len(COLORS)]))
    fig.add_hline(y=0, line_color="black", line_width=1)
    fig.update_layout(barmode="group", yaxis_title="sim vs real (%)", height=360,
                      margin={"l": 10, "r": 10, "t": 30, "b": 10}, legend={"orientation": "h"})
    return fig

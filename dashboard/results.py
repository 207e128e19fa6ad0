"""One simulated scenario on screen: the headline figures, the latency CDFs against the SLO, KV use and batch over
time, the latency table, and the scenario YAML and report.json to download."""
from __future__ import annotations

import json

import pandas as pd
import streamlit as st
import yaml

from dashboard import charts
from dashboard.form import portable
from infersim.api import Outcome, step_costs
from sim.report.outputs import cost_line

STEP_PARTS = (("linear", "linear_s"), ("experts", "experts_s"), ("attention", "attention_s"),
              ("communication", "communication_s"), ("LM head", "lm_head_s"), ("host overhead", "overhead_s"), ("drafting", "draft_s"), ("swap", "swap_s"))

LATENCY_ROWS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))


def seconds(x: float | None) -> str:
    """A latency for a label: seconds, 3 significant digits."""
    return "-" if x is None else f"{x:.3g} s"


def headline(report: dict) -> None:
    """The figures a planner reads first, as metrics."""
    q = report["slo"]["quantile"]
    note = {"delta_color": "off", "delta_arrow": "off"}  # context under a figure, not a change
    cols = st.columns(4)
    cols[0].metric(f"TTFT p{q * 100:g}", seconds(report["slo"]["ttft_at_quantile_s"]))
    cols[1].metric(f"TPOT p{q * 100:g}", seconds(report["slo"]["tpot_at_quantile_s"]))
    # units in the label: a 4-column tile cuts "5.06 req/s" to "5.06 re…" on a laptop-wide page
    cols[2].metric("Throughput, req/s", f"{report['throughput']['requests_per_s']:.3g}",
                   f"{report['throughput']['output_tokens_per_s']:,.0f} output tok/s", **note)
    cols[3].metric("Goodput, req/s", f"{report['goodput_requests_per_s']:.3g}",
                   f"{report['slo_attainment'] * 100:.1f}% within SLO", **note)
    cols = st.columns(4)
    per_million = report["cost"]["usd_per_million_output_tokens"]
    cols[0].metric("$ per 1M output tokens", "-" if per_million is None else f"${per_million:,.3f}",
                   f"${report['cost']['usd_per_hour']:,.2f} per hour", **note)
    cols[1].metric("KV cache peak", f"{report['kv_cache']['peak_utilization'] * 100:.1f}%",
                   f"{report['kv_cache']['preemptions']:,} preemptions", **note)
    r = report["requests"]
    cols[2].metric("Completed", f"{r['completed']:,}", f"{r['rejected']:,} rejected", help=f"of {r['arrived']:,} "
                   "arrived: each request ends completed or rejected (the reasons: report.json)", **note)
    cols[3].metric("E2E p90", seconds(report["e2e_s"]["p90"]), f"p50 {seconds(report['e2e_s']['p50'])}", **note)


def slo_line(report: dict) -> None:
    """Whether the SLO holds, in one coloured line."""
    slo = report["slo"]
    targets = ", ".join(f"{name} ≤ {slo[key]:g} s" for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"),
                                                                         ("E2E", "e2e_s"))
                        if slo.get(key) is not None)
    if not targets:
        st.info("No SLO set: goodput counts every completed request.")
        return
    text = f"SLO (p{slo['quantile'] * 100:g} {targets}): "
    if slo["met"] and not slo.get("met_counting_rejected", True):
        st.warning(text + "met, but only because rejected requests are left out.")
    elif slo["met"]:
        st.success(text + "met.")
    else:
        st.warning(text + "missed.")


def techniques(report: dict) -> None:
    """One line each for the model's memory (what compression frees for KV), prefix caching's hits, a closed
    loop's users, the conversations' turns, speculative decoding's acceptance and the disaggregated pools' use."""
    mem, kv, model = report.get("memory_gib"), report["kv_cache"], report["scenario"]["config"]["model"]
    if mem:
        dtypes = ", ".join(f"{k} {model[k]}" for k in ("weight_dtype", "kv_dtype", "sparsity")
                           if isinstance(model, dict) and k in model)
        st.caption(f"Memory per device{f' ({dtypes})' if dtypes else ''}: weights {mem['weights']:.2f} GiB, KV cache "
                   f"{mem['kv_cache']:.2f} GiB ({kv['capacity_tokens']:,} tokens) of {mem['device']:.0f} GiB.")
    if "prefix_cache_hit_rate" in kv:
        st.caption(f"Prefix caching: {kv['prefix_cache_hit_rate'] * 100:.1f}% of the prompt tokens found cached, "
                   f"{kv['prefix_cache_hit_tokens']:,} tokens not computed.")
    loop = report.get("closed_loop")
    if loop:
        st.caption(f"Closed loop: {loop['users']:,} users, think time {loop['think_time_s']:g} s; "
                   f"{loop['mean_in_flight']:.1f} requests in flight on average, "
                   f"{report['throughput']['requests_per_s']:.2f} requests/s.")
    conv = report.get("conversations")
    if conv:
        first, later = conv["first_turn_ttft_s"]["p50"], conv["later_turn_ttft_s"]["p50"]
        st.caption(f"Conversations: {conv['conversations']:,} of {conv['turns_mean']:.1f} turns on average, "
                   f"{conv['answered']:,} with every turn answered; TTFT p50 {seconds(first)} on first turns, "
                   f"{seconds(later)} on later ones (each resends the conversation so far); first arrival to last "
                   f"token p50 {seconds(conv['duration_s']['p50'])}.")
    spec = report.get("speculative")
    if spec:
        st.caption(f"Speculative decoding: α {spec['alpha']:.2f}, {spec['mean_accepted_length']:.2f} tokens per "
                   f"verify step, {spec['accepted']:,} of {spec['drafted']:,} drafts accepted.")
    for name, pool in (report.get("pools") or {}).items():
        st.caption(f"{name.title()} pool: {pool['replicas']} × {pool['hardware']} (TP {pool['tensor_parallel_size']}, "
                   f"PP {pool['pipeline_parallel_size']}), busy {pool['utilization'] * 100:.0f}%, KV peak "
                   f"{pool['kv_peak_utilization'] * 100:.1f}%, ${pool['usd_per_hour']:,.2f}/h.")


def latency_table(report: dict) -> pd.DataFrame:
    """Mean and percentiles of each latency, in seconds."""
    return pd.DataFrame([{"latency": name, **{k: report[key][k] for k in ("mean", "p50", "p90", "p99")}}
                         for name, key in LATENCY_ROWS]).set_index("latency")


def step_table(rows: list[tuple[str, dict]]) -> pd.DataFrame:
    """Each step's time and its parts, in ms (parts no step has left out)."""
    parts = [(name, key) for name, key in STEP_PARTS if any(r[key] for _, r in rows)]
    return pd.DataFrame([{"step": label, "total": r["total_s"] * 1e3, **{name: r[key] * 1e3 for name, key in parts}}
                         for label, r in rows]).set_index("step")


def step_breakdown(outcome: Outcome) -> None:
    """Where a typical step's time goes: a prefill of the median prompt and a decode step of the run's mean batch."""
    rows = step_costs(outcome.plan, report=outcome.report)
    st.markdown("**Where a step's time goes** (ms): a prefill of the median prompt, a decode step of the run's mean "
                "batch")
    st.dataframe(step_table(rows).style.format("{:.3f}"))
    priced = outcome.report.get("cost_model") or {}
    sources = [priced] if "source" in priced else list(priced.values())
    st.caption("Priced by: " + "; ".join(dict.fromkeys(cost_line(c) for c in sources)))


def show(outcome: Outcome, data: dict, key: str) -> None:
    """Everything about one run; `key` keeps its widgets apart from another page's."""
    report = outcome.report
    headline(report)
    slo_line(report)
    techniques(report)
    st.plotly_chart(charts.latency_cdfs({report["scenario"]["name"]: charts.record_curves(outcome.records)},
                                        report["slo"]), key=f"{key}.cdf")
    st.plotly_chart(charts.over_time(outcome.traces), key=f"{key}.time")
    if len(outcome.traces) > charts.MAX_REPLICAS:
        st.caption(f"The first {charts.MAX_REPLICAS} of {len(outcome.traces)} replicas are drawn.")
    st.dataframe(latency_table(report).style.format("{:.4g}", na_rep="-"))
    step_breakdown(outcome)
    name = report["scenario"]["name"]
    c1, c2 = st.columns(2)
    c1.download_button("Download the scenario YAML", yaml.safe_dump(portable(data), sort_keys=False),
                       file_name=f"{name}.yaml", mime="application/x-yaml", on_click="ignore", key=f"{key}.yaml")
    c2.download_button("Download report.json", json.dumps(report, indent=2) + "\n", file_name="report.json",
                       mime="application/json", on_click="ignore", key=f"{key}.json")

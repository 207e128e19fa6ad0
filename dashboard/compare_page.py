"""Compare: two or more configurations side by side on the same workload: the headline figures in one table, the
latency CDFs overlaid, each one's KV use and batch over time."""
import copy

import pandas as pd
import streamlit as st

from dashboard import background, charts, form, seeds
from infersim.api import compare_data
from sim.config.errors import ConfigError

WHATIF = "What-if: the last simulated settings"
PAIR = ("scenarios/static_vs_continuous_continuous.yaml", "scenarios/static_vs_continuous_static.yaml")
MAX_CONFIGURATIONS = 6


def options() -> list[str]:
    """What can be compared: What-if's last run, then the scenario files."""
    return ([WHATIF] if "whatif.result" in st.session_state else []) + list(seeds.scenario_files())


def load(label: str) -> seeds.Seed:
    """One option's scenario (ConfigError for a file that cannot be read)."""
    if label == WHATIF:
        data, base_dir, _ = st.session_state["whatif.result"]
        return seeds.Seed(WHATIF, data, base_dir)
    path = seeds.scenario_files()[label]
    return seeds.Seed(label, seeds.read_scenario(path, label), path.parent)


def side_by_side(outcomes: list) -> pd.DataFrame:
    """The figures a planner compares, one column per configuration."""
    def row(r: dict) -> dict:
        q = f"p{r['slo']['quantile'] * 100:g}"
        return {"TTFT p50 (s)": r["ttft_s"]["p50"], f"TTFT {q} (s)": r["slo"]["ttft_at_quantile_s"],
                "TPOT p50 (s)": r["tpot_s"]["p50"], f"TPOT {q} (s)": r["slo"]["tpot_at_quantile_s"],
                "E2E p90 (s)": r["e2e_s"]["p90"], "throughput (req/s)": r["throughput"]["requests_per_s"],
                "output tokens/s": r["throughput"]["output_tokens_per_s"],
                "goodput (req/s)": r["goodput_requests_per_s"], "SLO attainment (%)": r["slo_attainment"] * 100,
                "$ per hour": r["cost"]["usd_per_hour"],
                "$ per 1M output tokens": r["cost"]["usd_per_million_output_tokens"],
                "KV cache peak (%)": r["kv_cache"]["peak_utilization"] * 100,
                "preemptions": r["kv_cache"]["preemptions"], "completed": r["requests"]["completed"],
                "rejected": r["requests"]["rejected"]}
    return pd.DataFrame({label: row(o.report) for label, o in outcomes})


def show(outcomes: list) -> None:
    """The table, the SLO verdicts, the overlaid CDFs and a tab per configuration."""
    table = side_by_side(outcomes)
    st.dataframe(table.style.format("{:.4g}", na_rep="-"), height=35 * (len(table) + 1) + 3)  # every row, no scroll
    met = [label for label, o in outcomes if o.report["slo"]["met"]]
    missed = [label for label, o in outcomes if not o.report["slo"]["met"]]
    st.caption(f"SLO met by: {', '.join(met) or 'none'}; missed by: {', '.join(missed) or 'none'}.")
    slo = outcomes[0][1].report["slo"]
    st.plotly_chart(charts.latency_cdfs({label: charts.record_curves(o.records) for label, o in outcomes}, slo),
                    key="compare.cdf")
    for tab, (label, o) in zip(st.tabs([label for label, _ in outcomes]), outcomes):
        with tab:
            st.plotly_chart(charts.over_time(o.traces), key=f"compare.time.{label}")


st.title("Compare")
st.caption("Several deployments on the same requests (same workload, same seed): which meets the SLO, at what cost.")
choices = options()
picked = st.multiselect("Configurations (two or more)", choices, default=[p for p in PAIR if p in choices],
                        key="compare.picked", max_selections=MAX_CONFIGURATIONS)
if len(picked) < 2:
    st.warning("Pick two or more configurations to compare.")
    st.stop()
try:
    chosen = {label: load(label) for label in picked}
except ConfigError as e:
    st.error(e.one_line())
    st.stop()
st.subheader("Workload and SLO, the same for all")
source = chosen[st.selectbox("Taken from", picked, key="compare.workload.from")]
common = {"workload": source.data.get("workload") or {}, "slo": source.data.get("slo") or {}}
shared = form.Form("compare.workload", common)
with st.expander("Workload and SLO", expanded=False):
    workload = form.workload(shared, common["workload"])
    slo = form.slo(shared, common["slo"])
st.subheader("Deployments")
items = []
for col, label in zip(st.columns(len(picked)), picked):
    seed = chosen[label]
    with col:
        f = form.Form(f"compare.{label}", seed.data)
        name = st.text_input("Label", seed.data.get("name") or label, key=f.key("label"))
        data = copy.deepcopy(seed.data)
        with st.expander("Deployment and policy", expanded=False):
            form.set_sections(data, form.deployment(f, seed.data))
            form.set_sections(data, form.policy(f, seed.data))
        items.append((name, form.set_sections(data, {"workload": workload, "slo": slo})))
names = [name for name, _ in items]
if workload is None:
    st.stop()
if len(set(names)) < len(names):
    st.error("Two configurations have the same label: give each its own.")
    st.stop()
if st.button("Compare", type="primary", key="compare.run"):
    try:
        outcomes = background.run(lambda progress, cancel: compare_data(
            items, source.base_dir, progress=background.stoppable(progress, cancel)), "configurations simulated",
            "compare.cancel")
    except ConfigError as e:
        st.error(e.one_line())
    else:
        if outcomes is not None:
            st.session_state["compare.result"] = (items, outcomes)
if background.cancelled("compare.cancel"):
    st.info("Cancelled.")
if "compare.result" in st.session_state:
    ran, outcomes = st.session_state["compare.result"]
    if ran != items:
        st.caption("The settings have changed since this comparison: press Compare to see them.")
    show(outcomes)

"""Search: the cheapest deployment that carries the target rate within the SLOs, over a space of configurations
(infersim.api: infersim/commands/search.py), with a progress bar; the Pareto fronts, and any configuration opened in What-if."""
import hashlib
import json
import os

import pandas as pd
import streamlit as st

from dashboard import background, charts, seeds
from infersim.api import BACKENDS, parse_search_spec, run_search
from sim.config.errors import ConfigError

SPECS = seeds.SCENARIOS / "search"
FRONTS = {"Cost vs capacity": ("capacity_rps", "capacity within the SLOs ({unit})", "pareto"),
          "Cost vs TPOT at the target rate": ("tpot_p90_s", "TPOT at the SLO quantile (s)", "pareto_latency")}


def spec_text() -> tuple[str, str, object] | None:
    """The picked spec file or upload: (label, its YAML text, the folder its paths start at)."""
    files = {str(p.relative_to(seeds.REPO)): p for p in sorted(SPECS.glob("*.yaml"))}
    c1, c2 = st.columns([3, 2])
    label = c1.selectbox("Search spec", list(files), key="search.spec") if files else None
    upload = c2.file_uploader("or upload a search spec (YAML)", type=["yaml", "yml"], key="search.upload")
    if upload is not None:
        return upload.name, upload.getvalue().decode("utf-8", errors="replace"), seeds.upload_dir()
    if label is None:
        return None
    return label, files[label].read_text(encoding="utf-8"), files[label].parent


def open_in_whatif(search, row) -> None:
    """Hand the configuration's scenario to What-if and go there."""
    seeds.hand_over("whatif", seeds.Seed(f"search: {row.label}", row.scenario, search.base_dir))
    st.switch_page("whatif_page.py")


def rows_table(result) -> pd.DataFrame:
    """Every configuration, cheapest first, pruned last."""
    ordered = sorted(result.rows, key=lambda r: (r.status != "ok", r.usd_per_hour, -r.capacity_rps, r.label))
    table = pd.DataFrame([{"configuration": r.label, "recommended": r is result.recommended, "status": r.status,
                           "devices": r.devices, "$/h": r.usd_per_hour,
                           f"capacity {result.unit}": r.capacity_rps if r.status == "ok" else None,
                           "$ per 1M tokens": r.usd_per_million_tokens, "TTFT q (s)": r.ttft_p90_s,
                           "TPOT q (s)": r.tpot_p90_s, "E2E q (s)": r.e2e_p90_s, "Pareto": r.pareto, "why not / note": r.reason}
                           for r in ordered])
    numbers = [f"capacity {result.unit}", "$ per 1M tokens", "TTFT q (s)", "TPOT q (s)"]
    table[numbers] = table[numbers].apply(pd.to_numeric)  # None → NaN, shown as "-"
    return table


def show(search, result) -> None:
    """The recommendation, the fronts (a clicked point opens in What-if) and the table."""
    best = result.recommended
    if best is not None:
        st.success(f"Recommended: {best.label}: {best.devices} devices, ${best.usd_per_hour:,.2f}/h, carries "
                   f"{best.capacity_rps:.3g} {result.unit} (target {result.target_rate:.3g}).")
    else:
        st.warning(f"No configuration carries {result.target_rate:.3g} {result.unit} within the SLOs.")
    ok = [(i, r) for i, r in enumerate(result.rows) if r.status == "ok"]
    for tab, (name, (field, title, front)) in zip(st.tabs(list(FRONTS)), FRONTS.items()):
        with tab:
            points = [{"x": r.usd_per_hour, "y": getattr(r, field), "label": r.label, "row": i,
                       "front": getattr(r, front), "best": r is best} for i, r in ok if getattr(r, field) is not None]
            fig, rows = charts.pareto(points, "$ per hour", title.format(unit=result.unit),
                                      result.target_rate if field == "capacity_rps" else None)
            event = st.plotly_chart(fig, on_select="rerun", selection_mode="points", key=f"search.front.{field}")
            picked = (event or {}).get("selection", {}).get("points", [])
            if picked:  # a clicked point: open its configuration
                p = picked[0]
                open_in_whatif(search, result.rows[rows[p["curve_number"]][p["point_index"]]])
    st.dataframe(rows_table(result).style.format(precision=3, na_rep="-"))
    c1, c2 = st.columns([3, 1])
    # also those pruned unsearched (costlier, a repeat, over max_devices): they have a plan (devices), so they run
    labels = {r.label: r for r in result.rows if r.status == "ok" or r.devices}
    if labels:
        pick = c1.selectbox("Configuration", list(labels), index=list(labels).index(best.label) if best else 0,
                            key="search.open.pick")
        if c2.button("Open in What-if", key="search.open"):
            open_in_whatif(search, labels[pick])
    st.download_button("Download search.json", json.dumps(result.to_json(), indent=2) + "\n", file_name="search.json",
                       mime="application/json", on_click="ignore", key="search.json")


st.title("Search")
st.caption("Each configuration's capacity: the highest rate (a closed loop: the most users) at which it meets the "
           "SLOs; the cheapest that carries the target wins. Click a point to open that configuration in What-if.")
picked = spec_text()
if picked is None:
    st.info("Upload a search spec (scenarios/search/*.yaml shows the format).")
    st.stop()
label, text, base_dir = picked
edited = st.text_area("The spec (edit it here)", text, height=260,
                      key=f"search.text.{hashlib.sha1(f'{label}{text}'.encode()).hexdigest()[:12]}")
try:
    path = seeds.upload_dir() / "search-spec.yaml"
    path.write_text(edited, encoding="utf-8")
    search = parse_search_spec(seeds.read_mapping(path, label), base_dir)
except ConfigError as e:
    st.error(ConfigError(e.message, e.key_path, label).one_line())
    st.stop()
count = 1
for values in search.space.values():
    count *= len(values)
c1, c2, c3 = st.columns(3)
backend = c1.selectbox("Backend", list(BACKENDS), key="search.backend",
                       help="local: processes on this machine; ray: a local Ray cluster")
workers = c2.number_input("Workers", 1, 256, min(count, os.cpu_count() or 1), key="search.workers")
c3.metric("Configurations", f"{count:,}", f"target {search.target_rate:.3g} {search.unit}", delta_color="off",
          delta_arrow="off")
if st.button("Search", type="primary", key="search.run"):
    try:
        result = background.run(lambda progress, cancel: run_search(search, backend, int(workers), progress=progress,
                                                                    cancel=cancel), "searching", "search.cancel")
    except ConfigError as e:
        st.error(e.one_line())
    else:
        st.session_state["search.result"] = (label, edited, search, result)
if background.cancelled("search.cancel"):
    st.info("Cancelled.")
if "search.result" in st.session_state:
    ran_label, ran_text, ran_search, result = st.session_state["search.result"]
    if (ran_label, ran_text) != (label, edited):
        st.caption(f"The results below are of the last search, of {ran_label}: press Search to run this spec.")
    show(ran_search, result)

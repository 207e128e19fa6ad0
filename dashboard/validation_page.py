"""Validation: validation.json files of `infersim validate` runs (CPU and GPU), simulator vs real executor per
metric, the errors side by side, and each run's latency CDFs overlaid; capacity.json files of `validate --capacity`,
the capacity measured on the executor against the simulator's."""
import json
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard.seeds import REPO
from sim.config.errors import ConfigError

SPEEDUPS = ("tpot_p50_speedup", "throughput_speedup")  # a speculative run's extra rows
MAX_BYTES = 16 * 2**20


def found(name: str = "validation.json") -> dict[str, Path]:
    """`name` files under runs/ and docs/runs/, by their path in the repository, newest folder first."""
    paths = sorted((REPO / "runs").rglob(name), reverse=True)
    paths += sorted((REPO / "docs" / "runs").rglob(f"*{name}"), reverse=True)
    return {str(p.relative_to(REPO)): p for p in paths}


def parse_capacity(text: bytes, name: str) -> dict:
    """A capacity.json's content, checked for the keys shown; ConfigError naming the file otherwise."""
    data = _json(text, name)
    if not isinstance(data, dict):
        raise ConfigError("not a capacity.json of `infersim validate --capacity`", file=name)
    for key in ("measured", "predicted"):
        row = data.get(key)
        if not isinstance(row, dict) or not isinstance(row.get("capacity_rps"), (int, float)):
            raise ConfigError("a mapping with capacity_rps (a number)", key, name)
    if not _number(data["measured"].get("missed_at_rps")):
        raise ConfigError("a number or null", "measured.missed_at_rps", name)
    at_speed = data.get("predicted_at_run_speed") or {}
    if not isinstance(at_speed, dict) or not _number(at_speed.get("capacity_rps")):
        raise ConfigError("a mapping with capacity_rps (a number)", "predicted_at_run_speed", name)
    for key in ("error_pct", "error_at_run_speed_pct"):
        if not _number(data.get(key)):
            raise ConfigError("a number or null", key, name)
    probes = data.get("probes") or []
    if not isinstance(probes, list) or not all(isinstance(p, dict) for p in probes):
        raise ConfigError("a list of mappings (rate, passes, sim_passes)", "probes", name)
    return data


def capacity_table(runs: list[tuple[str, dict]]) -> pd.DataFrame:
    """One row per capacity validation: measured (and the rate it missed at), predicted raw and at run speed, in its
    unit (requests/s, or a closed loop's users)."""
    rows = []
    for label, d in runs:
        at_speed = d.get("predicted_at_run_speed") or {}
        probes = d.get("probes") or []
        rows.append({"file": label, "scenario": d.get("scenario"), "unit": d.get("unit", "req/s"),
                     "measured": d["measured"]["capacity_rps"], "missed at": d["measured"].get("missed_at_rps"),
                     "predicted": d["predicted"]["capacity_rps"], "error %": d.get("error_pct"),
                     "at run speed": at_speed.get("capacity_rps"),
                     "error % at run speed": d.get("error_at_run_speed_pct"), "probes": len(probes),
                     "verdicts agreeing": sum(p.get("passes") == p.get("sim_passes") for p in probes)})
    return pd.DataFrame(rows).set_index("file")


def _json(text: bytes, name: str):
    """The file's JSON value; ConfigError naming the file if it is too large or not JSON."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{len(text) / 2**20:.1f} MiB; allowed: at most {MAX_BYTES // 2**20} MiB", file=name)
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"not JSON ({type(e).__name__}: {str(e)[:80]})", file=name) from None


def _number(v) -> bool:
    return v is None or isinstance(v, (int, float)) and not isinstance(v, bool)


def _rows(rows: dict, where: str, name: str) -> None:
    """Each row of a metrics-like mapping: real, sim and error_pct, and every figure the table shows, numbers."""
    for metric, row in rows.items():
        if not isinstance(row, dict) or not {"real", "sim", "error_pct"} <= set(row):
            raise ConfigError("each metric has real, sim and error_pct", f"{where}.{metric}", name)
        if not all(_number(row.get(k)) for k in ("real", "sim", "error_pct", "error_at_run_speed_pct",
                                                  "spread_pct")):
            raise ConfigError("real, sim, error_pct (and error_at_run_speed_pct, spread_pct) are numbers (or null)",
                              f"{where}.{metric}", name)


def parse(text: bytes, name: str) -> dict:
    """A validation.json's content, checked for everything the page shows (a table cell of text, a list where a
    mapping goes, used to raise inside the page); ConfigError naming the file otherwise."""
    data = _json(text, name)
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict) or not data["metrics"]:
        raise ConfigError("no 'metrics' mapping: not a validation.json of `infersim validate`", file=name)
    _rows(data["metrics"], "metrics", name)
    for key in ("requests", "speculative", "latency_cdf"):
        if not isinstance(data.get(key) or {}, dict):
            raise ConfigError(f"a mapping, not a {type(data[key]).__name__}", key, name)
    _rows({k: v for k, v in (data.get("speculative") or {}).items() if k in SPEEDUPS}, "speculative", name)
    ratios = data.get("step_time_ratio") or []
    if not isinstance(ratios, list) or not all(isinstance(r, dict) and _number(r.get("all")) for r in ratios):
        raise ConfigError("a list of mappings whose 'all' is a number", "step_time_ratio", name)
    cdf = data.get("latency_cdf") or {}
    if {"levels", "real", "sim"} <= set(cdf) and not (
            _numbers(cdf["levels"]) and all(isinstance(cdf[k], dict) and all(
                v is None or _numbers(v) and len(v) == len(cdf["levels"]) for v in cdf[k].values())
                for k in ("real", "sim"))):
        raise ConfigError("levels a list of numbers; real and sim mappings of lists as long (or null)", "latency_cdf",
                          name)
    return data


def _numbers(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def table(data: dict) -> pd.DataFrame:
    """One row per metric: real, simulated, the signed errors, and the spread over repeated runs."""
    rows = dict(data["metrics"])
    rows.update({k: v for k, v in (data.get("speculative") or {}).items() if k in SPEEDUPS and isinstance(v, dict)})
    return pd.DataFrame([{"metric": name, "real": r.get("real"), "sim": r.get("sim"), "error %": r.get("error_pct"),
                          "error % at the run's step speed": r.get("error_at_run_speed_pct"),
                          **({"spread %": r["spread_pct"]} if "spread_pct" in r else {})}
                         for name, r in rows.items()]).set_index("metric")


def plot_beside(path: Path | None) -> Path | None:
    """The CDF plot `infersim validate` wrote beside the file (runs without CDF data in their JSON)."""
    if path is None:
        return None
    stem = path.name.removesuffix("validation.json").rstrip(".")
    for candidate in (path.parent / "latency_cdf_sim_vs_real.png", path.parent / f"{stem}.latency_cdf.png"):
        if candidate.is_file():
            return candidate
    return None


def show(label: str, data: dict, path: Path | None) -> None:
    """One validation: what ran, the per-metric table, the CDF overlay."""
    st.subheader(label)
    req = data.get("requests") or {}
    st.caption(f"scenario {data.get('scenario', '?')} on {data.get('device', '?')}, {data.get('runs', 1)} executor "
               f"run(s), {req.get('completed', '?')} of {req.get('arrived', '?')} requests completed; profile "
               f"{data.get('profile', '?')}")
    ratios = [r["all"] for r in data.get("step_time_ratio") or [] if isinstance(r, dict) and r.get("all")]
    if ratios:  # the CLI's drift line: far from 1, the machine's speed changed since profiling
        st.caption(f"Executor steps ran {', '.join(f'{r:.2f}' for r in ratios)}× the profile's prediction for their "
                   "shapes; the 'at the run's step speed' column takes that out.")
    st.dataframe(table(data).style.format("{:.4g}", na_rep="-"))
    cdf = data.get("latency_cdf")
    if isinstance(cdf, dict) and {"levels", "real", "sim"} <= set(cdf):
        curves = {name: charts.quantile_curves(cdf["levels"], cdf[name]) for name in ("real", "sim")}
        st.plotly_chart(charts.latency_cdfs(curves, None, height=300), key=f"validation.cdf.{label}")
    elif (png := plot_beside(path)) is not None:
        st.image(str(png), caption=f"{png.name}: real vs simulated latency CDFs")
    else:
        st.caption("No CDF data in this file (older `infersim validate` runs keep it in a PNG beside it).")


st.title("Validation")
st.caption("Simulator vs the real executor, from `infersim validate --out DIR` (DIR/validation.json).")
files = found()
picked = st.multiselect("validation.json files", list(files), default=list(files)[:3], key="validation.files")
uploads = st.file_uploader("or upload validation.json files", type=["json"], accept_multiple_files=True,
                           key="validation.upload")
loaded = []
for label in picked:
    try:
        loaded.append((label, parse(files[label].read_bytes(), label), files[label]))
    except (ConfigError, OSError) as e:
        st.error(e.one_line() if isinstance(e, ConfigError) else f"{label}: cannot read it ({e.strerror})")
for upload in uploads or []:
    try:
        loaded.append((upload.name, parse(upload.getvalue(), upload.name), None))
    except ConfigError as e:
        st.error(e.one_line())
st.header("Capacity")
st.caption("The highest rate meeting the SLOs, measured by real serves and predicted (`infersim validate SCENARIO "
           "--capacity --out DIR` writes DIR/capacity.json).")
capacity_files = found("capacity.json")
chosen = st.multiselect("capacity.json files", list(capacity_files), default=list(capacity_files)[:5],
                        key="validation.capacity")
capacities = []
for label in chosen:
    try:
        capacities.append((label, parse_capacity(capacity_files[label].read_bytes(), label)))
    except (ConfigError, OSError) as e:
        st.error(e.one_line() if isinstance(e, ConfigError) else f"{label}: cannot read it ({e.strerror})")
if capacities:
    st.dataframe(capacity_table(capacities).style.format("{:.4g}", na_rep="-", subset=pd.IndexSlice[:, [
        "measured", "missed at", "predicted", "error %", "at run speed", "error % at run speed"]]))
else:
    st.caption("No capacity.json under runs/ or docs/runs/ yet.")

st.header("Latency")
if not loaded:
    st.info("Pick or upload a validation.json (`infersim validate SCENARIO --out DIR` writes DIR/validation.json).")
    st.stop()
errors = {label: {name: row.get("error_pct") for name, row in data["metrics"].items()} for label, data, _ in loaded}
st.plotly_chart(charts.errors_by_metric(errors), key="validation.errors")
for label, data, path in loaded:
    show(label, data, path)

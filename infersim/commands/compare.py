"""`infersim compare`: several configurations on one workload, one table and overlaid latency CDFs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from infersim.inputs import prepare_out
from infersim.scenario_keys import apply
from infersim.simulation import Outcome, simulate_data
from sim.config.errors import ConfigError
from sim.config.scenario import SLOConfig
from sim.config.yaml_file import load_yaml, read_yaml
from sim.report.metrics import per_request_latency

# (label, report path) of each table column
COLUMNS = [("TTFT p50 ms", ("ttft_s", "p50"), 1e3), ("TTFT p90 ms", ("ttft_s", "p90"), 1e3),
           ("TPOT p50 ms", ("tpot_s", "p50"), 1e3), ("TPOT p90 ms", ("tpot_s", "p90"), 1e3),
           ("E2E p90 s", ("e2e_s", "p90"), 1.0), ("out tok/s", ("throughput", "output_tokens_per_s"), 1.0),
           ("goodput req/s", ("goodput_requests_per_s",), 1.0), ("SLO att.", ("slo_attainment",), 1.0),
           ("$/h", ("cost", "usd_per_hour"), 1.0), ("$/1M tok", ("cost", "usd_per_million_output_tokens"), 1.0)]


MAX_CONFIGURATIONS = 200  # side by side in one table and one plot; a bigger space is `infersim search`'s
# keys a sweep cannot change: every configuration runs the first one's workload under its SLOs
NOT_SWEPT = ("workload", "slo")


def sweep(base: dict, key: str, values: list) -> list[tuple[str, dict]]:
    """One configuration per value of a dotted scenario key (`serving.max_num_seqs`), labelled by the value."""
    if key.split(".")[0] in NOT_SWEPT:
        raise ConfigError(f"{key}: every configuration runs the first one's workload and SLOs, so sweeping them "
                          "changes nothing; allowed: a key of the deployment (serving.max_num_seqs, hardware, ...)",
                          "--sweep")
    if key in ("name", "description"):
        raise ConfigError(f"{key} is a label: every configuration would be the same deployment; allowed: a key of "
                          "the deployment (serving.max_num_seqs, hardware, ...)", "--sweep")
    twice = next((i for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:  # 1 and 1.0: one deployment run twice under two labels
        raise ConfigError(f"{key}={values[twice]} is an earlier value again (one deployment, two labels); allowed: "
                          "each value once", "--sweep")
    return [(f"{key}={v}", apply(base, key, v)) for v in values]


def parse_sweep(text: str) -> tuple[str, list]:
    """`KEY=V1,V2,...` (each value read as YAML: numbers, true/false, null, [1, 3])."""
    key, sep, rest = text.partition("=")
    if not sep or not key or not rest:
        raise ConfigError(f"expected KEY=V1,V2,... (e.g. serving.max_num_seqs=64,256); got {text!r}", "--sweep")
    try:
        values = [load_yaml(v) for v in _split_top(rest)]
    except ConfigError as e:
        raise ConfigError(f"cannot read the values in {rest[:60]!r}: {e.message}", "--sweep") from None
    return key.strip(), values


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets ([1, 3] stays one value)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def compare_files(scenarios: list[Path], swept: str | None = None, out: Path | None = None
                  ) -> list[tuple[str, Outcome]]:
    """Scenario files simulated on the first one's workload and SLOs (or one file and `swept`, KEY=V1,V2,...: one
    configuration per value), each labelled by its file's name; a note on stderr where another file's workload or SLOs
    differ from the first's. `out` is checked writable before anything runs."""
    items = []
    for path in scenarios:
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError("a scenario is a mapping of keys", file=str(path))
        items.append((path.stem, data))
    stems = [label for label, _ in items]
    # files with the same name in different folders are labelled by their paths
    items = [(str(p) if stems.count(label) > 1 else label, d) for p, (label, d) in zip(scenarios, items)]
    dirs, files = [p.parent for p in scenarios], [str(p) for p in scenarios]
    if swept is not None:
        if len(items) != 1:
            raise ConfigError("--sweep takes exactly one scenario", "--sweep")
        items = sweep(items[0][1], *parse_sweep(swept))
        dirs, files = dirs * len(items), [f"{scenarios[0]} (--sweep {label})"[:200] for label, _ in items]
    elif len(items) < 2:
        raise ConfigError("give two or more scenarios, or one and --sweep KEY=V1,V2")
    else:
        which, sections = differing(items, dirs)
        if which:  # they run the first's: say so, a table of unlike workloads would mislead
            names = ", ".join(str(scenarios[i]) for i in which[:3]) + (" ..." if len(which) > 3 else "")
            what = " and ".join(sections)
            print(f"infersim: note: {names}: {what} {'differ' if len(sections) > 1 else 'differs'} from "
                  f"{scenarios[0]}'s; every scenario runs "
                  f"{scenarios[0]}'s {what}", file=sys.stderr)
    prepare_out(out)
    return compare_data(items, scenarios[0].parent, dirs=dirs, files=files)


def compare_data(items: list[tuple[str, dict]], base_dir: Path = Path("."), progress=None,
                 dirs: list[Path] | None = None, files: list[str] | None = None) -> list[tuple[str, Outcome]]:
    """Simulate each (label, scenario data) on the first one's workload and SLOs; `progress(done, total)` between
    configurations. `dirs`: each configuration's folder, for its relative paths (default: `base_dir`); `files`: what
    an error in each names (default: its label). A configuration that cannot run is a ConfigError naming it."""
    if len(items) < 1:
        raise ConfigError("nothing to compare: give two or more scenarios, or one and --sweep")
    if len(items) > MAX_CONFIGURATIONS:
        raise ConfigError(f"{len(items):,} configurations; allowed: at most {MAX_CONFIGURATIONS} side by side "
                          "(`infersim search` searches bigger spaces)")
    labels = [label for label, _ in items]
    twice = next((label for i, label in enumerate(labels) if label in labels[:i]), None)
    if twice is not None:  # compare.json is keyed by label: one would silently replace the other
        raise ConfigError(f"two configurations are labelled {twice!r}; allowed: each its own")
    dirs = dirs or [base_dir] * len(items)
    workload, slo = _anchored(items[0][1].get("workload"), dirs[0]), items[0][1].get("slo")
    out = []
    for i, (label, data) in enumerate(items):
        # the first's SLOs, also when it has none (another's own SLOs used to grade it alone)
        data = {**{k: v for k, v in data.items() if k != "slo"}, "workload": workload,
                **({"slo": slo} if slo is not None else {})}
        try:
            out.append((label, simulate_data(data, dirs[i])))
        except ConfigError as e:
            raise ConfigError(e.message, e.key_path, e.file or (files[i] if files else label)) from None
        if progress:
            progress(i + 1, len(items))
    return out


def differing(items: list[tuple[str, dict]], dirs: list[Path]) -> tuple[list[int], list[str]]:
    """Which configurations after the first have a workload or SLOs of their own (compare_data replaces them by the
    first's), and which of the two sections differ: (their indices, ["workload", "slo"] or a part of it)."""
    def slo_of(data: dict):
        try:
            return SLOConfig.model_validate(data.get("slo") or {})
        except ValidationError:
            return data.get("slo")

    first_w, first_s = _anchored(items[0][1].get("workload"), dirs[0]), slo_of(items[0][1])
    which, sections = [], set()
    for i, (_, data) in enumerate(items[1:], 1):
        differs = {"workload": _anchored(data.get("workload"), dirs[i]) != first_w, "slo": slo_of(data) != first_s}
        if any(differs.values()):
            which.append(i)
            sections |= {k for k, v in differs.items() if v}
    return which, [k for k in ("workload", "slo") if k in sections]


def _anchored(node, folder: Path, parent: str = ""):
    """The workload with its relative trace paths made absolute against `folder` (the first scenario's), so that
    the other configurations, each resolved against its own folder, replay the same files."""
    if isinstance(node, list):
        return [_anchored(v, folder, parent) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        is_path = (k == "path" and parent == "trace") or (k == "trace" and node.get("dist") == "empirical")
        if is_path and isinstance(v, str) and v and not v.startswith("builtin:"):
            out[k] = str(folder / v)  # an absolute path survives the join unchanged
        else:
            out[k] = _anchored(v, folder, k)
    return out


def value(report: dict, path: tuple, scale: float):
    v = report
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    return None if v is None else v * scale


def table(results: list[tuple[str, Outcome]]) -> list[list[str]]:
    rows = []
    for label, o in results:
        cells = [label]
        for _, path, scale in COLUMNS:
            v = value(o.report, path, scale)
            cells.append("-" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}")
        rows.append(cells)
    return rows


def write_outputs(out: Path, results: list[tuple[str, Outcome]]) -> None:
    """compare.json (each configuration's report), compare.md (the table) and cdf.png (TTFT, TPOT, E2E overlaid)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps({label: o.report for label, o in results}, indent=2,
                                                 allow_nan=False) + "\n")
    header = ["configuration"] + [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table(results)]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    write_cdf_png(out / "cdf.png", results)


def write_cdf_png(path: Path, results: list[tuple[str, Outcome]]) -> None:
    """TTFT, TPOT and E2E CDFs of every configuration overlaid with the SLO lines, one panel each (1430 x 418
    pixels); the first panel's legend names them."""
    from sim.report.plots import cdf  # the plots' Pillow import only where a plot is drawn
    from sim.report.png import Canvas

    fig = Canvas(13, 3.8, dpi=110)
    axes = fig.subplots(3, left=0.051, right=0.989, bottom=0.153, top=0.959, wspace=0.183)
    for ax, key, unit in zip(axes, ("ttft", "tpot", "e2e"), ("s", "ms", "s")):
        scale = 1e3 if unit == "ms" else 1.0
        for label, o in results:
            x, fraction = cdf(per_request_latency(o.records)[key])
            if len(x):
                ax.plot(x * scale, fraction, label=label, lw=1.2)
        slo = results[0][1].report["slo"].get(f"{key}_s") if key != "e2e" else None
        if slo:
            ax.vline(slo * scale, label="SLO", lw=0.8)
        ax.xlabel, ax.ylabel = f"{key.upper()} ({unit})", "fraction of requests"
    # no request completed in any configuration and no SLO line: no entry, no legend box
    axes[0].legend, axes[0].legend_loc = True, "best"
    fig.save(path)


def print_comparison(results: list[tuple[str, Outcome]], first: Path, out: Path | None) -> None:
    """One row per configuration: latency, throughput, goodput, SLO attainment and cost."""
    t = Table("configuration", *(c[0] for c in COLUMNS), title="on the workload of " + str(first))
    for row in table(results):
        t.add_row(*row)
    Console().print(t)
    if out is not None:
        Console().print(f"wrote {out}/compare.json, compare.md, cdf.png")

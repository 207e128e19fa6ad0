"""`infersim validate`: run a scenario on the executor and in the simulator (with the device's
profile) and report, per metric, real vs simulated and the signed error; plus the real-vs-real spread."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sim.cluster import sim_records, simulate
from sim.metrics import RequestRecords, compute_metrics, per_request_latency
from sim.scenario import Plan, make_plan
from sim.workload import generate_requests

METRICS = [("ttft_p50", "ttft_s", "p50"), ("ttft_p90", "ttft_s", "p90"), ("tpot_p50", "tpot_s", "p50"),
           ("tpot_p90", "tpot_s", "p90"), ("itl_p50", "itl_s", "p50"), ("e2e_p50", "e2e_s", "p50"),
           ("throughput_out_tok_s", "throughput", "output_tokens_per_s")]

PROFILES = Path(__file__).parent / "profiles"


def with_profile(plan: Plan, profile: Path) -> Plan:
    """The same plan, predicted with a fitted profile instead of its own cost model."""
    sc = plan.scenario
    sc = sc.model_copy(update={"cost_model": sc.cost_model.model_copy(update={"profile": str(profile.resolve())})})
    return make_plan(sc, plan.base_dir)


def pick(metrics: dict, section: str, key: str) -> float | None:
    return metrics[section][key]


def compare(reals: list[dict], sim: dict) -> dict:
    """Per metric: real (the mean over the executor runs), sim, the signed % error of sim vs real, and with
    two or more runs each run's value and the real-vs-real spread ((max - min) / mean, in %)."""
    out = {}
    for name, section, key in METRICS:
        values = [pick(m, section, key) for m in reals]
        s = pick(sim, section, key)
        r = None if any(v is None for v in values) else float(np.mean(values))
        row = {"real": r, "sim": s, "error_pct": None if not r or s is None else 100 * (s - r) / r}
        if len(reals) > 1:
            row["real_runs"] = values
            row["spread_pct"] = None if not r else 100 * (max(values) - min(values)) / r
        out[name] = row
    return out


def write_cdf_plot(path: Path, real: RequestRecords, sim: RequestRecords) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr, ls = per_request_latency(real), per_request_latency(sim)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
        for lat, label in ((lr, "real"), (ls, "sim")):
            x = np.sort(lat[key][~np.isnan(lat[key])])
            if len(x):
                ax.plot(x * 1000, np.arange(1, len(x) + 1) / len(x), label=label)
        ax.set(title=key.upper(), xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def validate(plan: Plan, profile: Path, device: str = "cpu", threads: int | None = None, runs: int = 1,
             out: Path | None = None, loaded=None) -> dict:
    """Run the executor `runs` times (two or more also measure its run-to-run noise) and the simulator;
    returns validation.json's content.
    `loaded`: the model already in memory (executor.serve.Loaded), to validate many scenarios on one load."""
    from executor.serve import load_model, serve

    specs = generate_requests(plan.scenario.workload, plan.base_dir)
    slo = plan.scenario.slo
    loaded = loaded or load_model(plan, device)
    real = [serve(plan, specs, device, threads, loaded=loaded)[0] for _ in range(max(1, runs))]
    sim_plan = with_profile(plan, profile)
    sim_rec = sim_records(simulate(sim_plan, specs))
    metrics = [compute_metrics(r, slo.ttft_s, slo.tpot_s, slo.quantile) for r in real]
    sim_m = compute_metrics(sim_rec, slo.ttft_s, slo.tpot_s, slo.quantile)
    result = {"scenario": plan.scenario.name, "device": device, "profile": str(profile), "runs": len(real),
              "requests": metrics[0]["requests"], "metrics": compare(metrics, sim_m)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
        write_cdf_plot(out / "latency_cdf_sim_vs_real.png", real[0], sim_rec)
    return result


HEADLINE = ("ttft_p50", "tpot_p50", "throughput_out_tok_s")


def summarize(results: list[dict]) -> dict:
    """Across scenarios: worst and median |error| of each metric (the issue's targets are on HEADLINE)."""
    out = {}
    for name, *_ in METRICS:
        errs = [abs(r["metrics"][name]["error_pct"]) for r in results if r["metrics"][name]["error_pct"] is not None]
        spread = [r["metrics"][name]["spread_pct"] for r in results
                 if r["metrics"][name].get("spread_pct") is not None]
        out[name] = {"max_abs_error_pct": max(errs) if errs else None,
                     "median_abs_error_pct": float(np.median(errs)) if errs else None,
                     "median_spread_pct": float(np.median(spread)) if spread else None}
    return out


def markdown_table(results: list[dict], metrics=HEADLINE) -> str:
    """One row per scenario and metric: real, sim, error (and the real-vs-real spread where measured)."""
    noise = any("spread_pct" in r["metrics"][metrics[0]] for r in results)
    lines = ["| scenario | metric | real | sim | error | " + ("real-vs-real spread |" if noise else ""),
             "|---|---|---:|---:|---:|" + ("---:|" if noise else "")]
    for r in results:
        for m in metrics:
            row = r["metrics"][m]
            cells = [r["scenario"], m, f"{row['real']:.4g}", f"{row['sim']:.4g}", f"{row['error_pct']:+.1f}%"]
            if noise:
                cells.append(f"{row['spread_pct']:.1f}%" if row.get("spread_pct") is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

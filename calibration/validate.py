"""`infersim validate`: run a scenario on the executor and in the simulator (with the device's
profile) and report, per metric, real vs simulated and the signed error; plus real-vs-real noise."""
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


def compare(real: dict, sim: dict, real2: dict | None = None) -> dict:
    """Per metric: real, sim, signed % error of sim vs real, and the real-vs-real spread if measured twice."""
    out = {}
    for name, section, key in METRICS:
        r, s = pick(real, section, key), pick(sim, section, key)
        row = {"real": r, "sim": s, "error_pct": None if not r or s is None else 100 * (s - r) / r}
        if real2 is not None:
            r2 = pick(real2, section, key)
            row["real2"] = r2
            row["noise_pct"] = None if not r or r2 is None else 100 * (r2 - r) / r
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


def validate(plan: Plan, profile: Path, device: str = "cpu", threads: int | None = None, repeat: bool = False,
             out: Path | None = None) -> dict:
    """Run real (once, or twice for the noise) and simulated; returns validation.json's content."""
    from executor.serve import load_model, serve

    specs = generate_requests(plan.scenario.workload, plan.base_dir)
    slo = plan.scenario.slo
    loaded = load_model(plan, device)
    runs = []
    for _ in range(2 if repeat else 1):
        records, *_ = serve(plan, specs, device, threads, loaded=loaded)
        runs.append(records)
    sim_plan = with_profile(plan, profile)
    sim_rec = sim_records(simulate(sim_plan, specs))
    metrics = [compute_metrics(r, slo.ttft_s, slo.tpot_s, slo.quantile) for r in runs]
    sim_m = compute_metrics(sim_rec, slo.ttft_s, slo.tpot_s, slo.quantile)
    result = {"scenario": plan.scenario.name, "device": device, "profile": str(profile),
              "requests": metrics[0]["requests"], "metrics": compare(metrics[0], sim_m, metrics[1] if repeat else None)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
        write_cdf_plot(out / "latency_cdf_sim_vs_real.png", runs[0], sim_rec)
    return result

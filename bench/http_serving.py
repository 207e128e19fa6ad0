"""HTTP serving's overhead (issue 48): one workload on the executor in process (`infersim serve`'s replay) and through
`infersim serve --http` (a server process; this process replays the workload against it as `validate --endpoint`
does, streaming), side by side, alternating round by round (in process first in even rounds, HTTP first in odd ones)
so the machine's drift falls on both. Each figure is the median over rounds; TTFT counts from the request's arrival
in process and from sending at the HTTP client, so the delta holds the HTTP stack both ways, the client's parsing and
the engine thread's hand-offs. Targets: throughput within 5%, TTFT p50 within +10 ms.

Usage: python bench/http_serving.py [--scenario bench/scenarios/http_serving.yaml] [--rounds 2]
Ends with `name: value` lines.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.endpoint import connect, replay  # noqa: E402
from calibration.endpoint_validate import endpoint_records  # noqa: E402
from sim.config.plan import load_scenario  # noqa: E402
from sim.config.workload import generate_requests  # noqa: E402
from sim.report.metrics import compute_metrics  # noqa: E402

FIGURES = (("throughput_tok_s", "throughput", "output_tokens_per_s", 1.0), ("ttft_p50_ms", "ttft_s", "p50", 1e3),
           ("tpot_p50_ms", "tpot_s", "p50", 1e3), ("itl_p50_ms", "itl_s", "p50", 1e3),
           ("e2e_p50_ms", "e2e_s", "p50", 1e3))


def figures(metrics: dict) -> dict:
    return {name: metrics[section][key] * scale for name, section, key, scale in FIGURES}


def in_process(plan, specs, loaded) -> dict:
    from executor.serve import serve

    records, *_ = serve(plan, specs, "cpu", plan.executor.threads, loaded=loaded)
    return figures(compute_metrics(records, plan.slo))


def over_http(path: Path, plan, specs) -> dict:
    """Start `infersim serve --http` on a free port, replay the workload against it, stop it."""
    server = subprocess.Popen([sys.executable, "-m", "infersim.cli", "serve", str(path), "--http", "--port", "0"],
                              cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in server.stderr:
            m = re.search(r"at (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError(f"the server did not start (exit code {server.wait()})")
        ep = connect(url)
        try:
            outcomes = replay(ep, specs, plan.workload.max_concurrency)
        finally:
            ep.close()
        _, records = endpoint_records(outcomes)
        assert all(o.finished for o in outcomes), [o.error for o in outcomes if not o.finished][:3]
        return figures(compute_metrics(records, plan.slo))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", type=Path, default=ROOT / "bench" / "scenarios" / "http_serving.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from executor.serve import load_model, set_threads

    _, plan = load_scenario(args.scenario)
    specs = generate_requests(plan.workload, plan.base_dir)
    set_threads(plan)
    loaded = load_model(plan, "cpu")
    runs = {"in_process": [], "http": []}
    load = []
    for r in range(args.rounds):
        order = ("in_process", "http") if r % 2 == 0 else ("http", "in_process")
        for mode in order:
            t0 = time.perf_counter()
            got = in_process(plan, specs, loaded) if mode == "in_process" else over_http(args.scenario, plan, specs)
            runs[mode].append(got)
            load.append(os.getloadavg()[0])
            print(f"round {r + 1} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items())
                  + f" ({time.perf_counter() - t0:.0f} s, load {load[-1]:.2f})", flush=True)
    med = {mode: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for mode, rs in runs.items()}
    a, b = med["in_process"], med["http"]
    print(f"scenario: {plan.name} ({len(specs)} requests, {args.rounds} rounds)")
    for k in a:
        print(f"in_process_{k}: {a[k]:.2f}")
        print(f"http_{k}: {b[k]:.2f}")
    print(f"throughput_ratio: {b['throughput_tok_s'] / a['throughput_tok_s']:.4f}")
    print(f"ttft_p50_delta_ms: {b['ttft_p50_ms'] - a['ttft_p50_ms']:+.2f}")
    print(f"tpot_p50_ratio: {b['tpot_p50_ms'] / a['tpot_p50_ms']:.4f}")
    print(f"load_avg_1min: {statistics.mean(load):.2f}")


if __name__ == "__main__":
    main()

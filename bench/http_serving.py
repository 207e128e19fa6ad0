"""HTTP serving's overhead (issues 48, 56): one workload on the executor in process (`infersim serve`'s replay) and
through `infersim serve --http` (an API server process and its engine process; this process replays the workload
against it as `validate --endpoint` does, streaming), each a process of its own loading the model, side by side,
alternating round by round (in process first in even rounds, HTTP first in odd ones) so the machine's drift falls on
both. Each figure is the median over rounds; TTFT counts from the request's arrival in process and from sending at
the HTTP client, so the delta holds the HTTP stack both ways, the client's parsing and the hops between the
processes. Targets (issue 56): saturated TTFT p50 within +5 ms, throughput ratio at least 0.99.

Two workloads (bench/scenarios/): http_serving.yaml at about half the engine's capacity (TTFT is then mostly the
prefill and what HTTP adds), http_serving_saturated.yaml past it (throughput is then what the engine serves).

Bursts: a client sees tokens in bursts when the process handing them on falls behind the engine (issue 56 measured
33-48% of inter-token gaps under 0.1 ms with another process busy on the machine). Every HTTP run reports the share
of its streams' gaps under 0.1 ms; a last run serves the saturated workload over HTTP while another process keeps a
core busy (`busy_` figures; target at most 5%).

On a small machine the HTTP client's own work (parsing streams) would take a core from the engine, which a
server's users do not see (their clients run elsewhere): by default each engine runs on core 0 with one thread, and
the client and the API server process on the other cores (`--shared-cores` to share them, as the first
measurements did).

Usage: python bench/http_serving.py [--scenario FILE ...] [--rounds 2] [--shared-cores] [--no-busy]
Ends with `name: value` lines, prefixed `light_`, `saturated_` and `busy_`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.endpoint import connect, replay  # noqa: E402
from calibration.endpoint_validate import endpoint_records  # noqa: E402
from sim.config.generator import generate_requests  # noqa: E402
from sim.config.plan import load_scenario  # noqa: E402
from sim.report.metrics import compute_metrics  # noqa: E402

FIGURES = (("throughput_tok_s", "throughput", "output_tokens_per_s", 1.0), ("ttft_p50_ms", "ttft_s", "p50", 1e3),
           ("tpot_p50_ms", "tpot_s", "p50", 1e3), ("itl_p50_ms", "itl_s", "p50", 1e3),
           ("e2e_p50_ms", "e2e_s", "p50", 1e3))


FIGURE_NAMES = [name for name, *_ in FIGURES]


BURST_GAP_S = 1e-4  # an inter-token gap shorter than this: tokens that reached the client in one burst


def figures(metrics: dict) -> dict:
    return {name: metrics[section][key] * scale for name, section, key, scale in FIGURES}


def burst_share(outcomes) -> float:
    """Of every stream's gaps between tokens in different chunks, the share under BURST_GAP_S."""
    gaps = [b - a for o in outcomes for a, b in zip(o.token_times, o.token_times[1:]) if b > a]
    return sum(g < BURST_GAP_S for g in gaps) / max(1, len(gaps))


def engine_on(pin: bool) -> tuple[list[str], object]:
    """Flags and a preexec for an engine process: with `pin`, core 0 and one thread, so that the HTTP client's own
    work (on the other cores) takes nothing from the engine and both ways compute alike."""
    if not pin:
        return [], None
    return ["--threads", "1"], lambda: os.sched_setaffinity(0, {0})


def in_process(path: Path, pin: bool) -> dict:
    """`infersim serve` of the scenario in a process of its own, as the server runs in one: its report's figures."""
    flags, preexec = engine_on(pin)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "infersim.cli", "serve", str(path), "--out", out, "-q", "--no-plots",
                        *flags], cwd=ROOT, check=True, capture_output=True, preexec_fn=preexec)
        report = json.loads((Path(out) / "report.json").read_text())
    assert report["requests"]["completed"] == report["requests"]["arrived"]
    return figures(report)


def over_http(path: Path, plan, specs, pin: bool) -> dict:
    """Start `infersim serve --http` on a free port, replay the workload against it, stop it. With `pin`, the API
    server runs beside this client, off core 0, and its engine process on core 0 with one thread."""
    flags = ["--threads", "1"] if pin else []
    client_cores = os.sched_getaffinity(0)
    server = subprocess.Popen([sys.executable, "-m", "infersim.cli", "serve", str(path), "--http", "--port", "0",
                               *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        said, url = "", None
        for line in server.stderr:
            said += line
            m = re.search(r"at (http://\S+)/v1 .*engine process (\d+)", said.replace("\n", " "))
            if m:
                url, engine_pid = m.group(1), int(m.group(2))
                break
        if url is None:
            raise RuntimeError(f"the server did not start (exit code {server.wait()}): {said[-500:]}")
        if pin:
            os.sched_setaffinity(server.pid, client_cores)
            os.sched_setaffinity(engine_pid, {0})
        ep = connect(url)
        try:
            outcomes = replay(ep, specs, plan.workload.max_concurrency)
        finally:
            ep.close()
        _, records = endpoint_records(outcomes)
        assert all(o.finished for o in outcomes), [o.error for o in outcomes if not o.finished][:3]
        return {**figures(compute_metrics(records, plan.slo)), "burst_share": burst_share(outcomes)}
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def busy_over_http(path: Path, pin: bool) -> dict:
    """The HTTP run while another process keeps a core busy (a Python spin loop, placed by the OS)."""
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        got = over_http(path, plan, specs, pin)
    finally:
        burner.kill()
        burner.wait()
    got["load_avg_1min"] = os.getloadavg()[0]
    print("busy http: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()), flush=True)
    return got


def compare(path: Path, rounds: int, pin: bool) -> dict:
    """One scenario, both ways, `rounds` rounds: the medians per way."""
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    runs = {"in_process": [], "http": []}
    for r in range(rounds):
        for mode in ("in_process", "http") if r % 2 == 0 else ("http", "in_process"):
            t0 = time.perf_counter()
            got = in_process(path, pin) if mode == "in_process" else over_http(path, plan, specs, pin)
            got["load_avg_1min"] = os.getloadavg()[0]
            runs[mode].append(got)
            print(f"{plan.name} round {r + 1} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {mode: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for mode, rs in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", type=Path, nargs="+", default=[ROOT / "bench" / "scenarios" / "http_serving.yaml",
                                                                 ROOT / "bench" / "scenarios" /
                                                                 "http_serving_saturated.yaml"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shared-cores", action="store_true",
                    help="engine and client share every core (default: the engine on core 0, one thread; the client "
                         "and the API server on the rest)")
    ap.add_argument("--no-busy", action="store_true", help="skip the run beside a busy process")
    args = ap.parse_args()
    pin = not args.shared_cores and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})  # this process replays: off the engine's core
    results = {path: compare(path, args.rounds, pin) for path in args.scenario}
    busy = None if args.no_busy else busy_over_http(args.scenario[-1], pin)
    for path, med in results.items():
        a, b = med["in_process"], med["http"]
        tag = "saturated_" if "saturated" in path.stem else "light_" if path.stem == "http_serving" else path.stem + "_"
        for k in FIGURE_NAMES:
            print(f"{tag}in_process_{k}: {a[k]:.2f}")
            print(f"{tag}http_{k}: {b[k]:.2f}")
        print(f"{tag}throughput_ratio: {b['throughput_tok_s'] / a['throughput_tok_s']:.4f}")
        print(f"{tag}ttft_p50_delta_ms: {b['ttft_p50_ms'] - a['ttft_p50_ms']:+.2f}")
        print(f"{tag}tpot_p50_ratio: {b['tpot_p50_ms'] / a['tpot_p50_ms']:.4f}")
        print(f"{tag}http_itl_under_0.1ms_share: {b['burst_share']:.4f}")
        print(f"{tag}load_avg_1min: {(a['load_avg_1min'] + b['load_avg_1min']) / 2:.2f}")
    if busy is not None:
        print(f"busy_http_itl_under_0.1ms_share: {busy['burst_share']:.4f}")
        print(f"busy_http_ttft_p50_ms: {busy['ttft_p50_ms']:.2f}")
        print(f"busy_load_avg_1min: {busy['load_avg_1min']:.2f}")
    print(f"engine_pinned_to_one_core: {int(pin)}")


if __name__ == "__main__":
    main()

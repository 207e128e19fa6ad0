"""A fixed-concurrency sweep measured and simulated (issue 55): does the client's transport (workload.client) make the
simulator's closed loop behave as a real server's does?

For each number of users N: `infersim serve --http` of bench/scenarios/fixed_concurrency.yaml (the engine on core 0,
one thread) and this project's replay client sending N users' requests back to back, as genai-perf and aiperf
`--concurrency N` and `vllm bench serve --max-concurrency N` at rate inf do; the server's own trace (`--out`) read
back. Then the same workload simulated with the shipped CPU profile scaled to the run's measured step speed
(validate's "at the run's step speed": the measured over the predicted time of the very steps the server ran), once
with `client: {transport: none}` (every user's next request at the engine the instant its last one ended: the
lock-step closed loop) and once with the measured transport (sim/config/client.py).

Per N: TTFT p50 real and simulated both ways, the simulations over the real; the cohort (per request, how many
requests got their first token from the same engine step, averaged: N when whole cohorts prefill together, 1 when
each prefills alone); and the transport in situ (the client's TTFT p50 less the server's own, which counts from its
handler: the way in without the server's queue, and the first token's way out).

First, in seconds and with no machine in it, the same sweep simulated for a GPU the way InferenceMAX runs vLLM:
Llama-3.1-8B on H100-SXM, chunked prefill of 8192 tokens, 1024 / 1024 tokens, 1-128 users.

Usage: python bench/fixed_concurrency.py [--users 1 2 4 8] [--rounds 8] [--shared-cores] [--gpu-only]
Ends with `name: value` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.endpoint import connect, replay  # noqa: E402
from calibration.endpoint_validate import endpoint_records  # noqa: E402
from calibration.validate import step_time_ratio, with_profile  # noqa: E402
from sim.config.generator import generate_requests  # noqa: E402
from sim.config.plan import plan_of  # noqa: E402
from sim.cost.build import make_cost_model, make_pricer  # noqa: E402
from sim.report.metrics import compute_metrics  # noqa: E402
from sim.simulator.cluster import sim_records, simulate  # noqa: E402

SCENARIO = ROOT / "bench" / "scenarios" / "fixed_concurrency.yaml"
PROFILE = ROOT / "calibration" / "profiles" / "cpu.json"


def scenario(users: int, rounds: int, transport: str | None = None) -> dict:
    """The bench scenario for `users` users, `rounds` requests each; `transport`: workload.client's (None: unset)."""
    data = yaml.safe_load(SCENARIO.read_text())
    data["cost_model"]["profile"] = str(PROFILE)
    data["workload"].update(num_requests=users * rounds, closed_loop={"users": users})
    if transport is not None:
        data["workload"]["client"] = {"transport": transport}
    return data


def cohort(first_token_s: list[float]) -> float:
    """Per request, how many requests had their first token at the same instant (the same engine step), averaged."""
    sizes = Counter(first_token_s)
    return float(np.mean([sizes[t] for t in first_token_s])) if first_token_s else float("nan")


def serve_and_replay(data: dict, pin: bool) -> tuple[dict, list[dict], list[dict]]:
    """The real run: (client metrics, the server's requests and steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "scenario.yaml", Path(tmp) / "out"
        path.write_text(yaml.safe_dump(data))
        server = subprocess.Popen([sys.executable, "-m", "infersim.cli", "serve", str(path), "--http", "--port", "0",
                                   "--out", str(out), *(["--threads", "1"] if pin else [])], cwd=ROOT,
                                  stderr=subprocess.PIPE, text=True,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
        try:
            url = next((m.group(1) for line in server.stderr if (m := re.search(r"at (http://\S+)/v1", line))), None)
            if url is None:
                raise RuntimeError(f"the server did not start (exit code {server.wait()})")
            specs = generate_requests(plan_of(data, SCENARIO.parent).workload, SCENARIO.parent)
            ep = connect(url)
            try:
                outcomes = replay(ep, specs)
            finally:
                ep.close()
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=120)
        assert all(o.finished for o in outcomes), [o.error for o in outcomes if not o.finished][:3]
        _, records = endpoint_records(outcomes)
        reqs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return compute_metrics(records), reqs, steps


def simulated(data: dict, scale: float) -> tuple[dict, float]:
    """The simulation at the run's step speed: (metrics, cohort)."""
    plan = plan_of(data, SCENARIO.parent)
    specs = generate_requests(plan.workload, plan.base_dir)
    result = simulate(with_profile(plan, PROFILE, scale), specs)
    metrics = compute_metrics(sim_records(result), plan.slo, plan.client)
    return metrics, cohort([r.first_token_s for r in result.requests])


def point(users: int, rounds: int, pin: bool) -> dict:
    """One point of the sweep: real and simulated both ways."""
    data = scenario(users, rounds)
    real, reqs, steps = serve_and_replay(data, pin)
    plan = plan_of(scenario(users, rounds, "none"), SCENARIO.parent)
    scale = step_time_ratio(steps, make_pricer(plan, make_cost_model(plan)))["all"]
    lock, lock_cohort = simulated(scenario(users, rounds, "none"), scale)
    client, client_cohort = simulated(scenario(users, rounds, "measured"), scale)
    server_ttft = np.median([r["token_times"][0] - r["arrival_s"] for r in reqs if r["token_times"]])
    return {"ttft_real_ms": real["ttft_s"]["p50"] * 1e3, "ttft_lockstep_ms": lock["ttft_s"]["p50"] * 1e3,
            "ttft_client_ms": client["ttft_s"]["p50"] * 1e3, "tpot_real_ms": real["tpot_s"]["p50"] * 1e3,
            "tpot_lockstep_ms": lock["tpot_s"]["p50"] * 1e3, "tpot_client_ms": client["tpot_s"]["p50"] * 1e3,
            "cohort_real": cohort([r["token_times"][0] for r in reqs if r["token_times"]]),
            "cohort_lockstep": lock_cohort, "cohort_client": client_cohort, "step_speed": scale,
            "transport_in_situ_ms": (real["ttft_s"]["p50"] - server_ttft) * 1e3, "load_avg_1min": os.getloadavg()[0]}


GPU = {"model": "Llama-3.1-8B", "hardware": "H100-SXM",
       "serving": {"enable_chunked_prefill": True, "max_num_batched_tokens": 8192, "max_num_seqs": 256},
       "workload": {"seed": 1, "prompt_len": {"dist": "fixed", "value": 1024},
                    "output_len": {"dist": "fixed", "value": 1024}}}


def gpu_point(users: int, rounds: int) -> dict:
    """An InferenceMAX-like point simulated both ways: Llama-3.1-8B on H100-SXM, vLLM v1's chunked prefill of 8192
    tokens, 1024 / 1024 tokens, `users` users back to back; the cohort over the second half of the run."""
    got = {}
    for name, transport in (("lockstep", "none"), ("client", "measured")):
        data = {**GPU, "workload": {**GPU["workload"], "num_requests": users * rounds, "closed_loop": {"users": users},
                                    "client": {"transport": transport}}}
        plan = plan_of(data)
        result = simulate(plan)
        m = compute_metrics(sim_records(result), plan.slo, plan.client)
        got[f"ttft_{name}_ms"], got[f"tpot_{name}_ms"] = m["ttft_s"]["p50"] * 1e3, m["tpot_s"]["p50"] * 1e3
        got[f"cohort_{name}"] = cohort([r.first_token_s for r in result.requests if r.id >= users * rounds // 2])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=8, help="requests per user")
    ap.add_argument("--shared-cores", action="store_true", help="the server and the client share every core")
    ap.add_argument("--gpu-only", action="store_true", help="only the simulated InferenceMAX-like sweep (seconds)")
    args = ap.parse_args()
    for users in (1, 4, 16, 64, 128):
        got = gpu_point(users, 10)
        print(f"gpu {users} users: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
        print(f"gpu_users{users}_ttft_lockstep_over_client: {got['ttft_lockstep_ms'] / got['ttft_client_ms']:.3f}")
        print(f"gpu_users{users}_cohort_lockstep: {got['cohort_lockstep']:.2f}")
        print(f"gpu_users{users}_cohort_client: {got['cohort_client']:.2f}")
    if args.gpu_only:
        return
    pin = not args.shared_cores and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})  # this process replays: off the engine's core
    rows = {}
    for users in args.users:
        rows[users] = got = point(users, args.rounds, pin)
        print(f"{users} users: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    for users, got in rows.items():
        for k, v in got.items():
            print(f"users{users}_{k}: {v:.3f}")
        print(f"users{users}_ttft_lockstep_over_real: {got['ttft_lockstep_ms'] / got['ttft_real_ms']:.3f}")
        print(f"users{users}_ttft_client_over_real: {got['ttft_client_ms'] / got['ttft_real_ms']:.3f}")
    many = [g for u, g in rows.items() if u > 1]
    if many:
        print(f"ttft_lockstep_abs_err_median_pct: "
              f"{np.median([abs(g['ttft_lockstep_ms'] / g['ttft_real_ms'] - 1) for g in many]) * 100:.1f}")
        print(f"ttft_client_abs_err_median_pct: "
              f"{np.median([abs(g['ttft_client_ms'] / g['ttft_real_ms'] - 1) for g in many]) * 100:.1f}")
    print(f"engine_pinned_to_one_core: {int(pin)}")


if __name__ == "__main__":
    main()

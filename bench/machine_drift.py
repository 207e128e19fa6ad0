"""How steady is this machine? The same small engine workloads, back to back for a while, nothing else running.

Each round (~2.5 s) times, through the real executor on SmolLM2-135M: a one-row decode (median of 11 steps),
a four-row decode (median of 8 steps) and a 150-token prefill, then a 1024³ fp32 matmul (best of 5). The
spread of those over the rounds is the floor under any sim-vs-real comparison made on this machine: a profile
measured at one time predicts another time only as well as the machine repeats itself. Also the correlation
between the decode and prefill rounds: if the kinds of step do not slow down together, no single speed factor
(the run's step ratio) can correct for the drift.

Usage: python bench/machine_drift.py [--seconds 120] [--threads 2]. Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from calibration.profile import profile_engine, run_workload
from executor.core.prompts import corpus_ids
from executor.model.weights import load_hf_model, smollm2_gguf_path


def one_round(net, corpus) -> dict:
    one = run_workload(profile_engine(net, "cpu", max_num_seqs=1), corpus, [(150, 12)])
    four = run_workload(profile_engine(net, "cpu", max_num_seqs=4), corpus, [(150, 9)] * 4)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mm = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        mm.append(time.perf_counter() - t)
    return {"decode_1row_ms": 1e3 * statistics.median(r["end_s"] - r["start_s"] for r in one[1:]),
            "decode_4row_ms": 1e3 * statistics.median(r["end_s"] - r["start_s"] for r in four[4:]),
            "prefill_150_ms": 1e3 * (one[0]["end_s"] - one[0]["start_s"]),
            "matmul_gflops": 2 * 1024 ** 3 / min(mm) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    net, _, tok = load_hf_model(smollm2_gguf_path())
    corpus = corpus_ids(tok)
    run_workload(profile_engine(net, "cpu"), corpus, [(64, 4)] * 2)  # warm-up: first forwards allocate
    rounds, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        r = one_round(net, corpus)
        rounds.append(r)
        print(f"{time.perf_counter() - t0:6.1f} s  " + "  ".join(f"{k} {v:6.1f}" for k, v in r.items()), flush=True)
    cols = {k: np.array([r[k] for r in rounds]) for k in rounds[0]}
    print(f"{len(rounds)} rounds in {time.perf_counter() - t0:.0f} s, {args.threads} threads")
    for k, v in cols.items():
        print(f"{k}_max_over_min: {v.max() / v.min():.2f}")
    for k, v in cols.items():
        print(f"{k}_spread_pct: {100 * (np.percentile(v, 90) - np.percentile(v, 10)) / np.median(v):.1f}")
    if len(rounds) > 2:
        print(f"decode_prefill_correlation: {np.corrcoef(cols['decode_1row_ms'], cols['prefill_150_ms'])[0, 1]:.2f}")


if __name__ == "__main__":
    main()

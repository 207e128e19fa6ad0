"""What one KV transfer of the disaggregated executor costs on this machine, as the simulator prices a link
(seconds = bytes / bandwidth + latency): executor.serving.kv_transfer.copy_kv between two SmolLM2-135M-shaped caches (fp32,
30 layers, 3 KV heads of 64), prompts of 16-1024 tokens, one torch thread (as a serve's decode process copies), the
sizes interleaved round after round. `--beside-prefill`: meanwhile another process runs prompt-sized fp32 matmuls on
one thread, as the prefill process computes beside the decode process's copies during a serve.

Usage: python bench/kv_transfer.py [--rounds 30] [--beside-prefill]. Ends with `name: value` headline lines: the
fitted bandwidth and latency, for a scenario's `pools.kv_transfer: {bandwidth, latency_s}`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from executor.core.malloc_tuning import keep_freed_memory
from executor.serving.kv_transfer import copy_kv

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
TOKENS = (16, 32, 64, 128, 256, 512, 1024)


def prefill_like(stop) -> None:
    """A process multiplying a 256-token activation by a weight, on one thread, until told to stop."""
    torch.set_num_threads(1)
    x, w = torch.randn(256, 576), torch.randn(576, 1536)
    while not stop.is_set():
        x @ w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--beside-prefill", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as every engine process does
    blocks = 2 * max(TOKENS) // BLOCK
    src = torch.randn(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM).share_memory_()
    dst = torch.zeros(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    perm = torch.randperm(blocks).tolist()  # block tables scattered over the pool, as after a while of serving
    stop = mp.get_context("spawn").Event()
    peer = None
    if args.beside_prefill:
        peer = mp.get_context("spawn").Process(target=prefill_like, args=(stop,))
        peer.start()
        time.sleep(2.0)
    times: dict[int, list[float]] = {n: [] for n in TOKENS}
    nbytes = {}
    try:
        for _ in range(args.rounds):
            for n in TOKENS:
                k = -(-n // BLOCK)
                t = time.perf_counter()
                nbytes[n] = copy_kv(src, perm[:k], dst, perm[blocks - k:], n)
                times[n].append(time.perf_counter() - t)
    finally:
        stop.set()
        if peer is not None:
            peer.join()
    med = {n: statistics.median(times[n]) for n in TOKENS}
    for n in TOKENS:
        print(f"{n:5d} tokens  {nbytes[n] / 1e6:7.2f} MB  {med[n] * 1e3:7.3f} ms  {nbytes[n] / med[n] / 1e9:5.2f} GB/s")
    slope, latency = np.polyfit([nbytes[n] for n in TOKENS], [med[n] for n in TOKENS], 1)
    print(f"beside_prefill: {args.beside_prefill}")
    print(f"kv_copy_bandwidth_bytes_per_s: {1 / slope:.4g}")
    print(f"kv_copy_latency_s: {max(latency, 0.0):.3g}")


if __name__ == "__main__":
    main()

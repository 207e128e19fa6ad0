"""Two builds of executor/model/kernels.cpp side by side: the A/B behind every kernel change in bench/RESULTS.md.

Builds each source with the flags executor/model/native.py uses for INFERSIM_ISA (so `INFERSIM_ISA=avx2` compares two
AVX2 builds on an AVX-512 host), loads both through ctypes into one process, and times their paged decode attention,
prompt attention and small-batch projections (fp32, int8 and int4 weights) on the same inputs,
alternating A and B call by call (median of --reps), so the machine's drift falls on both alike. Also reports
the largest difference between their outputs (0 where a change keeps the arithmetic order).
SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim 64, 30 layers' projections and the LM head), and
two layers of the 0.5B llama's projections at 8-32 rows; K/V blocks scattered over a pool far larger than the
caches, 2 threads.

Usage: [INFERSIM_ISA=avx2] python bench/kernel_ab.py A.cpp B.cpp [--reps 9] [--threads 2] [--only NAME] [--cpu-time]
(e.g. A = `git show HEAD~1:executor/model/kernels.cpp`; on a busy machine `--threads 1 --cpu-time`)
Ends with `name: value` lines, B's time over A's per case.
"""
from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from executor.model import native
from executor.model.quantize import QuantizedWeight
from sim.config import environment

H, KVH, D, BS, NUM_BLOCKS = 9, 3, 64, 16, 8192
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
# two layers of the 0.5B llama (scenarios/models/llama-0.5b): 1024 inputs, whose rows are 4 KB apart
PROJECTIONS_05B = [(1536, 1024), (1024, 1024), (11264, 1024), (1024, 5632)] * 2


def build(source: Path, out: Path) -> ctypes.CDLL:
    """The kernels compiled from `source` as native.py compiles them for INFERSIM_ISA, loaded through native.load."""
    _, flags = native.isa_build(environment.isa(), native.cpu_flags())
    subprocess.run(["c++", *flags, "-o", str(out), str(source)], check=True)
    return native.load(out)


def scattered_tables(rng: random.Random, lens: list[int]) -> torch.Tensor:
    """Block tables [len(lens), max blocks] of distinct blocks drawn at random from the pool."""
    blocks = rng.sample(range(NUM_BLOCKS), sum(-(-n // BS) for n in lens))
    width, tables, at = max(-(-n // BS) for n in lens), [], 0
    for n in lens:
        k = -(-n // BS)
        tables.append(blocks[at:at + k] + [0] * (width - k))
        at += k
    return torch.tensor(tables)


def cases(libs, rng):
    """(name, run(i) calling build i, work per call, unit, the two output tensors)."""
    k_pool, v_pool = torch.randn(NUM_BLOCKS, BS, KVH, D), torch.randn(NUM_BLOCKS, BS, KVH, D)
    scale = D ** -0.5
    out = []
    for rows, ctx in ((1, 300), (4, 300), (16, 200), (48, 175), (64, 400)):
        lens = [max(8, int(ctx * rng.uniform(0.3, 1.7))) for _ in range(rows)]
        q, tables, cl = torch.randn(rows, 1, H, D), scattered_tables(rng, lens), torch.tensor(lens)
        outs = [torch.empty_like(q), torch.empty_like(q)]

        def run(i, q=q, tables=tables, cl=cl, outs=outs, rows=rows):
            libs[i].paged_attention(q.data_ptr(), outs[i].data_ptr(), rows, 1, H, D, k_pool.data_ptr(),
                                    v_pool.data_ptr(), BS, KVH, tables.data_ptr(), tables.shape[1], cl.data_ptr(),
                                    None, scale, False)
        out.append((f"decode_attention_{rows}_rows", run, sum(lens) * KVH * D * 4 * 2, "GB/s", outs))
    for lens in ([100], [300] * 8, [1000], [1000] * 4):
        q, tables, ql = torch.randn(sum(lens), H, D), scattered_tables(rng, lens), torch.tensor(lens)
        starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
        outs = [torch.empty_like(q), torch.empty_like(q)]

        def run(i, q=q, tables=tables, ql=ql, starts=starts, outs=outs, n=len(lens)):
            libs[i].prefill_attention(q.data_ptr(), outs[i].data_ptr(), n, starts.data_ptr(), ql.data_ptr(),
                                      ql.data_ptr(), H, D, k_pool.data_ptr(), v_pool.data_ptr(), BS, KVH,
                                      tables.data_ptr(), tables.shape[1], scale, False)
        flops = sum(n * (n + 1) // 2 for n in lens) * H * D * 4
        out.append((f"prompt_attention_{len(lens)}x{lens[0]}", run, flops, "GFLOP/s", outs))
    weights = [native.pack_weight(torch.randn(n, k)) for n, k in PROJECTIONS]
    params = sum(n * k for n, k in PROJECTIONS)
    for m in (1, 4, 11, 16, 32, 48):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        ys = [[torch.empty(m, w.n) for w in weights] for _ in range(2)]

        def run(i, xs=xs, ys=ys, m=m):
            for w, y in zip(weights, ys[i]):
                libs[i].linear_small(xs[w.k].data_ptr(), m, w.k, w.data.data_ptr(), w.n, y.data_ptr(), w.n)
        out.append((f"projections_{m}_rows", run, params * 4, "GB/s", [y[-1] for y in ys]))
    out += quantized_cases(libs)
    weights_05b = [native.pack_weight(torch.randn(n, k)) for n, k in PROJECTIONS_05B]
    params = sum(n * k for n, k in PROJECTIONS_05B)
    for m in (8, 12, 16, 24, 32):
        xs = {k: torch.randn(m, k) for k in (1024, 5632)}
        ys = [[torch.empty(m, w.n) for w in weights_05b] for _ in range(2)]

        def run(i, xs=xs, ys=ys, m=m):
            for w, y in zip(weights_05b, ys[i]):
                libs[i].linear_small(xs[w.k].data_ptr(), m, w.k, w.data.data_ptr(), w.n, y.data_ptr(), w.n)
        out.append((f"projections_0.5b_{m}_rows", run, params * 2 * m, "GFLOP/s", [y[-1] for y in ys]))
    return out


def quantized_cases(libs):
    """SmolLM2's projections with int8 weights and int4 ones (groups of 32; the LM head int8, as quantize_weights
    makes it) at the few rows of decodes: GB/s of the quantized bytes streamed."""
    out = []
    for name, bits in (("int8", 8), ("int4", 4)):
        qs = [QuantizedWeight(torch.randn(n, k) * k ** -0.5, 8 if (n, k) == PROJECTIONS[-1] else bits)
              for n, k in PROJECTIONS]
        size = sum(q.panels.numel() * q.panels.element_size() + q.scales.numel() * q.scales.element_size()
                   for q in qs)
        for m in (1, 2, 3, 4):
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            ys = [[torch.empty(m, q.n) for q in qs] for _ in range(2)]

            def run(i, xs=xs, ys=ys, m=m, qs=qs):
                for q, y in zip(qs, ys[i]):
                    libs[i].linear_quantized(xs[q.k].data_ptr(), m, q.k, q.panels.data_ptr(), q.scales.data_ptr(),
                                             q.bits, q.group_size, q.n, y.data_ptr(), q.n, None, q.n)
            out.append((f"{name}_projections_{m}_rows", run, size, "GB/s", [y[-2] for y in ys]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the thread's CPU time, not the wall clock (one thread: on a machine others share, what "
                         "the call itself costs, without the time it waited for a core)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time measures one thread: add --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    native.library()  # torch's libgomp loaded first, as in the engine
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(args.a, Path(tmp) / "a.so"), build(args.b, Path(tmp) / "b.so")]
        headline = []
        for name, run, work, unit, outs in cases(libs, random.Random(0)):
            if args.only and args.only not in name:
                continue
            times = [[], []]
            for _ in range(args.reps):
                for i in (0, 1):
                    t = clock()
                    run(i)
                    times[i].append(clock() - t)
            a, b = statistics.median(times[0]), statistics.median(times[1])
            diff = (outs[0] - outs[1]).abs().max().item()
            print(f"{name:28s} A {a * 1e3:8.3f} ms ({work / a / 1e9:6.1f} {unit})  B {b * 1e3:8.3f} ms "
                  f"({work / b / 1e9:6.1f} {unit})  B/A {b / a:.3f}  max |A-B| {diff:.1e}", flush=True)
            headline.append((name, b / a))
    for name, r in headline:
        print(f"{name}_b_over_a: {r:.3f}")


if __name__ == "__main__":
    main()

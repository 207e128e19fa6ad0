"""The native decode kernels (executor/model/native.py) against the torch paths they replace, side by side.

1. Projections of M rows through all 30 layers of SmolLM2-135M's shapes (random weights, 425 MB: never
   cache-resident): oneDNN's prepacked GEMM against the native panel kernel, M = 1..128.
   (A served model measures its own crossover per weight shape: executor.model.layers.tune_native_rows.)
2. Decode attention of B rows (block size 16, blocks scattered over the pool, contexts around C tokens,
   SmolLM2's 9 query / 3 kv heads of 64): gathered K/V + SDPA (the sdpa backend's torch path) against the
   native paged kernel, which reads the pool through the block tables.
3. Prompt attention (whole prompts of 8-1000 tokens, SmolLM2's heads, block size 16, one call for the batch):
   torch's flash SDPA per prompt on gathered K/V with the kv heads repeated (the sdpa backend's torch path)
   against the native flash-style kernel over the pool, in GFLOP/s of causal attention.
4. A layer's elementwise work at 3, 58 and 4096 rows: residual add + RMSNorm, SiLU·up, and RoPE of q and k with
   K/V written to scattered cache slots, as torch ops (the FUSED_OPS path) against the fused native kernels.

Usage: python bench/native_kernels.py [--threads 2]. Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import time

import torch

from executor.model import attention, native
from executor.model.attention import AttentionMetadata, sdpa_attention

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down (out, in)


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def linear_rows(reps: int) -> dict[int, float]:
    """oneDNN ms / native ms for each row count, interleaved."""
    torch.manual_seed(0)
    weights = [[torch.randn(o, i) for o, i in SHAPES] for _ in range(30)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 4096) for w in layer] for layer in weights]
    panels = [[native.pack_weight(w) for w in layer] for layer in weights]
    nbytes = sum(o * i for o, i in SHAPES) * 4 * 30
    ratios = {}
    for m in (1, 2, 3, 4, 6, 8, 11, 16, 24, 32, 40, 48, 64, 96, 128):
        xs = {i: torch.randn(m, i) for _, i in SHAPES}

        def onednn():
            for layer in packed:
                for (_, i), p in zip(SHAPES, layer):
                    torch.ops.mkldnn._linear_pointwise(xs[i], p, None, "none", [], "")

        def ours():
            for layer in panels:
                for (_, i), w in zip(SHAPES, layer):
                    native.linear_small(xs[i], w)

        a, b = best_ms(onednn, reps), best_ms(ours, reps)
        ratios[m] = a / b
        print(f"linear, {m:2d} rows: oneDNN {a:6.1f} ms ({nbytes / a / 1e6:5.1f} GB/s), native {b:6.1f} ms "
              f"({nbytes / b / 1e6:5.1f} GB/s), oneDNN / native {a / b:.2f}")
    return ratios


def scattered_pool(lens: list[int], g: torch.Generator, bs: int, kvh: int, d: int):
    """(block tables, K/V pool [2, blocks, bs, kvh, d]) for sequences of these lengths, their blocks scattered over
    a random pool with 8 spare blocks."""
    num_blocks = sum(-(-n // bs) for n in lens) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // bs)])
        at += len(tables[-1])
    return tables, torch.randn(2, num_blocks, bs, kvh, d, generator=g)


def decode_attention(reps: int) -> dict[tuple[int, int], float]:
    """SDPA-path ms / native ms for decode batches (rows, mean context)."""
    bs, kvh, d, h = 16, 3, 64, 9
    ratios = {}
    for rows, ctx in ((1, 300), (3, 330), (16, 200), (58, 190), (64, 600)):
        g = torch.Generator().manual_seed(rows)
        lens = torch.randint(ctx // 2, ctx * 3 // 2, (rows,), generator=g).tolist()
        tables, pool = scattered_pool(lens, g, bs, kvh, d)
        q = torch.randn(rows, h, d, generator=g)
        meta = AttentionMetadata.build([1] * rows, lens, tables, bs)

        def run(use_native):
            attention.USE_NATIVE_ATTENTION = use_native
            return sdpa_attention(q, pool[0], pool[1], meta)

        err = (run(True) - run(False)).abs().max().item()
        a, b = best_ms(lambda: run(False), reps), best_ms(lambda: run(True), reps)
        attention.USE_NATIVE_ATTENTION = True
        kv_bytes = sum(lens) * kvh * d * 4 * 2
        ratios[(rows, ctx)] = a / b
        print(f"decode attention, {rows:2d} rows, {sum(lens):6d} keys: gather+SDPA {a:6.2f} ms, native {b:6.2f} ms "
              f"({kv_bytes / b / 1e6:5.1f} GB/s of K/V), ratio {a / b:.2f}, max |diff| {err:.1e}")
    return ratios


def prompt_attention(reps: int) -> dict[int, float]:
    """SDPA-path ms / native ms for a step's prompts of a given typical length (one call per layer)."""
    bs, kvh, d, h = 16, 3, 64, 9
    ratios = {}
    for count, length in ((32, 40), (16, 250), (4, 1000)):
        g = torch.Generator().manual_seed(length)
        lens = torch.randint(length // 2, length * 3 // 2, (count,), generator=g).tolist()
        tables, pool = scattered_pool(lens, g, bs, kvh, d)
        q = torch.randn(sum(lens), h, d, generator=g)

        def run(use_native):
            attention.USE_NATIVE_ATTENTION = use_native
            return sdpa_attention(q, pool[0], pool[1], AttentionMetadata.build(lens, lens, tables, bs))

        err = (run(True) - run(False)).abs().max().item()
        a, b = best_ms(lambda: run(False), reps), best_ms(lambda: run(True), reps)
        attention.USE_NATIVE_ATTENTION = True
        flops = sum(4 * h * d * n * (n + 1) // 2 for n in lens)
        ratios[length] = a / b
        print(f"prompt attention, {count:2d} prompts of ~{length:4d} tokens: SDPA {a:6.2f} ms ({flops / a / 1e6:5.1f} "
              f"GFLOP/s), native {b:6.2f} ms ({flops / b / 1e6:5.1f} GFLOP/s), ratio {a / b:.2f}, max |diff| {err:.1e}")
    return ratios


def elementwise(reps: int) -> dict[tuple[str, int], float]:
    """torch ms / native ms of a layer's fused elementwise kernels at a few and at thousands of rows."""
    import torch.nn.functional as F

    from executor.model.layers import apply_rope_into

    g = torch.Generator().manual_seed(0)
    h, kvh, d, hidden, inter = 9, 3, 64, 576, 1536
    cos_t, sin_t = torch.randn(2048, d // 2, generator=g), torch.randn(2048, d // 2, generator=g)
    ratios = {}
    for rows in (3, 58, 4096):
        x, delta, w = (torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g),
                       torch.randn(hidden, generator=g))
        gate, up = torch.randn(rows, inter, generator=g), torch.randn(rows, inter, generator=g)
        qkv = torch.randn(rows, (h + 2 * kvh) * d, generator=g)
        pos = torch.randint(0, 2048, (rows,), generator=g)
        k_pool, v_pool = torch.zeros(8192, kvh, d), torch.zeros(8192, kvh, d)
        slots = torch.randperm(8192, generator=g)[:rows]

        def rope_torch():
            cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]
            qk = apply_rope_into(qkv[:, :(h + kvh) * d].view(rows, -1, d), cos, sin)
            k_pool.index_copy_(0, slots, qk[:, h:])
            v_pool.index_copy_(0, slots, qkv[:, (h + kvh) * d:].view(rows, kvh, d))

        pairs = {
            "add+rmsnorm": (lambda: F.rms_norm(x.add_(delta), (hidden,), w, 1e-5),
                            lambda: native.add_rms_norm(x, delta, w, 1e-5)),
            "silu*up": (lambda: F.silu(gate.clone(), inplace=True).mul_(up), lambda: native.silu_mul(gate, up)),
            "rope+kv write": (rope_torch, lambda: native.rope_write_kv(qkv, h, kvh, d, cos_t, sin_t, pos, k_pool,
                                                                      v_pool, slots)),
        }
        for name, (theirs, ours) in pairs.items():
            a, b = best_ms(theirs, reps), best_ms(ours, reps)
            ratios[(name, rows)] = a / b
            print(f"{name}, {rows:4d} rows: torch {a:7.3f} ms, native {b:7.3f} ms, ratio {a / b:.2f}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("bench/native_kernels.py: the native kernels could not be built (no C++ compiler?)")
    lin = linear_rows(args.reps)
    att = decode_attention(args.reps * 2)
    pro = prompt_attention(args.reps * 2)
    ew = elementwise(args.reps * 2)
    crossover = 0
    for m, r in lin.items():  # the row counts up to which every one measured favours the native kernel
        if r <= 1.0:
            break
        crossover = m
    print(f"native linear faster up to {crossover} rows over SmolLM2's shapes together (a runner measures each "
          f"shape: executor.model.layers.tune_native_rows; untuned default {native.linear_max_rows()})")
    for m in (1, 3, 11, 16, 32, 64):
        print(f"linear_speedup_{m}_rows: {lin[m]:.2f}")
    for (rows, ctx), r in att.items():
        print(f"decode_attention_speedup_{rows}_rows: {r:.2f}")
    for length, r in pro.items():
        print(f"prompt_attention_speedup_{length}_tokens: {r:.2f}")
    for (name, rows), r in ew.items():
        print(f"{name.replace('+', '_').replace('*', '_').replace(' ', '_')}_speedup_{rows}_rows: {r:.2f}")


if __name__ == "__main__":
    main()

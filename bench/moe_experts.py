"""A mixture-of-experts block's routed experts on the CPU: grouped matmuls (torch._grouped_mm over the tokens sorted
by expert) against a loop over the experts that got tokens, called alternately on the same inputs, per step size.

    python bench/moe_experts.py [--experts 64 --top-k 8 --hidden 1024 --width 256 --threads 2]

The default shape is a Qwen3-MoE-like block shrunk to fit a small CPU (64 experts of width 256, top-8). Prints the
largest output difference, then `name: value` lines (milliseconds per block call, the loop's time over the grouped
one's).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from executor.model import moe


def time_ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    block = moe.SparseMoeBlock(args.hidden, args.experts, args.top_k, args.width).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    with torch.inference_mode():
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, args.hidden, generator=gen)
            runs = {True: [], False: []}
            outs = {}
            for i in range(2 * args.repeats):  # alternate, so the machine's drift falls on both
                grouped = i % 2 == 0
                moe.USE_GROUPED_MM = grouped
                outs[grouped] = block(x)
                runs[grouped] += time_ms(lambda: block(x), 1)
            moe.USE_GROUPED_MM = True
            diff = (outs[True] - outs[False]).abs().max().item()
            g, loop = statistics.median(runs[True]), statistics.median(runs[False])
            print(f"tokens {t}: max |grouped - loop| {diff:.1e}")
            print(f"grouped_ms_{t}: {g:.3f}")
            print(f"loop_ms_{t}: {loop:.3f}")
            print(f"loop_over_grouped_{t}: {loop / g:.2f}")


if __name__ == "__main__":
    main()

"""MXFP4 experts on the CPU: kept packed and dequantized per step (the experts a step touches) against dequantized
once at load, in a gpt-oss-shaped mixture-of-experts block, called alternately on the same inputs per step size.

    python bench/mxfp4.py [--experts 32 --top-k 4 --hidden 1024 --width 1024 --threads 2]

Both compute from exactly the same weight values (the output difference printed must be 0). Prints `name: value`
lines: milliseconds per block call each way, packed over dequantized, and the experts' bytes each way.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from executor.model import moe, mxfp4


def block_of(args, seed: int = 0) -> moe.SparseMoeBlock:
    """gpt-oss's block: router over the top-k logits (with a bias), clamped SwiGLU experts with biases."""
    gen = torch.Generator().manual_seed(seed)
    block = moe.SparseMoeBlock(args.hidden, args.experts, args.top_k, args.width, routing=moe.Routing("topk_softmax"),
                               bias=True, act=moe.Activation("clamped_swiglu")).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
    return block


def nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    packed, plain = block_of(args), block_of(args)
    mxfp4.pack_experts(packed)
    mxfp4.pack_experts(plain)
    mxfp4.dequantize_experts(plain)  # the same MXFP4 values, expanded once
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, args.hidden, generator=gen)
            runs: dict[str, list[float]] = {"packed": [], "load": []}
            outs = {}
            for i in range(2 * args.repeats):  # alternate, so the machine's drift falls on both
                name, block = ("packed", packed) if i % 2 == 0 else ("load", plain)
                start = time.perf_counter()
                outs[name] = block(x)
                runs[name].append((time.perf_counter() - start) * 1e3)
            p, d = statistics.median(runs["packed"][1:]), statistics.median(runs["load"][1:])
            print(f"tokens {t}: max |packed - dequantized at load| {(outs['packed'] - outs['load']).abs().max():.1e}")
            print(f"packed_ms_{t}: {p:.3f}")
            print(f"dequantized_at_load_ms_{t}: {d:.3f}")
            print(f"packed_over_load_{t}: {p / d:.2f}")
    print(f"expert_bytes_packed: {nbytes(packed.experts)}")
    print(f"expert_bytes_dequantized: {nbytes(plain.experts)}")


if __name__ == "__main__":
    main()

"""Time the kernels a serving step is made of on this GPU, for the simulator's GPU kernel model (sim/cost/kernels.py).

    python -m calibration.gpu_kernels --out kernels.json            # ~2 minutes on one H100 / H200
    python -m calibration.gpu_kernels --device cpu --dry --out k.json   # a few seconds: checks the command

What it times, each kernel replayed from a CUDA graph so that launch latency is out of the figure (a serving engine
replays its decode steps the same way), with weights rotated through copies larger than the L2 cache so that each
call streams them from memory as a decoder layer does:
- GEMMs `x[M, K] @ w[N, K]ᵀ` in bf16 for the projections of several model shapes at tensor-parallel sizes 1-8, the
  LM head and mixture-of-experts expert shapes, M = 1 to 16,384 tokens; fp8 (`torch._scaled_mm`) where the GPU has
  it;
- elementwise passes: copy, add, SiLU-and-multiply, RMSNorm;
- attention through PyTorch's SDPA (FlashAttention-2 backend): causal prefills by length and heads, chunks over a
  cached prefix (causal to the lower right), and decodes of a batch over its KV cache (GQA as query groups);
- grouped expert GEMMs (`torch._grouped_mm`) as a mixture-of-experts layer runs them, tokens spread over experts.

Writes one JSON record per measurement: {"op": ..., shape fields..., "s": seconds per call}. Needs only torch (and the sharding rule, sim/config/sharding.py).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sim.cost.kernels import layer_gemms

# Shapes of real models (hidden, heads, kv_heads, head_dim, intermediate, vocab): the projections a device computes
# at each tensor-parallel size
MODELS = {
    "Llama-3.2-1B": (2048, 32, 8, 64, 8192, 128256),
    "Llama-3.2-3B": (3072, 24, 8, 128, 8192, 128256),
    "Llama-3-8B": (4096, 32, 8, 128, 14336, 128256),
    "Qwen2.5-14B": (5120, 40, 8, 128, 13824, 152064),
    "Qwen2.5-32B": (5120, 40, 8, 128, 27648, 152064),
    "Llama-3-70B": (8192, 64, 8, 128, 28672, 128256),
}
# mixture-of-experts layers (hidden, expert intermediate, experts, top-k)
MOE = {"Mixtral-8x7B": (4096, 14336, 8, 2), "Qwen3-30B-A3B": (2048, 768, 128, 8),
       "DeepSeek-V3-EP8": (7168, 2048, 32, 8)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192, 16384)
DRY_TOKENS = (1, 4, 16, 64)
ROTATE_BYTES = 256 * 2**20  # weights rotated through copies this large: several times a Hopper's 50-60 MB L2


def projections(hidden, heads, kv_heads, head_dim, inter, tp) -> list[tuple[str, int, int]]:
    """(name, N, K) of a decoder layer's GEMMs on one of `tp` devices (Megatron sharding; KV heads replicated where
    fewer than devices)."""
    return [(op, n, k) for op, _, n, k in layer_gemms(hidden, heads, kv_heads, head_dim, inter, tp, 1)]


class Timer:
    """Seconds per call of a function, replayed from a CUDA graph (on a GPU) or called in a loop (dry run)."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device == "cuda"

    def __call__(self, fn, calls: int = 20, replays: int = 3) -> float:
        fn(0)
        if not self.cuda:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            return (time.perf_counter() - t) / calls
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(1)
        torch.cuda.synchronize()
        once = time.perf_counter() - t
        if once > 2e-3:  # long kernels: launch latency is noise, time a few eagerly
            return self._events(lambda: [fn(i) for i in range(3)]) / 3
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(2):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        times = sorted(self._events(graph.replay) for _ in range(replays))
        return times[len(times) // 2] / calls

    @staticmethod
    def _events(run) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


def rotated(make, nbytes: int, limit: int = 32) -> list:
    """Enough copies of a tensor that cycling through them streams ROTATE_BYTES from memory."""
    return [make() for _ in range(max(1, min(limit, math.ceil(ROTATE_BYTES / max(nbytes, 1)))))]


def gemm_shapes(dry: bool) -> list[tuple[str, int, int]]:
    shapes: dict[tuple[int, int], str] = {}
    models = {"tiny": (256, 4, 2, 64, 512, 1024)} if dry else MODELS
    for name, (hidden, heads, kv_heads, head_dim, inter, vocab) in models.items():
        for tp in (1, 2, 4, 8):
            if heads % tp:
                continue
            for op, n, k in projections(hidden, heads, kv_heads, head_dim, inter, tp):
                shapes.setdefault((n, k), f"{name} tp{tp} {op}")
        shapes.setdefault((vocab, hidden), f"{name} lm_head")
    if not dry:
        for name, (hidden, inter, _, _) in MOE.items():
            shapes.setdefault((2 * inter, hidden), f"{name} expert gate_up")
            shapes.setdefault((hidden, inter), f"{name} expert down")
    return [(label, n, k) for (n, k), label in shapes.items()]


def time_gemms(timer: Timer, device: str, dry: bool, dtype=torch.bfloat16) -> list[dict]:
    out = []
    tokens = DRY_TOKENS if dry else TOKENS
    for label, n, k in gemm_shapes(dry):
        ws = rotated(lambda: torch.randn(n, k, device=device, dtype=dtype) * 0.02, n * k * 2)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            y = torch.empty(m, n, device=device, dtype=dtype)
            s = timer(lambda i: torch.mm(x, ws[i % len(ws)].t(), out=y))
            out.append({"op": "gemm", "dtype": "bf16", "m": m, "n": n, "k": k, "label": label, "s": s})
    return out


def time_fp8_gemms(timer: Timer, device: str, dry: bool) -> list[dict]:
    """fp8 e4m3 GEMMs with per-tensor scales (torch._scaled_mm), where the GPU has fp8 tensor cores."""
    if device != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        return []
    out = []
    fp8 = torch.float8_e4m3fn
    one = torch.ones((), device=device)
    for label, n, k in [s for s in gemm_shapes(dry) if s[0].startswith(("Llama-3-8B tp1", "Llama-3-70B tp8"))]:
        ws = rotated(lambda: (torch.randn(n, k, device=device) * 0.1).to(fp8), n * k)
        for m in (16, 64, 256, 1024, 4096, 16384):
            x = (torch.randn(m, k, device=device) * 0.1).to(fp8)
            try:
                s = timer(lambda i: torch._scaled_mm(x, ws[i % len(ws)].t(), scale_a=one, scale_b=one,
                                                     out_dtype=torch.bfloat16))
            except (RuntimeError, TypeError) as e:
                return out + [{"op": "gemm_fp8", "error": str(e)[:200]}]
            out.append({"op": "gemm", "dtype": "fp8", "m": m, "n": n, "k": k, "label": label, "s": s})
    return out


def time_elementwise(timer: Timer, device: str, dry: bool, dtype=torch.bfloat16) -> list[dict]:
    """Bandwidth-bound passes over [tokens, width] activations; `bytes` is what each call reads and writes."""
    out = []
    for tokens in ((1, 64) if dry else (1, 16, 128, 1024, 4096, 16384)):
        for width in ((256,) if dry else (2048, 4096, 8192, 28672)):
            def t(*shape):
                return torch.randn(*shape, device=device, dtype=dtype)
            a, b, c = t(tokens, width), t(tokens, width), t(tokens, width)
            w = t(width)
            size = tokens * width * 2
            cases = {
                "copy": (lambda i: c.copy_(a), 2 * size),
                "add": (lambda i: torch.add(a, b, out=c), 3 * size),
                "silu_mul": (lambda i: torch.mul(F.silu(a), b, out=c), 3 * size),
                "rms_norm": (lambda i: F.rms_norm(a, (width,), w, 1e-6), 2 * size),
            }
            for kind, (fn, nbytes) in cases.items():
                out.append({"op": "elementwise", "kind": kind, "tokens": tokens, "width": width, "bytes": nbytes,
                            "s": timer(fn)})
    return out


def _sdpa(q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def time_attention(timer: Timer, device: str, dry: bool, dtype=torch.bfloat16) -> list[dict]:
    """Prefill (causal, square), chunks over a cached prefix (causal to the lower right) and decode (one query token
    per sequence; a GQA group's query heads attend their shared KV head as a short query)."""
    from torch.nn.attention.bias import causal_lower_right

    out = []

    def t(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    heads_dims = ((4, 64),) if dry else ((4, 128), (8, 128), (16, 128), (32, 128), (64, 128), (32, 64))
    for heads, dim in heads_dims:
        for seq in ((16, 64) if dry else (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)):
            if heads * seq > 64 * 16384:
                continue
            q, k, v = t(1, heads, seq, dim), t(1, heads, seq, dim), t(1, heads, seq, dim)
            s = timer(lambda i: _sdpa(q, k, v, is_causal=True), calls=5)
            out.append({"op": "attn_prefill", "batch": 1, "seq": seq, "past": 0, "heads": heads, "head_dim": dim,
                        "s": s})
    for batch, seq in (((2, 16),) if dry else ((4, 1024), (8, 512), (16, 256), (32, 128), (64, 64))):
        q, k, v = t(batch, 32, seq, 128), t(batch, 32, seq, 128), t(batch, 32, seq, 128)
        s = timer(lambda i: _sdpa(q, k, v, is_causal=True), calls=5)
        out.append({"op": "attn_prefill", "batch": batch, "seq": seq, "past": 0, "heads": 32, "head_dim": 128,
                    "s": s})
    for chunk, past in (((8, 16),) if dry else ((256, 2048), (512, 2048), (512, 8192), (2048, 2048), (2048, 8192),
                                                (128, 16384))):
        q = t(1, 32, chunk, 128)
        k, v = t(1, 32, past + chunk, 128), t(1, 32, past + chunk, 128)
        mask = causal_lower_right(chunk, past + chunk)
        s = timer(lambda i: _sdpa(q, k, v, attn_mask=mask), calls=5)
        out.append({"op": "attn_prefill", "batch": 1, "seq": chunk, "past": past, "heads": 32, "head_dim": 128,
                    "s": s})
    groups = ((2, 2, 64),) if dry else ((8, 4, 128), (1, 8, 128), (2, 4, 128), (32, 1, 128), (8, 8, 128))
    for kv_heads, group, dim in groups:
        for batch in ((1, 4) if dry else (1, 4, 16, 64, 256)):
            for ctx in ((32,) if dry else (256, 1024, 4096, 16384)):
                kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
                if kv_bytes > 8 * 2**30:
                    continue
                q = t(batch, kv_heads, group, dim)
                kvs = rotated(lambda: (t(batch, kv_heads, ctx, dim), t(batch, kv_heads, ctx, dim)), kv_bytes, 16)
                s = timer(lambda i: _sdpa(q, *kvs[i % len(kvs)]))
                out.append({"op": "attn_decode", "batch": batch, "context": ctx, "kv_heads": kv_heads,
                            "heads": kv_heads * group, "head_dim": dim, "kv_bytes": kv_bytes, "s": s})
    return out


def time_moe(timer: Timer, device: str, dry: bool, dtype=torch.bfloat16) -> list[dict]:
    """A mixture-of-experts layer's expert GEMMs: tokens × top-k rows spread at random over the experts, each expert
    multiplying its rows (torch._grouped_mm where it runs, else a loop of GEMMs)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, (hidden, inter, experts, top_k) in ({"tiny": (128, 64, 4, 2)} if dry else MOE).items():
        w_up = torch.randn(experts, hidden, 2 * inter, device=device, dtype=dtype) * 0.02
        w_down = torch.randn(experts, inter, hidden, device=device, dtype=dtype) * 0.02
        for tokens in ((1, 8) if dry else (1, 4, 16, 64, 256, 1024, 4096, 16384)):
            choice = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
            counts = torch.bincount(choice, minlength=experts)
            rows = int(counts.sum())
            offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
            x, h = torch.randn(rows, hidden, device=device, dtype=dtype), torch.randn(rows, inter, device=device,
                                                                                      dtype=dtype)
            bounds = [0] + torch.cumsum(counts, 0).tolist()
            for kind, inp, w in (("gate_up", x, w_up), ("down", h, w_down)):
                def loop(i, inp=inp, w=w):
                    return [inp[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
                impl, fn = "loop", loop
                if device == "cuda" and hasattr(torch, "_grouped_mm"):
                    try:
                        torch._grouped_mm(inp, w, offs=offs)
                        impl, fn = "grouped_mm", (lambda i, inp=inp, w=w: torch._grouped_mm(inp, w, offs=offs))
                    except (RuntimeError, TypeError):
                        pass
                out.append({"op": "moe", "model": name, "kind": kind, "impl": impl, "tokens": tokens, "top_k": top_k,
                            "experts": experts, "active_experts": int((counts > 0).sum()), "hidden": hidden,
                            "inter": inter, "s": timer(fn, calls=5)})
    return out


def ceilings(timer: Timer, device: str, dry: bool) -> dict:
    """The device's achieved peaks: a large bf16 matmul and a large copy."""
    n = 256 if dry else 8192
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device,
                                                                              dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    mm = timer(lambda i: torch.mm(a, b, out=c), calls=5)
    x = torch.empty((1 if dry else 1024) * 2**20, device=device)
    y = torch.empty_like(x)
    cp = timer(lambda i: y.copy_(x), calls=5)
    return {"bf16_matmul_flops": 2 * n**3 / mm, "copy_bytes_per_s": 2 * x.numel() * 4 / cp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("kernels.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry", action="store_true", help="tiny shapes: check the command, not the numbers")
    ap.add_argument("--only", default="", help="comma-separated parts: ceilings,gemm,attention,elementwise,moe,fp8")
    args = ap.parse_args()
    torch.manual_seed(0)
    timer = Timer(args.device)
    info = {"device": args.device, "torch": torch.__version__, "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    # the most needed first: a run cut short keeps them
    parts = {"ceilings": ceilings, "gemm": time_gemms, "attention": time_attention, "elementwise": time_elementwise,
             "moe": time_moe, "fp8": time_fp8_gemms}
    wanted = [p for p in args.only.split(",") if p] or list(parts)
    result = {"info": info, "stages_s": {}, "ceilings": {}, "records": []}
    for name in wanted:
        t = time.perf_counter()
        got = parts[name](timer, args.device, args.dry)
        if name == "ceilings":
            result["ceilings"] = got
        else:
            result["records"] += got
        result["stages_s"][name] = round(time.perf_counter() - t, 1)
        args.out.write_text(json.dumps(result))  # after each part: a run cut short keeps what it measured
        print(f"{name}: {len(got)} in {result['stages_s'][name]} s", flush=True)
    print(json.dumps({"out": str(args.out), "records": len(result["records"]), **result["ceilings"]}))


if __name__ == "__main__":
    main()

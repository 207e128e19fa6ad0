"""Weight-only quantized projections and the int8 KV cache, side by side with fp32 (the decisions behind
executor/model/quantize.py and the int8 paths of executor/model/kernels.cpp).

1. kernels: every projection of SmolLM2-135M's 30 layers plus its LM head (random weights, 538 MB in fp32: never
   cache-resident) at M rows, interleaved: fp32 through oneDNN's prepacked GEMM and the native panel kernel; int8
   and int4 (groups of 128 and 32) through the native quantized kernel, through torch's own weight-only kernels
   (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu) and by dequantizing and multiplying with MKL.
2. --model: SmolLM2-135M itself, engine steps (decode at batch 1 and 16 with 128 tokens of context, a 512-token
   prompt step) for fp32, int8, int4 and int8 / int4 + int8 KV, interleaved rounds, medians; then perplexity on
   the held-out text (executor/model/quality.py) per configuration (group sizes, the LM head's dtype, outlier columns,
   and int8 activations as a VNNI kernel would round them: per row or per 32 features), and the int8 KV scale
   schemes compared on the model's real keys and values.

Usage: python bench/quant_kernels.py [--threads 2] [--model] [--rounds 5]. Ends with `name: value` lines.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from executor.core.malloc_tuning import keep_freed_memory  # noqa: E402
from executor.model import native, quantize  # noqa: E402
from executor.model.quantize import QuantizedWeight  # noqa: E402

SHAPES = [(960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # qkv, o, gate, up, down (out, in)
HEAD = (49152, 576)
ROWS = (1, 4, 16, 64, 128, 256)


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def kernels(reps: int, rows=ROWS) -> dict[str, float]:
    """ms for all projections of one forward (30 layers + head) per method and row count, interleaved; a line per
    row count as it is measured."""
    torch.manual_seed(0)
    shapes = SHAPES * 30 + [HEAD]
    weights = [torch.randn(o, i) * i ** -0.5 for o, i in shapes]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    methods = {}
    mk = [torch.ops.mkldnn._reorder_linear_weight(w, 4096) for w in weights]
    methods["fp32_onednn"] = lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                         for x, p in zip(xs, mk)]
    if native.available():
        panels = [native.pack_weight(w) for w in weights]
        methods["fp32_native"] = lambda xs: [native.linear_small(x, p) for x, p in zip(xs, panels)]
    for name, bits, group in (("int8", 8, 128), ("int4_g128", 4, 128), ("int4_g32", 4, 32)):
        qs = [QuantizedWeight(w, bits, group) for w in weights]
        methods[f"{name}_native"] = lambda xs, qs=qs: [native.linear_quantized(x, q.panels, q.scales, q.bits,
                                                                               q.group_size, q.n)
                                                       for x, q in zip(xs, qs)]
        methods[f"{name}_deq_mm"] = lambda xs, qs=qs: [x @ native.dequantize_panels(q.panels, q.scales, q.bits,
                                                                                    q.group_size, q.n, q.k)
                                                       for x, q in zip(xs, qs)]
    # torch's own weight-only kernels: int8 [N, K] with per-channel scales; int4 packed by torch, groups of 32
    # (its groups must divide K: SmolLM2's 576 is no multiple of 128)
    t8 = [(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8), w.abs().amax(1) / 127)
          for w in weights]
    methods["int8_torch"] = lambda xs: [torch.ops.aten._weight_int8pack_mm(x, q, s) for x, (q, s) in zip(xs, t8)]
    try:
        t4 = [torch4(w, 32) for w in weights]
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.randn(1, 576), *t4[0])
        methods["int4_g32_torch"] = lambda xs: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, *p)
                                                for x, p in zip(xs, t4)]
    except (RuntimeError, TypeError) as e:
        print(f"torch int4 kernel unavailable: {str(e).splitlines()[0][:120]}")
    out = {"fp32_bytes": fp32_bytes}
    print(f"all projections of one forward (fp32 {fp32_bytes / 1e6:.0f} MB), ms (best of 2 interleaved medians of "
          f"{reps}), by rows:")
    print("rows " + "".join(f"{name:>17}" for name in methods), flush=True)
    for m in rows:
        xs = [torch.randn(m, i) for _, i in shapes]
        for _ in range(2):
            for name, fn in methods.items():
                if (name.endswith("_torch") and m > 16) or (name.endswith("_deq_mm") and m < 64):
                    continue  # torch's decode kernels are far behind past a few rows; dequantizing is for prompts
                key = f"{name}@{m}"
                out[key] = min(out.get(key, float("inf")), median_ms(lambda: fn(xs), reps))
        print(f"{m:4d} " + "".join(f"{out.get(f'{name}@{m}', float('nan')):17.2f}" for name in methods), flush=True)
    return out


def torch4(w: torch.Tensor, group: int):
    """(packed weight, group size, scales-and-zeros) for aten._weight_int4pack_mm_for_cpu (torchao's layout:
    asymmetric, q in [0, 15], w = (q - 8) · scale + zero)."""
    n, k = w.shape
    g = w.view(n, k // group, group) if k % group == 0 else None
    if g is None:
        raise RuntimeError(f"K {k} is not a multiple of the group size {group}")
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = lo + 8 * scale
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [K / group, N, 2]
    return packed, group, sz


def engine_steps(base, corpus: list[int], rounds: int) -> dict[str, float]:
    """Median engine step times per configuration, interleaved rounds: bench/compression.py's decode and prompt
    timings (128 tokens of context, 16 timed decode steps; one 512-token prompt step)."""
    from compression import decode_step_s, prompt_step_s

    configs = {"fp32": (None, None), "int8": ("int8", None), "int4": ("int4", None), "int8_kv8": ("int8", "int8"),
               "int4_kv8": ("int4", "int8")}
    models = {name: (quantize.quantize_weights(copy.deepcopy(base), w) if w else base, kv)
              for name, (w, kv) in configs.items()}
    samples = {}
    for _ in range(rounds):
        for name, (model, kv) in models.items():
            for what, fn in (("decode_b1", lambda: decode_step_s(model, kv, 1, corpus, 16)),
                             ("decode_b16", lambda: decode_step_s(model, kv, 16, corpus, 16)),
                             ("prompt_512", lambda: prompt_step_s(model, kv, corpus))):
                samples.setdefault(f"{name}_{what}", []).append(fn())
    out = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    print("engine steps, ms (median over rounds):")
    for what in ("decode_b1", "decode_b16", "prompt_512"):
        fp = out[f"fp32_{what}"]
        print(f"  {what}: " + ", ".join(f"{n} {out[f'{n}_{what}']:.1f} ({fp / out[f'{n}_{what}']:.2f}x)"
                                          for n in configs))
    return out


def quality(base, tokenizer) -> dict[str, float]:
    """Perplexity on the held-out text per configuration."""
    from executor.model.quality import heldout_ids, perplexity

    ids = heldout_ids(tokenizer)
    out = {"fp32": perplexity(base, ids)}
    out["kv8"] = perplexity(base, ids, kv_dtype="int8")
    for name, (w, g, thr, head) in {"int8": ("int8", 32, None, None), "int4_g32": ("int4", 32, None, None),
                                    "int4_g64": ("int4", 64, None, None), "int4_g128": ("int4", 128, None, None),
                                    "int4_g32_head_int4": ("int4", 32, None, "int4"),
                                    "int8_outliers6": ("int8", 32, 6.0, None)}.items():
        model = quantize.quantize_weights(copy.deepcopy(base), w, g, thr, lm_head_dtype=head)
        out[name] = perplexity(model, ids)
        if thr is not None:
            print(f"{name}: {quantize.outlier_columns(model)} input features kept in fp32")
    # W8A8 / W4A8 (what a VNNI kernel would compute): activations rounded to int8 at every projection's input, with
    # a scale per row or per 32 features
    for name, w, group in (("int8_a8_per_row", "int8", None), ("int8_a8_g32", "int8", 32), ("int4_a8_g32", "int4", 32)):
        model = quantize.quantize_weights(copy.deepcopy(base), w)
        for m in model.modules():
            if isinstance(m, QuantizedWeight):
                m.matmul = lambda x, m=m, g=group: QuantizedWeight.forward(m, fake_quantize(x, g))
        out[name] = perplexity(model, ids)
    print(f"perplexity over {len(ids)} held-out tokens: " + ", ".join(
        f"{k} {v:.3f} ({100 * (v / out['fp32'] - 1):+.2f}%)" for k, v in out.items()))
    return out


def fake_quantize(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x rounded to int8 levels, a scale (max |x| / 127) per row, or per `group` features of a row."""
    k = x.shape[-1]
    g = k if group is None else group
    xp = torch.nn.functional.pad(x, (0, -k % g)).view(*x.shape[:-1], -1, g)
    s = (xp.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return (torch.round(xp / s) * s).view(*x.shape[:-1], -1)[..., :k]


@torch.inference_mode()
def kv_schemes(base, tokenizer) -> dict[str, float]:
    """Attention output error of int8 KV scale schemes on the model's real K/V (a 256-token window of the held-out
    text, every layer): a scale per (token, head) — what the cache does —, per (16-token block, head) from the
    block's largest value (as if requantized whenever a larger value arrives), and per (block, head) fixed from the
    block's first token with 2x headroom (values beyond it clamp)."""
    from executor.model.attention import AttentionMetadata
    from executor.model.cache_engine import KVCache, dequantize_kv, quantize_kv
    from executor.model.quality import heldout_ids

    ids = heldout_ids(tokenizer)[:256]
    c = base.config
    cache = KVCache.for_model(c, 16, 16)
    meta = AttentionMetadata.build([256], [256], [list(range(16))], 16)
    base(torch.tensor(ids), meta.positions(), meta, cache)

    def block_scale(x, first_only):
        b = x.view(16, 16, c.num_kv_heads, c.head_dim)  # [blocks, tokens, heads, D]
        amax = (b[:, :1].abs().amax(-1, keepdim=True) * 2 if first_only else b.abs().amax((1, 3), keepdim=True))
        s = amax.amax(1, keepdim=True) / 127
        return (torch.round(b / s).clamp(-127, 127) * s).view_as(x)

    errs = {"token": [], "block_max": [], "block_first_2x": []}
    for layer in range(c.num_layers):
        k, v = (cache.data[layer, i].reshape(256, c.num_kv_heads, c.head_dim) for i in (0, 1))
        g = c.num_heads // c.num_kv_heads
        qs = torch.randn(256, c.num_heads, c.head_dim) * k.std()
        ref = _causal(qs, k, v, g)
        for name, (kq, vq) in {"token": (dequantize_kv(quantize_kv(k)), dequantize_kv(quantize_kv(v))),
                               "block_max": (block_scale(k, False), block_scale(v, False)),
                               "block_first_2x": (block_scale(k, True), block_scale(v, True))}.items():
            out = _causal(qs, kq, vq, g)
            errs[name].append(((out - ref).norm() / ref.norm()).item())
    res = {f"kv_err_{k}": statistics.mean(v) for k, v in errs.items()}
    print("int8 KV, attention output relative error (mean over layers): " +
          ", ".join(f"{k} {v:.2e}" for k, v in res.items()))
    return res


def _causal(q, k, v, g):
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q, kr) / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", action="store_true", help="also SmolLM2-135M's engine steps and perplexity")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every engine does: freed buffers stay mapped (fresh pages cost a fault each)
    print(f"{args.threads} threads, load average {os.getloadavg()[0]:.2f} at start")
    res = {}
    if not args.skip_kernels:
        k = kernels(args.reps)
        for m in (1, 16):
            for name in ("fp32_native", "int8_native", "int4_g128_native", "int4_g32_native", "int8_torch",
                         "int4_g32_torch"):
                if f"{name}@{m}" in k:
                    res[f"{name}_ms_rows{m}"] = k[f"{name}@{m}"]
        res["int8_kernel_speedup_rows1"] = k["fp32_native@1"] / k["int8_native@1"]
        res["int4_kernel_speedup_rows1"] = k["fp32_native@1"] / k["int4_g128_native@1"]
        res["int8_stream_GBps_rows1"] = k["fp32_bytes"] / 4 / k["int8_native@1"] / 1e6
    if args.model:
        from executor.core.prompts import corpus_ids
        from executor.model.weights import load_hf_model, smollm2_gguf_path

        base, _, tokenizer = load_hf_model(smollm2_gguf_path())
        base.eval()
        steps = engine_steps(base, corpus_ids(tokenizer), args.rounds)
        for what in ("decode_b1", "decode_b16", "prompt_512"):
            for name in ("int8", "int4", "int8_kv8"):
                res[f"{name}_{what}_speedup"] = steps[f"fp32_{what}"] / steps[f"{name}_{what}"]
        res.update({f"ppl_{k}": v for k, v in quality(base, tokenizer).items()})
        res.update(kv_schemes(base, tokenizer))
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    for k, v in res.items():
        print(f"{k}: {v:.4g}")


if __name__ == "__main__":
    main()

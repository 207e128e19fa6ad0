"""Our quantized CPU kernels beside llama.cpp's (issue 31: "llama.cpp's Q8_0 / Q4 kernels on the same CPU are the
speed to beat"), SmolLM2-135M, side by side in one run: our executor as fp32, int8 (per-channel scales) and int4
(Q4_1's layout: groups of 32, scale and min), llama.cpp (through llama-cpp-python) on GGUF files of the same model as
F32, Q8_0, Q4_0 and Q4_1.

The GGUF files are made from the one the project's model ships in (Q4_1) by llama.cpp's own quantizer (requantized:
their values are Q4_1's, which does not change a kernel's speed). Per configuration: decode tokens/s at batch 1 over
a 128-token context (median of 24 single-token steps, as bench/compression.py times ours) and prompt tokens/s (one
512-token prompt). Timings alternate round by round between all seven, each figure the median of its rounds. The
ratios are ours over llama.cpp's at the same bits: above 1, ours is faster.

llama-cpp-python has no wheel here: `pip install llama-cpp-python` builds llama.cpp from source (~10 min on 2
cores; cmake and a C++ compiler). Without it the bench says so and exits 2.

Usage: python bench/vs_llamacpp.py [--rounds 5] [--threads 2]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import llama_cpp
except ImportError:
    print("bench/vs_llamacpp.py: llama-cpp-python is not installed; `pip install llama-cpp-python` builds it from "
          "source (cmake and a C++ compiler)", file=sys.stderr)
    sys.exit(2)

import torch  # noqa: E402
from compression import CONTEXT, PROMPT, build, decode_step_s, prompt_step_s  # noqa: E402

from executor.core.prompts import corpus_ids, prompt_ids  # noqa: E402
from executor.model.weights import load_hf_model, smollm2_gguf_path  # noqa: E402

OURS = ("fp32", "int8", "int4")
# llama.cpp file type -> its quantizer's ftype; Q4_1 is the shipped file itself
THEIRS = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_1": None}
PAIRS = (("fp32", "F32"), ("int8", "Q8_0"), ("int4", "Q4_1"), ("int4", "Q4_0"))


@contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for the block: llama.cpp's C code writes its logs there, not to sys.stderr."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def gguf_files(folder: Path) -> dict[str, Path]:
    """The shipped Q4_1 file and llama.cpp's requantizations of it."""
    source = smollm2_gguf_path()
    files = {}
    for name, ftype in THEIRS.items():
        if ftype is None:
            files[name] = source
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
        out = folder / f"smollm2-{name}.gguf"
        with quiet_stderr():  # the quantizer logs every tensor to fd 2
            failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
        if failed:
            raise RuntimeError(f"llama.cpp could not quantize {source} to {name}")
        files[name] = out
    return files


def llama_decode_step_s(llm, tokens: list[int], steps: int) -> float:
    """Median time of `steps` single-token decodes after a CONTEXT-token prompt (a fresh KV cache)."""
    llm.reset()
    llm.eval(tokens[:CONTEXT])
    times = []
    for tok in tokens[CONTEXT:CONTEXT + steps]:
        t = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def llama_prompt_step_s(llm, tokens: list[int]) -> float:
    llm.reset()
    t = time.perf_counter()
    llm.eval(tokens[:PROMPT])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, _, tokenizer = load_hf_model(smollm2_gguf_path())
    base.eval()
    corpus = corpus_ids(tokenizer)
    tokens = prompt_ids(corpus, max(PROMPT, CONTEXT + args.steps), 7)
    ours = {n: build(base, n) for n in OURS}
    with tempfile.TemporaryDirectory() as tmp:
        files = gguf_files(Path(tmp))
        theirs = {n: llama_cpp.Llama(model_path=str(p), n_ctx=PROMPT + 64, n_batch=PROMPT, n_ubatch=PROMPT,
                                     n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
                  for n, p in files.items()}
        sizes = {n: p.stat().st_size / 1e6 for n, p in files.items()}
        print(f"SmolLM2-135M, {args.threads} threads, {args.rounds} rounds, llama-cpp-python "
              f"{llama_cpp.__version__}, load average {os.getloadavg()[0]:.2f} at start")
        timing = {n: {"b1": [], "prompt": []} for n in (*OURS, *THEIRS)}
        for _ in range(args.rounds):
            with torch.inference_mode():
                for n in OURS:
                    model, kv = ours[n]
                    timing[n]["b1"].append(decode_step_s(model, kv, 1, corpus, args.steps))
                    timing[n]["prompt"].append(prompt_step_s(model, kv, corpus))
            for n, llm in theirs.items():
                timing[n]["b1"].append(llama_decode_step_s(llm, tokens, args.steps))
                timing[n]["prompt"].append(llama_prompt_step_s(llm, tokens))
        print(f"load average {os.getloadavg()[0]:.2f} after the timings")
    rate = {n: {"b1": 1 / statistics.median(t["b1"]), "prompt": PROMPT / statistics.median(t["prompt"])}
            for n, t in timing.items()}
    print(f"\n{'engine':<10} {'weights':<6} {'decode b1 t/s':>14} {'prompt t/s':>11} {'file MB':>8}")
    for n in OURS:
        print(f"{'infersim':<10} {n:<6} {rate[n]['b1']:14.1f} {rate[n]['prompt']:11.0f} {'':>8}")
    for n in THEIRS:
        print(f"{'llama.cpp':<10} {n:<6} {rate[n]['b1']:14.1f} {rate[n]['prompt']:11.0f} {sizes[n]:8.0f}")
    print()
    for kind in ("prompt", "b1"):  # the batch-1 decode ratios, the figures, come last
        for mine, other in PAIRS:
            label = "decode_b1" if kind == "b1" else "prompt"
            print(f"{mine}_vs_llamacpp_{other.lower()}_{label}: {rate[mine][kind] / rate[other][kind]:.2f}")


if __name__ == "__main__":
    main()

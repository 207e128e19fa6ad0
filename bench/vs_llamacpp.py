"""Our quantized CPU kernels beside llama.cpp's (issue 31: "llama.cpp's Q8_0 / Q4 kernels on the same CPU are the
speed to beat"), SmolLM2-135M, side by side in one run: our executor as fp32, int8 (per-channel scales) and int4
(Q4_1's layout: groups of 32, scale and min), llama.cpp (through llama-cpp-python) on GGUF files of the same model as
F32, Q8_0, Q4_0 and Q4_1.

The GGUF files are made from the one the project's model ships in (Q4_1) by llama.cpp's own quantizer (requantized:
their values are Q4_1's, which does not change a kernel's speed). Per configuration: decode tokens/s at batch 1 over
a 128-token context (median of 24 single-token steps, as bench/compression.py times ours) and prompt tokens/s (one
512-token prompt). Timings alternate round by round between all seven, each figure the median of its rounds. The
ratios are ours over llama.cpp's at the same bits: above 1, ours is faster.

Builds side by side, each in a worker process of its own (bench/builds.py), alternating within every round: ours
per native-kernel build (the CPU's best and, on a CPU with AVX-512, the AVX2 one beside it: what an AMD Zen 2/3
runs; `--isa` names them instead), llama.cpp per Python interpreter that has a llama-cpp-python build
(`--llamacpp-python PYTHON ...`; default: this one), each named by the widest instruction set its build reports
(llama_print_system_info: avx512 or avx2). The ratios pair each of our builds with llama.cpp's of the same
instruction set; our first build's headline lines keep their names, another's end in `_<build>`
(`int8_vs_llamacpp_q8_0_decode_b1_avx2`). `--cpu-time` (with `--threads 1`) times CPU time instead of the wall
clock, for a machine others keep busy.

llama-cpp-python has no wheel here: `pip install llama-cpp-python` builds llama.cpp from source (~10-20 min on 2
cores; cmake and a C++ compiler), for this CPU (GGML_NATIVE=ON) unless told otherwise: an AVX2 build in a venv of
its own takes `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"` (DEVELOPERS.md). Without
one the bench says so and exits 2.

Usage: python bench/vs_llamacpp.py [--rounds 5] [--threads 2] [--isa auto avx2] [--llamacpp-python PYTHON ...]
       [--cpu-time]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import builds  # noqa: E402
import compression  # noqa: E402
import torch  # noqa: E402
from compression import CONTEXT, PROMPT, build, decode_step_s, prompt_step_s  # noqa: E402

from executor.core.prompts import corpus_ids, prompt_ids  # noqa: E402
from executor.model.weights import load_hf_model, smollm2_gguf_path  # noqa: E402
from sim.config.environment import ISAS  # noqa: E402

OURS = ("fp32", "int8", "int4")
# llama.cpp file type -> its quantizer's ftype name; Q4_1 is the shipped file itself
THEIRS = {"F32": "LLAMA_FTYPE_ALL_F32", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "Q4_1": None}
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


def gguf_files(llama_cpp, folder: Path) -> dict[str, Path]:
    """The shipped Q4_1 file and llama.cpp's requantizations of it."""
    source = smollm2_gguf_path()
    files = {}
    for name, ftype in THEIRS.items():
        if ftype is None:
            files[name] = source
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, ftype), True, 2
        out = folder / f"smollm2-{name}.gguf"
        with quiet_stderr():  # the quantizer logs every tensor to fd 2
            failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
        if failed:
            raise RuntimeError(f"llama.cpp could not quantize {source} to {name}")
        files[name] = out
    return files


def llama_decode_step_s(llm, tokens: list[int], steps: int, clock) -> float:
    """Median time of `steps` single-token decodes after a CONTEXT-token prompt (a fresh KV cache)."""
    llm.reset()
    llm.eval(tokens[:CONTEXT])
    times = []
    for tok in tokens[CONTEXT:CONTEXT + steps]:
        t = clock()
        llm.eval([tok])
        times.append(clock() - t)
    return statistics.median(times)


def llama_prompt_step_s(llm, tokens: list[int], clock) -> float:
    llm.reset()
    t = clock()
    llm.eval(tokens[:PROMPT])
    return clock() - t


class Ours:
    """A bench worker's SmolLM2-135M as fp32, int8 and int4, under this process's native kernels."""

    def __init__(self, steps: int, cpu_time: bool):
        if cpu_time:
            compression.CLOCK[0] = time.process_time
        base, _, tokenizer = load_hf_model(smollm2_gguf_path())
        base.eval()
        self.corpus, self.steps = corpus_ids(tokenizer), steps
        self.models = {n: build(base, n) for n in OURS}

    def tokens(self, n: int) -> list[int]:
        """The token ids llama.cpp is timed on: our decodes' and prompt's."""
        return prompt_ids(self.corpus, n, 7)

    def timing(self, name: str) -> dict[str, float]:
        model, kv = self.models[name]
        with torch.inference_mode():
            return {"b1": decode_step_s(model, kv, 1, self.corpus, self.steps),
                    "prompt": prompt_step_s(model, kv, self.corpus)}


class Theirs:
    """A bench worker's llama.cpp (this interpreter's llama-cpp-python) on the GGUF files, each a Llama."""

    def __init__(self, tokens: list[int], steps: int, threads: int, cpu_time: bool):
        import llama_cpp

        self.llama_cpp, self.tokens, self.steps = llama_cpp, tokens, steps
        self.clock = time.process_time if cpu_time else time.perf_counter
        self.folder = tempfile.TemporaryDirectory()
        files = gguf_files(llama_cpp, Path(self.folder.name))
        self.sizes = {n: p.stat().st_size / 1e6 for n, p in files.items()}
        self.llms = {n: llama_cpp.Llama(model_path=str(p), n_ctx=PROMPT + 64, n_batch=PROMPT, n_ubatch=PROMPT,
                                        n_threads=threads, n_threads_batch=threads, verbose=False)
                     for n, p in files.items()}

    def build(self) -> dict:
        """The build's widest instruction set (avx512, avx2 or generic), version and file sizes."""
        info = self.llama_cpp.llama_print_system_info().decode()
        widest = "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "generic"
        return {"isa": widest, "version": self.llama_cpp.__version__, "sizes": self.sizes}

    def timing(self, name: str) -> dict[str, float]:
        llm = self.llms[name]
        return {"b1": llama_decode_step_s(llm, self.tokens, self.steps, self.clock),
                "prompt": llama_prompt_step_s(llm, self.tokens, self.clock)}


def llama_workers(pythons: list[str], tokens: list[int], steps: int, threads: int, cpu_time: bool) -> dict:
    """{build name: (worker, its build info)} per interpreter; a name met twice gets the interpreter's position."""
    out = {}
    for i, python in enumerate(pythons):
        worker = builds.Worker(Theirs, (tokens, steps, threads, cpu_time), python=python, threads=threads)
        info = worker.call("build")
        out[info["isa"] if info["isa"] not in out else f"{info['isa']}{i}"] = (worker, info)
    return out


def measure(ours: dict, theirs: dict, rounds: int) -> dict[tuple[str, str], dict[str, float]]:
    """{(build, weights): {"b1": decode tokens/s, "prompt": prompt tokens/s}}, rounds alternating every engine."""
    engines = [(b, n, w) for n in OURS for b, w in ours.items()] + \
        [(b, n, w) for n in THEIRS for b, (w, _) in theirs.items()]
    timing = {(b, n): {"b1": [], "prompt": []} for b, n, _ in engines}
    for _ in range(rounds):
        for b, n, worker in engines:
            for key, seconds in worker.call("timing", n).items():
                timing[b, n][key].append(seconds)
    print(f"load average {os.getloadavg()[0]:.2f} after the timings")
    return {key: {"b1": 1 / statistics.median(t["b1"]), "prompt": PROMPT / statistics.median(t["prompt"])}
            for key, t in timing.items()}


def report(rate: dict, ours: list[str], theirs: dict) -> None:
    """The table and, per build of ours that llama.cpp has a build of the same name, the ratios (our first build's
    under the plain names)."""
    print(f"\n{'engine':<10} {'build':<7} {'weights':<6} {'decode b1 t/s':>14} {'prompt t/s':>11} {'file MB':>8}")
    for n in OURS:
        for b in ours:
            print(f"{'infersim':<10} {b:<7} {n:<6} {rate[b, n]['b1']:14.1f} {rate[b, n]['prompt']:11.0f} {'':>8}")
    for n in THEIRS:
        for b, (_, info) in theirs.items():
            print(f"{'llama.cpp':<10} {b:<7} {n:<6} {rate[b, n]['b1']:14.1f} {rate[b, n]['prompt']:11.0f} "
                  f"{info['sizes'][n]:8.0f}")
    pairs = [b for b in ours if b in theirs]
    for b in ours:
        if b not in theirs:
            print(f"(no llama.cpp build for {b}: --llamacpp-python with an interpreter that has one)")
    print()
    for kind in ("prompt", "b1"):  # the batch-1 decode ratios, the figures, come last
        for b in pairs:
            suffix = "" if b == ours[0] else f"_{b}"
            for mine, other in PAIRS:
                label = "decode_b1" if kind == "b1" else "prompt"
                ratio = rate[b, mine][kind] / rate[b, other][kind]
                print(f"{mine}_vs_llamacpp_{other.lower()}_{label}{suffix}: {ratio:.2f}")


def missing_llamacpp(pythons: list[str] | None) -> str | None:
    """Why the interpreters named (or, with none, this one) cannot run llama.cpp's side: one line, or None."""
    if not pythons:
        return None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed"
    for python in pythons:
        try:
            found = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        except OSError as e:
            return f"--llamacpp-python {python}: {e.strerror}"
        if not found:
            return f"--llamacpp-python {python}: that interpreter has no llama-cpp-python"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--isa", nargs="+", choices=ISAS, help="our builds to measure (default: the CPU's best, and "
                    "avx2 beside it on an AVX-512 CPU)")
    ap.add_argument("--llamacpp-python", nargs="+", metavar="PYTHON",
                    help="interpreters with a llama-cpp-python build each (default: this one)")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU time, not the wall clock (with --threads 1)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time measures one thread: add --threads 1")
    missing = missing_llamacpp(args.llamacpp_python)
    if missing:
        print(f"bench/vs_llamacpp.py: {missing}; `pip install llama-cpp-python` builds it from source (cmake and a "
              "C++ compiler; DEVELOPERS.md), or name interpreters that have it with --llamacpp-python", file=sys.stderr)
        sys.exit(2)
    ours = builds.isa_workers(Ours, (args.steps, args.cpu_time), args.isa, args.threads)
    theirs = {}
    try:
        tokens = next(iter(ours.values())).call("tokens", max(PROMPT, CONTEXT + args.steps))
        theirs = llama_workers(args.llamacpp_python or [sys.executable], tokens, args.steps, args.threads,
                               args.cpu_time)
        versions = ", ".join(f"{b} {info['version']}" for b, (_, info) in theirs.items())
        print(f"SmolLM2-135M, {args.threads} threads, {args.rounds} rounds{', CPU time' if args.cpu_time else ''}; "
              f"ours: {', '.join(ours)}; llama-cpp-python: {versions}; load average {os.getloadavg()[0]:.2f} at start")
        report(measure(ours, theirs, args.rounds), list(ours), theirs)
    finally:
        for w in [*ours.values(), *(w for w, _ in theirs.values())]:
            w.close()


if __name__ == "__main__":
    main()

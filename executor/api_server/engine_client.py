"""The API server's end of the engine process (executor.serving.online): starting it (forked: it loads and warms
up the model), sending it requests and aborts, and handing each request's outputs to its handler's queue, all on the
server's event loop. An engine process that dies ends every request in flight with ENGINE_DIED and calls `on_death`:
the server answers 503 from then on and stops with a non-zero exit."""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from executor.serving.channel import (
    ABORT,
    ADD,
    ENGINE_DIED,
    HEADER,
    REJECTED,
    RUNNING,
    SHUTDOWN,
    frame,
    fresh_address,
    unframe,
)
from sim.config.errors import ConfigError
from sim.config.plan import Plan

READY_TIMEOUT_S = 1800.0  # a first GGUF conversion takes ~1 min on 2 cores; a GPU's first load more


def _engine_process(*args) -> None:
    """The engine process's entry: torch is imported there (and in the fork server), never in the API server."""
    from executor.serving.online import engine_main

    engine_main(*args)


def _context():
    """Engine processes fork from a server process that has imported the engine once (multiprocessing's
    forkserver): a fresh interpreter each time, as spawn gives, without paying torch's import per engine (tests
    and benches start many). The fork server never runs a step, so no OpenMP or CUDA state is forked."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["executor.serving.online", "transformers.models.auto.modeling_auto",
                                "transformers.models.llama.modeling_llama", "transformers.tokenization_utils_fast"])
    return ctx


class EngineDied(RuntimeError):
    """The engine process ended without being told to (or could not start)."""


@dataclass
class Update:
    """A request's news after an engine turn: new token ids at engine time `at`; `state` RUNNING, FINISHED (then
    `reason` is the finish reason) or REJECTED (why)."""

    tokens: list[int]
    at: float
    state: int
    reason: str | None

    @property
    def ended(self) -> bool:
        return self.state != RUNNING


@dataclass(eq=False)
class Pending:
    """A request the engine runs, as its API server follows it: its queue of Updates and its tokens' times."""

    rid: int
    prompt_len: int
    arrival_s: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)
    state: int = RUNNING
    reason: str | None = None


class EngineClient:
    """Starts the engine process for `plan` and waits until it is ready (raises ConfigError for a scenario the
    engine cannot serve, EngineDied if it fails to start). `info`: what the engine said ready with (its clock's
    t0, the tokenizer, vocab size, EOS, pid). `start()` on the event loop connects; `on_update(pending, update)`
    sees every update first (metrics), `on_gauges(list)` every turn's gauges."""

    def __init__(self, plan: Plan, device: str, threads: int | None, keep_trace: bool = False,
                 keep_warm_s: float = 0.0):
        ctx = _context()
        self.address, self.keep_trace = fresh_address(), keep_trace
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_process, name="infersim-engine", daemon=True,
                                args=(plan, device, threads, self.address, child, keep_trace, keep_warm_s,
                                      os.getpid()))
        self.proc.start()
        child.close()
        self.info = self._ready()
        self.t0 = self.info["t0"]
        self.ids = itertools.count()
        self.pending: dict[int, Pending] = {}
        self.error: str | None = None
        self.stopping = False
        self.trace = None
        self.on_update: Callable[[Pending, Update], None] = lambda p, u: None
        self.on_gauges: Callable[[list], None] = lambda g: None
        self.on_death: Callable[[], None] = lambda: None

    def _ready(self) -> dict:
        msg = self._recv(READY_TIMEOUT_S)
        if msg[0] == "error":
            self.proc.join(10)
            raise ConfigError(msg[1], msg[2])
        return msg[1]

    def _recv(self, timeout_s: float):
        """The engine's next message on the pipe; EngineDied if it exits (or says nothing for `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                code = self.proc.exitcode
                self.proc.kill()
                raise EngineDied(f"the engine process did not start (exit code {code}); its error is above")
        try:
            return self.conn.recv()
        except EOFError:
            raise EngineDied(f"the engine process ended while starting (exit code {self.proc.exitcode})") from None

    def now(self) -> float:
        """The engine's clock (token times are on it): CLOCK_MONOTONIC is one clock for every process."""
        return time.perf_counter() - self.t0

    async def start(self) -> None:
        """On the server's event loop: connect, read outputs, watch the engine process."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.proc.sentinel, self._died)
        try:
            self.stream_in, self.stream_out = await asyncio.open_unix_connection(self.address)
        except OSError:  # the engine died since it said ready: its sentinel tells
            self.stream_in = self.stream_out = None
        self.reader = loop.create_task(self._read())

    def _send(self, message) -> None:
        """One frame to the engine; the transport buffers what the socket cannot take yet (never waits)."""
        if self.stream_out is not None and not self.stream_out.is_closing():
            self.stream_out.write(frame(message))

    def submit(self, prompt_ids: list[int], max_tokens: int, arrival_s: float, temperature: float, top_p: float,
               seed: int | None, ignore_eos: bool, min_tokens: int) -> Pending:
        """Send a request to the engine; its Updates come to the returned Pending's queue."""
        rid = next(self.ids)
        p = self.pending[rid] = Pending(rid, len(prompt_ids), arrival_s)
        if self.error is not None:
            self._end(p, ENGINE_DIED)
            return p
        self._send([ADD, rid, prompt_ids, max_tokens, arrival_s, temperature, top_p, seed, ignore_eos, min_tokens])
        return p

    def abort(self, p: Pending, reason: str | None) -> None:
        """End a request at the engine's next turn, its KV freed: rejected with `reason`, or finished (`reason`
        None: a stop string matched)."""
        if p.state == RUNNING and self.error is None:
            self._send([ABORT, p.rid, reason])

    async def _read(self) -> None:
        while self.stream_in is not None:
            try:
                (n,) = HEADER.unpack(await self.stream_in.readexactly(HEADER.size))
                gauges, items = unframe(await self.stream_in.readexactly(n))
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the engine hung up: its process's end says why
            self.on_gauges(gauges)
            for rid, tokens, at, state, reason in items:
                p = self.pending.get(rid)
                if p is not None:
                    self._deliver(p, Update(tokens, at, state, reason))

    def _deliver(self, p: Pending, u: Update) -> None:
        p.token_times += [u.at] * len(u.tokens)
        p.state, p.reason = u.state, u.reason
        if u.ended:
            del self.pending[p.rid]
        self.on_update(p, u)
        p.queue.put_nowait(u)

    def _end(self, p: Pending, reason: str) -> None:
        self._deliver(p, Update([], self.now(), REJECTED, reason))

    def _died(self) -> None:
        """The engine process ended: unexpected unless stopping; every request in flight ends with ENGINE_DIED."""
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if self.stopping:
            return
        self.proc.join(1)
        self.error = f"{ENGINE_DIED} (exit code {self.proc.exitcode})"
        for p in list(self.pending.values()):
            self._end(p, ENGINE_DIED)
        self.on_death()

    async def stop(self) -> None:
        """Tell the engine to stop (requests still in it are rejected: server stopped), wait for it to end (and
        for its trace, if it keeps one), close the channel."""
        self.stopping = True
        if self.error is None:
            self._send([SHUTDOWN])
            await asyncio.to_thread(self._collect)
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        if self.stream_out is not None:
            self.stream_out.close()
        shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)

    def _collect(self) -> None:
        """On a thread: the engine's trace (if kept), then its exit."""
        if self.keep_trace:
            try:
                msg = self._recv(600.0)
                self.trace = msg[1] if msg[0] == "trace" else None
            except EngineDied:
                self.trace = None
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()

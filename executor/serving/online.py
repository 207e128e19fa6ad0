"""An engine serving requests as they come (`infersim serve --http`): one thread runs the engine loop, and requests
enter and leave it between steps. Callers on other threads (the HTTP handlers) submit requests, abort them, and hear
of each request's new tokens after every step through one callback, so many clients share one continuous batch
through the scenario's scheduler."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.core.cpu_load import CpuLoad
from executor.core.engine import Engine
from executor.model.sampling import RequestSampling
from sim.policy.request import Request, Status

IDLE_WAIT_S = 0.5  # the longest an idle loop sleeps before it looks for expired requests again
LOAD_EVERY_S = 0.5  # how often the loop reads the machine's load (executor.serving.serve's replay alike)
WARM_ELEMENTS = 1 << 16  # keep-warm op: above torch's parallel grain, small enough to stay in L2 (executor.serving.serve)


@dataclass(eq=False)
class Stream:
    """A request in the engine, with its own sampling, and how many of its output tokens its client has been told
    of (`sent`); its status and reasons are on `request`."""

    request: Request
    prompt_ids: list[int]
    sampling: RequestSampling | None
    sent: int = 0


class OnlineEngine:
    """The engine loop on its own thread. `dispatch(updates)` is called once after each step with every stream's
    news [(stream, new tokens, time, ended)], on the loop's thread (an asyncio server hands it to its event loop).
    `keep_warm_s`: after the last work, idle time busy-polls this long so the next request's first step starts at
    the speed of back-to-back steps (torch's threads stay awake), while other processes leave the cores free; then
    the loop sleeps until a request comes. `adapt_threads`: torch's threads follow the cores other processes leave
    free, as an unpinned replay's do (executor.core.cpu_load)."""

    def __init__(self, engine: Engine, dispatch: Callable[[list[tuple[Stream, list[int], float, bool]]], None],
                 keep_warm_s: float = 0.0, on_end: Callable[[Stream], None] | None = None, keep_trace: bool = False,
                 adapt_threads: bool = False):
        self.engine, self.dispatch, self.keep_warm_s, self.on_end = engine, dispatch, keep_warm_s, on_end
        self.load, self.adapt_threads, self.next_sample = CpuLoad(), adapt_threads, 0.0
        self.keep_trace = keep_trace  # every step's record and sample kept (a report at the end); else dropped
        self.lock = threading.Condition()
        self.inbox: list[Stream] = []
        self.aborts: list[tuple[Stream, str | None]] = []
        self.live: set[Stream] = set()
        self.finished: list[Request] = []  # with keep_trace: every request that ended, in the order it did
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="infersim-engine", daemon=True)

    def now(self) -> float:
        """The engine's clock (token times are on it)."""
        return self.engine.now()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the loop after the step in flight; requests still in it are rejected ("server stopped")."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join()

    def submit(self, stream: Stream) -> None:
        """Queue a request for the next look between steps (any thread)."""
        with self.lock:
            if self.stopping:
                raise RuntimeError("the server is stopping")
            self.inbox.append(stream)
            self.lock.notify()

    def abort(self, stream: Stream, reason: str | None) -> None:
        """End a request at the next look between steps, its KV freed (any thread): rejected with `reason` (its
        client went away), or finished (`reason` None: its client matched a stop string)."""
        with self.lock:
            self.aborts.append((stream, reason))
            self.lock.notify()

    @property
    def num_live(self) -> int:
        return len(self.live)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the server answers 500s from here on, and says why once
            self.error = e
            raise
        finally:
            self._close_all("server stopped")

    def _loop(self) -> None:
        engine = self.engine
        idle_since = None
        while True:
            self._sample_load()
            with self.lock:
                if not self.inbox and not self.aborts and not engine.has_work():
                    if self.stopping:
                        return
                    if idle_since is None:
                        idle_since = time.perf_counter()
                    if time.perf_counter() - idle_since >= self.keep_warm_s:
                        self.lock.wait(IDLE_WAIT_S)
                if self.stopping:
                    return
                inbox, self.inbox = self.inbox, []
                aborts, self.aborts = self.aborts, []
            updates = []
            for s in inbox:
                self.live.add(s)
                if not engine.add(s.request, s.prompt_ids, s.sampling):
                    updates.append(self._news(s))
            for s, reason in aborts:
                if not s.request.is_done:
                    engine.abort(s.request, reason)
                if s in self.live:
                    updates.append(self._news(s))
            if engine.has_work():
                idle_since = None
                engine.step()
                if not self.keep_trace:  # a server runs for days: its steps are counted, not kept
                    engine.records.clear()
                    engine.samples.clear()
                updates += [self._news(s) for s in list(self.live) if s.request.is_done or self._has_new(s)]
            elif not updates and idle_since is not None and time.perf_counter() - idle_since < self.keep_warm_s \
                    and not self.load.others_busy():
                _keep_warm()
            if updates:
                self.dispatch(updates)

    def _sample_load(self) -> None:
        now = time.perf_counter()
        if now < self.next_sample:
            return
        self.next_sample = now + LOAD_EVERY_S
        others = self.load.sample()
        if self.adapt_threads and others is not None and self.load.threads_for(others) != torch.get_num_threads():
            torch.set_num_threads(self.load.threads_for(others))

    def _has_new(self, s: Stream) -> bool:
        return len(self.engine.tokens.get(s.request, ())) - s.request.prompt_len > s.sent

    def _news(self, s: Stream) -> tuple[Stream, list[int], float, bool]:
        """The tokens a stream has not been told of, their time, and whether it ended (then it leaves the loop)."""
        r = s.request
        tokens = self.engine.tokens.get(r, s.prompt_ids)[r.prompt_len + s.sent:]
        s.sent += len(tokens)
        ended = r.is_done
        if ended:
            self.live.discard(s)
            self.engine.tokens.pop(r, None)
            if self.keep_trace:
                self.finished.append(r)
            if self.on_end is not None:
                self.on_end(s)
        return s, tokens, r.token_times[-1] if tokens and r.token_times else self.now(), ended

    def _close_all(self, reason: str) -> None:
        """Requests still queued or running when the loop ends: rejected with `reason`, their clients told."""
        with self.lock:
            pending, self.inbox = self.inbox + list(self.live), []
            self.stopping = True
        updates = []
        for s in pending:
            if not s.request.is_done:
                s.request.status, s.request.reject_reason = Status.REJECTED, reason
            self.live.add(s)
            updates.append(self._news(s))
        if updates:
            self.dispatch(updates)


def _keep_warm() -> None:
    """About a millisecond of a small multi-threaded op: torch's threads stay awake through a short idle gap."""
    a = torch.ones(WARM_ELEMENTS)
    for _ in range(20):
        torch.mul(a, 1.0, out=a)

"""The engine core: the one loop every way of running the executor drives (nano-vllm's `step`, vLLM v1's EngineCore).

One turn: the port puts what is due into the engine (new requests, aborts), the engine steps (schedule, run the model
runner, post-process: `Engine.step`), the port publishes what the step produced; with nothing to run, the loop idles
until the port's next request (busy-polling torch's threads warm first, while no other process wants the cores).
Modes differ only in their `Port`: where requests come from and where outputs go — the timed replay's arrival book
(executor.serving.serve), an API server's socket (executor.serving.online), a disaggregated driver or decode instance
(executor.serving.disaggregated), or a list of prompts all due at once (`run_offline`: profile sweeps, distillation,
warm-ups, the benches).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from executor.core.cpu_load import CpuLoad

LOAD_EVERY_S = 0.5  # how often the loop reads the machine's load (and the longest an idle wait lasts)
WARM_ELEMENTS = 1 << 16  # keep-warm op: above torch's parallel grain (32768), small enough to stay in L2


class Port:
    """Where a mode's requests come from and its outputs go. The defaults: nothing comes, nothing is published, an
    idle wait sleeps."""

    def take(self, engine, now: float) -> bool:
        """Put into the engine (Engine.add, Engine.abort) what is due by engine time `now`; False: stop at once."""
        return True

    def publish(self, engine, stepped: bool) -> None:
        """After a turn (`stepped`: the engine ran a step): hand on what changed."""

    def more(self) -> bool:
        """Whether requests may still come: the loop ends once this is False and the engine has no work."""
        return False

    def next_s(self) -> float:
        """Engine time at which the next request is known to be due (inf: not known)."""
        return math.inf

    def ready(self) -> bool:
        """Whether something is waiting to be taken now (ends a keep-warm spin early)."""
        return False

    def wait(self, timeout_s: float, busy: bool) -> None:
        """Idle: block up to `timeout_s` for something to take. `busy`: the engine has work it could not schedule
        (a step may run once time passes or blocks come back)."""
        if not busy:
            time.sleep(max(0.0, timeout_s))

    def tick(self, now: float) -> None:
        """Every LOAD_EVERY_S of engine time (progress reports, liveness checks)."""


@dataclass
class EngineCore:
    """The loop over an engine (executor.core.engine.Engine, or one over a process group) and a port. `load`: the
    machine's load, sampled every LOAD_EVERY_S; with `adapt_threads`, torch's threads follow the cores other
    processes leave free. `keep_warm_s`: for this long after the last step (inf: every idle gap) idle time
    busy-polls a small multi-threaded op, so the next step starts at the speed of back-to-back steps, while `load`
    sees the other processes leave the cores free."""

    engine: object
    port: Port
    load: CpuLoad | None = None
    adapt_threads: bool = False
    keep_warm_s: float = 0.0

    def run(self) -> None:
        """Turns until the port says stop, or has no more to send and the engine no work."""
        engine, port = self.engine, self.port
        next_sample = engine.now() + LOAD_EVERY_S
        last_step = engine.now()
        while True:
            now = engine.now()
            if not port.take(engine, now):
                return
            if now >= next_sample:
                next_sample = now + LOAD_EVERY_S
                self._sample_load()
                port.tick(now)
            stepped = engine.has_work() and engine.step() is not None
            port.publish(engine, stepped)
            if stepped:
                last_step = engine.now()
                continue
            busy = engine.has_work()
            if not busy and not port.more():
                return
            self._idle(now, last_step, busy)

    def _sample_load(self) -> None:
        others = self.load.sample() if self.load is not None else None
        if self.adapt_threads and others is not None and self.load.threads_for(others) != torch.get_num_threads():
            torch.set_num_threads(self.load.threads_for(others))

    def _idle(self, now: float, last_step: float, busy: bool) -> None:
        """Until the port's next request, LOAD_EVERY_S at most: busy-polling while the keep-warm spell lasts and the
        machine is otherwise quiet, else waiting on the port."""
        until = min(self.port.next_s(), now + LOAD_EVERY_S)
        warm_until = min(until, last_step + self.keep_warm_s)
        if not busy and warm_until > now and self.load is not None and not self.load.others_busy():
            keep_warm(self.engine, warm_until, self.port.ready)
        else:
            self.port.wait(until - self.engine.now(), busy)


def keep_warm(engine, until: float, ready=lambda: False) -> None:
    """Run a small multi-threaded op until engine time `until` or until `ready()`: torch's threads stay awake and on
    their cores through an idle gap."""
    a = torch.ones(WARM_ELEMENTS)
    while engine.now() < until and not ready():
        torch.mul(a, 1.0, out=a)


class Offline(Port):
    """Every request due at once: (request, prompt ids) pairs, taken on the first turn."""

    def __init__(self, requests):
        self.requests = list(requests)

    def take(self, engine, now: float) -> bool:
        for r, ids in self.requests:
            engine.add(r, ids)
        self.requests = []
        return True


def run_until_done(engine, requests) -> None:
    """Queue (request, prompt ids) pairs at once and run the engine core until every one has ended."""
    EngineCore(engine, Offline(requests)).run()

"""The engine core's loop (executor/core/engine_core.py) over a stand-in engine: a turn takes, steps, publishes; an
idle loop waits on its port until the next request (LOAD_EVERY_S at most); it ends when the port has no more and the
engine no work, or at once when the port says stop; work it cannot schedule is retried without sleeping."""
from __future__ import annotations

import math

import pytest

from executor.core.engine_core import LOAD_EVERY_S, EngineCore, Port


class Clock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


class StandInEngine(Clock):
    """`work` steps to run, each 10 ms; `stuck` turns in which work waits that cannot be scheduled."""

    def __init__(self, work: int = 0, stuck: int = 0):
        super().__init__()
        self.work, self.stuck, self.log = work, stuck, []

    def has_work(self) -> bool:
        return self.work > 0 or self.stuck > 0

    def step(self):
        if self.stuck:
            self.stuck -= 1
            self.log.append("nothing scheduled")
            return None
        self.work -= 1
        self.t += 0.01
        self.log.append("step")
        return object()


class Script(Port):
    """Requests due at `arrivals` (engine times), each one step of work."""

    def __init__(self, engine: StandInEngine, arrivals: list[float], stop_at: int | None = None):
        self.engine, self.arrivals, self.stop_at, self.turns = engine, list(arrivals), stop_at, 0

    def take(self, engine, now: float) -> bool:
        self.turns += 1
        if self.stop_at is not None and self.turns > self.stop_at:
            return False
        while self.arrivals and self.arrivals[0] <= now:
            self.arrivals.pop(0)
            engine.work += 1
            engine.log.append(f"take {now:.2f}")
        return True

    def publish(self, engine, stepped: bool) -> None:
        if stepped:
            engine.log.append("publish")

    def more(self) -> bool:
        return bool(self.arrivals)

    def next_s(self) -> float:
        return self.arrivals[0] if self.arrivals else math.inf

    def wait(self, timeout_s: float, busy: bool) -> None:
        self.engine.log.append(("wait", round(timeout_s, 3), busy))
        if not busy:
            self.engine.t += timeout_s


def test_a_turn_takes_steps_and_publishes_and_idles_until_the_next_request():
    engine = StandInEngine()
    EngineCore(engine, Script(engine, [0.0, 0.3, 2.0])).run()
    assert engine.log[:4] == ["take 0.00", "step", "publish", ("wait", 0.29, False)]
    assert engine.log[4:7] == ["take 0.30", "step", "publish"]
    # the next request 1.69 s away: the wait is cut at LOAD_EVERY_S, then continued
    waits = [e for e in engine.log[7:] if isinstance(e, tuple)]
    assert waits[0] == ("wait", LOAD_EVERY_S, False) and len(waits) == 4
    assert engine.log[-3:] == ["take 2.00", "step", "publish"] and engine.work == 0


def test_the_loop_ends_once_nothing_more_comes_and_the_engine_is_idle():
    engine = StandInEngine(work=3)
    EngineCore(engine, Script(engine, [])).run()
    assert engine.log == ["step", "publish"] * 3


def test_a_port_that_says_stop_ends_the_loop_with_work_left():
    engine = StandInEngine(work=10)
    EngineCore(engine, Script(engine, [], stop_at=4)).run()
    assert engine.log == ["step", "publish"] * 4 and engine.work == 6


def test_work_that_cannot_be_scheduled_yet_is_retried_without_sleeping():
    engine = StandInEngine(work=1, stuck=2)
    EngineCore(engine, Script(engine, [])).run()
    assert engine.log == ["nothing scheduled", ("wait", LOAD_EVERY_S, True), "nothing scheduled",
                          ("wait", LOAD_EVERY_S, True), "step", "publish"]


@pytest.mark.parametrize("busy_machine", [False, True])
def test_idle_gaps_keep_warm_only_within_the_spell_and_on_a_quiet_machine(monkeypatch, busy_machine):
    from executor.core import engine_core

    class Load:
        def sample(self):
            return None

        def others_busy(self):
            return busy_machine

    spun = []
    monkeypatch.setattr(engine_core, "keep_warm", lambda e, until, ready: (spun.append(until),
                                                                           setattr(e, "t", until)))
    engine = StandInEngine()
    EngineCore(engine, Script(engine, [0.0, 0.2, 1.5]), Load(), keep_warm_s=0.3).run()
    waits = [e for e in engine.log if isinstance(e, tuple)]
    if busy_machine:
        assert spun == [] and waits[0] == ("wait", 0.19, False)
    else:  # up to the next arrival at 0.2; then from 0.21 to the spell's end (0.51), then a plain wait
        assert spun == pytest.approx([0.2, 0.51]) and waits[0] == ("wait", 0.5, False)

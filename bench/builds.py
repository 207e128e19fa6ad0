"""Builds of the native kernels (and of other engines) side by side in one bench run: each in a worker process of its
own, started under its INFERSIM_ISA (or another Python interpreter, for an engine installed elsewhere), which sets
up its models once and then runs what the parent asks, one call at a time. The parent alternates the workers round by
round, so every build's figures are taken on the same minutes of the machine (bench/compression.py,
bench/vs_llamacpp.py).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from contextlib import contextmanager

from executor.model import native
from sim.config import environment


def isas(requested: list[str] | None) -> list[str]:
    """The INFERSIM_ISA values to measure: `requested`, or by default the CPU's best build ("auto") and, on a CPU
    with AVX-512, the AVX2 build beside it."""
    if requested:
        return list(dict.fromkeys(requested))
    best = native.best_isa(native.cpu_flags())
    return ["auto", "avx2"] if best == "avx512" else ["auto"]


def label(isa: str) -> str:
    """The build's name in tables and headline lines: the instruction set "auto" resolves to on this CPU."""
    return native.isa_build(isa, native.cpu_flags())[0]


@contextmanager
def _environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _serve(conn, factory, args, threads: int, paths: list[str]) -> None:
    """A worker's loop: make the object once, then answer each (method, args) with the method's result until None
    arrives; an exception goes back as its traceback's text. `paths`: its interpreter's own import paths (spawn
    hands a child the parent's sys.path, without another venv's site-packages)."""
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch

    torch.set_num_threads(threads)
    try:
        obj = factory(*args)
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))
        return
    while (msg := conn.recv()) is not None:
        name, call_args = msg
        try:
            conn.send(("ok", getattr(obj, name)(*call_args)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Worker:
    """`factory(*args)` made in a process of its own under INFERSIM_ISA=`isa` (None: as the parent has it), run by
    `python` (None: this interpreter); `call` runs a method of it there and returns its result."""

    def __init__(self, factory, args: tuple, isa: str | None = None, python: str | None = None, threads: int = 2):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        executable = multiprocessing.spawn.get_executable()
        paths = json.loads(subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], check=True,
                                          capture_output=True, text=True).stdout) if python else []
        with _environment(**({"INFERSIM_ISA": isa} if isa else {})):
            ctx.set_executable(python or executable)
            try:
                self.process = ctx.Process(target=_serve, args=(child, factory, args, threads, paths), daemon=True)
                self.process.start()
            finally:
                ctx.set_executable(executable)
        child.close()
        self._answer()

    def _answer(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"a bench worker exited (code {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"in a bench worker:\n{value}")
        return value

    def call(self, name: str, *args):
        self.conn.send((name, args))
        return self._answer()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
        self.process.join(timeout=30)


def isa_workers(factory, args: tuple, requested: list[str] | None, threads: int) -> dict[str, Worker]:
    """{label: worker} for each build to measure (see `isas`), started one after another."""
    environment.isa()  # a bad INFERSIM_ISA in the parent is reported before anything starts
    chosen: dict[str, str] = {}
    for isa in isas(requested):  # "auto" and the set it resolves to are one build
        chosen.setdefault(label(isa), isa)
    return {name: Worker(factory, args, isa=isa, threads=threads) for name, isa in chosen.items()}

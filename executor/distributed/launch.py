"""A process group started from inside infersim: rank 0 is the calling (driver) process, ranks 1..N-1 are
`multiprocessing` spawn-context children, all joined by torch.distributed (gloo over TCP on 127.0.0.1, or NCCL
where asked for on CUDA).

    with launch(worker, [(args of rank 1), (args of rank 2)]) as group:   # worker(rank, *args) in each child
        dist.send(...)            # the driver's side of the protocol, with ranks 1..N-1
        group.check()             # raises WorkerError if a child has exited

`worker` is a picklable top-level function; its arguments travel pickled (tensors through shared memory). Each
process runs `threads` torch threads (OpenMP set to wait passively, so an idle thread does not spin on a core a
peer needs).

A failure never hangs the driver. A child's exception is written to the group's store before it exits, and its
sockets close, so the driver's pending gloo call fails at once ("Connection closed by peer"); so do a killed
child's. `group.check()` polls the children's exit codes (a backstop between calls), and the driver's gloo calls
time out after `timeout_s` (a child alive but stuck). `group.failure(exc)` turns whichever happened into one
WorkerError naming the rank. On leaving the block the process group is destroyed and the children joined (killed
after a grace period), so one process can run many groups in turn. Children wait for the driver without a
timeout (between a serve's requests the driver may be idle for long) and end when its sockets close.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
GRACE_S = 2.0  # how long a finishing child gets to exit before it is killed
REPORT_S = 1.0  # how long a failing child gets to write its error message
START_TIMEOUT_S = 120.0  # spawn, import torch, connect: seconds on a busy 2-core machine
CHILD_TIMEOUT = timedelta(days=7)  # children wait for the driver's next message as long as it is alive
STOPPED = "the serve stopped: a worker failed"  # the reject reason of requests a failed worker left unfinished


class WorkerError(RuntimeError):
    """A rank of a process group failed: died, raised, or stopped answering. `rank` is None when no rank could be
    blamed (a timeout with every child alive)."""

    def __init__(self, message: str, rank: int | None):
        super().__init__(message)
        self.rank = rank


@dataclass
class Group:
    """A running process group, as the driver (rank 0) sees it."""

    world_size: int
    backend: str
    store: dist.TCPStore
    procs: list  # the children, rank 1 first
    timeout_s: float

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every child that has exited."""
        return [(rank, p.exitcode) for rank, p in enumerate(self.procs, 1) if p.exitcode is not None]

    def check(self) -> None:
        """Raise the WorkerError of a child that has exited (a cheap waitpid per child: call it between steps)."""
        if self.dead():
            raise self.failure(None)

    def failure(self, exc: BaseException | None) -> WorkerError:
        """The WorkerError for a failed collective or a dead child: a child's own error message first, else the
        child that died and how, else the timeout. Waits up to REPORT_S for a failing child to report."""
        deadline = time.monotonic() + REPORT_S
        errors = self._errors()
        while not errors and not self.dead() and time.monotonic() < deadline:
            time.sleep(0.05)  # a child that raised writes its message, then exits
            errors = self._errors()
        if errors:
            rank, message = errors[0]
            return WorkerError(f"rank {rank} failed: {message}", rank)
        for rank, code in self.dead():
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            return WorkerError(f"rank {rank} died ({how})", rank)
        detail = " ".join(str(exc).split())[:160] if exc is not None else "no reply"
        return WorkerError(f"a rank stopped answering within {self.timeout_s:g} s: {detail}", None)

    def _errors(self) -> list[tuple[int, str]]:
        keys = [f"error/{rank}" for rank in range(1, self.world_size)]
        out = []
        for rank, key in enumerate(keys, 1):
            if self.store.check([key]):
                out.append((rank, self.store.get(key).decode(errors="replace")))
        return out


@contextmanager
def collective(handle) -> Iterator[None]:
    """Run a step's collectives for `handle` (a parallel group's driver handle: `.group`, `.broken`): a dead child
    is found before, and a failure inside marks the handle broken (no orderly shutdown then) and becomes the
    group's WorkerError."""
    handle.group.check()
    try:
        yield
    except WorkerError:
        handle.broken = True
        raise
    except (RuntimeError, TimeoutError) as e:
        handle.broken = True
        raise handle.group.failure(e) from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _child_main(rank: int, world_size: int, port: int, backend: str, threads: int, worker: Callable,
                args: tuple) -> None:
    """A child's whole life: join the group, run `worker(rank, *args)`, report any exception, leave."""
    torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"ready/{rank}", "1")
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=CHILD_TIMEOUT)
        worker(rank, *args)
    except BaseException as e:  # noqa: BLE001 -- whatever it was, the driver must hear of it in one line
        try:
            store.set(f"error/{rank}", _one_line(e))
        except Exception:  # noqa: BLE001 -- the driver is gone: nobody to tell
            pass
        os._exit(1)  # skip teardown: a broken group can block in it
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def launch(worker: Callable, args: Sequence[tuple], threads: int = 1, timeout_s: float = 120.0,
           backend: str = "gloo") -> Iterator[Group]:
    """A process group of 1 + len(args) ranks: this process is rank 0; child rank r runs `worker(r, *args[r-1])`.
    `threads`: torch threads of every rank (this process's are restored on exit); `timeout_s`: the longest the
    driver waits in one collective. Yields the Group; on exit the group is torn down whatever happened. One group
    at a time in a process: it is torch.distributed's default process group."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process; leave its block first")
    world_size = 1 + len(args)
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    ctx = mp.get_context("spawn")
    procs: list = []
    group = Group(world_size, backend, store, procs, timeout_s)
    threads_before = torch.get_num_threads()
    joined, failed = False, True
    try:
        _spawn(ctx, procs, worker, args, world_size, store.port, backend, threads)
        _wait_ready(group)
        torch.set_num_threads(threads)
        dist.init_process_group(backend, store=store, rank=0, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        joined = True
        yield group
        failed = False
    finally:
        torch.set_num_threads(threads_before)
        if joined:
            dist.destroy_process_group()
        _reap(procs, 0.2 if failed else GRACE_S)  # after a failure nothing is worth waiting for


def _spawn(ctx, procs: list, worker: Callable, args: Sequence[tuple], world_size: int, port: int, backend: str,
           threads: int) -> None:
    """Start the children (appended to `procs` as they start), with OpenMP's passive wait in their environment."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # children inherit it before their OpenMP starts
    try:
        for rank, a in enumerate(args, 1):
            p = ctx.Process(target=_child_main, args=(rank, world_size, port, backend, threads, worker, tuple(a)),
                            daemon=True, name=f"infersim-rank{rank}")
            p.start()
            procs.append(p)
    finally:
        if saved is None:
            del os.environ["OMP_WAIT_POLICY"]
        else:
            os.environ["OMP_WAIT_POLICY"] = saved


def _wait_ready(group: Group) -> None:
    """Until every child has started and is about to join (polling, so a child that dies while starting is
    reported instead of leaving the driver waiting in the rendezvous)."""
    keys = [f"ready/{rank}" for rank in range(1, group.world_size)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not group.store.check(keys):
        if group.dead():
            raise group.failure(None)
        if time.monotonic() > deadline:
            raise WorkerError(f"the worker processes did not start within {START_TIMEOUT_S:g} s", None)
        time.sleep(0.02)


def _reap(procs: list, grace_s: float) -> None:
    """Join the children; kill the ones still running after `grace_s`."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(GRACE_S)

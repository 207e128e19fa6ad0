"""Where a sweep's independent tasks run: local processes (all cores) or a Ray cluster. Either way each task is the
same top-level function of its own inputs, so the results do not depend on the backend or the order of completion."""
from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from sim.config.errors import ConfigError

BACKENDS = ("local", "ray")


def map_unordered(fn: Callable, items: Sequence, backend: str = "local", workers: int | None = None,
                  address: str | None = None, wanted: Callable[[int], bool] | None = None
                  ) -> Iterator[tuple[int, object]]:
    """(index, fn(items[index])) as tasks finish, started in the items' order. `local`: `workers` processes (default:
    the cores; 1 runs in this process); `ray`: tasks on the cluster at `address` (None: a local Ray started here).
    `wanted(index)`, asked as the item is about to start (every result yielded before then already seen by the
    caller), skips it when False: nothing is yielded for it."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}", "--backend")
    if address is not None and backend != "ray":
        raise ConfigError(f"{address!r} is a Ray cluster's address: only with --backend ray", "--address")
    starts = (i for i in range(len(items)) if wanted is None or wanted(i))  # asked lazily, as each would start
    if backend == "ray":
        yield from _ray(fn, items, starts, address)
        return
    workers = min(workers or os.cpu_count() or 1, len(items)) or 1
    if workers == 1:
        for i in starts:
            yield i, fn(items[i])
        return
    # spawn: workers start clean (the parent may hold threads, e.g. a progress bar's, that fork would copy mid-state)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from _windowed(pool.submit, lambda f: f.result(), _wait_local, fn, items, starts, workers)


def _wait_local(pending) -> list:
    return list(wait(pending, return_when=FIRST_COMPLETED)[0])


def _windowed(submit: Callable, result: Callable, wait_some: Callable, fn: Callable, items: Sequence,
              starts: Iterator[int], window: int) -> Iterator[tuple[int, object]]:
    """At most `window` tasks in flight, the next started as one finishes (so `starts` asks `wanted` late)."""
    pending: dict = {}
    try:
        while True:
            while len(pending) < window and (i := next(starts, None)) is not None:
                pending[submit(fn, items[i])] = i
            if not pending:
                return
            for f in wait_some(pending):
                yield pending.pop(f), result(f)
    finally:
        for f in pending:
            if hasattr(f, "cancel"):
                f.cancel()


def _ray(fn: Callable, items: Sequence, starts: Iterator[int], address: str | None) -> Iterator[tuple[int, object]]:
    check_address(address)
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray backend needs Ray: pip install ray", "--backend") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_project_paths())}})
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ConfigError(f"cannot reach a Ray cluster at {address}: {e}", "--address") from None
    try:
        task = ray.remote(fn)
        window = max(1, int(ray.cluster_resources().get("CPU", 1)))  # the cluster's cores busy, no more
        yield from _windowed(lambda f, item: task.remote(item), ray.get,
                             lambda refs: ray.wait(list(refs), num_returns=1)[0], fn, items, starts, window)
    finally:
        if started:
            ray.shutdown()


def check_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A Ray address (HOST:PORT or ray://HOST:PORT) that answers: Ray itself retries an unreachable one for
    minutes. None and "auto" (a local or already running Ray) pass unchecked."""
    if address in (None, "auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{address!r}; allowed: HOST:PORT, ray://HOST:PORT or auto", "--address")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"cannot reach a Ray cluster at {address} ({type(e).__name__}: {e.strerror or e})",
                          "--address") from None


def _project_paths() -> list[str]:
    """The folder holding this project's packages, so Ray workers import the same code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [root]

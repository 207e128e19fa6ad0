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
                  address: str | None = None) -> Iterator[tuple[int, object]]:
    """(index, fn(items[index])) as tasks finish. `local`: `workers` processes (default: the cores; 1 runs in this
    process); `ray`: tasks on the cluster at `address` (None: a local Ray started here)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}", "--backend")
    if address is not None and backend != "ray":
        raise ConfigError(f"{address!r} is a Ray cluster's address: only with --backend ray", "--address")
    if backend == "ray":
        yield from _ray(fn, items, address)
        return
    workers = min(workers or os.cpu_count() or 1, len(items)) or 1
    if workers == 1:
        for i, item in enumerate(items):
            yield i, fn(item)
        return
    # spawn: workers start clean (the parent may hold threads, e.g. a progress bar's, that fork would copy mid-state)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(fn, item): i for i, item in enumerate(items)}
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    yield pending.pop(f), f.result()
        finally:
            for f in pending:
                f.cancel()


def _ray(fn: Callable, items: Sequence, address: str | None) -> Iterator[tuple[int, object]]:
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
        refs = {task.remote(item): i for i, item in enumerate(items)}
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                yield refs.pop(ref), ray.get(ref)
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

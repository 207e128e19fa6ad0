"""What communication costs on this machine, measured through the executor's own launcher and collectives: the
profile sweep stores it (`comm` in the profile JSON) and the simulator prices tensor- and pipeline-parallel steps
with it (sim/cost/fitted.py).

Two ranks, one torch thread each. Per operation and message size, the mean time of many repeats with both ranks
calling together: the shared-memory all-reduce and gather tensor parallelism uses (shm.py), gloo's all-reduce for
comparison, a gloo send one way (half a round trip: what a pipeline stage's activations cost) and the broadcast
of a step message's frame (messages.py). Each is fitted as latency + bytes × seconds per byte.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from executor.distributed import messages
from executor.distributed.launch import launch
from executor.distributed.shm import ShmCollectives, make_buffers
from executor.distributed.tensor_parallel import SHM_CAPACITY

OPS = ("all_reduce_shm", "gather_shm", "all_reduce_gloo", "send_gloo", "message_gloo")
TOKENS = (1, 4, 16, 64, 256, 1024, 2048)  # rows of a 576-wide fp32 hidden state: 2.3 KB to 4.7 MB


def _repeats(nbytes: int) -> int:
    return 200 if nbytes < 100_000 else 40 if nbytes < 1_000_000 else 10


def _run(rank: int, comm: ShmCollectives, sizes: list[int]) -> list[list[float]]:
    """Both ranks run this, in step: per op, per size, the mean seconds (as rank 0 sees it)."""
    table = []
    for op in OPS:
        row = []
        for n in sizes:
            x = torch.ones(n // 4)
            frame = torch.zeros(messages.FRAME, dtype=torch.uint8)
            reps = _repeats(n)

            def once() -> None:
                if op == "all_reduce_shm":
                    comm.all_reduce(x)
                elif op == "gather_shm":
                    comm.gather(x)
                elif op == "all_reduce_gloo":
                    dist.all_reduce(x)
                elif op == "send_gloo":  # a round trip: rank 0 sends, rank 1 sends back
                    if rank == 0:
                        dist.send(x, 1)
                        dist.recv(x, 1)
                    else:
                        dist.recv(x, 0)
                        dist.send(x, 0)
                else:
                    dist.broadcast(frame, 0)
            for _ in range(3):
                once()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                once()
            mean = (time.perf_counter() - t) / reps
            row.append(mean / 2 if op == "send_gloo" else mean)
        table.append(row)
    return table


def _worker(rank: int, buffers, sizes: list[int]) -> None:
    _run(rank, ShmCollectives(buffers, rank), sizes)


def fit_line(sizes: list[int], times: list[float]) -> dict:
    """latency_s + s_per_byte · bytes, least squares, both >= 0."""
    x, y = np.asarray(sizes, float), np.asarray(times, float)
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # through the smallest time instead
        intercept, slope = float(y.min()), max(0.0, float(np.polyfit(x, y - y.min(), 1)[0]))
    return {"latency_s": max(0.0, float(intercept)), "s_per_byte": max(0.0, float(slope))}


def measure_comm(hidden_size: int = 576, threads: int = 1) -> dict:
    """The profile's `comm` section: raw times per op and size, and their fits."""
    sizes = [t * hidden_size * 4 for t in TOKENS]
    buffers = make_buffers(2, SHM_CAPACITY)
    with launch(_worker, [(buffers, sizes)], threads=threads, timeout_s=120) as group:
        table = _run(0, ShmCollectives(buffers, 0, group.check, 120.0), sizes)
    raw = {op: [[n, t] for n, t in zip(sizes, row)] for op, row in zip(OPS, table)}
    return {"world_size": 2, "backend": "gloo", "threads": threads, "bytes": sizes, "times_s": raw,
            "fit": {op: fit_line(sizes, row) for op, row in zip(OPS, table)}}

"""The executor's process groups (executor/distributed): the launcher and how a failing worker ends a run, the
step messages, the shared-memory collectives."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from executor.core.model_runner import StepInput
from executor.distributed import messages
from executor.distributed.launch import WorkerError, launch
from executor.distributed.shm import ShmCollectives, make_buffers
from executor.distributed.tensor_parallel import tensor_parallel
from sim.policy.request import Request
from tests.parallel_workloads import PROMPTS, model, policy


def test_step_messages_round_trip_in_one_frame_or_two():
    step = StepInput([(Request(0, 0.0, 9, 2), 1, 9), (Request(1, 0.0, 5, 2), 5, 5)], [4, 1, 2, 3, 4, 5], [1, 5, 1],
                     [9, 5, 3], [[3, 4], [7], [1]], 1, 1, [0, 1], [1, 1], [(2, 30)], [(31, 5)], None)
    kind, ve, back = messages.decode(messages.encode_step(step, virtual_engine=1))
    assert (kind, ve) == (messages.STEP, 1) and back.rows == [(None, 1, 9), (None, 5, 5)]
    assert back.input_ids == step.input_ids and back.block_tables == step.block_tables and back.swap_in == [(31, 5)]
    long = StepInput([(None, 3000, 3000)], list(range(3000)), [3000], [3000], [list(range(188))], 0, 0, [0], [1],
                     [], [], [0, 1, 1])
    msg = messages.encode_step(long)
    assert msg.numel() > messages.FRAME
    first, rest = messages._frames(msg)
    assert torch.equal(messages._join(first, rest), msg) and messages.decode(msg)[2] == long
    short = messages.encode(messages.STOP)
    assert torch.equal(messages._join(*messages._frames(short)), short)


def _boom(rank: int) -> None:
    raise ValueError("boom in the worker")


def _echo_then_sleep(rank: int) -> None:
    x = torch.zeros(4)
    dist.broadcast(x, 0)
    time.sleep(600)


def test_a_worker_s_exception_is_one_line_naming_its_rank():
    t = time.monotonic()
    with pytest.raises(WorkerError) as e:
        with launch(_boom, [()], timeout_s=20) as group:
            try:
                dist.barrier()
            except RuntimeError as exc:
                raise group.failure(exc) from None
    assert e.value.rank == 1 and str(e.value) == "rank 1 failed: ValueError: boom in the worker"
    assert time.monotonic() - t < 15


def test_a_stuck_worker_times_out_and_is_reaped():
    t = time.monotonic()
    with pytest.raises(WorkerError) as e:
        with launch(_echo_then_sleep, [()], timeout_s=1) as group:
            dist.broadcast(torch.ones(4), 0)
            pid = group.pids[0]
            try:
                dist.barrier()
            except RuntimeError as exc:
                raise group.failure(exc) from None
    assert e.value.rank is None and "stopped answering within 1 s" in str(e.value)
    assert time.monotonic() - t < 20
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_killed_tensor_parallel_worker_ends_the_run_with_its_rank():
    with tensor_parallel(model(), 2, timeout_s=30) as tp:
        engine = tp.engine(policy())
        for r, p in zip([Request(i, 0.0, len(p), 30) for i, p in enumerate(PROMPTS)], PROMPTS):
            engine.add(r, p)
        for _ in range(3):
            engine.step()
        os.kill(tp.group.pids[0], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(WorkerError, match=r"^rank 1 died \(killed by SIGKILL\)$"):
            while engine.has_work():
                engine.step()
        assert time.monotonic() - t < 10
        assert len(engine.records) >= 3


def _reduce_and_gather(rank: int, buffers) -> None:
    comm = ShmCollectives(buffers, rank)
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(x)
    comm.gather(x)
    big = torch.full((7, 5), float(rank + 1))
    comm.all_reduce(big)  # 35 floats through a capacity of 8: five chunks
    comm.gather(big)


def test_shared_memory_all_reduce_and_gather_in_chunks():
    buffers = make_buffers(2, 8)
    with launch(_reduce_and_gather, [(buffers,)], timeout_s=20):
        comm = ShmCollectives(buffers, 0)
        x = torch.arange(10, dtype=torch.float32)
        comm.all_reduce(x)
        assert torch.equal(x, torch.arange(10, dtype=torch.float32) * 3)
        parts = comm.gather(x)
        assert all(torch.equal(p, x) for p in parts)
        big = torch.ones(7, 5)
        comm.all_reduce(big)
        assert torch.equal(big, torch.full((7, 5), 3.0))
        assert [p.shape for p in comm.gather(big)] == [(7, 5)] * 2

"""The serve's reading of other processes' CPU (executor/core/cpu_load.py): a worker process's CPU is the serve's own,
also after the worker has exited, so a multi-process serve does not report its own workers as a busy machine."""
from __future__ import annotations

import subprocess
import sys
import time

from executor.core.cpu_load import BUSY_CORES, CpuLoad


def test_an_exited_worker_s_cpu_does_not_become_other_processes():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
    worker = subprocess.Popen([sys.executable, "-c", burn])
    load = CpuLoad(workers=[worker.pid])
    time.sleep(0.3)
    running = load.own_cpu_s()  # the worker's CPU so far is the serve's own
    worker.wait()
    # read from the counters, not the machine's busy time: other processes on a busy machine do not move them;
    # had the exited worker's CPU dropped out of "own", the machine's time it used would read as other processes'
    assert load.own_cpu_s() - running > 0.5, (running, load.own_cpu_s())


def test_others_busy_reads_the_latest_sample():
    load = CpuLoad()
    assert not load.others_busy()  # no sample yet: nothing says the machine is busy
    load.samples += [0.1, BUSY_CORES]
    assert load.others_busy()
    load.samples.append(0.0)
    assert not load.others_busy()


def test_bursts_a_low_mean_hides_make_the_machine_busy():
    load = CpuLoad()
    load.samples += [0.0] * 18 + [1.5]  # mean 0.08 cores; busy in 5% of samples
    assert not load.busy and load.warning("the sweep") is None
    load.samples += [1.5]  # busy in 2 of 20 samples: a tenth of the sweep's slices spoiled
    assert load.busy and "10% of its samples" in load.warning("the sweep")

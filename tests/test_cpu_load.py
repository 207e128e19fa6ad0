"""The serve's reading of other processes' CPU (executor/cpu_load.py): a worker process's CPU is the serve's own,
also after the worker has exited, so a multi-process serve does not report its own workers as a busy machine."""
from __future__ import annotations

import subprocess
import sys
import time

from executor.cpu_load import BUSY_CORES, CpuLoad


def test_an_exited_worker_s_cpu_does_not_become_other_processes():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
    worker = subprocess.Popen([sys.executable, "-c", burn])
    load = CpuLoad(workers=[worker.pid])
    time.sleep(0.3)
    load.sample()  # the worker running: its CPU is the serve's own
    worker.wait()
    time.sleep(0.2)
    others = load.sample()  # after it exited, its CPU must not come back as negative "own" time
    assert others is not None and others < 0.5, load.samples


def test_others_busy_reads_the_latest_sample():
    load = CpuLoad()
    assert not load.others_busy()  # no sample yet: nothing says the machine is busy
    load.samples += [0.1, BUSY_CORES]
    assert load.others_busy()
    load.samples.append(0.0)
    assert not load.others_busy()

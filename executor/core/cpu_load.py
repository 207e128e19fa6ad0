"""Other processes' CPU use, read while the executor runs: to size torch's threads to the cores that are free, and
to say when a timing was taken on a busy machine.

OpenMP threads wait for each other at every parallel region; when another process holds one of their cores, a
waiting thread spins (or sleeps and wakes) until the descheduled peer runs again, and on these 2-core machines a
2-thread decode step then took 3-50x its time. One thread per free core keeps the slowdown in proportion to the
cores taken (measured: 2 threads beside a CPU burner 4.8 s for a run that takes 1.4 s alone; 1 thread 1.6 s).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

# other processes using this many cores' worth of CPU, on average, make a timing unreliable
BUSY_CORES = 0.5
# ... and so does this share of samples at BUSY_CORES or more: bursts a low mean hides (a test suite next door
# spoiled a profile sweep's fit, held-out MAPE 0.43, at a mean below BUSY_CORES)
BUSY_SHARE = 0.1


def _busy_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks over all CPUs since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (0 once it has exited, or where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuLoad:
    """Cores' worth of CPU that other processes used between calls to `sample()` (machine busy time less this
    process's own and its `workers'`: the pids of a multi-process serve's other ranks), and torch threads sized to
    what they leave."""

    def __init__(self, max_threads: int | None = None, workers: Sequence[int] = ()):
        self.cores = os.cpu_count() or 1
        self.max_threads = max_threads or torch.get_num_threads()
        self.workers = list(workers)
        self._last = self._read()
        self.samples: list[float] = []

    def own_cpu_s(self) -> float:
        """CPU seconds this process and its workers have used: never falls, also when a worker exits."""
        own = os.times()
        # a worker reads from /proc while it runs; once exited and reaped, its whole CPU time is in children_*
        reaped = own.children_user + own.children_system
        return own.user + own.system + reaped + sum(map(_cpu_seconds, self.workers))

    def _read(self):
        return time.monotonic(), _busy_jiffies(), self.own_cpu_s()

    def sample(self) -> float | None:
        """Other processes' cores since the last sample (None where /proc/stat cannot be read)."""
        now = self._read()
        (t0, j0, own0), (t1, j1, own1) = self._last, now
        self._last = now
        if j0 is None or j1 is None or t1 - t0 < 0.05 or j1[1] == j0[1]:
            return None
        busy_share = (j1[0] - j0[0]) / (j1[1] - j0[1])  # of all CPUs' time in the interval
        others = max(0.0, busy_share * self.cores - (own1 - own0) / (t1 - t0))
        self.samples.append(others)
        return others

    def threads_for(self, others: float) -> int:
        """One thread per core the other processes leave free (at least one, at most max_threads)."""
        return max(1, min(self.max_threads, round(self.cores - others)))

    def others_busy(self) -> bool:
        """Whether the latest sample saw other processes using BUSY_CORES or more (before any sample: no)."""
        return bool(self.samples) and self.samples[-1] >= BUSY_CORES

    @property
    def mean_others(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def busy_share(self) -> float:
        """Share of the samples in which other processes used BUSY_CORES or more."""
        return sum(x >= BUSY_CORES for x in self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def busy(self) -> bool:
        return self.mean_others >= BUSY_CORES or self.busy_share >= BUSY_SHARE

    def warning(self, what: str) -> str | None:
        """A one-line warning when other processes were busy enough to spoil `what`'s timings, else None."""
        if not self.busy:
            return None
        return (f"warning: other processes used {self.mean_others:.1f} of {self.cores} cores during {what} (≥ "
                f"{BUSY_CORES} in {self.busy_share:.0%} of its samples): its timings are the busy machine's, not the "
                "executor's (run it on a quiet machine to measure)")

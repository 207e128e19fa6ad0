"""What the simulator holds per simulated request: `infersim run` (plots on) of a simulated day of
Azure-conversation-like traffic (bench/scenarios/azure_conv_day.yaml, ~465k requests) and of its first two hours,
side by side in fresh processes; peak RSS and wall time of each, and the memory each extra request costs.

Usage: python bench/sim_memory.py [--hours-short 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

DAY = Path(__file__).resolve().parent / "scenarios" / "azure_conv_day.yaml"


def run(path: Path) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, requests) of `infersim run PATH --out ...` in a fresh process."""
    with tempfile.TemporaryDirectory() as out:
        # the peak is VmHWM, this process image's own: ru_maxrss carries the parent's peak across fork + exec
        # told by an atexit hook: the `infersim` process ends at once after its command (cli._end_process)
        code = ("import atexit, sys; from infersim.cli import main; sys.argv = ['infersim', 'run', sys.argv[1], "
                "'--out', sys.argv[2], '-q']\natexit.register(lambda: print(next(int(line.split()[1]) for line in "
                "open('/proc/self/status') if line.startswith('VmHWM'))))\nmain()")
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code, str(path), out], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        peak_kib = int(r.stdout.strip().splitlines()[-1])
        arrived = json.loads((Path(out) / "report.json").read_text())["requests"]["arrived"]
    return wall, peak_kib / 1024, arrived


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours-short", type=float, default=2.0, help="the short run's simulated hours")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        short = Path(d) / "short.yaml"
        data = yaml.safe_load(DAY.read_text())
        data["workload"]["duration_s"] = args.hours_short * 3600
        short.write_text(yaml.safe_dump(data))
        s_wall, s_mib, s_n = run(short)
    wall, mib, n = run(DAY)
    per_request = (mib - s_mib) * 2**20 / (n - s_n)
    print(f"{args.hours_short:g} h: {s_n:,} requests, {s_wall:.1f} s, peak RSS {s_mib:.0f} MiB")
    print(f"24 h: {n:,} requests, {wall:.1f} s, peak RSS {mib:.0f} MiB")
    print(f"sim_day_requests: {n}")
    print(f"sim_day_wall_s: {wall:.1f}")
    print(f"sim_day_peak_rss_mib: {mib:.0f}")
    print(f"bytes_per_simulated_request: {per_request:.0f}")


if __name__ == "__main__":
    main()

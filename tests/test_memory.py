"""Bounded memory: a quarter of a simulated day of Azure-conversation-like traffic (~116k requests, ~2.2e7 tokens),
plots on, within 400 MiB of peak RSS (361 MiB measured 2026-12-05 with vLLM's defaults and client transport; 271 MiB
before them) — the rate of memory per request that keeps the whole day (~465k requests) within 1.25 GiB (1,185 MiB
on 2026-12-05, 888 MiB on 2026-12-01: vLLM's faster steps make ~9% more of them, and each request now carries its
client transport; bench/sim_memory.py runs the day). The simulator keeps steps and requests
in typed arrays and the inter-token gaps as a weighted sample per decode step, never a time per token."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_a_quarter_of_a_simulated_day_fits_in_400_mib(tmp_path):
    from sim_memory import DAY, run

    data = yaml.safe_load(DAY.read_text())
    data["workload"]["duration_s"] = 21_600  # a quarter of the day: the same rate per request, a quarter of the time
    path = tmp_path / "half-day.yaml"
    path.write_text(yaml.safe_dump(data))
    wall, peak_mib, arrived = run(path)
    assert arrived > 100_000
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"

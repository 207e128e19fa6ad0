"""Bounded memory: a simulated day of Azure-conversation-like traffic (~465k requests, ~9e7 tokens), plots on,
within 1 GiB of peak RSS. The simulator keeps steps and requests in typed arrays and the inter-token gaps as a
weighted sample per decode step, never a time per token (bench/sim_memory.py prints the figures)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_a_simulated_day_fits_in_a_gigabyte():
    from sim_memory import DAY, run

    wall, peak_mib, arrived = run(DAY)
    assert arrived > 400_000
    assert peak_mib < 1024, f"peak RSS {peak_mib:.0f} MiB"

"""Same seed, same result on any machine: the report's figures do not depend on how many cores the process may use
(a BLAS dot product splits its sum over threads, so the weighted ITL mean once moved in its last bit with them)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = """
import numpy as np
from sim.report.metrics import summarize
rng = np.random.default_rng(0)
x = np.sort(rng.exponential(0.01, 2_000_000))
print(repr(summarize(x, np.cumsum(rng.integers(1, 5, len(x))))["mean"]))
"""


def _mean_on(cores: set[int]) -> str:
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores)).stdout


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to compare with one")
def test_weighted_mean_is_the_same_on_one_core_and_on_all():
    cores = os.sched_getaffinity(0)
    assert _mean_on({min(cores)}) == _mean_on(cores)


def test_itl_counts_a_chunk_of_accepted_drafts_as_one_gap():
    """Tokens one verify step emits arrive together, as vLLM's benchmark streams them: one gap, never a gap of 0 (an
    ITL p50 of 0 ms with speculation on). So the median gap is a step, and TPOT (per token) is below it."""
    from infersim.api import simulate_data

    data = {"model": "Llama-3-8B", "hardware": "H100-SXM",
            "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 100,
                         "prompt_len": {"dist": "fixed", "value": 500}, "output_len": {"dist": "fixed", "value": 100}},
            "speculative": {"method": "ngram", "acceptance_rate": 0.8, "num_speculative_tokens": 4}}
    report = simulate_data(data).report
    assert report["itl_s"]["p50"] > 1.5 * report["tpot_s"]["p50"] > 0


def test_equal_gaps_are_summed_in_the_sample_s_order_whatever_the_sort():
    """Ties keep the sample's order (a stable sort): numpy's default sort orders equal values differently on AVX-512
    and AVX2 builds, and the weighted mean and the CDF points moved in their last bits with it."""
    from sim.report.metrics import MAX_CDF_POINTS, spread_indices, summarize, summarize_gaps

    rng = np.random.default_rng(3)
    values = rng.integers(1, 40, 50_000) * 0.0173  # many equal gaps, each with its own weight
    weights = rng.integers(1, 1000, len(values))
    order = np.lexsort((np.arange(len(values)), values))  # by value, ties by position
    cw = np.cumsum(weights[order], dtype=np.int64)
    got = summarize_gaps([values.copy(), weights.copy()])
    assert got.stats == summarize(values[order], sorted_cumulative=cw)
    assert got.cdf_fraction.tolist() == (cw[spread_indices(len(cw), MAX_CDF_POINTS)] / cw[-1]).tolist()

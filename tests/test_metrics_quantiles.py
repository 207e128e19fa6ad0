"""The report's percentiles are numpy's, bit for bit, without np.quantile's import of numpy.ma (issue 59: a run's
start-up): linear_quantiles against np.quantile / np.percentile, spread_indices against np.unique."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.report.metrics import linear_quantiles, spread_indices

ROOT = Path(__file__).resolve().parents[1]
QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0, 1 / 3)


def samples(rng, count: int):
    """Samples numpy's percentiles are hard on: ties, both zeros, one value, near-equal values, long and short."""
    for k in range(count):
        n = int(rng.integers(1, 3000)) if k % 5 == 0 else int(rng.integers(1, 40))
        yield (rng.exponential(0.02, n), np.round(rng.normal(0, 1, n), 1), rng.integers(0, 4, n) * 0.1,
               5.0 + rng.random(n) * 1e-12, np.array([-0.0, 0.0] * n))[k % 5]


def test_linear_quantiles_are_numpy_s_bit_for_bit():
    rng = np.random.default_rng(7)
    for x in samples(rng, 3000):
        qs = tuple(float(q) for q in rng.choice(QUANTILES, 3)) + (float(rng.random()),)
        assert [repr(v) for v in linear_quantiles(x, qs)] == [repr(float(v)) for v in np.quantile(x, qs)]
        assert [repr(v) for v in linear_quantiles(x, (0.5, 0.9, 0.99))] == \
            [repr(float(v)) for v in np.percentile(x, [50, 90, 99])]
        assert repr(linear_quantiles(x, (qs[-1],))[0]) == repr(float(np.quantile(x, qs[-1])))


def test_linear_quantiles_leave_their_input_alone():
    x = np.array([3.0, 1.0, 2.0])
    assert linear_quantiles(x, (0.5,)) == [2.0]
    assert x.tolist() == [3.0, 1.0, 2.0]


@pytest.mark.parametrize("most", [1, 2, 3, 4000])
def test_spread_indices_are_np_unique_of_linspace(most):
    for n in [*range(0, 600), 4001, 12345, 10**6 + 3]:
        want = np.unique(np.linspace(0, n - 1, min(n, most)).astype(np.int64))
        got = spread_indices(n, most)
        assert got.dtype == want.dtype and np.array_equal(got, want), n


def test_summaries_do_not_import_numpy_ma():
    probe = ("import sys\nimport numpy as np\nfrom sim.report.metrics import summarize, summarize_gaps\n"
             "summarize(np.array([0.3, 0.1, np.nan]))\nsummarize_gaps([np.array([0.2, 0.1]), np.ones(2, np.int64)])\n"
             "print('numpy.ma' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert r.stdout.split() == ["False"]

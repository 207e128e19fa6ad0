"""Bad input, fifth pass (values at the far ends of what the schema allows, and warnings that reached the user's
stderr). Each case printed a numpy or matplotlib warning and its source line around the one-line error or after a
good run (R), or raised a traceback (T); each now exits 2 with one line, or runs, and prints nothing else.

pytest captures warnings, so an in-process run would hide them: the stderr cases run the real CLI in a subprocess
(under a second each), and the in-process ones turn the warnings a user would see into errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import png_size
from tests.test_bad_input_more import BASE, MAX_CHARS, invoke, one_line_error, scenario, write

SHOWN = pytest.mark.filterwarnings("error::RuntimeWarning", "error::UserWarning")  # Python shows these by default


def cli(*args) -> subprocess.CompletedProcess:
    exe = shutil.which("infersim")
    cmd = [exe] if exe else [sys.executable, "-m", "infersim.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=120)


# R: a numpy RuntimeWarning ('overflow encountered in divide') and its source line came before the error
STDERR_CASES = {
    "trace-time_scale-1e-308": ({"workload": {"trace": {"path": "builtin:azure_conv", "max_requests": 10,
                                                        "time_scale": 1.0e-308}}}, "workload.trace.time_scale"),
    "constant-rate-1e-308": ({"workload_changes": {"arrival": {"process": "constant", "rate": 1.0e-308}}},
                             "workload.arrival.rate"),
    # T: the gamma's scale divided by rate x 1/cv², which underflows to 0 (ZeroDivisionError)
    "gamma-rate-5e-324": ({"workload_changes": {"arrival": {"process": "gamma", "rate": 5e-324, "cv": 2.0}}},
                          "workload.arrival.rate"),
}


@pytest.mark.parametrize("name", list(STDERR_CASES))
def test_stderr_is_the_one_line(tmp_path, name):
    changes, key = STDERR_CASES[name]
    path = write(tmp_path / "s.yaml", scenario(**changes))
    r = cli("run", path, "-q", "--no-plots")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
    assert lines[0].startswith("infersim: error: ") and len(lines[0]) <= MAX_CHARS, lines[0]
    assert str(path) in lines[0] and key in lines[0], lines[0]


@SHOWN
@pytest.mark.parametrize("value", [5e-324, 1e-308])
def test_tiny_trace_time_scales_in_process(tmp_path, value):
    path = write(tmp_path / "s.yaml", {**BASE, "workload": {"trace": {"path": "builtin:azure_conv",
                                                                      "max_requests": 10, "time_scale": value}}})
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "workload.trace.time_scale")


@SHOWN
def test_a_queue_delay_of_1e308_runs(tmp_path):
    """T: a bulk decode run with a request waiting (TGI's gate holds it) and none to come priced its steps up to that
    one's expiry, int((1e308 - now) / step time): an int of inf."""
    serving = {"max_num_seqs": 8, "waiting_served_ratio": 1.2, "max_queue_delay_s": 1e308}
    workload = {**BASE["workload"], "arrival": {"process": "poisson", "rate": 10.0}, "num_requests": 8}
    path = write(tmp_path / "s.yaml", {**BASE, "serving": serving, "workload": workload})
    r = invoke("run", path, "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "report.json").read_text())["requests"]["completed"] == 8


@SHOWN
def test_a_search_down_to_5e_324_requests_per_second(tmp_path):
    """T: the grid's lowest point, log(min_rate / target), took the log of 0 (math domain error)."""
    spec = {"name": "tiny", "scenario": {**BASE, "workload": {**BASE["workload"], "num_requests": 20}},
            "target": {"rate": 2.0, "slo": {"ttft_s": 1e-12}}, "space": {"replicas": [1]},
            "search": {"max_requests": 20, "min_rate": 5e-324, "max_rate": 10.0, "precision": 0.5}}
    path = write(tmp_path / "spec.yaml", spec)
    r = invoke("search", path, "-q", "--workers", "1", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "search.json").read_text())["rows"]


@SHOWN
def test_compare_where_nothing_completes_draws_no_legend(tmp_path):
    """R: every configuration rejected every request: matplotlib warned 'No artists with labels found to put in
    legend' for the empty CDF plot."""
    path = write(tmp_path / "s.yaml", {**BASE, "serving": {"max_model_len": 8}})  # 8 + 8 tokens: none fits
    r = invoke("compare", path, "--sweep", "replicas=1,2", "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert png_size(tmp_path / "out" / "cdf.png") == (1430, 418)

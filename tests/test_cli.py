"""The `infersim` CLI: the shipped scenarios run, report.json keeps its contract, bad input is one line.

Most tests run the CLI in-process (tests/cli_runner.py) or call `run_scenario` directly; exactly one test
starts the real `infersim` console script in a subprocess.
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infersim.api import run_scenario
from tests.cli_runner import run_cli

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
PLOTS = ("latency_cdf.png", "kv_cache.png", "batch_size.png")
SMALL = ROOT / "scenarios" / "smollm2_cpu_small.yaml"  # the fastest one: used for the plots run

# A valid synthetic workload the bad-input scenarios share (flow-style YAML, one line).
WORKLOAD = ("workload: {arrival: {process: poisson, rate: 1.0}, num_requests: 5, "
            "prompt_len: {dist: fixed, value: 8}, output_len: {dist: fixed, value: 8}}")
GOOD_HEAD = "model: Llama-2-7B\nhardware: A100-80GB\n"


def invoke(*args: str):
    # wide enough that rich never truncates a table cell
    return run_cli(list(args), env={"COLUMNS": "200"})


def request_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# -- the shipped scenarios -----------------------------------------------------------------------

def test_scenarios_exist_and_say_what_they_answer():
    names = {p.name for p in SCENARIOS}
    assert len(SCENARIOS) >= 6, names
    for required in ("azure_conv_llama2_7b_a100.yaml", "azure_conv_llama3_8b_h100_x2.yaml",
                     "chunked_prefill_long_prompts.yaml", "tgi_waiting_served_ratio.yaml",
                     "bursty_gamma_swap.yaml", "smollm2_cpu_small.yaml"):
        assert required in names
    assert sum(n.startswith("static_vs_continuous_") for n in names) >= 2
    for p in SCENARIOS:
        assert p.read_text().startswith("#"), f"{p.name}: no comment header saying what it answers"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_simulates(path, tmp_path):
    report = run_scenario(path, out=tmp_path, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] > 0
    assert rq["arrived"] == rq["completed"] + rq["rejected"]
    assert rq["completed"] > rq["rejected"], f"{path.name}: mostly rejected: {rq}"
    assert report["ttft_s"]["p50"] > 0 and report["throughput"]["output_tokens_per_s"] > 0
    assert len(request_rows(tmp_path / "requests.csv")) == rq["arrived"]
    assert not any((tmp_path / p).exists() for p in PLOTS)


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("validation*/*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_validation_scenario_simulates(path):
    """Every validation scenario parses and simulates (the executor half runs in `infersim validate`)."""
    report = run_scenario(path, out=None, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] == rq["completed"] + rq["rejected"] and rq["completed"] > 0


def test_static_vs_continuous_pair_share_the_workload(tmp_path):
    static, cont = (run_scenario(ROOT / "scenarios" / f"static_vs_continuous_{k}.yaml", out=None, quiet=True,
                                 plots=False) for k in ("static", "continuous"))
    assert static["scenario"]["config"]["workload"] == cont["scenario"]["config"]["workload"]
    assert (static["scenario"]["batching"], static["scenario"]["kv_allocator"]) == ("static", "contiguous")
    assert (cont["scenario"]["batching"], cont["scenario"]["kv_allocator"]) == ("continuous", "paged")
    assert static["ttft_s"]["p50"] > 10 * cont["ttft_s"]["p50"]


# -- one full run with plots: files on disk and the report.json contract --------------------------

@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out"
    result = invoke("run", str(SMALL), "--out", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    return out


def test_run_writes_report_csv_and_plots(full_run):
    report = json.loads((full_run / "report.json").read_text())
    rows = request_rows(full_run / "requests.csv")
    assert len(rows) == report["requests"]["arrived"] > 0
    assert {r["status"] for r in rows} <= {"completed", "rejected"}
    for name in PLOTS:
        data = (full_run / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name


def test_report_json_contract(full_run):
    r = json.loads((full_run / "report.json").read_text())
    assert isinstance(r["scenario"], dict) and r["scenario"]["name"] == "smollm2-135m-cpu-small"
    assert r["engine"] == "sim"
    for k in ("arrived", "completed", "rejected"):
        assert isinstance(r["requests"][k], int)
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        for q in ("mean", "p50", "p90", "p99"):
            assert isinstance(r[metric][q], float), (metric, q)
        assert r[metric]["p50"] <= r[metric]["p90"] <= r[metric]["p99"]
    for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert r["throughput"][k] > 0
    assert 0 <= r["goodput_requests_per_s"] <= r["throughput"]["requests_per_s"]
    assert 0.0 <= r["slo_attainment"] <= 1.0
    assert 0.0 < r["kv_cache"]["peak_utilization"] <= 1.0
    assert isinstance(r["kv_cache"]["preemptions"], int)
    assert r["wall_time_s"] >= 0


# -- bad input: exit code 2, one line on stderr naming the file and the key path ------------------

BAD = {
    # name: (file content, key path, text the message must contain)
    "unknown_key_in_a_length_distribution": (
        GOOD_HEAD + "workload: {arrival: {process: poisson, rate: 1.0}, num_requests: 5, prompt_len: {dist: uniform, "
        "min: 8, max: 9, maxx: 1}, output_len: {dist: fixed, value: 8}}", "workload.prompt_len.maxx",
        ["allowed: dist, min, max"]),
    "model_not_a_name_or_mapping": ("model: 123\nhardware: A100-80GB\n" + WORKLOAD, "model", ["catalog name"]),
    "num_blocks_beyond_memory": (GOOD_HEAD + "kv_cache: {num_blocks: 10000000}\n" + WORKLOAD, "kv_cache.num_blocks",
                                 ["GiB", "at most"]),
    "unknown_top_key": (GOOD_HEAD + "colour: blue\n" + WORKLOAD, "colour", ["allowed:", "serving", "kv_cache"]),
    "unknown_nested_key": (GOOD_HEAD + "serving: {max_num_seq: 4}\n" + WORKLOAD, "serving.max_num_seq",
                           ["allowed:", "max_num_seqs", "max_num_batched_tokens"]),
    "wrong_type": (GOOD_HEAD + "serving: {max_num_seqs: many}\n" + WORKLOAD, "serving.max_num_seqs",
                   ["integer", "'many'"]),
    "kv_heads_do_not_divide": (
        "model: {num_layers: 2, hidden_size: 64, num_heads: 8, num_kv_heads: 3, intermediate_size: 128, "
        "vocab_size: 100}\nhardware: A100-80GB\n" + WORKLOAD, "model.num_kv_heads", ["num_kv_heads", "num_heads"]),
    "unknown_model": ("model: Llama-9-7B\nhardware: A100-80GB\n" + WORKLOAD, "model",
                      ["Llama-9-7B", "allowed:", "Llama-2-7B", "SmolLM2-135M"]),
    "unknown_hardware": ("model: Llama-2-7B\nhardware: B900\n" + WORKLOAD, "hardware",
                         ["B900", "allowed:", "A100-80GB", "H200"]),
    "model_does_not_fit": ("model: Llama-2-70B\nhardware: L4\n" + WORKLOAD, "hardware",
                           ["Llama-2-70B", "does not fit", "L4"]),
    "negative_arrival_rate": (GOOD_HEAD + WORKLOAD.replace("rate: 1.0", "rate: -2.0"), "workload.arrival.rate",
                              ["greater than 0", "-2.0"]),
    "gpu_memory_utilization_above_1": (GOOD_HEAD + "kv_cache: {gpu_memory_utilization: 1.5}\n" + WORKLOAD,
                                       "kv_cache.gpu_memory_utilization", ["1.5"]),
    "missing_trace_file": (GOOD_HEAD + "workload: {trace: {path: no_such_trace.csv}}\n", "workload.trace.path",
                           ["no_such_trace.csv"]),
    # no key path for these: the file itself is the problem
    "invalid_yaml": (GOOD_HEAD + "serving: [continuous\n", "", ["not valid YAML", "line"]),
    "list_not_mapping": ("- model: Llama-2-7B\n- hardware: A100-80GB\n", "", ["mapping", "list"]),
}


def check_one_line_error(exit_code: int, stdout: str, stderr: str, path: Path, key: str, needles: list[str]):
    assert exit_code == 2, (exit_code, stdout, stderr)
    assert "Traceback" not in stdout + stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    prefix = f"infersim: error: {path}: " + (f"{key}: " if key else "")
    assert lines[0].startswith(prefix), (prefix, lines[0])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("content,key,needles", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_one_line_exit_2(tmp_path, content, key, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = invoke("run", str(path), "--quiet", "--no-plots")
    check_one_line_error(result.exit_code, result.stdout, result.stderr, path, key, needles)


def test_missing_scenario_file(tmp_path):
    path = tmp_path / "nowhere.yaml"
    result = invoke("run", str(path), "--quiet")
    check_one_line_error(result.exit_code, result.stdout, result.stderr, path, "", ["not found"])


def test_real_subprocess_exit_codes_and_stderr(tmp_path):
    """The installed `infersim` script: 0 and a report for a good scenario, 2 and one line for a bad one."""
    exe = shutil.which("infersim")
    cmd = [exe] if exe else [sys.executable, "-m", "infersim.cli"]
    out = tmp_path / "out"
    ok = subprocess.run([*cmd, "run", str(SMALL), "--out", str(out), "--quiet", "--no-plots"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == "" and (out / "report.json").is_file()

    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD_HEAD + "serving: {max_num_seq: 4}\n" + WORKLOAD)
    r = subprocess.run([*cmd, "run", str(bad), "--quiet", "--no-plots"], capture_output=True, text=True,
                       timeout=120)
    check_one_line_error(r.returncode, r.stdout, r.stderr, bad, "serving.max_num_seq", ["allowed:", "max_num_seqs"])


# -- catalogs -----------------------------------------------------------------------------------

def test_models_lists_the_catalog():
    result = invoke("models")
    assert result.exit_code == 0
    assert "Llama-2-7B" in result.stdout and "SmolLM2-135M" in result.stdout


def test_hardware_lists_the_catalog():
    result = invoke("hardware")
    assert result.exit_code == 0
    for name in ("A100-80GB", "H200", "B200", "GB200", "B300", "GB300", "L40S", "RTX-PRO-6000"):
        assert name in result.stdout


def test_a_speculative_scenario_without_an_acceptance_rate_is_one_line_exit_2(tmp_path):
    """The simulator needs α; `run` and `validate` say so with the file and key path (validate before any
    executor run)."""
    path = tmp_path / "spec.yaml"
    path.write_text("model: SmolLM2-135M\nhardware: cpu\nspeculative: {num_speculative_tokens: 4}\n"
                    "workload: {num_requests: 5, arrival: {process: poisson, rate: 1},\n"
                    "  prompt_len: {dist: fixed, value: 32}, output_len: {dist: fixed, value: 8}}\n")
    for args in (["run", str(path)], ["validate", str(path), "--profile", str(tmp_path / "p.json")]):
        if args[0] == "validate":
            (tmp_path / "p.json").write_text("{}")
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert f"{path}: speculative.acceptance_rate" in r.output and "Traceback" not in r.output


def test_distill_with_bad_layers_is_one_line_exit_2(tmp_path):
    """Checked against the target before any generation or training."""
    for layers in ("0,99", "a,b"):
        r = invoke("distill", "--layers", layers, "--out", str(tmp_path / "d"))
        assert r.exit_code == 2, r.output
        assert "--layers" in r.output and "Traceback" not in r.output
        assert not (tmp_path / "d").exists()


def test_serve_with_a_missing_profile_is_one_line_exit_2(tmp_path):
    """`serve --profile` is checked before the executor loads or runs anything."""
    r = invoke("serve", "scenarios/validation/spec_draft.yaml", "--profile", str(tmp_path / "none.json"))
    assert r.exit_code == 2, r.output
    assert "--profile" in r.output and "profile not found" in r.output and "Traceback" not in r.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA answer")
@pytest.mark.parametrize("cmd", [["-m", "calibration.gpu_check"], ["bench/gpu_step_overhead.py"]])
def test_gpu_scripts_without_cuda_say_so_in_one_line(cmd):
    r = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "CUDA" in r.stderr


def test_validate_says_when_the_machine_drifted_from_its_profile():
    from infersim.commands.validate import drift_line

    def runs(*ratios):
        return [{"step_time_ratio": [{"all": r} for r in ratios]}]

    assert drift_line(runs(0.97, 1.03, 1.02)) is None and drift_line([{}]) is None
    line = drift_line(runs(0.85, 0.93) + runs(0.92))
    assert "0.90x" in line and "0.85-0.93 over 3 runs" in line and "11% faster" in line
    assert "slower" in drift_line(runs(1.1))


def test_validate_requests_only_sizes_capacity_probes():
    r = invoke("validate", "scenarios/validation/medium_load.yaml", "--requests", "64")
    assert r.exit_code == 2 and "--requests" in r.output and "--capacity" in r.output and "Traceback" not in r.output


def test_capacity_probes_take_more_requests_of_the_same_workload():
    from infersim.commands.validate import _with_requests
    from sim.config.plan import load_scenario

    path = ROOT / "scenarios" / "validation" / "spec_ngram.yaml"
    _, plan = load_scenario(path)
    longer = _with_requests(plan, 48, path)
    assert longer.workload.num_requests == 48 and plan.workload.num_requests == 16
    assert longer.workload.seed == plan.workload.seed and longer.speculative == plan.speculative


def test_validate_predicts_with_the_profile_the_scenarios_name():
    from infersim.commands.validate import _validation_profile
    from sim.config.plan import load_scenario

    paths = sorted((ROOT / "scenarios" / "validation_llama_0.5b").glob("*.yaml"))
    plans = [(p, load_scenario(p)[1]) for p in paths]
    assert _validation_profile(None, None, "cpu", plans).name == "cpu_llama-0.5b.json"
    smollm2 = [(p, load_scenario(p)[1]) for p in [ROOT / "scenarios" / "validation" / "medium_load.yaml"]]
    assert _validation_profile(None, None, "cpu", smollm2).name == "cpu.json"
    assert _validation_profile(None, None, "cpu", plans + smollm2).name == "cpu.json"  # no one profile: the device's

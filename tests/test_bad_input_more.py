"""More bad input, found by trying to break each command: every case exits 2 with one line (at most 300 characters)
naming the file and the key, through the CLI in-process, as tests/test_bad_input.py runs its cases. Each class of
input here used to end in a traceback, a hang, exit code 1 or a silently wrong report (see each group's comment).
"""
from __future__ import annotations

import copy
import json
import shutil
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from sim.config.yaml_file import read_yaml
from tests.cli_runner import run_cli

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "calibration" / "profiles" / "cpu.json"
CUDA_PROFILE = ROOT / "calibration" / "profiles" / "cuda.json"
MAX_CHARS = 300

BASE = {
    "name": "bad-input-more", "model": "SmolLM2-135M", "hardware": "cpu",
    "workload": {"seed": 0, "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 3,
                 "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8}},
}


def invoke(*args: str):
    return run_cli([str(a) for a in args])


def one_line_error(r, *needles: str) -> str:
    """The exit-2, one-line contract; every needle (file, key) in the line."""
    assert isinstance(r.exception, SystemExit), f"traceback: {r.exception!r}"
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, f"exit {r.exit_code}: {r.output[:600]}"
    line = lines[0]
    assert line.startswith("infersim: error: ") and len(line) <= MAX_CHARS, line
    for needle in needles:
        assert str(needle) in line, (needle, line)
    return line


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, (dict, list)):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    elif isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def scenario(**changes) -> dict:
    d = copy.deepcopy(BASE)
    for k, v in changes.items():
        if k == "workload_changes":
            d["workload"].update(v)
        else:
            d[k] = v
    return d


def run_broken(tmp_path: Path, data, *needles: str) -> str:
    path = write(tmp_path / "broken.yaml", data)
    return one_line_error(invoke("run", path, "-q", "--no-plots"), path, *needles)


# -- scenarios: each used to be a traceback (T), a hang or runaway memory (H) or a wrong report (W) ----------------
SCENARIOS = {
    # T: 1e300 GiB of memory made the block count NaN; H: a config.json that never ends was read whole
    "memory_gib-huge": ({"hardware": {"base": "cpu", "memory_gib": 1e300}}, "hardware.memory_gib"),
    "hf_config-dev-zero": ({"model": {"hf_config": "/dev/zero"}}, "model.hf_config"),
    # T: an empty peak_flops table
    "peak_flops-empty": ({"hardware": {"base": "cpu", "peak_flops": {}}}, "hardware.peak_flops"),
    # W: a link of 1e-300 B/s or a latency of 1e300 s priced steps at 1e300 s
    "interconnect-tiny": ({"hardware": {"base": "cpu", "interconnect_bandwidth": 1e-300},
                           "parallel": {"tensor_parallel_size": 3}}, "hardware.interconnect_bandwidth"),
    "interconnect-latency-huge": ({"hardware": {"base": "cpu", "interconnect_latency_s": 1e300},
                                   "parallel": {"tensor_parallel_size": 3}}, "hardware.interconnect_latency_s"),
    "host-bandwidth-tiny": ({"hardware": {"base": "cpu", "host_bandwidth": 1e-300},
                             "kv_cache": {"preemption": "swap"}}, "hardware.host_bandwidth"),
    # T: swap space of 1e300 GiB made the swap block count NaN
    "swap_space-huge": ({"kv_cache": {"preemption": "swap", "swap_space_gib": 1e300}}, "kv_cache.swap_space_gib"),
    # W: a context past the model's trained positions was planned for (vLLM refuses it)
    "max_model_len-past-positions": ({"serving": {"max_model_len": 65536}}, "serving.max_model_len"),
    # W: a head of hidden_size // num_heads silently dropped the remainder; a negative RoPE base was taken
    "hidden-not-divisible": ({"model": {"base": "SmolLM2-135M", "hidden_size": 577}}, "model"),
    "rope_theta-negative": ({"model": {"base": "SmolLM2-135M", "rope_theta": -1}}, "model.rope_theta"),
    # W: true/false where a number goes was read as 1/0
    "replicas-true": ({"replicas": True}, "replicas"),
    "rate-true": ({"workload_changes": {"arrival": {"process": "poisson", "rate": True}}}, "workload.arrival.rate"),
    "length-true": ({"workload_changes": {"prompt_len": {"dist": "fixed", "value": True}}},
                    "workload.prompt_len.value"),
    "model-layers-true": ({"model": {"base": "SmolLM2-135M", "num_layers": True}}, "model.num_layers"),
    # W: an empty profile path silently fell back to the roofline
    "profile-empty": ({"cost_model": {"profile": ""}}, "cost_model.profile"),
    "pool-profile-empty": ({"pools": {"prefill": {}, "decode": {"cost_model": {"profile": ""}}}},
                           "pools.decode.cost_model.profile"),
    # W: arrivals 1e300 s apart left no room in the clock's float for a step: latencies of 0
    "rate-tiny": ({"workload_changes": {"arrival": {"process": "poisson", "rate": 1e-300}}}, "workload.arrival.rate"),
    "burst-far": ({"workload_changes": {"bursts": [{"at_s": 1e300, "count": 2}]}}, "workload.bursts[0].at_s"),
    "trace-time_scale-tiny": ({"workload": {"trace": {"path": "builtin:azure_conv", "max_requests": 5,
                                                      "time_scale": 1e-300}}}, "workload.trace.time_scale"),
    # H: 2,000,000 burst requests on top of a trace were not counted against the request limit
    "trace-plus-bursts": ({"workload": {"trace": {"path": "builtin:azure_conv", "max_requests": 3},
                                        "bursts": [{"at_s": 0, "count": 2_000_000}]}}, "workload.bursts"),
    # T: weights summing to inf
    "weights-overflow": ({"workload_changes": {"prompt_len": {"dist": "empirical", "values": [1, 2],
                                                              "weights": [1e308, 1e308]}}}, "workload.prompt_len"),
    # W: drafter and verify costs of 1e300 s, a reference step of 1e-300 s; γ of a million
    "draft-time-huge": ({"speculative": {"acceptance_rate": 0.5, "draft_s_per_step": 1e300}},
                        "speculative.draft_s_per_step"),
    "verify-ratio-huge": ({"speculative": {"acceptance_rate": 0.5, "verify_cost_ratio": 1e300}},
                          "speculative.verify_cost_ratio"),
    "reference-step-tiny": ({"speculative": {"acceptance_rate": 0.5, "draft_s_per_step": 0.01,
                                             "draft_s_reference_step": 1e-300}}, "speculative"),
    "gamma-huge": ({"speculative": {"acceptance_rate": 0.5, "num_speculative_tokens": 10**6}},
                   "speculative.num_speculative_tokens"),
    "draft_model-empty": ({"speculative": {"method": "draft_model", "acceptance_rate": 0.5, "draft_model": ""}},
                          "speculative.draft_model"),
    # W: keys of another method, or per-request rates beside one α, were ignored without a word
    "medusa-tree-on-ngram": ({"speculative": {"acceptance_rate": 0.5, "medusa_tree": [[0]]}}, "medusa_tree"),
    "draft-model-on-ngram": ({"speculative": {"acceptance_rate": 0.5, "draft_model": "d"}}, "draft_model"),
    "rates-and-alpha": ({"speculative": {"acceptance_rate": 0.5, "request_rates": [[0.5, 0.5]]}}, "request_rates"),
    # T at serve time: torch takes neither seed nor thread count
    "executor-seed-huge": ({"executor": {"seed": 10**30}}, "executor.seed"),
    "executor-threads-huge": ({"executor": {"threads": 10**30}}, "executor.threads"),
}


@pytest.mark.parametrize("changes, key", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_broken_scenario(tmp_path, changes, key):
    run_broken(tmp_path, scenario(**changes), key)


HEAD = "model: SmolLM2-135M\nhardware: cpu\n"
WORKLOAD = ("workload: {arrival: {process: poisson, rate: 1}, num_requests: 2, prompt_len: {dist: fixed, value: 4}, "
            "output_len: {dist: fixed, value: 4}}\n")


@pytest.mark.parametrize("text", ["? [1, 2]\n: 2\n", "? {a: 1}\n: 2\n", "serving: {? [1]: 2}\n"],
                         ids=["list-key", "mapping-key", "nested-list-key"])
def test_a_key_that_is_a_list_or_mapping(tmp_path, text):
    """T: an unhashable key made the duplicate-key check raise TypeError."""
    run_broken(tmp_path, HEAD + text + WORKLOAD, "line")


def test_a_big_scenario_within_the_limits_reads_in_seconds(tmp_path):
    """H: 150,000 values (within the 200,000 limit) took 13 s to parse with PyYAML's pure-Python parser."""
    values = "[" + ", ".join(["1"] * 150_000) + "]"
    text = HEAD + WORKLOAD.replace("prompt_len: {dist: fixed, value: 4}",
                                   f"prompt_len: {{dist: empirical, values: {values}}}")
    path = write(tmp_path / "big.yaml", text)
    t0 = time.perf_counter()
    read_yaml(path)
    assert time.perf_counter() - t0 < 10


# -- profiles ----------------------------------------------------------------------------------------------------
def _profile(mutate) -> dict:
    d = json.loads(PROFILE.read_text())
    mutate(d)
    return d


PROFILES = {
    # T: a fit that prices a decode step at 0 s divided by zero in the simulator
    "coefs-zero": (lambda d: d["fit"].update(coefs={k: 0.0 for k in d["fit"]["coefs"]}), {}, "fit.coefs"),
    "coefs-empty": (lambda d: d["fit"].update(coefs={}), {}, "fit.coefs"),
    # T: composing tensor parallelism needs the measured all-reduce; KeyError without it
    "comm-missing-op": (lambda d: d["comm"].update(fit={"send_gloo": {"latency_s": 1e-4, "s_per_byte": 1e-9}}),
                        {"parallel": {"tensor_parallel_size": 3}}, "parallel.tensor_parallel_size"),
    # W: a weight dtype that is no text compared as "uncompressed"
    "model-dtype-list": (lambda d: d["model"].update(weight_dtype=[1]), {}, "model.weight_dtype"),
}


@pytest.mark.parametrize("mutate, extra, key", list(PROFILES.values()), ids=list(PROFILES))
def test_broken_profile(tmp_path, mutate, extra, key):
    prof = write(tmp_path / "profile.json", json.dumps(_profile(mutate)))
    path = write(tmp_path / "scenario.yaml", scenario(cost_model={"profile": str(prof)}, **extra))
    line = one_line_error(invoke("run", path, "-q", "--no-plots"), key)
    assert str(prof) in line or str(path) in line


# -- search specs: each used to run (pruning everything, or ignoring the key) or hang -----------------------------
SEARCH_SCENARIO = {"model": "SmolLM2-135M", "hardware": "cpu", "slo": {"ttft_s": 1.0},
                   "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 20,
                                "prompt_len": {"dist": "fixed", "value": 8},
                                "output_len": {"dist": "fixed", "value": 8}}}


def search_spec(**changes) -> dict:
    return {"scenario": SEARCH_SCENARIO, "space": {"serving.max_num_seqs": [4]},
            "search": {"max_requests": 20, "min_rate": 0.5, "max_rate": 4}, **changes}


SEARCHES = {
    "space-empty": (search_spec(space={}), "space"),
    "space-typo": (search_spec(space={"serving.max_num_sqes": [4, 8]}), "space.serving.max_num_sqes"),
    "space-bad-value": (search_spec(space={"serving.max_num_seqs": [4, -1]}), "space.serving.max_num_seqs[1]"),
    "space-bad-model-dtype": (search_spec(space={"model.weight_dtype": ["int8", "int3"]}),
                              "space.model.weight_dtype[1]"),
    "space-workload": (search_spec(space={"workload.num_requests": [5, 10]}), "space.workload.num_requests"),
    "space-slo": (search_spec(space={"slo.ttft_s": [0.5, 1.0]}), "space.slo.ttft_s"),
    "space-pools-true": (search_spec(space={"pools": [[True, True]]}), "space.pools"),
    "rates-reversed": (search_spec(search={"max_requests": 20, "min_rate": 100, "max_rate": 1}), "search"),
}


@pytest.mark.parametrize("spec, key", list(SEARCHES.values()), ids=list(SEARCHES))
def test_broken_search_spec(tmp_path, spec, key):
    path = write(tmp_path / "search.yaml", spec)
    one_line_error(invoke("search", path, "-q", "--workers", "1"), path, key)


def test_a_search_names_the_base_scenario_file_it_found_broken(tmp_path):
    base = write(tmp_path / "base.yaml", {**SEARCH_SCENARIO, "replicas": 0})
    path = write(tmp_path / "search.yaml", search_spec(scenario="base.yaml"))
    one_line_error(invoke("search", path, "-q", "--workers", "1"), base, "replicas")


@pytest.mark.parametrize("args, key", [(["--address", "127.0.0.1:1"], "--address"),
                                       (["--backend", "ray", "--address", "127.0.0.1:1"], "--address"),
                                       (["--backend", "ray", "--address", "no-port"], "--address"),
                                       (["--workers", "0"], "--workers")])
def test_search_flags(tmp_path, args, key):
    """H: Ray retried an unreachable address for many minutes; T/usage panel: --workers 0."""
    path = write(tmp_path / "search.yaml", search_spec())
    one_line_error(invoke("search", path, "-q", "--workers", "1", *args), key)


# -- compare -----------------------------------------------------------------------------------------------------
def test_compare_names_the_broken_file_not_its_stem(tmp_path):
    good = write(tmp_path / "good.yaml", scenario())
    bad = write(tmp_path / "bad.yaml", scenario(replicas=0))
    one_line_error(invoke("compare", good, bad, "-q"), bad, "replicas")


def test_compare_resolves_each_scenarios_paths_in_its_own_folder(tmp_path):
    """W: a second scenario's relative profile was looked up in the first one's folder (and not found)."""
    good = write(tmp_path / "a" / "good.yaml", scenario())
    other = write(tmp_path / "b" / "other.yaml", scenario(cost_model={"profile": "p.json"}))
    shutil.copy(PROFILE, tmp_path / "b" / "p.json")
    r = invoke("compare", good, other, "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert set(json.loads((tmp_path / "out" / "compare.json").read_text())) == {"good", "other"}


def test_compare_keeps_files_of_one_name_apart(tmp_path):
    """W: two files of one name made one compare.json entry; the same file twice is refused."""
    a = write(tmp_path / "a" / "x.yaml", scenario())
    b = write(tmp_path / "b" / "x.yaml", scenario(serving={"max_num_seqs": 2}))
    r = invoke("compare", a, b, "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert len(json.loads((tmp_path / "out" / "compare.json").read_text())) == 2
    one_line_error(invoke("compare", a, a, "-q"), a)


@pytest.mark.parametrize("sweep, needles", [
    ("workload.num_requests=2,3", ["--sweep", "workload.num_requests"]),  # W: every value ran the first's workload
    ("slo.ttft_s=1,2", ["--sweep", "slo.ttft_s"]),
    ("serving.max_num_seqs=4,4", ["serving.max_num_seqs=4"]),  # W: one entry of compare.json replaced the other
    ("serving.max_num_seqs=4,-1", ["serving.max_num_seqs", "--sweep"]),
    ("serving.max_num_seqs=" + ",".join(str(i) for i in range(1, 300)), ["at most"]),  # H: no bound
])
def test_compare_sweeps(tmp_path, sweep, needles):
    path = write(tmp_path / "s.yaml", scenario())
    one_line_error(invoke("compare", path, "-q", "--sweep", sweep), *needles)


# -- validate --real-from: each used to be a traceback or a score of the wrong run ---------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """The H200 runs of the validation scenarios shipped in docs/runs, unpacked once."""
    folder = tmp_path_factory.mktemp("recorded")
    with tarfile.open(ROOT / "docs/runs/2026-11-30-h200/runs.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    return folder


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rewrite(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


RECORDED = {
    "no-requests-file": (lambda d: (d / "run1/requests.jsonl").unlink(), "requests.jsonl"),
    "no-steps-file": (lambda d: (d / "run1/steps.jsonl").unlink(), "steps.jsonl"),
    "run-is-a-file": (lambda d: (d / "run2").write_text("x"), "run2"),
    "not-json": (lambda d: (d / "run1/requests.jsonl").write_text("not json\n"), "line 1"),
    "binary": (lambda d: (d / "run1/steps.jsonl").write_bytes(bytes(range(256))), "steps.jsonl"),
    "a-list": (lambda d: (d / "run1/requests.jsonl").write_text("[1, 2]\n"), "line 1"),
    "no-arrival": (lambda d: _rewrite(d / "run1/requests.jsonl", [{"id": 0}]), "arrival_s"),
    "bad-status": (lambda d: _rewrite(d / "run1/requests.jsonl", [
        {**r, "status": "weird"} for r in _lines(d / "run1/requests.jsonl")]), "status"),
    "step-without-tokens": (lambda d: _rewrite(d / "run1/steps.jsonl", [
        {k: v for k, v in r.items() if k != "new_tokens"} for r in _lines(d / "run1/steps.jsonl")]), "new_tokens"),
    "no-requests": (lambda d: (d / "run1/requests.jsonl").write_text(""), "no requests"),
    "no-steps": (lambda d: (d / "run1/steps.jsonl").write_text(""), "no step"),
    # W: a run of 3 of the 16 requests, or of another scenario, was scored as this scenario's
    "fewer-requests": (lambda d: _rewrite(d / "run1/requests.jsonl", _lines(d / "run1/requests.jsonl")[:3]),
                       "--real-from"),
}


@pytest.mark.parametrize("mutate, needle", list(RECORDED.values()), ids=list(RECORDED))
def test_broken_recorded_run(tmp_path, recorded, mutate, needle):
    folder = tmp_path / "low_load"
    shutil.copytree(recorded / "low_load", folder)
    mutate(folder)
    r = invoke("validate", ROOT / "scenarios/validation/low_load.yaml", "--device", "cuda", "--profile", CUDA_PROFILE,
               "--real-from", folder)
    one_line_error(r, folder, needle)


def test_a_run_of_another_scenario_is_not_scored(recorded):
    r = invoke("validate", ROOT / "scenarios/validation/medium_load.yaml", "--device", "cuda", "--profile",
               CUDA_PROFILE, "--real-from", recorded / "low_load")
    one_line_error(r, recorded / "low_load", "--real-from", "another scenario")


def test_validate_profile_that_is_a_folder(tmp_path, recorded):
    r = invoke("validate", ROOT / "scenarios/validation/low_load.yaml", "--device", "cuda", "--profile", tmp_path,
               "--real-from", recorded / "low_load")
    one_line_error(r, "--profile", tmp_path)


# -- flags checked before anything loads -------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["serve", "x.yaml", "--threads", "0"], "--threads"),
    (["validate", "x.yaml", "--threads", "-3"], "--threads"),
    (["run", "--no-such-flag"], "--no-such-flag"),
    (["serve"], "scenario"),
    (["no-such-command"], "no-such-command"),
    (["distill", "--layers", ""], "--layers"),
    (["distill", "--layers", "-1"], "--layers"),
])
def test_flags(args, needle):
    """Usage mistakes were a multi-line panel; distill's layers were checked after the teacher loaded."""
    one_line_error(invoke(*args), needle)


def test_distill_out_that_is_a_file(tmp_path):
    f = write(tmp_path / "file", "x")
    one_line_error(invoke("distill", "--out", f), "--out", f)


def test_serve_checkpoint_without_model_type(tmp_path):
    """T: transformers' ValueError for a config.json without model_type, after the serve had started."""
    ckpt = tmp_path / "ckpt"
    write(ckpt / "config.json", json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                            "intermediate_size": 128, "vocab_size": 100}))
    path = write(tmp_path / "s.yaml", scenario(model={"hf_config": str(ckpt)}))
    one_line_error(invoke("serve", path, "-q"), path, "model.hf_config", "model_type")



@pytest.mark.parametrize("args, flag", [
    (["profile", "--out", "{tmp}", "--quick"], "--out"),
    (["validate", str(ROOT / "scenarios/validation/low_load.yaml"), "--profile-alongside", "{tmp}"],
     "--profile-alongside"),
])
def test_a_profile_to_write_that_is_a_folder(tmp_path, args, flag):
    """H then T: minutes of profiling ended in IsADirectoryError when the profile was written."""
    one_line_error(invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args]), flag, tmp_path)

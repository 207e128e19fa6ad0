"""Bad input, second pass: the executor's inputs (serve, validate, profile), search spaces, compare, and the
dashboard's uploads. Every case used to end in a traceback (T), a hang or minutes lost before the error (H), or a
silently wrong result (W); each now exits 2 with one line naming the file and the key, as in
tests/test_bad_input_more.py, or (the dashboard) shows the line in the page. Executor cases use a 2-layer config.json
with executor.random_weights, so nothing loads real weights.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.test_bad_input_more import invoke, one_line_error, write

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "calibration" / "profiles" / "cpu.json"
CUDA_PROFILE = ROOT / "calibration" / "profiles" / "cuda.json"
HEADS = ROOT / "executor" / "data" / "medusa-smollm2-135m"
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "head_dim": 16, "vocab_size": 1000, "max_position_embeddings": 512, "tie_word_embeddings": False,
               "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "dtype": "float32"}
SMALL = {"seed": 0, "arrival": {"process": "poisson", "rate": 1000.0}, "num_requests": 2,
         "prompt_len": {"dist": "fixed", "value": 4}, "output_len": {"dist": "fixed", "value": 2}}


def tiny(tmp_path: Path, config: dict | None = None, **sections) -> dict:
    """A serve-ready scenario on a 2-layer llama given by its config.json alone (random weights)."""
    ckpt = write(tmp_path / "ckpt" / "config.json", json.dumps(config or TINY_CONFIG)).parent
    d = {"name": "round2", "model": {"hf_config": str(ckpt)}, "hardware": "cpu",
         "serving": {"max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64},
         "kv_cache": {"num_blocks": 32, "block_size": 8}, "workload": copy.deepcopy(SMALL),
         "executor": {"threads": 1, "random_weights": True}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return d


def smollm2(**sections) -> dict:
    """SmolLM2-135M's architecture (what the shipped Medusa heads fit), random weights: errors come before it builds."""
    return {"name": "round2-smollm2", "model": "SmolLM2-135M", "hardware": "cpu",
            "serving": {"max_num_seqs": 4, "max_model_len": 64, "max_num_batched_tokens": 64},
            "kv_cache": {"num_blocks": 32, "block_size": 8}, "workload": copy.deepcopy(SMALL),
            "executor": {"threads": 1, "random_weights": True}, **sections}


# -- model: {hf_config}: a config.json with missing keys, wrong types, absurd values ---------------------------------
HF_CONFIGS = {
    # W: a pydantic dump cut mid-word; now the file's own key and the rule
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
    "head_dim-0": ({"head_dim": 0}, "head_dim 0"),
    "layers-0": ({"num_hidden_layers": 0}, "num_hidden_layers 0"),
    "heads-0": ({"num_attention_heads": 0}, "num_attention_heads 0"),
    "max-positions-0": ({"max_position_embeddings": 0}, "max_position_embeddings 0"),
    "rope-negative": ({"rope_theta": -5}, "rope_theta -5"),
    "missing-hidden": ({"hidden_size": None}, "hidden_size missing"),
    # W then T: "64" and "false" were taken by the simulator (as 64 and true) and refused by transformers in serve
    "hidden-text": ({"hidden_size": "64"}, "hidden_size '64'"),
    "tie-text": ({"tie_word_embeddings": "false"}, "tie_word_embeddings 'false'"),
    "vocab-fraction": ({"vocab_size": 1000.5}, "vocab_size 1000.5"),
    "rope-text": ({"rope_theta": "abc"}, "rope_theta 'abc'"),
    # W: read as fp16, so an fp32 or quantized checkpoint's weights were priced at 2 bytes unannounced
    "dtype-unknown": ({"dtype": None, "torch_dtype": "float64"}, "torch_dtype 'float64'"),
    "dtype-list": ({"dtype": ["float32"]}, "torch_dtype ['float32']"),
}


def hf_config_error(tmp_path: Path, change: dict, needle: str) -> None:
    """`run` of the tiny config.json with `change` (None drops a key) is one line naming the file and `needle`."""
    config = {k: v for k, v in {**TINY_CONFIG, **change}.items() if v is not None}
    path = write(tmp_path / "s.yaml", tiny(tmp_path, config))
    line = one_line_error(invoke("run", path, "-q", "--no-plots"), path, "model.hf_config", needle)
    assert "config.json" in line


@pytest.mark.parametrize("change, needle", list(HF_CONFIGS.values()), ids=list(HF_CONFIGS))
def test_broken_hf_config(tmp_path, change, needle):
    hf_config_error(tmp_path, change, needle)


def test_hf_config_a_list(tmp_path):
    path = write(tmp_path / "s.yaml", tiny(tmp_path))
    write(tmp_path / "ckpt" / "config.json", "[1, 2]")
    one_line_error(invoke("serve", path, "-q"), path, "model.hf_config", "not a list")


def test_hf_config_rope_theta_of_transformers_5_is_read():
    """W: transformers >= 5 writes rope_theta under rope_parameters; it was read as the default 10000."""
    from sim.config.hf_config import model_from_hf_config

    config = {**TINY_CONFIG, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert model_from_hf_config(config).rope_theta == 100000.0


def test_hf_config_dtype_the_scenario_sets_or_the_file_names():
    from sim.config.hf_config import model_from_hf_config

    config = {k: v for k, v in TINY_CONFIG.items() if k != "dtype"}
    assert model_from_hf_config({**config, "torch_dtype": "float8_e4m3fn"}).weight_dtype == "fp8"
    assert model_from_hf_config({**config, "torch_dtype": "float64"}, weight_dtype="int8").weight_dtype == "int8"


# -- speculative drafters: checked before the target model loads -----------------------------------------------------
def _heads(tmp_path: Path, meta=None, weights: bool = True, text: str | None = None) -> Path:
    folder = tmp_path / "heads"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "medusa.json").write_text(text if text is not None else json.dumps(
        meta or json.loads((HEADS / "medusa.json").read_text())))
    if weights:
        shutil.copy(HEADS / "medusa.safetensors", folder)
    return folder


DEEP = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
DRAFTERS = {
    # H: a tree deeper than the shipped 3 heads failed only after the target model had loaded
    "medusa-tree-deeper-than-heads": (lambda t: {"method": "medusa", "medusa_tree": DEEP}, "speculative.medusa_tree"),
    # T: medusa.json without its weights, or not JSON, or without num_heads: a FileNotFoundError / KeyError
    "medusa-no-weights": (lambda t: {"method": "medusa", "medusa_tree": [[0]],
                                     "medusa_heads": str(_heads(t, weights=False))}, "speculative.medusa_heads"),
    "medusa-meta-not-json": (lambda t: {"method": "medusa", "medusa_tree": [[0]],
                                        "medusa_heads": str(_heads(t, text="{"))}, "speculative.medusa_heads"),
    "medusa-meta-no-heads": (lambda t: {"method": "medusa", "medusa_tree": [[0]],
                                        "medusa_heads": str(_heads(t, meta={"hidden_size": 576}))},
                             "speculative.medusa_heads"),
    "draft-missing": (lambda t: {"method": "draft_model", "draft_model": str(t / "no-such-draft")},
                      "speculative.draft_model"),
    "draft-no-weights": (lambda t: {"method": "draft_model", "draft_model": str(
        write(t / "draft" / "draft.json", json.dumps({"num_layers": 1, "hidden_size": 576})).parent)},
                         "speculative.draft_model"),
}


@pytest.mark.parametrize("spec, key", list(DRAFTERS.values()), ids=list(DRAFTERS))
@pytest.mark.parametrize("command", ["serve", "validate"])
def test_broken_drafter(tmp_path, command, spec, key):
    speculative = spec(tmp_path)
    if command == "validate":  # what the simulator needs, so that the drafter is what is wrong
        speculative = {**speculative, **({"medusa_rank_probs": [[0.5, 0.5]] * 4}
                                         if speculative["method"] == "medusa" else {"acceptance_rate": 0.5})}
    path = write(tmp_path / "s.yaml", smollm2(speculative=speculative))
    one_line_error(invoke(command, path, "--profile", PROFILE) if command == "validate" else invoke(command, path, "-q"),
                   path, key)


def test_run_checks_named_heads_that_exist_and_plans_with_heads_not_made_yet(tmp_path):
    """W: `infersim run` planned a tree 4 deep on a folder of 3 heads that `serve` then refused."""
    probs = {"medusa_rank_probs": [[0.5, 0.5]] * 4}
    named = write(tmp_path / "s.yaml", smollm2(speculative={"method": "medusa", "medusa_tree": DEEP, **probs,
                                                            "medusa_heads": str(_heads(tmp_path))}))
    one_line_error(invoke("run", named, "-q"), named, "speculative.medusa_tree")
    planned = write(tmp_path / "p.yaml", smollm2(speculative={"method": "medusa", "medusa_tree": DEEP, **probs,
                                                              "medusa_heads": str(tmp_path / "to-train")}))
    r = invoke("run", planned, "-q")
    assert r.exit_code == 0, r.output


def test_heads_of_another_model(tmp_path):
    """T at engine construction: heads of hidden size 576 on a 64-wide model."""
    path = write(tmp_path / "s.yaml", tiny(tmp_path, speculative={"method": "medusa", "medusa_tree": [[0]]}))
    one_line_error(invoke("serve", path, "-q"), path, "speculative.medusa_heads", "hidden size 576")


# -- executor threads -------------------------------------------------------------------------------------------------
def test_threads_past_the_cores_are_said_out_loud(tmp_path):
    """W: executor.threads 1000 on 2 cores served every step 100x slower and reported it as this machine's speed."""
    cores = len(os.sched_getaffinity(0))
    path = write(tmp_path / "s.yaml", tiny(tmp_path, executor={"threads": cores + 1}))
    r = invoke("serve", path, "--no-plots")
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.output.splitlines() if line.startswith("infersim: warning:")]
    assert len(warnings) == 1 and "executor.threads" in warnings[0] and f"{cores} cores" in warnings[0]


@pytest.mark.parametrize("args, flag", [
    (["serve", "x.yaml", "--threads", str(10**20)], "--threads"),  # T: torch's overflow
    (["profile", "--threads", str(10**20)], "--threads"),
    (["train-medusa", "--threads", str(10**20)], "--threads"),
    (["distill", "--threads", str(10**20)], "--threads"),  # W: reported against --layers
    (["profile", "--repeats", str(10**6)], "--repeats"),  # H: a sweep of a million repeats
    (["validate", "x.yaml", "--repeat", str(10**6)], "--repeat"),
    (["distill", "--train-minutes", "inf"], "--train-minutes"),  # H: trained forever
    (["train-medusa", "--train-minutes", "1e9"], "--train-minutes"),
])
def test_flags_past_their_bounds(args, flag):
    one_line_error(invoke(*args), flag)


@pytest.mark.parametrize("command, args, needles", [
    ("serve", ["--out", "/sys/infersim-out"], ["--out"]),
    ("serve", ["--out", "{file}"], ["--out", "{file}"]),
    ("validate", ["--out", "{file}"], ["--out", "{file}"]),
    ("serve", ["--profile", "{tmp}"], ["--profile", "{tmp}"]),
    ("serve", ["--profile", "{truncated}"], ["{truncated}", "not readable JSON"]),
])
def test_serve_and_validate_outputs_and_profiles(tmp_path, command, args, needles):
    """Checked before the model loads (already so; kept so by this test)."""
    names = {"{file}": str(write(tmp_path / "a-file", "x")), "{tmp}": str(tmp_path),
             "{truncated}": str(write(tmp_path / "p.json", PROFILE.read_text()[:300]))}
    path = write(tmp_path / "s.yaml", tiny(tmp_path))
    one_line_error(invoke(command, path, *[names.get(a, a) for a in args]), *[names.get(n, n) for n in needles])


# -- validate: a broken profile is refused before the executor runs -------------------------------------------------
@pytest.mark.parametrize("text, needle", [
    (PROFILE.read_text()[:300], "not readable JSON"),
    (PROFILE.read_text().replace('"coefs": {', '"coefs": {"step": NaN, ', 1), "not readable JSON"),
    ("[1]", "not a list"),
])
def test_validate_reads_its_profile_before_serving(tmp_path, text, needle):
    """H: the executor ran the scenario first; the profile's error came after."""
    prof = write(tmp_path / "p.json", text)
    path = write(tmp_path / "s.yaml", tiny(tmp_path))
    one_line_error(invoke("validate", path, "--profile", prof), prof, needle)


def test_validate_with_a_profile_of_another_model(tmp_path):
    path = write(tmp_path / "s.yaml", tiny(tmp_path))
    one_line_error(invoke("validate", path, "--profile", PROFILE), "--profile", "measured for SmolLM2")


# -- validate --real-from: runs that do not add up ----------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recorded")
    with tarfile.open(ROOT / "docs/runs/2026-11-30-h200/runs.tar.gz") as tar:
        tar.extractall(folder, filter="data")
    return folder / "low_load"


def _edit(path: Path, change) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records = change(records) or records
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _first(key: str, fn):
    def change(records):
        records[0][key] = fn(records[0])
    return change


RECORDED = {
    # W: each was scored as a run: half the steps, a request of 3 of its 33 tokens, negative latencies
    "steps-cut-at-a-line": ("steps.jsonl", lambda rs: rs[:len(rs) // 2], "cut short"),
    "tokens-missing": ("requests.jsonl", _first("token_times", lambda r: r["token_times"][:3]), "token_times"),
    "tokens-out-of-order": ("requests.jsonl", _first("token_times", lambda r: r["token_times"][::-1]), "time order"),
    "token-before-arrival": ("requests.jsonl", _first("token_times", lambda r: [-1.0] + r["token_times"][1:]),
                             "arrival_s"),
    "step-ends-before-it-starts": ("steps.jsonl", _first("end_s", lambda s: s["start_s"] - 1), "line 1"),
    "step-contexts-missing": ("steps.jsonl", _first("context_lens", lambda s: []), "context_lens"),
}


@pytest.mark.parametrize("name, change, needle", list(RECORDED.values()), ids=list(RECORDED))
def test_recorded_run_that_does_not_add_up(tmp_path, recorded, name, change, needle):
    folder = tmp_path / "low_load"
    shutil.copytree(recorded, folder)
    _edit(folder / "run1" / name, change)
    r = invoke("validate", ROOT / "scenarios/validation/low_load.yaml", "--device", "cuda", "--profile", CUDA_PROFILE,
               "--real-from", folder)
    one_line_error(r, folder / "run1" / name, needle)


# -- profile ------------------------------------------------------------------------------------------------------
def _samples(mutate) -> dict:
    d = json.loads(PROFILE.read_text())
    d["samples"] = mutate(d["samples"])
    return d


REFITS = {
    # T: IndexError, ValueError from the fit; W: a fit of 3 steps, or of negative times, written as the profile
    "no-samples": (lambda s: [], "samples"),
    "nan-time": (lambda s: [{**x, "time_s": float("nan")} for x in s], "time_s"),
    "negative-time": (lambda s: [{**x, "time_s": -1.0} for x in s], "time_s"),
    "three-samples": (lambda s: s[:3], "at least"),
}


@pytest.mark.parametrize("mutate, needle", list(REFITS.values()), ids=list(REFITS))
def test_refit_of_broken_samples(tmp_path, mutate, needle):
    prof = write(tmp_path / "p.json", json.dumps(_samples(mutate)))
    before = prof.read_text()
    one_line_error(invoke("profile", "--refit", "--out", prof), "--out", prof, needle)
    assert prof.read_text() == before


def test_refit_of_a_folder(tmp_path):
    """T: IsADirectoryError."""
    one_line_error(invoke("profile", "--refit", "--out", tmp_path), "--out", tmp_path)


def test_profile_out_nothing_can_be_written_to(tmp_path):
    """H: root passes os.access on /sys; the sweep ran for minutes before the write failed."""
    one_line_error(invoke("profile", "--quick", "--out", "/sys/infersim-profile.json"), "--out")


@pytest.mark.parametrize("text", ["name: a scenario\n", "{}", "\x00\x01"], ids=["yaml", "json", "binary"])
def test_profile_out_onto_a_file_that_is_not_a_profile(tmp_path, text):
    """W: the sweep's minutes ended by overwriting it."""
    target = write(tmp_path / "chat.yaml", text)
    one_line_error(invoke("profile", "--quick", "--out", target), "--out", "not an infersim profile")
    assert target.read_text() == text


@pytest.mark.parametrize("command", ["distill", "train-medusa"])
def test_training_out_nothing_can_be_written_to(command):
    """H: minutes of generating and training before the write failed."""
    one_line_error(invoke(command, "--out", "/sys/infersim-drafter"), "--out")


def test_retree_of_heads_whose_record_is_broken(tmp_path):
    """T: a JSONDecodeError / KeyError from medusa.json."""
    folder = _heads(tmp_path, text="{")
    one_line_error(invoke("train-medusa", "--retree", "--out", folder), "--out", folder)
    _heads(tmp_path, meta={"num_heads": 3, "hidden_size": 576})
    one_line_error(invoke("train-medusa", "--retree", "--out", folder), "--out", "heldout_rank_probs")


def test_capacity_requests_past_the_limit_names_the_flag(tmp_path):
    path = write(tmp_path / "s.yaml", tiny(tmp_path))
    one_line_error(invoke("validate", path, "--capacity", "--requests", str(10**8)), path, "--requests")


def test_profile_scenario_without_weights_names_the_file(tmp_path):
    path = write(tmp_path / "s.yaml", {**smollm2(), "model": "Llama-2-7B", "hardware": "A100-80GB",
                                       "executor": {"threads": 1}})
    one_line_error(invoke("profile", "--quick", "--scenario", path, "--out", tmp_path / "p.json"), path, "model")


# -- search spaces ------------------------------------------------------------------------------------------------
SEARCH_SCENARIO = {"model": "SmolLM2-135M", "hardware": "cpu", "slo": {"ttft_s": 1.0},
                   "workload": {"arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 20,
                                "prompt_len": {"dist": "fixed", "value": 8},
                                "output_len": {"dist": "fixed", "value": 8}}}
SPACES = {
    # W: the same configuration probed twice, two rows of one label in search.json
    "duplicate": ({"serving.max_num_seqs": [4, 8, 4]}, "space.serving.max_num_seqs[2]"),
    "duplicate-as-float": ({"serving.max_num_seqs": [4, 4.0]}, "space.serving.max_num_seqs[1]"),
    "duplicate-null": ({"pools": [None, None]}, "space.pools[1]"),
    # W: two spellings of one configuration were two rows, each probed
    "duplicate-spelling": ({"hardware": ["cpu", {"base": "cpu"}]}, "space.hardware[1]"),
    "duplicate-default": ({"kv_cache": [{"block_size": 16}, {"block_size": 16, "allocator": "paged"}]},
                          "space.kv_cache[1]"),
    # W: which of the two won depended on the keys' order
    "key-inside-a-whole-section": ({"serving": [{"max_num_seqs": 8}], "serving.max_num_seqs": [4]},
                                   "space.serving.max_num_seqs"),
    # W: the simulator ignores executor: every value gave the same capacity
    "executor-key": ({"executor.threads": [1, 2]}, "space.executor.threads"),
}


@pytest.mark.parametrize("space, key", list(SPACES.values()), ids=list(SPACES))
def test_broken_search_space(tmp_path, space, key):
    path = write(tmp_path / "search.yaml", {"scenario": SEARCH_SCENARIO, "space": space,
                                            "search": {"max_requests": 20, "min_rate": 0.5, "max_rate": 4}})
    one_line_error(invoke("search", path, "-q", "--workers", "1"), path, key)


# -- compare: workloads and SLOs that differ ------------------------------------------------------------------------
def _scenario(**changes) -> dict:
    d = {"name": "x", "model": "SmolLM2-135M", "hardware": "cpu", "workload": copy.deepcopy(SMALL)}
    d["workload"]["arrival"]["rate"] = 1.0
    return {**d, **changes}


@pytest.mark.parametrize("other, said", [
    (_scenario(workload={**SMALL, "num_requests": 5}), "workload differs"),
    (_scenario(slo={"ttft_s": 0.1}), "slo differs"),
    (_scenario(workload={**SMALL, "num_requests": 5}, slo={"ttft_s": 0.1}), "workload and slo differ"),
])
def test_compare_says_whose_workload_and_slo_ran(tmp_path, other, said):
    """W: the later scenarios' workload and slo were replaced by the first's without a word; and where the first
    had no slo, a later one's own slo graded it alone."""
    a, b = write(tmp_path / "a.yaml", _scenario()), write(tmp_path / "b.yaml", other)
    r = invoke("compare", a, b, "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if line.startswith("infersim: note:")]
    assert len(notes) == 1 and said in notes[0] and str(b) in notes[0] and f"runs {a}'s" in notes[0], notes
    reports = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert reports["b"]["requests"]["arrived"] == reports["a"]["requests"]["arrived"] == 2
    assert reports["b"]["slo"]["ttft_s"] is None


def test_compare_of_like_workloads_says_nothing(tmp_path):
    a = write(tmp_path / "a.yaml", _scenario())
    b = write(tmp_path / "b.yaml", _scenario(serving={"max_num_seqs": 2}, slo={"quantile": 0.9}))
    r = invoke("compare", a, b, "-q")
    assert r.exit_code == 0 and "note" not in r.output, r.output


@pytest.mark.parametrize("text", [b"", bytes(range(256)) * 4, b"arrival_s,prompt_len,output_len\n0,-3,5\n",
                                  b"arrival_s,prompt_len,output_len\n0,5,nan\n"],
                         ids=["empty", "binary", "negative-length", "nan-length"])
def test_serve_of_a_broken_trace(tmp_path, text):
    """The executor reads a trace as the simulator does: one line naming the trace, before the model loads."""
    trace = write(tmp_path / "t.csv", text)
    path = write(tmp_path / "s.yaml", {**tiny(tmp_path), "workload": {"trace": {"path": str(trace)}}})
    one_line_error(invoke("serve", path, "-q"), trace, "workload.trace.path")


# -- traces: what happens to rows out of order and lengths of 0 (README, workload.trace) --------------------------
def test_trace_rows_are_sorted_and_zero_lengths_count_as_one(tmp_path):
    from sim.config.generator import generate_requests
    from sim.config.workload import WorkloadConfig

    trace = write(tmp_path / "t.csv", "arrival_s,prompt_len,output_len\n5,10,0\n1,0,5\n3,7,7\n")
    specs = generate_requests(WorkloadConfig.model_validate({"trace": {"path": str(trace)}}))
    assert [(s.arrival_s, s.prompt_len, s.output_len) for s in specs] == [(0.0, 1, 5), (2.0, 7, 7), (4.0, 10, 1)]


# -- dashboard ------------------------------------------------------------------------------------------------------
GOOD_ROW = {"real": 1.0, "sim": 1.1, "error_pct": 10.0}
VALIDATIONS = {  # T: each raised inside the page (an exception box, the rest of the page gone)
    "requests-a-list": ({"metrics": {"ttft_p50": GOOD_ROW}, "requests": [1]}, "requests"),
    "speculative-a-list": ({"metrics": {"ttft_p50": GOOD_ROW}, "speculative": [1]}, "speculative"),
    "cdf-not-lists": ({"metrics": {"ttft_p50": GOOD_ROW}, "latency_cdf": {"levels": 3, "real": "x", "sim": 1}},
                      "latency_cdf"),
    "spread-text": ({"metrics": {"ttft_p50": {**GOOD_ROW, "spread_pct": "x"}}}, "metrics.ttft_p50"),
    "at-speed-text": ({"metrics": {"ttft_p50": {**GOOD_ROW, "error_at_run_speed_pct": "x"}}}, "metrics.ttft_p50"),
    "ratio-a-number": ({"metrics": {"ttft_p50": GOOD_ROW}, "step_time_ratio": 3}, "step_time_ratio"),
    "ratio-text": ({"metrics": {"ttft_p50": GOOD_ROW}, "step_time_ratio": [{"all": "x"}]}, "step_time_ratio"),
    "no-metrics": ({"metrics": {}}, "no 'metrics'"),
}
CAPACITIES = {
    "probes-text": {"probes": ["x"]},
    "missed-at-text": {"measured": {"capacity_rps": 4.0, "missed_at_rps": "x"}},
    "at-run-speed-a-number": {"predicted_at_run_speed": 3},
    "error-text": {"error_pct": "x"},
}


def test_dashboard_validation_uploads_and_capacity_files_that_are_broken(tmp_path, monkeypatch):
    import dashboard.seeds
    from tests.test_dashboard import assert_clean, errors, open_page

    good = {"scenario": "s", "measured": {"capacity_rps": 4.0, "missed_at_rps": 4.2},
            "predicted": {"capacity_rps": 4.2}, "probes": []}
    for name, change in CAPACITIES.items():
        write(tmp_path / "runs" / name / "capacity.json", json.dumps({**good, **change}))
    monkeypatch.setattr(dashboard.seeds, "REPO", tmp_path)
    at = open_page("validation_page.py")
    assert sorted(errors(at)) == sorted(f"runs/{n}/capacity.json: {k}" for n, k in (
        ("probes-text", "probes: a list of mappings (rate, passes, sim_passes)"),
        ("missed-at-text", "measured.missed_at_rps: a number or null"),
        ("at-run-speed-a-number", "predicted_at_run_speed: a mapping with capacity_rps (a number)"),
        ("error-text", "error_pct: a number or null")))
    at.file_uploader(key="validation.upload").set_value([
        (f"{name}.json", json.dumps(data).encode(), "application/json")
        for name, (data, _) in VALIDATIONS.items()]).run()
    assert_clean(at)
    shown = {line.split(".json: ")[0]: line for line in errors(at) if not line.startswith("runs/")}
    assert set(shown) == set(VALIDATIONS), shown
    for name, (_, needle) in VALIDATIONS.items():
        assert needle in shown[name], shown[name]


def test_dashboard_keeps_a_seeded_block_size_past_the_widgets_old_bound(tmp_path):
    """W: a scenario's block_size of 8192 was clipped to the widget's 4096 and simulated so."""
    from tests.test_dashboard import assert_clean, open_page, widget

    at = open_page()
    text = (ROOT / "scenarios/smollm2_cpu_small.yaml").read_text().replace("block_size: 16", "block_size: 8192")
    at.file_uploader(key="whatif.upload").set_value(("big.yaml", text.encode(), "application/x-yaml")).run()
    assert_clean(at)
    assert widget(at, "number_input", "kv.block_size").value == 8192

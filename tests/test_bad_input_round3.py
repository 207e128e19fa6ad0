"""Bad input, third pass: trace files read as something they do not say, and hf_config models priced as a dense
llama when they are not. Each case used to give a silently wrong result (W) or a traceback (T); each now exits 2 with
one line naming the file and the key, as in tests/test_bad_input_more.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sim.config.traces import load_trace
from tests.test_bad_input_more import invoke, one_line_error, write
from tests.test_bad_input_round2 import TINY_CONFIG, hf_config_error, tiny

SECONDS_HEADER = "arrival_s,prompt_len,output_len\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
MOONCAKE_LINE = '{"timestamp": 0, "input_length": 5, "output_length": 5}\n'


def run_trace(tmp_path: Path, name: str, text: str) -> str:
    """The one error line of a run replaying a trace file holding `text` (written as is: no newline translation)."""
    trace = tmp_path / name
    trace.write_bytes(text.encode("utf-8"))
    d = tiny(tmp_path)
    d["workload"] = {"trace": {"path": str(trace)}}
    path = write(tmp_path / "s.yaml", d)
    return one_line_error(invoke("run", path, "-q", "--no-plots"), path, "workload.trace.path", str(trace))


# -- trace files: each used to be read as other numbers or other rows than the file holds --------------------------
BROKEN_TRACES = {
    # W: a quoted cell holding a newline was cut in two lines, then "5" + "6" read as output_len 56
    "quoted-newline": ("t.csv", SECONDS_HEADER + '0,5,5\n"1",5,"5\n6"\n', "row 3: output_len '5\\n6'"),
    # W: a form feed or U+2028 inside a line split it into two requests (csv reads one row of 5 cells)
    "form-feed": ("t.csv", SECONDS_HEADER + "0,5,5\x0c1,5,5\n", "row 2: output_len '5\\x0c1'"),
    "line-separator": ("t.csv", SECONDS_HEADER + "0,5,5\u20281,5,5\n", "row 2: output_len '5\\u20281'"),
    # W: the first of two prompt_len columns was read, the other ignored
    "column-twice": ("t.csv", "arrival_s,prompt_len,output_len,prompt_len\n0,5,5,500\n",
                     "column 'prompt_len' named twice"),
    # W: json.loads kept the last of two input_length keys
    "jsonl-key-twice": ("t.jsonl", MOONCAKE_LINE + '{"timestamp": 1, "input_length": 5, "input_length": 500, '
                        '"output_length": 5}\n', "line 2: key 'input_length' given twice"),
    # W: float() reads underscores and other scripts' digits
    "underscore": ("t.csv", SECONDS_HEADER + "0,1_000,5\n", "row 2: prompt_len '1_000'"),
    "underscore-arrival": ("t.csv", SECONDS_HEADER + "0,5,5\n1_0,5,5\n", "row 3: arrival_s '1_0'"),
    "fullwidth-digit": ("t.csv", SECONDS_HEADER + "0,\uff15,5\n", "row 2: prompt_len"),
    "jsonl-underscore": ("t.jsonl", '{"timestamp": 0, "input_length": "1_000", "output_length": 5}\n',
                         "row 1: input_length '1_000'"),
    # W: Azure seconds written 1e1 or -0 were read as 10 and 0
    "azure-seconds-exponent": ("t.csv", AZURE_HEADER + "2023-11-16 18:15:1e1,5,5\n", "TIMESTAMP '2023-11-16 18:15:1e1'"),
    "azure-seconds-minus-zero": ("t.csv", AZURE_HEADER + "2023-11-16 18:15:-0,5,5\n", "TIMESTAMP '2023-11-16 18:15:-0'"),
    "azure-seconds-underscore": ("t.csv", AZURE_HEADER + "2023-11-16 18:15:1_0,5,5\n", "row 2: TIMESTAMP"),
    # T: a minute of another script's digits passed the check and numpy's datetime parse raised
    "azure-minute-digit": ("t.csv", AZURE_HEADER + "2023-11-16 18:1\u0665:10,5,5\n", "row 2: TIMESTAMP"),
}


@pytest.mark.parametrize("name, text, needle", list(BROKEN_TRACES.values()), ids=list(BROKEN_TRACES))
def test_broken_trace_round3(tmp_path, name, text, needle):
    line = run_trace(tmp_path, name, text)
    assert needle in line, line


GOOD_TRACES = {
    "crlf-and-spaces": ("t.csv", SECONDS_HEADER.replace("\n", "\r\n") + "0, 5 ,5\r\n1,6,7\r\n"),
    "cr-only": ("t.csv", SECONDS_HEADER.replace("\n", "\r") + "0,5,5\r1,6,7\r"),
    "quoted-cells": ("t.csv", SECONDS_HEADER + '"0","5","5"\n1,6,7\n'),
    "blank-lines-and-exponent": ("t.csv", SECONDS_HEADER + "0,5,5\n\n1,6,7e0\n"),
    "jsonl-crlf": ("t.jsonl", MOONCAKE_LINE.replace("\n", "\r\n") + '\n{"timestamp": 1000, "input_length": 6, '
                   '"output_length": 7}'),
    "azure": ("t.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,5,5\n2023-11-16 18:15:47,6,7\n"),
}


@pytest.mark.parametrize("name, text", list(GOOD_TRACES.values()), ids=list(GOOD_TRACES))
def test_good_traces_still_read(tmp_path, name, text):
    trace = tmp_path / name
    trace.write_bytes(text.encode("utf-8"))
    arrival, prompt, output = load_trace(trace)
    assert arrival.tolist()[0] == 0 and arrival.tolist()[1] > 0
    assert prompt.tolist() == [5, 6] and output.tolist() == [5, 7]


def test_builtin_trace_unchanged():
    arrival, prompt, output = load_trace("builtin:azure_conv")
    assert len(arrival) == 19_366 and arrival[0] == 0 and (arrival >= 0).all()
    assert int(prompt.sum()) > 0 and int(output.sum()) > 0


# -- hf_config: each used to be priced as a dense llama of the file's torch_dtype ---------------------------------
BROKEN_HF = {
    # W: a Mixtral priced as dense with one expert's MLP (Mixtral is modelled now; a top-k past its experts is not)
    "mixtral-top-k": ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 9},
                      "num_experts_per_tok 9 with 8 routed experts"),
    "llama-with-experts": ({"num_experts": 4}, "num_experts 4: mixture-of-experts in a llama config"),
    # W: a GPT-2 (other layers, LayerNorm, GELU) priced as a llama
    "gpt2": ({"model_type": "gpt2"}, "model_type 'gpt2' is not modelled; allowed: llama, mistral, mixtral"),
    # W: a 4-bit GPTQ checkpoint priced at its torch_dtype's fp32 bytes
    "gptq-fp32": ({"quantization_config": {"quant_method": "gptq", "bits": 4}, "dtype": None,
                   "torch_dtype": "float32"}, "quantized checkpoint (gptq, 4 bits); allowed: model.weight_dtype int4"),
    "awq-8bit": ({"quantization_config": {"quant_method": "awq", "bits": 8}}, "(awq, 8 bits); allowed: model.weight_dtype int8"),
}


@pytest.mark.parametrize("change, needle", list(BROKEN_HF.values()), ids=list(BROKEN_HF))
def test_unmodelled_hf_config(tmp_path, change, needle):
    hf_config_error(tmp_path, change, needle)


def test_quantized_hf_config_with_weight_dtype_runs(tmp_path):
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    d = tiny(tmp_path, config)
    d["model"]["weight_dtype"] = "int4"
    path = write(tmp_path / "s.yaml", d)
    r = invoke("run", path, "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("change", [{"model_type": "mistral"}, {"model_type": None}, {"num_local_experts": 1}])
def test_llama_shaped_hf_configs_still_accepted(tmp_path, change):
    config = {k: v for k, v in {**TINY_CONFIG, **change}.items() if v is not None}
    path = write(tmp_path / "s.yaml", tiny(tmp_path, config))
    r = invoke("run", path, "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "report.json").read_text())["requests"]["completed"] == 2


# -- scenario files, specs, profiles and commands (a hunt through every command, 2026-12-02) ------------------------
PROFILE = Path(__file__).resolve().parents[1] / "calibration" / "profiles" / "cpu.json"
WORKLOAD = "workload: {arrival: {process: poisson, rate: 1}, num_requests: 2, prompt_len: {dist: fixed, value: 4}, " \
           "output_len: {dist: fixed, value: 4}}\n"
HEAD = "model: SmolLM2-135M\nhardware: cpu\n"
SCENARIO_TEXTS = {
    # T: int() past Python's 4,300-digit limit, a ValueError out of PyYAML
    "integer-of-5000-digits": (HEAD + "serving: {max_num_seqs: " + "9" * 5000 + "}\n" + WORKLOAD, "5,000 characters"),
    # T: bytes broke the JSON copies of the scenario (search); W: pydantic read b"1" as the rate 1
    "binary-value": ("name: !!binary aGVsbG8=\n" + HEAD + WORKLOAD, "!!binary"),
    # the error line held the key's newline and terminal escapes (the line broke, the terminal turned red)
    "key-with-control-characters": (HEAD + 'serving: {"max\\nnum\\e[31mseqs": 4}\n' + WORKLOAD, "max\\nnum\\x1b[31mseqs"),
    # W: each of these was accepted and changed nothing: the run was the run without it
    "batch-size-under-continuous": (HEAD + "serving: {batch_size: 4}\n" + WORKLOAD, "serving.batch_size"),
    "chunk-size-without-chunked-prefill": (HEAD + "serving: {prefill_chunk_size: 64}\n" + WORKLOAD,
                                           "serving.prefill_chunk_size"),
    "max-waiting-tokens-without-ratio": (HEAD + "serving: {max_waiting_tokens: 4}\n" + WORKLOAD,
                                         "serving.max_waiting_tokens"),
    "max-num-seqs-under-static": (HEAD + "serving: {batching: static, max_num_seqs: 4}\n" + WORKLOAD,
                                  "serving.max_num_seqs"),
    "sequence-parallel-without-tp": (HEAD + "parallel: {sequence_parallel: true}\n" + WORKLOAD, "sequence_parallel"),
    "pool-batch-size": (HEAD + "pools: {prefill: {}, decode: {serving: {batch_size: 4}}}\n" + WORKLOAD,
                        "pools.decode.serving.batch_size"),
    # W: a CPU profile priced an H100's steps at the CPU's speed and the H100's price
    "cpu-profile-on-a-gpu": (f"model: SmolLM2-135M\nhardware: H100-SXM\ncost_model: {{profile: {PROFILE}}}\n" + WORKLOAD,
                             "cost_model.profile"),
}


@pytest.mark.parametrize("text, needle", list(SCENARIO_TEXTS.values()), ids=list(SCENARIO_TEXTS))
def test_broken_scenario_round3(tmp_path, text, needle):
    path = write(tmp_path / "s.yaml", text)
    line = one_line_error(invoke("run", path, "-q", "--no-plots"), path, needle)
    assert line.isprintable()


def test_keys_at_their_defaults_and_pool_overrides_still_run(tmp_path):
    """A key at its default changes nothing either way; a pool's own chunk size rides on the scenario's chunking."""
    text = HEAD + "serving: {batching: continuous, batch_size: 8, enable_chunked_prefill: true}\n" + \
        "pools: {prefill: {serving: {prefill_chunk_size: 64}}, decode: {}}\n" + WORKLOAD
    r = invoke("run", write(tmp_path / "s.yaml", text), "-q", "--no-plots")
    assert r.exit_code == 0, r.output


SEARCH_BASE = {"model": "SmolLM2-135M", "hardware": "cpu", "slo": {"ttft_s": 1.0}}


def test_search_of_a_workload_at_one_instant(tmp_path):
    """W: every configuration 'missed even at 0.01 req/s' (every rate scaled the arrivals to one instant)."""
    trace = write(tmp_path / "same.csv", "arrival_s,prompt_len,output_len\n0,5,5\n0,5,5\n0,5,5\n")
    spec = write(tmp_path / "search.yaml", {"scenario": {**SEARCH_BASE, "workload": {"trace": {"path": str(trace)}}},
                                            "space": {"serving.max_num_seqs": [4, 8]}})
    one_line_error(invoke("search", spec, "-q", "--workers", "1"), spec, "scenario.workload", "one instant")


def test_search_whose_base_names_a_missing_profile(tmp_path):
    """W: every configuration was pruned for it, and the search exited 0 with no recommendation."""
    spec = write(tmp_path / "search.yaml", {"scenario": {**SEARCH_BASE, "cost_model": {"profile": "nope.json"},
                                                         "workload": {**yaml.safe_load(WORKLOAD)["workload"],
                                                                      "num_requests": 20}},
                                            "space": {"serving.max_num_seqs": [4, 8]}})
    one_line_error(invoke("search", spec, "-q", "--workers", "1"), spec, "scenario.cost_model.profile", "nope.json")


def test_search_with_binary_values(tmp_path):
    """T: a TypeError from json.dumps of the base scenario."""
    spec = write(tmp_path / "search.yaml", "scenario: {name: !!binary aGVsbG8=, model: SmolLM2-135M, hardware: cpu}\n"
                                           "space: {serving.max_num_seqs: [4, 8]}\n")
    one_line_error(invoke("search", spec, "-q", "--workers", "1"), spec, "!!binary")


def test_the_same_scenario_twice(tmp_path):
    """W: compare ran one file twice under two labels; validate served it twice into one folder and took medians over
    the copy; compare kept the last --sweep and dropped the others."""
    path = write(tmp_path / "s.yaml", HEAD + WORKLOAD)
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / ".." / "s.yaml"
    one_line_error(invoke("compare", path, other, "-q"), "SCENARIO", "one file")
    one_line_error(invoke("validate", path, other, "--profile", PROFILE), "SCENARIO", "one file")
    one_line_error(invoke("compare", path, "--sweep", "serving.max_num_seqs=4,8", "--sweep",
                          "serving.max_num_seqs=2", "-q"), "--sweep", "2 times")


def test_capacity_without_an_slo_or_a_rate(tmp_path):
    """W: `validate --capacity` without an SLO reported a capacity of the keep-up rule alone (search refuses it)."""
    d = tiny(tmp_path)
    d.pop("slo", None)
    path = write(tmp_path / "s.yaml", d)
    one_line_error(invoke("validate", path, "--capacity", "--profile", PROFILE), path, "slo")


REFITS = {
    # T: ValueError, OverflowError and nnls's "infs or NaNs" out of the fit
    "num-sampled-text": lambda s: s.update(num_sampled="abc"),
    "context-past-a-float": lambda s: s.update(context_lens=[10**400] * len(s["context_lens"])),
    "context-1e308": lambda s: s.update(context_lens=[1e308] * len(s["context_lens"])),
    # W: written over the file, then refused by every run that named it
    "negative-new-tokens": lambda s: s.update(new_tokens=[-5] * len(s["new_tokens"])),
    "step-of-1e-300-s": lambda s: s.update(time_s=1e-300),
    "empty-step": lambda s: s.update(new_tokens=[], context_lens=[]),
    "prefill-rows-past-the-batch": lambda s: s.update(num_prefill=10**6),
}


@pytest.mark.parametrize("change", list(REFITS.values()), ids=list(REFITS))
def test_refit_of_odd_samples_leaves_the_file(tmp_path, change):
    prof = json.loads(PROFILE.read_text())
    for s in prof["samples"]:
        change(s)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    before = path.read_text()
    one_line_error(invoke("profile", "--refit", "--out", path), "--out", path.name)
    assert path.read_text() == before


def test_temperature_below_the_sampling_floor_is_greedy(tmp_path):
    """T: logits / 1e-300 overflowed to inf and torch.multinomial raised in the warm-up."""
    path = write(tmp_path / "s.yaml", tiny(tmp_path, executor={"temperature": 1e-300}))
    r = invoke("serve", path, "-q", "--no-plots")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", [["run"], ["serve", "s.yaml"], ["search", "s.yaml"], ["compare", "a.yaml", "b.yaml"],
                                     ["validate", "s.yaml"], ["profile"], ["distill"], ["train-medusa"]])
def test_empty_out_flag(command):
    """W: `--out ""` (an unset shell variable) wrote report.json and plots into the current folder."""
    one_line_error(invoke(*command, "--out", " "), "--out", "empty path")

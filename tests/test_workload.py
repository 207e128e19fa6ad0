"""Tests for sim/config/workload.py: arrival processes, length distributions, trace replay, validation."""
import csv
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.traces import load_trace
from sim.config.workload import EmpiricalLength, RequestSpec, WorkloadConfig

AZURE = Path(__file__).resolve().parents[1] / "sim" / "data" / "azure_llm_2023_conv.csv"
FIXED = {"dist": "fixed", "value": 7}


def synth(arrival=None, prompt=FIXED, output=FIXED, **kw):
    if "duration_s" not in kw:
        kw.setdefault("num_requests", 1000)
    return WorkloadConfig(arrival=arrival or {"process": "poisson", "rate": 10.0},
                          prompt_len=prompt, output_len=output, **kw)


def arrivals(reqs):
    return np.array([r.arrival_s for r in reqs])


def lengths(dist, n=20_000, seed=0):
    return np.array([r.prompt_len for r in generate_requests(synth(prompt=dist, num_requests=n,
                                                                    seed=seed))])


@pytest.fixture(scope="module")
def azure_csv():
    """The builtin trace parsed independently of sim.workload (timestamps to 1 µs)."""
    with open(AZURE, newline="") as f:
        rows = list(csv.DictReader(f))
    t = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    rel = np.array([(x - t[0]).total_seconds() for x in t])
    return (rel, np.array([int(r["ContextTokens"]) for r in rows]),
            np.array([int(r["GeneratedTokens"]) for r in rows]))


@pytest.fixture(scope="module")
def azure_reqs():
    return generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv"}))


# ---- arrival processes -------------------------------------------------------------------------

def test_poisson_rate_and_cv():
    reqs = generate_requests(synth({"process": "poisson", "rate": 25.0}, num_requests=20_000))
    gaps = np.diff(arrivals(reqs))
    assert reqs[0].arrival_s == 0.0
    assert 1 / gaps.mean() == pytest.approx(25.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_cv_as_requested():
    reqs = generate_requests(synth({"process": "gamma", "rate": 10.0, "cv": 3.0},
                                   num_requests=30_000))
    gaps = np.diff(arrivals(reqs))
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.10)
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.10)


def test_constant_gaps_exact():
    t = arrivals(generate_requests(synth({"process": "constant", "rate": 4.0}, num_requests=100)))
    assert np.array_equal(t, np.arange(100) / 4.0)


def test_duration_mode_arrivals_before_duration():
    for process in ({"process": "poisson", "rate": 50.0},
                    {"process": "gamma", "rate": 50.0, "cv": 2.0},
                    {"process": "constant", "rate": 50.0}):
        t = arrivals(generate_requests(synth(process, duration_s=60.0)))
        assert t.max() < 60.0 and t.min() == 0.0
        assert len(t) == pytest.approx(3000, rel=0.15)
    t = arrivals(generate_requests(synth({"process": "constant", "rate": 2.0}, duration_s=5.0)))
    assert list(t) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]


def test_bursts_add_exactly_count_at_time():
    base = generate_requests(synth(num_requests=500))
    bursty = generate_requests(synth(num_requests=500, bursts=[{"at_s": 12.5, "count": 40},
                                                               {"at_s": 0.0, "count": 3}]))
    assert len(bursty) == 543
    t = arrivals(bursty)
    assert (t == 12.5).sum() == 40 + (arrivals(base) == 12.5).sum()
    assert (t == 0.0).sum() == 3 + 1
    assert [r.id for r in bursty] == list(range(543))
    assert np.all(np.diff(t) >= 0)
    # the base process is untouched by the bursts
    assert sorted(set(t) - {12.5}) == sorted(set(arrivals(base)) - {12.5})


def test_trace_bursts_reuse_trace_lengths(azure_csv):
    reqs = generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv",
                                                   "max_requests": 100},
                                            bursts=[{"at_s": 1.0, "count": 50}]))
    assert len(reqs) == 150
    pairs = set(zip(azure_csv[1][:100], azure_csv[2][:100]))
    burst = [r for r in reqs if r.arrival_s == 1.0]
    assert len(burst) >= 50 and all((r.prompt_len, r.output_len) in pairs for r in burst)
    assert len({(r.prompt_len, r.output_len) for r in burst}) > 10  # resampled, not one row


# ---- length distributions ----------------------------------------------------------------------

def test_fixed_and_uniform_bounds():
    assert set(lengths({"dist": "fixed", "value": 123}, n=100)) == {123}
    x = lengths({"dist": "uniform", "min": 10, "max": 20})
    assert x.min() == 10 and x.max() == 20 and len(set(x)) == 11
    assert x.mean() == pytest.approx(15, rel=0.02)


def test_lognormal_median_and_clipping():
    x = lengths({"dist": "lognormal", "median": 400, "sigma": 1.0})
    assert np.median(x) == pytest.approx(400, rel=0.04)
    assert x.min() >= 1 and x.dtype.kind == "i"
    x = lengths({"dist": "lognormal", "median": 400, "sigma": 1.5, "min": 50, "max": 2000})
    assert x.min() == 50 and x.max() == 2000


def test_zipf_heavy_tailed_within_bounds():
    a = 1.5
    x = lengths({"dist": "zipf", "a": a, "min": 1, "max": 100_000}, n=30_000)
    assert x.min() >= 1 and x.max() <= 100_000
    # P(1)/P(2) = 2^a for a power law; the mean sits far above the median; the tail reaches far
    assert (x == 1).sum() / (x == 2).sum() == pytest.approx(2 ** a, rel=0.08)
    assert x.mean() > 5 * np.median(x)
    assert x.max() > 10_000
    y = lengths({"dist": "zipf", "a": 2.0, "min": 100, "max": 200}, n=5000)
    assert y.min() == 100 and y.max() <= 200


def test_empirical_weights_respected():
    x = lengths({"dist": "empirical", "values": [10, 20, 30], "weights": [1, 2, 7]}, n=30_000)
    assert set(x) == {10, 20, 30}
    freq = [(x == v).mean() for v in (10, 20, 30)]
    assert freq == pytest.approx([0.1, 0.2, 0.7], abs=0.01)
    assert set(lengths({"dist": "empirical", "values": [5, 6]}, n=200)) == {5, 6}


def test_empirical_from_trace_column(azure_csv):
    x = lengths({"dist": "empirical", "trace": "builtin:azure_conv", "column": "GeneratedTokens"})
    assert set(x) <= set(azure_csv[2])
    assert np.median(x) == pytest.approx(np.median(azure_csv[2]), rel=0.1)


@pytest.mark.parametrize("bad", [
    {"dist": "uniform", "min": 5, "max": 4},
    {"dist": "uniform", "min": 0, "max": 4},
    {"dist": "lognormal", "median": 10, "sigma": 1, "min": 9, "max": 8},
    {"dist": "zipf", "a": 1.0, "max": 10},
    {"dist": "zipf", "a": 1.2, "min": 11, "max": 10},
    {"dist": "empirical", "values": [1, 2], "weights": [1.0]},
    {"dist": "empirical", "values": []},
    {"dist": "empirical", "values": [1], "trace": "builtin:azure_conv", "column": "ContextTokens"},
    {"dist": "empirical", "trace": "builtin:azure_conv"},
    {"dist": "empirical", "trace": "builtin:nope", "column": "ContextTokens"},
    {"dist": "fixed", "value": 0},
    {"dist": "normal", "value": 3},
])
def test_bad_length_configs_rejected(bad):
    with pytest.raises(ValidationError):
        synth(prompt=bad)


# ---- trace replay ------------------------------------------------------------------------------

def test_builtin_trace_replay(azure_reqs, azure_csv):
    rel, ctx, gen = azure_csv
    assert len(azure_reqs) == 19_366
    t = arrivals(azure_reqs)
    assert t[0] == 0.0
    assert t[-1] == pytest.approx(3501.721937, abs=1e-6)
    assert np.allclose(t, rel, atol=1e-6)
    assert np.array_equal([r.prompt_len for r in azure_reqs], ctx)
    assert np.array_equal([r.output_len for r in azure_reqs], gen)
    assert [r.id for r in azure_reqs] == list(range(19_366))


def test_load_trace_matches_csv(azure_csv):
    t, p, o = load_trace("builtin:azure_conv")
    assert np.allclose(t, azure_csv[0], atol=1e-6)
    assert np.array_equal(p, azure_csv[1]) and np.array_equal(o, azure_csv[2])
    t2, _, _ = load_trace(AZURE)
    assert np.array_equal(t, t2)


def test_time_scale_halves_span(azure_reqs):
    fast = generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv",
                                                   "time_scale": 2.0}))
    assert arrivals(fast)[-1] == pytest.approx(arrivals(azure_reqs)[-1] / 2)
    assert [r.prompt_len for r in fast] == [r.prompt_len for r in azure_reqs]


def test_window_selects_rows(azure_csv):
    rel, ctx, _ = azure_csv
    reqs = generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv",
                                                   "start_s": 600, "end_s": 900}))
    sel = np.flatnonzero((rel >= 600) & (rel < 900))
    assert len(reqs) == len(sel) > 1000
    assert np.array_equal([r.prompt_len for r in reqs], ctx[sel])
    assert arrivals(reqs)[0] == 0.0
    assert np.allclose(arrivals(reqs), rel[sel] - rel[sel[0]], atol=1e-6)
    capped = generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv",
                                                     "start_s": 600, "max_requests": 10}))
    assert [r.prompt_len for r in capped] == list(ctx[sel[:10]])


def test_trace_timing_with_synthetic_lengths(azure_reqs):
    reqs = generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv",
                                                   "output_len": {"dist": "fixed", "value": 64}}))
    assert np.array_equal(arrivals(reqs), arrivals(azure_reqs))
    assert [r.prompt_len for r in reqs] == [r.prompt_len for r in azure_reqs]
    assert {r.output_len for r in reqs} == {64}


def test_empty_window_is_config_error():
    with pytest.raises(ConfigError) as e:
        generate_requests(WorkloadConfig(trace={"path": "builtin:azure_conv", "start_s": 99999}))
    assert e.value.key_path == "workload.trace"


def write(tmp_path, text, name="t.csv"):
    (tmp_path / name).write_text(text)
    return name


def test_relative_trace_resolves_against_base_dir(tmp_path):
    name = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n"
                           "2023-11-16 23:59:59.5,10,1,x\n"
                           "2023-11-17 00:00:01,20,2,y\n")
    reqs = generate_requests(WorkloadConfig(trace={"path": name}), base_dir=tmp_path)
    assert reqs == [RequestSpec(0, 0.0, 10, 1), RequestSpec(1, 1.5, 20, 2)]


def test_missing_trace_file_names_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        generate_requests(WorkloadConfig(trace={"path": "nope.csv"}), base_dir=tmp_path)
    assert e.value.key_path == "workload.trace.path"
    assert str(tmp_path / "nope.csv") in e.value.message
    with pytest.raises(ConfigError) as e:
        generate_requests(synth(output={"dist": "empirical", "trace": "gone.csv",
                                        "column": "GeneratedTokens"}), base_dir=tmp_path)
    assert e.value.key_path == "workload.output_len.trace" and "gone.csv" in e.value.message


@pytest.mark.parametrize("text, where", [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,5\n", "GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no data rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,six\n", "row 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,6\n"
     "yesterday,5,6\n", "row 3"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5.5,6\n", "row 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5\n", "row 2"),
    ("", "missing column"),
])
def test_bad_trace_files_are_config_errors(tmp_path, text, where):
    name = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_trace(tmp_path / name)
    assert where in e.value.message and name in e.value.message
    assert e.value.key_path == "workload.trace.path"


# ---- determinism and validation ----------------------------------------------------------------

def test_same_seed_same_list_different_seed_differs():
    cfg = dict(arrival={"process": "gamma", "rate": 5.0, "cv": 2.0},
               prompt={"dist": "lognormal", "median": 300, "sigma": 1.0},
               output={"dist": "zipf", "a": 1.3, "max": 4000}, num_requests=300,
               bursts=[{"at_s": 3.0, "count": 5}])
    a, b = generate_requests(synth(**cfg, seed=1)), generate_requests(synth(**cfg, seed=1))
    assert a == b
    assert a != generate_requests(synth(**cfg, seed=2))


def test_length_distribution_does_not_change_arrivals():
    a = generate_requests(synth(prompt={"dist": "uniform", "min": 1, "max": 9}, seed=4))
    b = generate_requests(synth(prompt={"dist": "zipf", "a": 2, "max": 9}, seed=4))
    assert np.array_equal(arrivals(a), arrivals(b))
    assert [r.output_len for r in a] == [r.output_len for r in b]


@pytest.mark.parametrize("cfg", [
    {"trace": {"path": "builtin:azure_conv"}, "arrival": {"process": "poisson", "rate": 1}},
    {"arrival": {"process": "poisson", "rate": 1}, "prompt_len": FIXED, "output_len": FIXED},
    {"arrival": {"process": "poisson", "rate": 1}, "prompt_len": FIXED, "output_len": FIXED,
     "num_requests": 5, "duration_s": 5},
    {"arrival": {"process": "poisson", "rate": 1}, "prompt_len": FIXED, "num_requests": 5},
    {},
    {"arrival": {"process": "gamma", "rate": 1}, "prompt_len": FIXED, "output_len": FIXED,
     "num_requests": 5},
    {"arrival": {"process": "poisson", "rate": 1, "cv": 2}, "prompt_len": FIXED,
     "output_len": FIXED, "num_requests": 5},
    {"arrival": {"process": "poisson", "rate": 0}, "prompt_len": FIXED, "output_len": FIXED,
     "num_requests": 5},
    {"trace": {"path": "builtin:azure_conv", "start_s": 10, "end_s": 5}},
    {"trace": {"path": "builtin:azure_conv", "time_scale": 0}},
    {"trace": {"path": "builtin:azure_conv"}, "bursts": [{"at_s": 1, "count": 0}]},
])
def test_invalid_modes_rejected(cfg):
    with pytest.raises(ValidationError):
        WorkloadConfig.model_validate(cfg)


def test_mode_error_names_allowed_keys():
    with pytest.raises(ValidationError) as e:
        WorkloadConfig.model_validate({})
    assert "trace" in str(e.value) and "num_requests" in str(e.value)


@pytest.mark.parametrize("cfg", [
    {"trace": {"path": "builtin:azure_conv"}, "rate": 3},
    {"trace": {"path": "builtin:azure_conv", "speed": 2}},
    {"trace": {"path": "builtin:azure_conv"}, "bursts": [{"at_s": 1, "count": 2, "x": 1}]},
    {"arrival": {"process": "poisson", "rate": 1, "burstiness": 2}, "prompt_len": FIXED,
     "output_len": FIXED, "num_requests": 5},
    {"arrival": {"process": "poisson", "rate": 1}, "prompt_len": {**FIXED, "max": 3},
     "output_len": FIXED, "num_requests": 5},
])
def test_unknown_keys_rejected(cfg):
    with pytest.raises(ValidationError) as e:
        WorkloadConfig.model_validate(cfg)
    assert "extra" in str(e.value).lower()


def test_models_are_frozen_and_empirical_direct():
    cfg = synth()
    with pytest.raises(ValidationError):
        cfg.seed = 3
    assert EmpiricalLength(dist="empirical", values=[3]).values == [3]


def test_trace_formats_read_the_same_requests(tmp_path):
    """Azure's CSV, BurstGPT's CSV (extra columns, seconds), Mooncake's JSONL (milliseconds, other keys) and a plain
    CSV of seconds, holding the same three requests out of order: the same arrays."""
    files = {
        "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,100,20\n"
                     "2023-11-16 18:15:45.0,7,3\n2023-11-16 18:16:01.25,4000,0\n",
        "burstgpt.csv": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                        "1.5,ChatGPT,100,20,120,Conversation log\n0,GPT-4,7,3,10,API log\n16.25,ChatGPT,4000,0,4000,"
                        "Conversation log\n",
        "mooncake.jsonl": '{"timestamp": 1500, "input_length": 100, "output_length": 20, "hash_ids": [1, 2]}\n'
                          '{"timestamp": 0, "input_length": 7, "output_length": 3, "hash_ids": []}\n\n'
                          '{"timestamp": 16250, "input_length": 4000, "output_length": 0, "hash_ids": [3]}\n',
        "seconds.csv": "arrival_s,prompt_len,output_len\n101.5,100,20\n100,7,3\n116.25,4000,0\n",
    }
    arrays = []
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        arrays.append(load_trace(tmp_path / name))
    for t, p, o in arrays:
        assert t.tolist() == [1.5, 0.0, 16.25] and p.tolist() == [100, 7, 4000] and o.tolist() == [20, 3, 0]


@pytest.mark.parametrize("name, text, where", [
    ("b.csv", "Timestamp,Request tokens,Response tokens\n-1,5,5\n", "Timestamp '-1'"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\nnan,5,5\n", "Timestamp 'nan'"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\n1,5,5.5\n", "Response tokens '5.5'"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 5}\n[1, 2]\n', "cannot read it"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 5}\n{"timestamp": 1\n', "cannot read it"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5}\n', "missing column"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 5}\n{"timestamp": 1, "input_length": 5}\n',
     "row 2: output_length ''"),
])
def test_bad_trace_files_of_other_formats(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        load_trace(tmp_path / name)
    assert where in e.value.message and name in e.value.message and "\n" not in e.value.message


def test_bursty_gamma_arrivals_are_held_to_the_request_limit(monkeypatch):
    """rate x duration_s bounds a Poisson count, not a very bursty gamma's (cv 100 at 10/s over 100 s draws 6,579
    here, not 1,000): the draw itself stops at the limit with an error at the cv."""
    import sim.config.generator as generator

    monkeypatch.setattr(generator, "MAX_REQUESTS", 2000)
    cfg = WorkloadConfig(arrival={"process": "gamma", "rate": 10.0, "cv": 100.0}, duration_s=100.0,
                         prompt_len={"dist": "fixed", "value": 8}, output_len={"dist": "fixed", "value": 8})
    with pytest.raises(ConfigError) as e:
        generate_requests(cfg)
    assert e.value.key_path == "workload.arrival.cv" and "at most 2,000" in e.value.message
    monkeypatch.setattr(generator, "MAX_REQUESTS", 2_000_000)
    assert len(generate_requests(cfg)) == 6579

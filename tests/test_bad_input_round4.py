"""Bad input, fourth pass (a hunt through closed loops, Mooncake traces, search specs and YAML's own forms). Each case
was a silently wrong result (W), a refusal of valid input (V) or a failure without its file (F); each now runs, or
exits 2 with one line naming the file and the key, as in tests/test_bad_input_more.py."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.test_bad_input_more import invoke, one_line_error, write
from tests.test_bad_input_round2 import tiny
from tests.test_bad_input_round3 import PROFILE

H100 = {"model": "Llama-3-8B", "hardware": "H100-SXM",
        "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 5.0}, "num_requests": 200,
                     "prompt_len": {"dist": "fixed", "value": 500}, "output_len": {"dist": "fixed", "value": 100}},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05}}


def users_workload(n: int = 4, **extra) -> dict:
    return {"seed": 1, "num_requests": 200, "prompt_len": {"dist": "fixed", "value": 500},
            "output_len": {"dist": "fixed", "value": 100}, "closed_loop": {"users": n}, **extra}


def test_yaml_merge_keys_are_read(tmp_path):
    """V: `<<: *anchor` was refused as 'could not determine a constructor'; yaml.safe_load reads it."""
    text = yaml.safe_dump(H100, sort_keys=False).replace(
        "  prompt_len:\n    dist: fixed\n    value: 500\n  output_len:\n    dist: fixed\n    value: 100\n",
        "  prompt_len: &len {dist: fixed, value: 500}\n  output_len: {<<: *len, value: 100}\n")
    assert "<<: *len" in text
    path = write(tmp_path / "s.yaml", text)
    r = invoke("run", path, "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "out" / "report.json").read_text())["scenario"]["config"]
    assert config["workload"]["output_len"] == {"dist": "fixed", "value": 100}


def test_a_section_with_its_keys_commented_out_is_its_defaults(tmp_path):
    """V: `serving:` alone (null) was refused while `speculative:` alone was accepted."""
    text = yaml.safe_dump(H100, sort_keys=False) + "serving:\nkv_cache:\nexecutor:\n"
    path = write(tmp_path / "s.yaml", text)
    r = invoke("run", path, "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output


def test_a_closed_loop_refuses_the_trace_s_time_scale(tmp_path):
    """W: time_scale was silently unread with a closed loop (the users send the rows, their timestamps unused)."""
    d = {**H100, "workload": {"trace": {"path": "builtin:azure_conv", "max_requests": 50, "time_scale": 5},
                              "closed_loop": {"users": 2}}}
    path = write(tmp_path / "s.yaml", d)
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "workload", "time_scale")


def test_cache_aware_routing_needs_a_prefix_cache(tmp_path):
    """W: cache_aware without prefix caching routed as least_outstanding, byte for byte."""
    path = write(tmp_path / "s.yaml", {**H100, "replicas": 2, "router": "cache_aware",
                                       "kv_cache": {"enable_prefix_caching": False}})
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "router", "enable_prefix_caching")
    path = write(tmp_path / "s.yaml", {**H100, "replicas": 2, "router": "cache_aware", "engine": "infersim"})
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "router", "enable_prefix_caching")  # its default
    pools = {**H100, "kv_cache": {"enable_prefix_caching": False},
             "pools": {"prefill": {"replicas": 1, "router": "cache_aware"}, "decode": {"replicas": 1}}}
    path = write(tmp_path / "p.yaml", pools)
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "pools.prefill.router")


def search_spec(tmp_path, **over):
    spec = {"name": "s", "scenario": H100, "target": {"rate": 5.0}, "space": {"replicas": [1]},
            "search": {"max_requests": 200}, **over}
    return write(tmp_path / "spec.yaml", spec)


def test_a_search_target_outside_the_rate_grid(tmp_path):
    """W: max_rate below the target read "SLO missed at the grid's top" though no probe missed the SLO."""
    path = search_spec(tmp_path, search={"max_requests": 200, "max_rate": 1.0})
    one_line_error(invoke("search", path), path, "search.max_rate", "outside")
    path = search_spec(tmp_path, search={"max_requests": 200, "min_rate": 50.0})
    one_line_error(invoke("search", path), path, "search.min_rate")


def test_a_users_search_checks_its_workload_and_its_probe_length_first(tmp_path):
    """F: a closed loop's base workload failed inside the workers, without the spec's file; W: probes too short to
    judge one user came out as capacity 0."""
    bad = {**H100, "workload": {"trace": {"path": "nope.csv"}, "closed_loop": {"users": 4}}}
    path = search_spec(tmp_path, scenario=bad, target={})
    one_line_error(invoke("search", path), path, "workload.trace.path")
    short = {**H100, "workload": users_workload()}
    path = search_spec(tmp_path, scenario=short, target={}, search={"max_requests": 3})
    one_line_error(invoke("search", path), path, "search.max_requests", "one user")


def test_a_swept_speculative_section_without_its_acceptance_rate_is_pruned(tmp_path):
    """F: the search died mid-run with 'speculative.acceptance_rate: required', naming neither file nor value."""
    path = search_spec(tmp_path, space={"speculative": [None, {"method": "ngram"}]})
    r = invoke("search", path, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    rows = {row["label"]: row for row in json.loads((tmp_path / "out" / "search.json").read_text())["rows"]}
    assert rows["speculative=ngram"]["status"] == "pruned"
    assert "acceptance_rate" in rows["speculative=ngram"]["reason"]


def test_capacity_validation_of_a_closed_loop_too_short_to_judge(tmp_path):
    """W: `validate --capacity --requests 3` of 6 users served three probes, all 'unsteady', and reported 0 users."""
    d = tiny(tmp_path, slo={"ttft_s": 1.0})
    d["workload"] = users_workload(6)
    path = write(tmp_path / "s.yaml", d)
    one_line_error(invoke("validate", path, "--capacity", "--requests", "3", "--profile", PROFILE), path,
                   "--requests", "one user")


@pytest.mark.parametrize("change", [lambda d: d.update(model=None), lambda d: d["model"].pop("num_layers"),
                                    lambda d: d.update(comm="x")], ids=["model-null", "no-num-layers", "comm-text"])
def test_refit_never_writes_a_profile_that_run_refuses(tmp_path, change):
    """W: `profile --refit` rewrote such files ("refitted 587 steps") and every run naming them then failed."""
    prof = json.loads(PROFILE.read_text())
    change(prof)
    path = write(tmp_path / "p.json", json.dumps(prof))
    before = path.read_text()
    one_line_error(invoke("profile", "--refit", "--out", path), str(path), "would refuse")
    assert path.read_text() == before


def test_a_pool_s_keys_keep_their_pool_in_the_labels_and_need_pools(tmp_path):
    """W: sweeping pools.prefill.replicas and pools.decode.replicas labelled rows 'replicas=1 replicas=2' (which is
    prefill?); on a base without pools every configuration was pruned and the search exited 0."""
    from infersim.commands.search import configurations, parse_search_spec

    pools = {**H100, "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}
    search = parse_search_spec({"scenario": pools, "space": {"pools.prefill.replicas": [1, 2],
                                                             "pools.decode.replicas": [1]}})
    assert [label for label, _, _ in configurations(search)] == ["prefill.replicas=1 decode.replicas=1",
                                                                  "prefill.replicas=2 decode.replicas=1"]
    path = search_spec(tmp_path, space={"pools.prefill.replicas": [1, 2]})
    one_line_error(invoke("search", path), path, "space.pools.prefill.replicas", "no pools")


def test_compare_sweeps_each_deployment_once(tmp_path):
    """W: `--sweep replicas=1,1.0` and `--sweep name=a,b` ran one deployment twice under two labels."""
    path = write(tmp_path / "s.yaml", H100)
    one_line_error(invoke("compare", path, "--sweep", "replicas=1,1.0"), "--sweep", "again")
    one_line_error(invoke("compare", path, "--sweep", "name=a,b"), "--sweep", "label")


def test_a_utf16_scenario_is_told_to_be_utf8_and_a_profile_may_start_with_a_bom(tmp_path):
    """The scenario's error said only 'cannot read it (UnicodeDecodeError)'; a profile written with a BOM was refused
    ('Unexpected UTF-8 BOM') though traces and scenarios take one."""
    path = tmp_path / "s.yaml"
    path.write_bytes(yaml.safe_dump(H100).encode("utf-16"))
    one_line_error(invoke("run", path, "-q", "--no-plots"), path, "UTF-8")
    prof = tmp_path / "p.json"
    prof.write_bytes(b"\xef\xbb\xbf" + PROFILE.read_bytes())
    d = {**tiny(tmp_path), "cost_model": {"profile": str(prof)}}
    d["model"], d["hardware"] = "SmolLM2-135M", "cpu"
    r = invoke("run", write(tmp_path / "b.yaml", d), "-q", "--no-plots", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output

"""`infersim search` and `infersim compare`: configurations, pruning, the capacity bisection, the recommendation, the
backends agreeing, and the command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from infersim.commands.search import parse_search_spec, probes_of, run_probe, run_search
from infersim.scenario_keys import apply
from sim.config.errors import ConfigError
from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.report.capacity import scaled
from tests.cli_runner import run_cli
from tests.helpers import png_size

ROOT = Path(__file__).resolve().parents[1]

BASE = {"model": "Llama-2-7B", "hardware": "A100-80GB",
        "workload": {"seed": 5, "arrival": {"process": "poisson", "rate": 2.0}, "num_requests": 600,
                     "prompt_len": {"dist": "lognormal", "median": 500, "sigma": 0.6, "max": 3000},
                     "output_len": {"dist": "lognormal", "median": 120, "sigma": 0.6, "max": 1000}},
        "slo": {"ttft_s": 0.5, "tpot_s": 0.05, "quantile": 0.9}}


def spec(prune_costlier: bool = True, **space) -> dict:
    return {"name": "t", "scenario": BASE, "target": {"rate": 3.0}, "space": space,
            "search": {"max_requests": 600, "precision": 0.1, "prune_costlier": prune_costlier}}


def test_configurations_apply_dotted_keys_and_prune_what_cannot_run():
    search = parse_search_spec(spec(**{"hardware": ["A100-80GB", {"base": "L4", "memory_gib": 8}],
                                       "parallel.tensor_parallel_size": [1, 3]}))
    result = run_search(search, workers=1)
    by = {r.label: r for r in result.rows}
    assert len(by) == 4
    assert by["hardware=A100-80GB tp=3"].status == "pruned" and "does not divide the 32" in by[
        "hardware=A100-80GB tp=3"].reason
    assert by["hardware=L4 tp=1"].status == "pruned" and "does not fit" in by["hardware=L4 tp=1"].reason
    assert by["hardware=A100-80GB tp=1"].status == "ok" and by["hardware=A100-80GB tp=1"].probes > 2
    # the pruned are never simulated
    assert by["hardware=L4 tp=1"].probes == by["hardware=A100-80GB tp=3"].probes == 0


def test_apply_sets_keys_pools_ratios_and_model_dtype():
    data = apply(BASE, "serving.max_num_seqs", 64)
    assert data["serving"] == {"max_num_seqs": 64} and "serving" not in BASE
    assert apply(BASE, "model.weight_dtype", "int8")["model"] == {"base": "Llama-2-7B", "weight_dtype": "int8"}
    pools = apply({**BASE, "replicas": 1}, "pools", [2, 3])["pools"]
    assert pools == {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}
    assert "pools" not in apply({**BASE, "pools": pools}, "pools", None)


def test_capacity_is_the_last_grid_rate_that_meets_the_slos():
    search = parse_search_spec(spec(replicas=[1, 2], prune_costlier=False))
    result = run_search(search, workers=1)
    one, two = result.rows
    assert two.capacity_rps > 1.5 * one.capacity_rps
    probe = probes_of(search)[0]
    plan = make_plan(parse_scenario(probe.data))
    assert run_probe(plan, scaled(probe.specs, one.capacity_rps))[0]
    assert not run_probe(plan, scaled(probe.specs, one.missed_at_rps))[0]
    assert one.missed_at_rps == pytest.approx(one.capacity_rps * 1.1)


@pytest.mark.parametrize("rate", [1.0, 3.0, 6.0, 12.0])
def test_stopping_a_probe_early_never_changes_its_verdict(rate):
    probe = probes_of(parse_search_spec(spec(replicas=[1])))[0]
    plan = make_plan(parse_scenario(probe.data))
    specs = scaled(probe.specs, rate)
    assert run_probe(plan, specs)[0] == run_probe(plan, specs, early_stop=False)[0]


def test_the_recommendation_is_the_cheapest_that_carries_the_target_and_the_others_say_why():
    search = parse_search_spec(spec(hardware=["L4", "A100-80GB", "H100-SXM"], replicas=[1, 2]))
    result = run_search(search, workers=1)
    best = result.recommended
    able = [r for r in result.rows if r.status == "ok" and r.capacity_rps >= 3.0]
    assert best is not None and best.usd_per_hour == min(r.usd_per_hour for r in able)
    for r in result.rows:
        if r.status == "pruned":  # costlier than the recommendation: never searched
            assert r.usd_per_hour > best.usd_per_hour and r.probes == 0 and "search.prune_costlier" in r.reason
        elif r is not best:
            assert r.reason.startswith(("SLO missed", "carries the target", "as cheap"))
    assert any(r.pareto for r in result.rows) and best.meets_at_target
    assert json.dumps(result.to_json())


def test_configurations_costlier_than_the_cheapest_that_carries_the_target_are_not_searched():
    """Pruning by cost changes nothing but the rows it prunes: every configuration as cheap as the recommendation or
    cheaper has the row a full search gives it (Pareto marks included), every costlier one is pruned, saying why."""
    space = {"hardware": ["L4", "A100-80GB", "H100-SXM"], "replicas": [1, 2]}
    full = run_search(parse_search_spec(spec(prune_costlier=False, **space)), workers=1)
    quick = run_search(parse_search_spec(spec(**space)), workers=1)
    best = full.recommended
    assert quick.recommended.label == best.label and quick.probes < full.probes
    costlier = 0
    for a, b in zip(full.to_json()["rows"], quick.to_json()["rows"]):
        if a["usd_per_hour"] <= best.usd_per_hour:
            assert a == b
        else:
            costlier += 1
            assert b["status"] == "pruned" and b["probes"] == 0 and b["capacity_rps"] == 0
            assert b["reason"] == (f"not searched: ${a['usd_per_hour']:.2f}/h, more than ${best.usd_per_hour:.2f}/h, "
                                   "the cheapest that carries the target (search.prune_costlier)")
    assert costlier >= 2


def test_a_tie_in_cost_and_capacity_goes_to_the_configuration_further_from_its_slos():
    """Two configurations as cheap with the same capacity: the one with more headroom at the target is recommended
    (whatever their labels' order), and the other says so rather than claiming less capacity."""
    from infersim.commands.search import ConfigResult, rank

    search = parse_search_spec(spec(replicas=[1]))
    slo = search.slo
    row = lambda label, ttft, tpot: ConfigResult(label, {}, {}, usd_per_hour=2.0, capacity_rps=5.0,  # noqa: E731
                                                 ttft_p90_s=ttft * slo.ttft_s, tpot_p90_s=tpot * slo.tpot_s,
                                                 meets_at_target=True)
    near, far = row("a-near", 0.9, 0.5), row("b-far", 0.3, 0.6)
    result = rank(search, [near, far])
    assert result.recommended is far
    assert near.reason.startswith("as cheap and as much capacity") and "90%" in near.reason and "60%" in near.reason
    less = row("c-less", 0.1, 0.1)
    less.capacity_rps = 4.0
    assert rank(search, [less, far]).recommended is far and less.reason == "as cheap, less capacity"


def test_a_row_short_of_the_target_says_whether_its_slos_or_its_pace_failed():
    """Below the target, a row names what failed the probe just above its capacity: the SLOs, or keeping up with the
    arrivals (a probe within its SLOs that fell behind, capacity.pace)."""
    from infersim.commands.search import ConfigResult, rank

    search = parse_search_spec(spec(replicas=[1]))
    row = lambda label, by, capacity: ConfigResult(label, {}, {}, usd_per_hour=1.0, capacity_rps=capacity,  # noqa: E731
                                                   missed_at_rps=2.2 if capacity else 0.01, missed_by=by)
    slow, late, never = row("a", "slo", 2.0), row("b", "keep_up", 2.0), row("c", "keep_up", 0.0)
    short = row("d", "short", 2.0)
    short.probe_limited = True
    rank(search, [slow, late, never, short])
    assert slow.reason == "SLO missed at 2.2 req/s: capacity 2 < target 3"
    assert late.reason == "fell behind its arrivals (completed < 80% of them) at 2.2 req/s: capacity 2 < target 3"
    assert never.reason.startswith("fell behind its arrivals") and "even at" in never.reason
    assert short.reason.startswith("capacity 2 req/s or more: at 2.2 its 600 probe requests arrive over too short a "
                                   "time") and "raise search.max_requests" in short.reason


def test_same_results_in_one_process_in_several_and_on_ray():
    """Also the rows pruned as costlier: the same whether a costlier one was searched (beside the one that carries
    the target, in another worker) or skipped."""
    search = parse_search_spec(spec(hardware=["A100-80GB", "H100-SXM"], pools=[None, [1, 1]]))
    rows = lambda r: [{k: v for k, v in row.items()} for row in r.to_json()["rows"]]  # noqa: E731
    one = rows(run_search(search, workers=1))
    assert sum("search.prune_costlier" in r["reason"] for r in one) == 3
    two = rows(run_search(search, workers=2))
    ray = rows(run_search(search, backend="ray"))
    assert one == two == ray


def test_bad_specs_are_one_line_errors():
    for bad, where in [({**spec(), "space": {"no_such": [1]}}, "space.no_such"),
                       ({**spec(), "space": {"replicas": []}}, "space.replicas"),
                       ({**spec(), "space": {"pools": [[1]]}}, "space.pools"),
                       ({**spec(replicas=[1]), "target": {"rate": -1}}, "target.rate"),
                       ({**spec(replicas=[1]), "scenario": {**BASE, "slo": {}}}, "target.slo"),
                       ({**spec(replicas=list(range(1, 200)), hardware=["a"] * 60)}, "space"),
                       ({**spec(replicas=[1]), "search": {"prune_costlier": "maybe"}}, "search.prune_costlier")]:
        with pytest.raises(ConfigError) as e:
            parse_search_spec(bad)
        assert e.value.key_path == where


def test_cli_search_writes_the_table_json_and_plot(tmp_path):
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec(hardware=["A100-80GB", "H100-SXM"])))
    r = run_cli(["search", str(path), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert "recommended:" in r.output
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"search.json", "search.md", "pareto.png"}
    assert png_size(tmp_path / "out" / "pareto.png") == (1210, 462)  # 11 x 4.2 inches at 110 dpi
    (tmp_path / "bad.yaml").write_text("scenario: x.yaml\nspace: {replicas: [1]}\n")
    r = run_cli(["search", str(tmp_path / "bad.yaml")])
    assert r.exit_code == 2 and "x.yaml" in r.output and "Traceback" not in r.output


def test_cli_compare_two_files_and_a_sweep(tmp_path):
    import yaml

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(BASE))
    b.write_text(yaml.safe_dump({**BASE, "hardware": "H100-SXM", "workload": {"trace": {"path": "nowhere.csv"}}}))
    r = run_cli(["compare", str(a), str(b), "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    reports = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert set(reports) == {"a", "b"}  # b ran on a's workload (its own trace path is never read)
    assert reports["a"]["requests"]["arrived"] == reports["b"]["requests"]["arrived"] == 600
    assert reports["b"]["tpot_s"]["p50"] < reports["a"]["tpot_s"]["p50"]
    r = run_cli(["compare", str(a), "--sweep", "serving.max_num_seqs=4,64", "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    swept = json.loads((tmp_path / "s" / "compare.json").read_text())
    assert swept["serving.max_num_seqs=4"]["ttft_s"]["p90"] > swept["serving.max_num_seqs=64"]["ttft_s"]["p90"]
    assert png_size(tmp_path / "s" / "cdf.png") == (1430, 418)  # 13 x 3.8 inches at 110 dpi
    r = run_cli(["compare", str(a), "--sweep", "max_num_seqs"])
    assert r.exit_code == 2 and "--sweep" in r.output


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios" / "search").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_search_specs_parse(path):
    """W: llama2_70b_capacity.yaml stopped parsing when a dotted key inside a searched section became an error."""
    from infersim.commands.search import configurations, load_search_spec

    assert len(configurations(load_search_spec(path))) > 1


def test_a_section_and_a_key_inside_it_combine_in_either_order():
    sections = [{"enable_chunked_prefill": True, "max_num_batched_tokens": 512}, {"enable_chunked_prefill": False}]
    from infersim.commands.search import configurations

    one = parse_search_spec(spec(**{"serving": sections, "serving.max_num_seqs": [16, 64]}))
    other = parse_search_spec(spec(**{"serving.max_num_seqs": [16, 64], "serving": sections}))
    seqs = sorted((d["serving"]["max_num_seqs"], d["serving"]["enable_chunked_prefill"])
                  for _, _, d in configurations(one))
    assert seqs == [(16, False), (16, True), (64, False), (64, True)]
    assert seqs == sorted((d["serving"]["max_num_seqs"], d["serving"]["enable_chunked_prefill"])
                          for _, _, d in configurations(other))


def test_every_configuration_has_its_own_label():
    """W: two `ngram` sections of different γ, or an A100 and an A100 with other bandwidth, made rows of one label
    (the recommendation named four configurations at once)."""
    from infersim.commands.search import configurations

    search = parse_search_spec(spec(**{
        "speculative": [None, {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rate": 0.5},
                        {"method": "ngram", "num_speculative_tokens": 5, "acceptance_rate": 0.5}],
        "hardware": ["A100-80GB", {"base": "A100-80GB", "memory_bandwidth": 1.2e12}]}))
    labels = [label for label, _, _ in configurations(search)]
    assert len(set(labels)) == len(labels) == 6
    assert "speculative=ngram(num_speculative_tokens=5) hardware=A100-80GB(memory_bandwidth=1.2e+12)" in labels
    assert "speculative=none hardware=A100-80GB" in labels

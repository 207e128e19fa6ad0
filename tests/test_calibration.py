"""Profile → fit → validate on a tiny checkpoint: the machinery end to end (accuracy is measured on the
real model by the validation scenarios, not here)."""
from __future__ import annotations

import json

import pytest

from sim.cost.fitted import FittedCostModel
from sim.policy.batch import shape_of
from tests.cli_runner import run_cli
from tests.helpers import png_size, tiny_checkpoint, write_tiny_scenario


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, checkpoint):
    """`infersim profile --quick` of the tiny checkpoint, made once for the tests here."""
    prof = tmp_path_factory.mktemp("profile") / "tiny.json"
    r = run_cli(["profile", "--model", str(checkpoint), "--out", str(prof), "--quick",
                 "--threads", "1"])
    assert r.exit_code == 0, r.output
    return prof


def test_profile_then_validate(tmp_path, checkpoint, profile):
    prof = profile
    data = json.loads(prof.read_text())
    assert data["model"]["num_layers"] == 2 and data["host"]["threads"] == 1
    assert data["measured"]["matmul_flops"] > 0 and data["measured"]["memory_bandwidth"] > 0
    assert len(data["samples"]) > 50
    # the fit prices a step at any size (a fixed cost: the step term or, below the knot, the few-token one) and
    # longer prompts higher
    cost = FittedCostModel.load(prof)
    assert cost.step_time(shape_of([1], [100])) > 0
    assert cost.step_time(shape_of([256], [256])) > cost.step_time(shape_of([16], [16])) > 0
    kinds = {(len(s["new_tokens"]) > 1, max(s["new_tokens"]) > 1) for s in data["samples"]}
    assert kinds >= {(False, True), (True, False), (True, True)}  # prefills, decode batches, mixed steps

    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-validate",
                               serving={"max_model_len": 512, "max_num_batched_tokens": 512},
                               kv_cache={"num_blocks": 128, "block_size": 16},
                               workload={"seed": 3, "num_requests": 20})
    out = tmp_path / "val"
    r = run_cli(["validate", str(path), "--profile", str(prof), "--out", str(out), "--repeat", "2"])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    assert v["requests"]["completed"] == 20 and v["runs"] == 2
    assert all(r["all"] > 0 for r in v["step_time_ratio"])
    assert (out / "run1" / "steps.jsonl").exists() and (out / "run2" / "requests.jsonl").exists()
    for name in ("ttft_p50", "tpot_p50", "throughput_out_tok_s", "itl_p50", "e2e_p50"):
        row = v["metrics"][name]
        assert row["real"] > 0 and row["sim"] > 0 and row["error_pct"] is not None and row["spread_pct"] >= 0
        assert row["real"] == pytest.approx(sum(row["real_runs"]) / 2)
    assert png_size(out / "latency_cdf_sim_vs_real.png") == (1170, 324)  # 13 x 3.6 inches at 90 dpi

    # the recorded runs re-scored without running: the same real values, the same prediction
    again = tmp_path / "again"
    r = run_cli(["validate", str(path), "--profile", str(prof), "--real-from", str(out), "--out", str(again)])
    assert r.exit_code == 0, r.output
    w = json.loads((again / "validation.json").read_text())
    assert w["runs"] == 2
    assert [a["all"] for a in w["step_time_ratio"]] == pytest.approx([b["all"] for b in v["step_time_ratio"]], rel=1e-9)
    for name, row in w["metrics"].items():
        assert row["real_runs"] == pytest.approx(v["metrics"][name]["real_runs"], rel=1e-12), name
        for key in ("sim", "error_pct", "error_at_run_speed_pct"):
            assert row[key] == pytest.approx(v["metrics"][name][key], rel=1e-6, abs=1e-6), (name, key)

    # a profile twice too slow: the predicted TPOT about doubles (so its error grows by ~100 points of the real one,
    # which a loaded machine inflates: judged on the prediction), the error at the runs' step speed does not move
    # (each run's measured ratio halves and cancels the doubling)
    slow = dict(data, fit=dict(data["fit"], coefs={k: 2 * c for k, c in data["fit"]["coefs"].items()}))
    slow_prof = tmp_path / "slow.json"
    slow_prof.write_text(json.dumps(slow))
    twice = tmp_path / "twice"
    r = run_cli(["validate", str(path), "--profile", str(slow_prof), "--real-from", str(out),
                 "--out", str(twice)])
    assert r.exit_code == 0, r.output
    x = json.loads((twice / "validation.json").read_text())
    assert [a["all"] for a in x["step_time_ratio"]] == pytest.approx([a["all"] / 2 for a in w["step_time_ratio"]])
    tpot, base = x["metrics"]["tpot_p50"], w["metrics"]["tpot_p50"]
    assert tpot["sim"] > 1.5 * base["sim"] and tpot["error_pct"] > base["error_pct"]
    assert tpot["error_at_run_speed_pct"] == pytest.approx(base["error_at_run_speed_pct"], rel=1e-6, abs=1e-6)
    r = run_cli(["validate", str(path), "--profile", str(prof), "--real-from", str(tmp_path)])
    assert r.exit_code == 2 and "no recorded runs" in r.output


def test_validate_without_a_profile_says_how_to_make_one(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: SmolLM2-135M\nhardware: cpu\nworkload: {trace: {path: builtin:azure_conv}}\n")
    r = run_cli(["validate", str(path), "--profile", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "infersim profile" in r.output


def test_validate_a_folder_of_scenarios_writes_a_summary(tmp_path, checkpoint, profile):
    """A folder expands to its scenarios (one model load), each gets its own subfolder, and the summary and
    markdown table cover them all."""
    prof = profile
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for name, rate in (("tiny-a", 20.0), ("tiny-b", 60.0)):
        write_tiny_scenario(folder, checkpoint, name=name,
                            workload={"num_requests": 10, "arrival": {"process": "poisson", "rate": rate}})
    out = tmp_path / "val"
    r = run_cli(["validate", str(folder), "--profile", str(prof), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "tiny-a" / "validation.json").exists() and (out / "tiny-b" / "validation.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["scenario"] for s in summary["scenarios"]] == ["tiny-a", "tiny-b"]
    row = summary["summary"]["tpot_p50"]
    assert row["max_abs_error_pct"] >= row["median_abs_error_pct"] >= 0
    at_speed = [abs(s["metrics"]["tpot_p50"]["error_at_run_speed_pct"]) for s in summary["scenarios"]]
    assert row["median_abs_error_at_run_speed_pct"] == pytest.approx(sum(at_speed) / 2)
    table = (out / "table.md").read_text()
    assert table.count("| tiny-a |") == 1 and "tpot_p50" in table and "error at the run's step speed" in table


def test_validate_a_speculative_scenario_reports_its_speedup(tmp_path, checkpoint, profile):
    """A speculative scenario is also served without speculation; validation.json has the real and simulated
    TPOT and throughput speedups and α measured vs given, and the re-score finds the plain runs again."""
    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-spec",
                               speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                            "acceptance_rate": 0.3},
                               workload={"num_requests": 10, "output_len": {"dist": "uniform", "min": 8, "max": 30}})
    out = tmp_path / "val"
    r = run_cli(["validate", str(path), "--profile", str(profile), "--out", str(out)])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    spec = v["speculative"]
    for name in ("tpot_p50_speedup", "throughput_speedup"):
        assert spec[name]["real"] > 0 and spec[name]["sim"] > 0 and spec[name]["error_pct"] is not None
        assert spec[name]["error_at_run_speed_pct"] is not None  # each half simulated at its runs' step speed
    assert spec["alpha_sim"] == pytest.approx(0.3, abs=0.15) and 0 <= spec["alpha_real"] <= 1
    assert spec["plain"]["tpot_p50"]["real"] > 0
    assert (out / "plain" / "run1" / "steps.jsonl").exists()
    again = run_cli(["validate", str(path), "--profile", str(profile), "--real-from", str(out)])
    assert again.exit_code == 0 and "tpot_p50_speedup" in again.output


@pytest.mark.parametrize("folder, profile, runs", [
    ("2026-11-29-h200", "docs/runs/2026-11-29-h200/cuda.json", 2),  # every step eager
    ("2026-11-30-h200", "calibration/profiles/cuda.json", 1),  # plain decode steps replayed from CUDA graphs
])
def test_the_shipped_h200_runs_rescore_here_without_a_gpu(tmp_path, folder, profile, runs):
    """docs/runs holds the executor runs gpu_check recorded on an H200; `--device cuda --real-from`
    re-scores them on any machine against the profile measured with them and gives the shipped table."""
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shipped = root / "docs/runs" / folder
    with tarfile.open(shipped / "runs.tar.gz") as tar:
        tar.extractall(tmp_path / "runs", filter="data")
    scenarios = [str(root / f"scenarios/validation/{s}.yaml") for s in ("low_load", "medium_load")]
    r = run_cli(["validate", *scenarios, "--device", "cuda", "--real-from", str(tmp_path / "runs"),
                 "--profile", str(root / profile), "--out", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output
    for s in ("low_load", "medium_load"):
        want = json.loads((shipped / f"{s}.validation.json").read_text())
        got = json.loads((tmp_path / "again" / s / "validation.json").read_text())
        assert got["runs"] == runs and got["profile"].endswith("cuda.json")
        for name, row in got["metrics"].items():
            if name not in want["metrics"]:  # a metric added since the runs were recorded
                continue
            assert row["real"] == pytest.approx(want["metrics"][name]["real"], rel=1e-12), (s, name)
            assert row["error_pct"] == pytest.approx(want["metrics"][name]["error_pct"], abs=0.5), (s, name)


def test_profile_of_a_missing_model_path_is_one_line(tmp_path):
    r = run_cli(["profile", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "no such file or directory" in r.output and "--model" in r.output


def test_validate_a_scenario_whose_requests_are_all_rejected(tmp_path, checkpoint, profile):
    """Every prompt longer than max_model_len: both sides reject all of them, the counts say so, and the
    per-run diagnostics have nothing to divide by instead of failing."""
    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-rejects", serving={"max_model_len": 64},
                               workload={"num_requests": 6, "prompt_len": {"dist": "uniform", "min": 80, "max": 90}})
    out = tmp_path / "val"
    r = run_cli(["validate", str(path), "--profile", str(profile), "--out", str(out)])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "validation.json").read_text())
    assert v["requests"]["rejected"] == 6 and v["requests"]["completed"] == 0
    assert v["step_time_ratio"][0]["all"] is None
    assert v["metrics"]["tpot_p50"]["error_at_run_speed_pct"] is None


def test_a_gpu_profile_measured_with_graphs_is_refused_for_an_eager_scenario(tmp_path):
    """On a GPU, a profile measured with CUDA graphs prices an eager scenario wrong (and the reverse): one line
    naming both and the key. The CPU has no graphs: nothing to check."""
    from pathlib import Path

    from calibration.validate import check_graphs
    from sim.config.errors import ConfigError
    from sim.config.plan import load_scenario, replan

    root = Path(__file__).resolve().parent.parent
    _, plan = load_scenario(root / "scenarios/validation/low_load.yaml")
    eager_plan = replan(plan, executor={**plan.source["executor"], "cuda_graphs": False})
    profile = tmp_path / "cuda.json"
    profile.write_text(json.dumps({"host": {"device": "cuda", "cuda_graphs": True}}))
    check_graphs([plan], profile, "cuda")
    check_graphs([eager_plan], profile, "cpu")
    with pytest.raises(ConfigError) as e:
        check_graphs([eager_plan], profile, "cuda")
    assert e.value.key_path == "executor.cuda_graphs" and "cuda_graphs true" in e.value.message
    check_graphs([eager_plan], root / "docs/runs/2026-11-29-h200/cuda.json", "cuda")  # predates the flag


def test_profile_alongside_sweeps_between_the_runs_and_predicts_with_it(tmp_path, checkpoint, profile, monkeypatch):
    """validate --profile-alongside: a slice of the sweep before every executor run and the rest after the last,
    the profile written and the scenarios predicted with it; the same steps as a sweep run all at once."""
    import calibration.validate as validate_mod
    from calibration.profile import Sweep
    from sim.config.plan import load_scenario

    order = []
    run_until, run_real = Sweep.run_until, validate_mod.run_real
    monkeypatch.setattr(Sweep, "run_until", lambda self, f: (order.append(("sweep", f)), run_until(self, f))[1])
    monkeypatch.setattr(validate_mod, "run_real", lambda *a, **k: (order.append(("run", None)), run_real(*a, **k))[1])
    plans = []
    for name in ("tiny-a", "tiny-b"):
        path = write_tiny_scenario(tmp_path, checkpoint, name=name, workload={"num_requests": 6})
        plans.append((load_scenario(path)[1], tmp_path / "val" / name))
    prof = tmp_path / "alongside.json"
    results = validate_mod.validate_many(plans, tmp_path / "unused.json", runs=2, alongside=prof, quick_sweep=True)
    kinds = [k for k, _ in order]
    assert kinds[:8] == ["sweep", "run"] * 4 and order[8] == ("sweep", 1.0)  # 4 runs: 5 slices
    assert [f for k, f in order if k == "sweep"][:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    data, whole = json.loads(prof.read_text()), json.loads(profile.read_text())
    assert [s["new_tokens"] for s in data["samples"]] == [s["new_tokens"] for s in whole["samples"]]
    assert data["fit"]["heldout"]["mape"] >= 0 and data["sweep_s"] > 0
    assert all(r["profile"] == str(prof) and r["requests"]["completed"] == 6 for r in results)

    r = run_cli(["validate", str(path), "--profile-alongside", str(prof), "--real-from", str(tmp_path)])
    assert r.exit_code == 2 and "--real-from" in r.output and r.output.strip().count("\n") == 0
    r = run_cli(["validate", str(path), "--profile-alongside", str(prof), "--profile", str(prof)])
    assert r.exit_code == 2 and "not with --profile" in r.output


def test_speculative_runs_and_their_plain_baselines_alternate_which_goes_first():
    """A B, B A: a speculative scenario's run goes before its plain baseline in odd repeats and after it in even
    ones, so a drift through the validation does not always land on the plain half of the speedup."""
    from calibration.validate import run_order

    main, plain = [0, 2, 3], [1, None, 4]  # scenarios: speculative, plain, speculative
    assert run_order(main, plain, 0) == [0, 1, 2, 3, 4]
    assert run_order(main, plain, 1) == [1, 0, 2, 4, 3]
    assert run_order(main, plain, 2) == run_order(main, plain, 0)


def test_profile_alongside_refuses_scenarios_on_different_models():
    """One profile prices one model: a validation that mixes models cannot measure one alongside (one line, before
    any model loads)."""
    from calibration.validate import alongside_sweep
    from sim.config.errors import ConfigError
    from tests.helpers import plan_of, scenario

    small, big = plan_of(scenario(model="SmolLM2-135M")), plan_of(scenario(model="Llama-2-7B"))

    def load(plan):
        raise AssertionError("no model should load")
    with pytest.raises(ConfigError, match="one model's profile") as e:
        alongside_sweep([small, big], load, "cpu", True)
    assert e.value.key_path == "--profile-alongside"


def test_a_sweep_run_in_slices_divides_out_each_slices_speed():
    """validate --profile-alongside runs the sweep in slices between executor runs, and the machine's speed moves
    between them: a slice that ran 1.5x slow is read off its own steps, and the samples are priced at the mean
    speed instead of at whichever slices their repeats fell in."""
    from calibration.profile import Sweep
    from executor.model.tiny import tiny_model

    sweep = Sweep(tiny_model(vocab_size=64), list(range(3, 60)), "cpu", quick=True, repeats=2)
    for f in (0.25, 0.5, 0.75, 1.0):
        sweep.run_until(f)
    assert sweep.num_slices == 4
    factor = [1.0, 1.5, 1.0, 0.8]
    for reps, where in zip(sweep.results, sweep.slice_of):  # the same machine, every step's time made exact
        for steps, j in zip(reps, where):
            for s in steps:
                s["start_s"], s["end_s"] = 0.0, (1e-3 + 2e-5 * sum(s["new_tokens"])) * factor[j]
    samples, speed = sweep.samples_and_speeds()
    mean = sum(factor) / 4
    assert speed == pytest.approx([f / mean for f in factor], rel=0.03)
    for s in samples:
        assert s["time_s"] == pytest.approx((1e-3 + 2e-5 * sum(s["new_tokens"])) * mean, rel=0.03)
    raw = [abs(s["repeat_times_s"][0] / s["repeat_times_s"][1] - 1) for s in samples]
    assert max(raw) > 0.2  # without the division, repeats in a slow and a fast slice disagree


def test_a_sweep_run_at_once_keeps_its_medians():
    from calibration.profile import Sweep
    from executor.model.tiny import tiny_model

    sweep = Sweep(tiny_model(vocab_size=64), list(range(3, 60)), "cpu", quick=True, repeats=2)
    sweep.run_until(1.0)
    samples, speed = sweep.samples_and_speeds()
    assert speed == [1.0] and all(s["time_s"] == pytest.approx(sum(s["repeat_times_s"]) / 2) for s in samples)


def test_capacity_is_measured_and_the_simulated_one_lies_between_rates_the_executor_passes_and_fails(
        tmp_path, checkpoint, profile):
    """`validate --capacity` end to end on the tiny model, and the check that keeps its bisection honest: the
    simulator's capacity sits between a rate the executor meets the SLOs at and one it misses them at."""
    from calibration.capacity import predicted_capacity, probe_grid
    from calibration.validate import run_real, slo_metrics
    from executor.core.cpu_load import CpuLoad
    from executor.serving.serve import load_model
    from sim.config.generator import generate_requests
    from sim.config.plan import load_scenario
    from sim.report.capacity import passes, probe_rows, scaled

    path = write_tiny_scenario(tmp_path, checkpoint, slo={"ttft_s": 0.25, "tpot_s": 0.05, "quantile": 0.9},
                               workload={"num_requests": 40})
    out = tmp_path / "cap"
    r = run_cli(["validate", str(path), "--capacity", "--precision", "0.3", "--profile", str(profile),
                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    cap = json.loads((out / "capacity.json").read_text())
    assert cap["measured"]["capacity_rps"] > 0 and cap["predicted"]["capacity_rps"] > 0
    assert [p["passes"] for p in cap["probes"]].count(True) >= 1 and len(list(out.glob("probe*"))) == len(cap["probes"])
    assert "error %" in r.output

    plan = load_scenario(path)[1]
    specs = generate_requests(plan.workload, plan.base_dir)
    base = probe_rows(specs)
    sim, _ = predicted_capacity(plan, profile, probe_grid(plan, specs), 0.1)
    assert sim.rate > 0 and sim.missed_at is not None
    loaded = load_model(plan, "cpu")
    load = CpuLoad()
    verdicts = []
    for rate in (sim.rate / 2, sim.missed_at * 2):
        probe = scaled(base, rate)
        records, _ = run_real(plan, probe, "cpu", 1, loaded)
        verdicts.append(passes(slo_metrics(plan, records), records, probe))
    load.sample()
    if load.busy:  # another process's timings: nothing to judge the executor's rate by
        pytest.skip(f"other processes used {load.mean_others:.1f} cores while the executor served")
    assert verdicts == [True, False], (sim.rate, sim.missed_at)


def test_a_closed_loop_s_capacity_is_measured_in_users(tmp_path, checkpoint, profile):
    """`validate --capacity` on a closed loop counts users: whole numbers, the same unit on both sides, each user
    count probed once."""
    import yaml

    path = write_tiny_scenario(tmp_path, checkpoint, slo={"ttft_s": 0.25, "tpot_s": 0.05, "quantile": 0.9},
                               workload={"num_requests": 48, "closed_loop": {"users": 4, "think_time_s": 0.01}})
    data = yaml.safe_load(path.read_text())
    data["workload"].pop("arrival")
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "cap"
    r = run_cli(["validate", str(path), "--capacity", "--precision", "0.3", "--profile", str(profile),
                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    cap = json.loads((out / "capacity.json").read_text())
    assert cap["unit"] == "users" and cap["target_rate"] == 4 and "probe 1 at 4 users" in r.output
    tried = [p["rate"] for p in cap["probes"]]
    assert all(u == int(u) and u >= 1 for u in tried) and len(set(tried)) == len(tried)
    for side in ("measured", "predicted"):
        assert cap[side]["capacity_rps"] == int(cap[side]["capacity_rps"]) >= 1


# -- calibration/gpu_check: the GPU command's scenarios and its CPU dry run -----------------------------------------

def test_gpu_check_scenarios_simulate_and_cut_down_for_the_dry_run(tmp_path):
    from calibration.gpu_check import CAPACITY, DRY_MODEL, DRY_REQUESTS, MODELS, dry_scenario
    from infersim.api import run_scenario
    from sim.config.plan import load_scenario

    paths = {p for ps in MODELS.values() for p in ps} | set(CAPACITY.values())
    for path in sorted(paths):
        report = run_scenario(path, out=None, quiet=True, plots=False)
        rq = report["requests"]
        assert rq["arrived"] == rq["completed"] + rq["rejected"] and rq["completed"] > 0
        _, plan = load_scenario(path)
        assert plan.hardware.name == "H200"
        _, dry = load_scenario(dry_scenario(path, tmp_path))
        assert (dry.model.num_layers, dry.model.hidden_size) == (DRY_MODEL["num_layers"], DRY_MODEL["hidden_size"])
        assert dry.executor.random_weights and dry.hardware.name == "cpu"
        assert dry.workload.num_requests == DRY_REQUESTS
    assert {load_scenario(p)[1].model.num_layers for p in MODELS["llama-3-8b"]} == {32}  # the 8B's shape


def test_gpu_check_dry_run_writes_one_summary(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "calibration.gpu_check", "--device", "cpu", "--models", "smollm2-135m",
                        "--quick", "--runs", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert "CPU dry run" in summary and "gpu-smollm2-135m" in summary and "ttft_p50" in summary
    assert (out / "smollm2-135m" / "cpu.json").exists()
    assert json.loads((out / "smollm2-135m" / "smollm2_h200" / "validation.json").read_text())["runs"]


def test_gpu_check_names_the_models_it_knows(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "calibration.gpu_check", "--device", "cpu", "--models", "gpt-5",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--models" in r.stderr and "llama-3-8b" in r.stderr

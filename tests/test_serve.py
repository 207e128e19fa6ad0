"""`infersim serve` end to end on a tiny random-weight checkpoint: online replay, the shared report,
the step trace, and every request accounted for (also when the KV cache is too small)."""
from __future__ import annotations

import json

import pytest

from infersim.api import serve_scenario
from tests.helpers import tiny_checkpoint, write_tiny_scenario


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def test_serve_writes_the_shared_report_and_the_step_trace(tmp_path, checkpoint):
    out = tmp_path / "out"
    report = serve_scenario(write_tiny_scenario(tmp_path, checkpoint), out, quiet=True, plots=False)
    rq = report["requests"]
    assert report["engine"] == "executor" and rq["arrived"] == 24 == rq["completed"] + rq["rejected"]
    assert rq["completed"] == 24
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert report[key]["p50"] > 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    reqs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(steps) == report["engine_steps"] > 0
    assert all(s["end_s"] > s["start_s"] and len(s["new_tokens"]) == len(s["context_lens"]) for s in steps)
    assert sum(s["num_prefill"] for s in steps) >= 24  # every prompt was prefilled
    for r in reqs:
        assert len(r["token_times"]) == r["max_tokens"] and r["first_token_s"] > r["arrival_s"]
    assert (out / "report.json").exists() and (out / "requests.csv").exists()


def test_too_small_kv_cache_preempts_and_loses_nothing(tmp_path, checkpoint):
    # all 24 arrive within milliseconds: at 40/s a fast machine finished each before the next came, and nothing
    # was ever preempted
    path = write_tiny_scenario(tmp_path, checkpoint, kv_cache={"num_blocks": 14, "block_size": 8},
                               serving={"max_model_len": 96},
                               workload={"arrival": {"process": "poisson", "rate": 20000.0}})
    report = serve_scenario(path, None, quiet=True, plots=False)
    rq = report["requests"]
    assert rq["arrived"] == rq["completed"] + rq["rejected"] == 24
    assert report["kv_cache"]["preemptions"] > 0
    assert rq["completed"] > 0


def test_serve_refuses_a_model_without_weights(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: Llama-2-7B\nhardware: A100-80GB\nworkload: {trace: {path: builtin:azure_conv}}\n")
    from sim.config.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        serve_scenario(path, None, quiet=True)
    assert e.value.key_path == "model" and "real weights" in e.value.message


def test_serve_with_a_draft_model_reports_speculation_and_its_cost(tmp_path, checkpoint):
    """method: draft_model serves through a draft saved like `infersim distill` saves one; the report has
    α and the measured drafting cost the simulator takes (draft_s_per_step, draft_s_per_seq)."""
    from executor.model.weights import load_hf_model
    from executor.speculative.draft_model import make_student

    target, _, _ = load_hf_model(checkpoint)
    make_student(target, [1], list(range(0, 1000, 2))).save(tmp_path / "draft", {"teacher": "tiny"})
    path = write_tiny_scenario(tmp_path, checkpoint, speculative={
        "method": "draft_model", "draft_model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    report = serve_scenario(path, tmp_path / "served", quiet=True, plots=False)
    assert report["requests"]["completed"] == 24
    spec = report["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["alpha"] <= 1
    # speculative.yaml: the scenario's section with what was measured; the simulator runs the scenario with it
    import yaml

    from sim.config.plan import load_scenario
    from sim.simulator.cluster import simulate
    measured = yaml.safe_load((tmp_path / "served" / "speculative.yaml").read_text())["speculative"]
    assert measured["method"] == "draft_model" and measured["request_rates"] == spec["request_rates"]
    assert measured["draft_s_per_step"] == pytest.approx(spec["draft_s_per_step"], abs=1e-6)
    calibrated = write_tiny_scenario(tmp_path, checkpoint, name="calibrated", speculative=measured)
    simulated = simulate(load_scenario(calibrated)[1])
    assert sum(r.num_drafted for r in simulated.requests) > 0
    assert spec["draft_s_per_step"] >= 0 and spec["draft_s_per_seq"] >= 0
    assert spec["draft_s_per_step"] + spec["draft_s_per_seq"] > 0
    rates = spec["request_rates"]  # [proposal_rate, α] per request that decoded: what request_rates takes
    assert 0 < len(rates) <= 24 and all(0 <= p <= 1 and 0 <= a <= 1 for p, a in rates)

    missing = write_tiny_scenario(tmp_path, checkpoint, name="no-draft", speculative={
        "method": "draft_model", "draft_model": "nowhere", "num_speculative_tokens": 3})
    from sim.config.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        serve_scenario(missing, None, quiet=True)
    assert e.value.key_path == "speculative.draft_model" and "infersim distill" in e.value.message


def test_serve_with_medusa_heads_reports_their_rank_probabilities(tmp_path, checkpoint):
    """method: medusa serves with tree verification through heads saved like `infersim train-medusa` saves
    them; the report has the measured rank probabilities the simulator takes (medusa_rank_probs)."""
    from executor.model.weights import load_hf_model
    from executor.speculative.medusa import MedusaHeads

    target, _, _ = load_hf_model(checkpoint)
    MedusaHeads(target, 2, list(range(1000))).save(tmp_path / "heads", {})
    tree = [[0], [1], [0, 0], [1, 0]]
    path = write_tiny_scenario(tmp_path, checkpoint, speculative={
        "method": "medusa", "medusa_heads": str(tmp_path / "heads"), "medusa_tree": tree})
    report = serve_scenario(path, None, quiet=True, plots=False)
    assert report["requests"]["completed"] == 24
    spec = report["speculative"]
    assert spec["drafted"] > 0 and len(spec["medusa_rank_probs"]) == 2
    assert abs(sum(spec["medusa_rank_probs"][0]) - 1) < 1e-9

    deep = write_tiny_scenario(tmp_path, checkpoint, name="too-deep", speculative={
        "method": "medusa", "medusa_heads": str(tmp_path / "heads"), "medusa_tree": [[0], [0, 0], [0, 0, 0]]})
    from sim.config.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        serve_scenario(deep, None, quiet=True)
    assert e.value.key_path == "speculative.medusa_tree"


def test_draft_cost_fits_the_drafter_and_the_verify_steps_ratio_to_the_profile():
    """The drafter's time is fitted from what the executor measured of it (no profile needed), and the verify
    forwards' time over the fitted model's prediction is their ratio, whatever their size."""
    from calibration.speculative import draft_cost
    from executor.core.engine import StepRecord
    from sim.cost.fitted import FittedCostModel
    from sim.policy.batch import shape_of

    cost = FittedCostModel({"step": 0.05, "new_tokens": 0.002, "kv_tokens": 1e-5})
    records = []
    for i, n in enumerate([1, 2, 3, 4, 5, 6] * 3):
        plain = i % 3  # rows that got no drafts this step cost nothing extra
        new, ctx = [4] * n + [1] * plain, [100 + 10 * i] * (n + plain)
        pred = cost.step_time(shape_of(new, ctx, 4 * n + plain, 0))
        drafter = 0.010 + 0.003 * n  # the drafter's passes
        verify = 1.1 * pred  # the verify forward, slower than the profile predicts
        records.append(StepRecord(i, 1.0 * i, 1.0 * i + drafter + verify, new, ctx, 0, n + plain, 0, 4 * n + plain,
                                  0, [], 0, num_drafted=3 * n, num_accepted=n, draft_s=drafter))
    only = draft_cost(records)
    assert only["draft_s_per_step"] == pytest.approx(0.010) and only["draft_s_per_seq"] == pytest.approx(0.003)
    assert "verify_cost_ratio" not in only
    fit = draft_cost(records, cost)
    assert fit["draft_s_per_step"] == pytest.approx(0.010) and fit["draft_s_per_seq"] == pytest.approx(0.003)
    assert fit["verify_cost_ratio"] == pytest.approx(1.1) and fit["plain_decode_step_ratio"] == 1.0


def test_draft_cost_counts_the_drafter_s_steps_that_found_no_drafts():
    """Prompt lookup's search costs its time in every step it runs, drafts or none: those steps (draft_s > 0,
    nothing drafted) are in the fit, so draft_s_per_step is the search and draft_s_per_seq what a drafting
    request adds; steps the drafter was not asked for (draft_s 0) are not."""
    from calibration.speculative import draft_cost
    from executor.core.engine import StepRecord

    records = []
    for i, n in enumerate([0, 0, 1, 2, 0, 3] * 3):
        new, ctx = [4] * n + [1] * (3 - n), [100] * 3
        records.append(StepRecord(i, 1.0 * i, 1.0 * i + 0.03, new, ctx, 0, 3, 0, 3 + 3 * n, 0, [], 0,
                                  num_drafted=3 * n, num_accepted=n, draft_s=0.0004 + 0.0001 * n))
    records += [StepRecord(100 + i, 200.0 + i, 200.03 + i, [1] * 9, [100] * 9, 0, 9, 0, 9, 0, [], 0)
                for i in range(5)]  # a batch over disable_by_batch_size: the drafter not asked
    fit = draft_cost(records)
    assert fit["draft_s_per_step"] == pytest.approx(0.0004) and fit["draft_s_per_seq"] == pytest.approx(0.0001)


def test_draft_cost_fits_a_draft_model_s_catch_up_on_prompts():
    """A draft model reads a new request's prompt at its first draft (draft_fed_tokens): the fit gives that
    time per token apart from the per-step and per-request parts; drafters with no model report none."""
    from calibration.speculative import draft_cost
    from executor.core.engine import StepRecord

    records = []
    for i, (n, fed) in enumerate([(1, 1), (2, 160), (2, 2), (3, 3), (3, 203), (1, 1), (2, 3), (3, 90)] * 2):
        new, ctx = [4] * n, [300] * n
        records.append(StepRecord(i, 1.0 * i, 1.0 * i + 0.05, new, ctx, 0, n, 0, 4 * n, 0, [], 0, num_drafted=3 * n,
                                  num_accepted=n, draft_s=0.006 + 0.002 * n + 5e-5 * fed, draft_fed_tokens=fed))
    fit = draft_cost(records)
    assert fit["draft_s_per_step"] == pytest.approx(0.006) and fit["draft_s_per_seq"] == pytest.approx(0.002)
    assert fit["draft_s_per_token"] == pytest.approx(5e-5)
    for r in records:
        r.draft_fed_tokens = 0
    assert "draft_s_per_token" not in draft_cost(records)


def test_draft_cost_reads_the_machine_speed_off_the_runs_plain_decode_steps():
    """A serve whose plain decode steps all ran 1.2x the profile: the verify steps' share of that slowness is
    the machine's, not speculation's; with too few plain steps to tell, the profile's speed is taken."""
    from calibration.speculative import MIN_PLAIN_STEPS, draft_cost
    from executor.core.engine import StepRecord
    from sim.cost.fitted import FittedCostModel
    from sim.policy.batch import shape_of

    cost = FittedCostModel({"step": 0.05, "new_tokens": 0.002, "kv_tokens": 1e-5})
    spec, t = [], 0.0
    for i, n in enumerate([1, 2, 3, 4] * 4):
        new, ctx = [4] * n, [100 + 10 * i] * n
        pred = cost.step_time(shape_of(new, ctx, 4 * n, 0))
        spec.append(StepRecord(i, t, t + 0.006 + 1.2 * 1.05 * pred, new, ctx, 0, n, 0, 4 * n, 0, [], 0,
                               num_drafted=3 * n, num_accepted=n, draft_s=0.006))
        t += 1.0
    plain = []
    for i in range(MIN_PLAIN_STEPS):
        new, ctx = [1] * (1 + i % 3), [200] * (1 + i % 3)
        dur = 1.2 * cost.step_time(shape_of(new, ctx, len(new), 0))
        plain.append(StepRecord(100 + i, t, t + dur, new, ctx, 0, len(new), 0, len(new), 0, [], 0))
        t += 1.0
    fit = draft_cost(spec + plain, cost)
    assert fit["plain_decode_step_ratio"] == pytest.approx(1.2) and fit["plain_decode_steps"] == MIN_PLAIN_STEPS
    # the drafter's 6 ms were at the serve's 1.2x: 5 ms at the profile's speed, which the reference step names
    assert fit["draft_s_per_step"] == pytest.approx(0.005) and fit["draft_s_per_seq"] == pytest.approx(0.0, abs=1e-9)
    assert fit["draft_s_reference_step"] == pytest.approx(cost.step_time(shape_of([1], [256])))
    assert fit["verify_cost_ratio"] == pytest.approx(1.05) and fit["verify_step_ratio"] == pytest.approx(1.26)
    few = draft_cost(spec + plain[:MIN_PLAIN_STEPS - 1], cost)
    assert few["plain_decode_step_ratio"] == 1.0 and few["verify_cost_ratio"] == pytest.approx(1.26)


class _Load:
    """A stand-in CpuLoad whose other processes are as busy as told."""

    def __init__(self, busy: bool):
        self.busy_now = busy

    def sample(self):
        return 1.5 if self.busy_now else 0.0

    def threads_for(self, others):
        return 1

    def others_busy(self):
        return self.busy_now


@pytest.mark.parametrize("busy", [False, True])
def test_keep_warm_polls_idle_gaps_only_on_a_quiet_machine(monkeypatch, busy):
    from executor.core import engine_core
    from executor.model.tiny import tiny_model
    from executor.serving import serve as serve_mod
    from sim.config.workload import RequestSpec
    from tests.test_engine import make_engine

    warmed, slept = [], []
    real_warm = engine_core.keep_warm
    monkeypatch.setattr(engine_core, "keep_warm", lambda e, until, ready: (warmed.append(until),
                                                                            real_warm(e, until, ready)))
    monkeypatch.setattr(engine_core.time, "sleep", lambda s: slept.append(s))
    engine = make_engine(tiny_model(seed=1))
    specs = [RequestSpec(i, 0.2 * i, 8, 3) for i in range(4)]  # gaps far longer than a tiny step
    reqs = serve_mod.replay(engine, specs, list(range(3, 200)), _Load(busy), keep_warm=True)
    assert all(r.is_done for r in reqs) and len(reqs) == 4
    assert all(r.first_token_s >= r.arrival_s for r in reqs)  # nothing started before it arrived
    assert (bool(warmed), bool(slept)) == ((False, True) if busy else (True, False))

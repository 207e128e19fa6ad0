"""The fitted step-cost model: recovers known coefficients, matches decode_time to step_time exactly,
plugs into scenarios through cost_model.profile, and refuses a profile of another model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from calibration.profile import fit_samples
from sim.config.errors import ConfigError
from sim.cost.fitted import FEATURES, FittedCostModel, RoutedExperts, fit, routed_experts
from sim.policy.batch import shape_of
from tests.helpers import run, scenario

TRUE = {"step": 0.03, "new_tokens": 4e-4, "decode_seqs": 1e-3, "prefill_seqs": 5e-3, "has_prefill": 0.02,
        "batched_prefill": 0.015, "has_verify": 0.01, "sampled": 2e-4, "attn_pairs": 2e-8, "kv_tokens": 3e-6,
        "prefill_kv": 2e-6,
        "few_tokens": 0.0, "ramp_tokens": 0.0, "experts_touched": 0.0, "window_kv": 0.0, "window_pairs": 0.0}


def synthetic(n=400, noise=0.02, seed=0, truth=None):
    rng = np.random.default_rng(seed)
    truth = truth or FittedCostModel(TRUE)
    shapes, times = [], []
    for _ in range(n):
        kind = rng.random()
        b = int(rng.integers(1, 32)) if kind < 0.66 else 0  # decode rows
        p = int(rng.integers(1, 4)) if 0.33 < kind < 0.85 else 0  # prompt chunks (1-3), alone or with decodes
        # in some steps some decode rows verify drafts
        drafts = rng.integers(0, 5, b) * (rng.random(b) < 0.4) if kind < 0.25 else np.zeros(b, int)
        new = (1 + drafts).tolist() + rng.integers(8, 512, p).tolist()
        ctx = (rng.integers(16, 1024, b) + drafts).tolist() + [n + int(rng.integers(0, 512)) for n in new[b:]]
        # some chunks end mid-prompt; every verify position samples
        shape = shape_of(new, ctx, sampled=int(sum(new[:b])) + int(rng.integers(0, p + 1)), num_prefill=p)
        shapes.append(shape)
        times.append(truth.step_time(shape) * (1 + noise * rng.standard_normal()))
    return shapes, times


def test_fit_recovers_coefficients_and_reports_heldout_error():
    shapes, times = synthetic()
    result = fit(shapes, times)
    c = result["coefs"]
    assert sum(s.num_verify > 0 for s in shapes) > 30
    for k in ("step", "new_tokens", "prefill_seqs", "has_prefill", "batched_prefill", "has_verify", "kv_tokens"):
        assert c[k] == pytest.approx(TRUE[k], rel=0.2), k
    # a decode row's three per-row terms are told apart only by the few chunks that do not sample: check the sum
    row = ("new_tokens", "decode_seqs", "sampled")
    assert sum(c[k] for k in row) == pytest.approx(sum(TRUE[k] for k in row), rel=0.1)
    assert result["heldout"]["mape"] < 0.03 and result["heldout"]["r2"] > 0.98
    exact = fit(*synthetic(noise=0.0))
    assert exact["heldout"]["mape"] < 1e-6


def test_fit_finds_the_few_token_kink():
    """Steps of fewer than `knot` tokens cost as much as `knot` tokens' linear work (weights streamed whatever the
    rows): the fit picks that knot among its candidates and recovers the term."""
    truth = FittedCostModel({**TRUE, "few_tokens": TRUE["new_tokens"] + TRUE["decode_seqs"]}, knot=8)
    shapes, times = synthetic(truth=truth)
    result = fit(shapes, times)
    assert result["knot"] == 8
    assert result["coefs"]["few_tokens"] == pytest.approx(truth.coefs["few_tokens"], rel=0.3)
    assert result["heldout"]["mape"] < 0.03
    plain = fit(*synthetic())  # no kink in the truth: whatever knot fits the noise adds little to a 1-token step
    one = shape_of([1], [100])
    assert plain["coefs"]["few_tokens"] * max(0, plain["knot"] - 1) < 0.03 * FittedCostModel(TRUE).step_time(one)


def test_fit_finds_the_gemm_ramp():
    """Up to `ramp_knot` rows each token costs more (the GEMMs not yet at full efficiency): the fit picks that knot
    among its candidates and recovers the extra per-token cost; without a ramp in the truth it adds little."""
    truth = FittedCostModel({**TRUE, "ramp_tokens": 3e-4}, ramp_knot=128)
    result = fit(*synthetic(truth=truth))
    assert result["ramp_knot"] == 128
    assert result["coefs"]["ramp_tokens"] == pytest.approx(3e-4, rel=0.3)
    assert result["heldout"]["mape"] < 0.03
    plain = fit(*synthetic())
    prompt = shape_of([256], [256])
    assert plain["coefs"]["ramp_tokens"] * min(256, plain["ramp_knot"]) < 0.03 * FittedCostModel(TRUE).step_time(prompt)


def test_decode_time_equals_step_time_of_the_decode_shape():
    for m in (FittedCostModel(TRUE), FittedCostModel({**TRUE, "few_tokens": 1e-3}, knot=12),
              FittedCostModel({**TRUE, "ramp_tokens": 2e-4}, knot=4, ramp_knot=64),
              FittedCostModel({**TRUE, "experts_touched": 3e-5}, knot=4, experts=RoutedExperts(8, 2, 3)),
              FittedCostModel({**TRUE, "window_kv": 2e-6, "window_pairs": 1e-8}, knot=4, window=128)):
        for b, s in [(1, 17), (7, 3000), (64, 65536)]:
            assert m.decode_time(b, s) == m.step_time(shape_of([1] * b, [s // b] * (b - 1) + [s - (s // b) * (b - 1)]))


def test_a_profile_of_the_older_form_predicts_as_it_did():
    """Profiles fitted before the decode/prefill split had one `seqs` term for every sequence."""
    old = {"step": 0.03, "new_tokens": 4e-4, "seqs": 1e-3, "sampled": 2e-4, "attn_pairs": 2e-8, "kv_tokens": 3e-6}
    m = FittedCostModel(old)
    for new, ctx in [([1] * 5, [40] * 5), ([1, 1, 300], [20, 30, 300])]:
        shape = shape_of(new, ctx)
        want = (old["step"] + old["new_tokens"] * sum(new) + old["seqs"] * len(new) + old["sampled"] * len(new)
                + old["attn_pairs"] * shape.attn_pairs + old["kv_tokens"] * sum(ctx))
        assert m.step_time(shape) == pytest.approx(want, rel=1e-12)


def write_profile(tmp_path, model="Llama-2-7B", layers=32, hidden=4096):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": {"name": model, "num_layers": layers, "hidden_size": hidden},
                                "fit": {"coefs": TRUE}}))
    return path


def test_scenario_uses_a_profile_and_its_predictions_follow_it(tmp_path):
    path = write_profile(tmp_path)
    fitted, _, _ = run(scenario(cost_model={"profile": str(path)}))
    roofline, _, _ = run(scenario())
    assert fitted["tpot_s"]["p50"] != roofline["tpot_s"]["p50"]
    assert fitted["tpot_s"]["p50"] > TRUE["step"]  # every decode step costs at least the fixed term


def test_profile_of_another_model_is_refused(tmp_path):
    path = write_profile(tmp_path, "SmolLM2-135M", 30, 576)
    with pytest.raises(ConfigError) as e:
        run(scenario(cost_model={"profile": str(path)}))
    assert e.value.key_path == "cost_model.profile" and "SmolLM2" in e.value.message
    assert set(FEATURES) == set(TRUE)


def test_profile_scale_stretches_every_step(tmp_path):
    """cost_model.profile_scale: the same machine running k times slower takes k times as long per step;
    with arrivals far apart (no queueing) every latency scales by k."""
    path = write_profile(tmp_path)
    work = {"arrival": {"process": "constant", "rate": 0.05}, "num_requests": 4,
            "prompt_len": {"dist": "fixed", "value": 64}, "output_len": {"dist": "fixed", "value": 8}}
    base, _, _ = run(scenario(cost_model={"profile": str(path)}, workload=work))
    slow, _, _ = run(scenario(cost_model={"profile": str(path), "profile_scale": 1.25}, workload=work))
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert slow[key]["p50"] == pytest.approx(1.25 * base[key]["p50"], rel=1e-9)
    assert FittedCostModel(TRUE).scaled(2.0).step_time(shape_of([5], [9])) == \
        pytest.approx(2 * FittedCostModel(TRUE).step_time(shape_of([5], [9])))


def test_refit_fits_a_profile_again_on_its_stored_samples(tmp_path):
    """`infersim profile --refit` re-fits the coefficients from the samples the profile stores (no sweep) and
    rewrites it; a missing profile is a one-line error, exit 2."""
    from tests.cli_runner import run_cli

    shapes, _ = synthetic(noise=0.0)
    samples = []
    for s in shapes:
        # shape_of's inputs back: a per-row split with the same sums, each context at least its new tokens
        new = [s.num_new_tokens - (s.num_seqs - 1)] + [1] * (s.num_seqs - 1)
        ctx = [s.sum_context - (s.num_seqs - 1)] + [1] * (s.num_seqs - 1)
        samples.append({"new_tokens": new, "context_lens": ctx, "num_sampled": s.num_sampled,
                        "num_prefill": s.num_prefill, "time_s": FittedCostModel(TRUE).step_time(
                            shape_of(new, ctx, s.num_sampled, s.num_prefill))})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": {"name": "x", "num_layers": 2, "hidden_size": 64},
                                "fit": {"coefs": {k: 1.0 for k in TRUE}}, "samples": samples}))
    result = run_cli(["profile", "--refit", "--out", str(path)])
    assert result.exit_code == 0, result.output
    prof = json.loads(path.read_text())
    assert prof["fit"]["heldout"]["mape"] < 1e-6 and prof["samples"] == samples
    m = FittedCostModel(prof["fit"]["coefs"])
    for sample in samples[:50]:
        shape = shape_of(sample["new_tokens"], sample["context_lens"], sample["num_sampled"], sample["num_prefill"])
        assert m.step_time(shape) == pytest.approx(sample["time_s"], rel=1e-6)
    missing = run_cli(["profile", "--refit", "--out", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "no such profile" in missing.output and len(missing.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["cpu.json", "cpu_1thread.json"])
def test_the_fit_s_form_holds_on_the_shipped_profiles_recorded_steps(name):
    """The timing-free twin of the SmolLM2 validation test's held-out check: the recorded steps of each shipped
    CPU profile refit to a held-out error of a few percent, whatever this machine is doing."""
    data = json.loads((Path(__file__).parent.parent / "calibration" / "profiles" / name).read_text())
    fit = fit_samples(data["samples"])
    assert fit["heldout"]["mape"] < 0.08 and fit["heldout"]["r2"] > 0.99
    assert fit["heldout"]["mape"] == pytest.approx(data["fit"]["heldout"]["mape"], abs=0.005)


def test_a_mixture_of_experts_fit_prices_the_experts_its_steps_touch():
    """A step reads each expert its tokens touch once: a batch-1 decode 2 of 8 experts a layer, a 64-token prompt
    nearly all. The fit recovers that term beside the dense ones, and a dense model's steps price as before."""
    experts = RoutedExperts(num_experts=8, top_k=2, moe_layers=3)
    truth = FittedCostModel({**TRUE, "experts_touched": 4e-4}, experts=experts)
    shapes, times = synthetic(truth=truth)
    result = fit(shapes, times, experts=experts)
    assert result["coefs"]["experts_touched"] == pytest.approx(4e-4, rel=0.2)
    assert result["heldout"]["mape"] < 0.03
    one, prompt = shape_of([1], [100]), shape_of([64], [64])
    assert experts.touched(1) == pytest.approx(3 * 2) and experts.touched(64) == pytest.approx(3 * 8, rel=1e-3)
    assert truth.step_cost(one).experts_s == pytest.approx(4e-4 * 6)
    assert truth.step_time(prompt) - FittedCostModel(TRUE).step_time(prompt) == pytest.approx(4e-4 * 24, rel=1e-3)
    dense = FittedCostModel({**TRUE, "experts_touched": 4e-4})  # no routing: the term prices nothing
    assert dense.step_time(prompt) == FittedCostModel(TRUE).step_time(prompt)
    assert fit(shapes, times)["coefs"]["experts_touched"] == 0.0


def test_routed_experts_of_a_model():
    from sim.config.models import catalog_model

    mixtral = routed_experts(catalog_model("Mixtral-8x7B"))
    assert mixtral == RoutedExperts(8, 2, 32)
    assert routed_experts(catalog_model("Mixtral-8x7B").model_dump()) == mixtral  # as a profile records it
    assert routed_experts(catalog_model("Llama-3-8B")) is None and routed_experts(None) is None


def test_a_sliding_window_fit_prices_keys_up_to_the_window():
    """gpt-oss-like layers: full ones read every key, sliding ones at most W. The window terms are recovered beside
    the full ones, a decode step's price stops growing with its context past W in the windowed layers, and a
    model without such layers prices as before."""
    from sim.cost.fitted import attention_window, window_pairs

    truth = FittedCostModel({**TRUE, "kv_tokens": 1.5e-6, "attn_pairs": 1e-8, "window_kv": 1.5e-6,
                             "window_pairs": 1e-8}, window=400)
    shapes, times = synthetic(truth=truth)
    result = fit(shapes, times, window=400)
    assert result["heldout"]["mape"] < min(0.03, fit(shapes, times)["heldout"]["mape"])  # than priced as full
    fitted = FittedCostModel(result["coefs"], knot=result["knot"], ramp_knot=result["ramp_knot"], window=400)
    for b, c in [(1, 100), (8, 900), (24, 1000)]:  # decode steps below and past the window
        assert fitted.decode_time(b, b * c) == pytest.approx(truth.decode_time(b, b * c), rel=0.03)
    grow = [truth.decode_time(8, 8 * c) - truth.decode_time(8, 8 * (c - 1)) for c in (40, 900)]
    assert grow[1] == pytest.approx(grow[0] / 2, rel=1e-6)  # past the window only the full layers' keys add
    assert window_pairs(1, 10, 10, 64) == 55 and window_pairs(1, 10, 110, 64) == 640  # short prompt; 10 past W
    assert window_pairs(2, 20, 220, 64) == 1280 and window_pairs(1, 100, 100, 64) == 64 * 65 / 2 + 36 * 64
    plain = FittedCostModel({**TRUE, "window_kv": 1.5e-6})  # no window: the terms price nothing
    assert plain.step_time(shape_of([1, 30], [900, 30], None, 1)) == FittedCostModel(TRUE).step_time(
        shape_of([1, 30], [900, 30], None, 1))
    from sim.config.models import catalog_model

    assert attention_window(catalog_model("gpt-oss-120b")) == 128
    assert attention_window(catalog_model("gpt-oss-120b").model_dump()) == 128
    assert attention_window(catalog_model("Llama-3-8B")) is None and attention_window(None) is None

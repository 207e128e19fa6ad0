"""The GPU kernel model refined by an engine's measured steps (what `infersim profile --device cuda` records): the
refinement recovers a known one, goes into the profile, and prices a plan on that GPU where it was the closer fit."""
from __future__ import annotations

import json
import random
from dataclasses import fields
from pathlib import Path

import pytest

from calibration.kernel_refine import catalog_gpu, kernel_model, refine, refine_profile
from calibration.profile import refit
from sim.config.errors import ConfigError
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.profile import REFINEMENT_TERMS
from sim.cost.build import describe_cost, make_cost_model
from sim.cost.gpu import KernelCostModel, Refinement
from sim.policy.batch import shape_of
from tests.helpers import plan_of, scenario

CUDA_PROFILE = Path(__file__).resolve().parents[1] / "calibration" / "profiles" / "cuda.json"  # SmolLM2 on an H200, 2026-11-30


def test_a_profile_names_the_refinement_s_fields():
    assert tuple(f.name for f in fields(Refinement)) == REFINEMENT_TERMS


@pytest.mark.parametrize("name, device", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"),
                                          ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
                                          ("NVIDIA A40", "A40"), ("NVIDIA L4", None), (None, None)])
def test_a_cuda_device_name_is_its_catalog_gpu(name, device):
    assert catalog_gpu(name) == device


def synthetic(truth: Refinement, n: int = 300) -> tuple[dict, list[dict]]:
    """Steps of Llama-3.2-1B on an H200 timed as the refined model `truth` prices them (1% noise)."""
    model = {"name": "Llama-3.2-1B", "num_layers": 16, "hidden_size": 2048, "num_heads": 32, "num_kv_heads": 8,
             "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "weight_dtype": "bf16"}
    base = kernel_model(model, "H200")
    cost = KernelCostModel(base.blocks, base.kernels, HARDWARE_CATALOG["H200"], base.collectives, 1, truth)
    rng = random.Random(0)
    samples = []
    for _ in range(n):
        if rng.random() < 0.3:
            new = [rng.randint(16, 2048)]
            ctx = list(new)
        else:
            b = rng.randint(1, 256)
            new, ctx = [1] * b, [rng.randint(256, 16384) for _ in range(b)]
        t = cost.step_time(shape_of(new, ctx))
        samples.append({"new_tokens": new, "context_lens": ctx, "num_sampled": len(new),
                        "num_prefill": sum(1 for x in new if x > 1), "time_s": t * rng.uniform(0.99, 1.01)})
    return model, samples


def test_refinement_recovers_the_engine_s_own_proportions_and_overheads():
    truth = Refinement(linear=1.15, attention=0.8, lm_head=1.0, communication=1.0, step_overhead_s=4e-4,
                       per_seq_overhead_s=2e-5, prefill_overhead_s=1e-3)
    model, samples = synthetic(truth)
    got = refine(samples, model, "H200")
    assert got["heldout"]["mape"] < 0.02 < got["unrefined_heldout"]["mape"]
    r = got["refinement"]
    assert r["linear"] == pytest.approx(1.15, rel=0.05) and r["attention"] == pytest.approx(0.8, rel=0.15)
    assert r["step_overhead_s"] == pytest.approx(4e-4, rel=0.3)
    assert 1e-5 <= r["per_seq_overhead_s"] <= 4e-5  # a decode row's host cost and its attention floor trade places


def test_a_profile_refines_the_kernel_model_of_its_gpu_and_the_plan_takes_the_closer_fit(tmp_path):
    prof = refit(json.loads(CUDA_PROFILE.read_text()))  # `profile --refit`: the CUDA path, on recorded H200 steps
    assert prof["kernels"]["device"] == "H200" and set(prof["kernels"]["refinement"]) == set(REFINEMENT_TERMS)
    assert prof["kernels"] == refine_profile(prof)
    path = tmp_path / "cuda.json"
    path.write_text(json.dumps(prof))
    model = {"base": "SmolLM2-135M", "weight_dtype": "bf16"}
    auto = plan_of(scenario(model=model, hardware="H200", cost_model={"profile": str(path)}))
    linear_closer = prof["fit"]["heldout"]["mape"] < prof["kernels"]["heldout"]["mape"]
    assert auto.cost.source == ("profile" if linear_closer else "kernels")
    forced = plan_of(scenario(model=model, hardware="H200", cost_model={"profile": str(path), "type": "kernels"}))
    assert forced.cost.source == "kernels" and forced.cost.refinement == prof["kernels"]["refinement"]
    cost = make_cost_model(forced)
    assert isinstance(cost, KernelCostModel) and cost.refinement == Refinement(**prof["kernels"]["refinement"])
    assert describe_cost(forced)["refined_by"] == "cuda.json"
    with pytest.raises(ConfigError) as e:  # the refinement is of an H200's kernels, not an H100's
        plan_of(scenario(model=model, hardware="H100-SXM", cost_model={"profile": str(path), "type": "kernels"}))
    assert e.value.key_path == "cost_model.type"
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model=model, hardware="H200", cost_model={"profile": str(path), "type": "roofline"}))
    assert e.value.key_path == "cost_model.type"

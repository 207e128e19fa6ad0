"""A step's price by part (sim/cost/step.py: StepCost): every cost model's parts add up to its total, the total is its
step_time bit for bit, and each part is the work it names; the pricer (sim/cost/pricer.py) adds drafting, the verify
cost ratio and a pipeline's stages as the replica did."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from sim.config.profile import FEATURES
from sim.cost.build import make_cost_model, plan_blocks
from sim.cost.fitted import PART_OF, FittedCostModel
from sim.cost.parallel import ParallelFittedCostModel
from sim.cost.pricer import StepPricer
from sim.cost.roofline import RooflineCostModel
from sim.cost.step import PARTS, PricesStages, StepCost
from sim.policy.batch import shape_of
from tests.helpers import plan_of, scenario

CPU_PROFILE = Path(__file__).parent.parent / "calibration" / "profiles" / "cpu.json"
SMOL_WORKLOAD = {"seed": 1, "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 5,
                 "prompt_len": {"dist": "fixed", "value": 50}, "output_len": {"dist": "fixed", "value": 5}}


def roofline(**over):
    return make_cost_model(plan_of(scenario(cost_model={"type": "roofline"}, **over)))


def kernels(**over):
    return make_cost_model(plan_of(scenario(**over)))


def fitted(**parallel):
    return make_cost_model(plan_of(scenario(model="SmolLM2-135M", hardware="cpu", parallel=parallel,
                                            cost_model={"profile": str(CPU_PROFILE)}, workload=SMOL_WORKLOAD,
                                            serving={"max_num_seqs": 16, "max_model_len": 1024})))


COST_MODELS = {
    "roofline": lambda: roofline(),
    "roofline int4": lambda: roofline(model={"base": "Llama-3-8B", "weight_dtype": "int4"}, hardware="L40S"),
    "roofline TP 4 switch": lambda: roofline(model="Llama-3-8B", hardware="H100-SXM",
                                             parallel={"tensor_parallel_size": 4}),
    "roofline TP 2 ring, sequence parallel": lambda: roofline(model="Llama-3-8B", hardware="L40S", parallel={
        "tensor_parallel_size": 2, "sequence_parallel": True}),
    "roofline PP 2": lambda: roofline(model="Llama-2-13B", parallel={"pipeline_parallel_size": 2}),
    "kernels": lambda: kernels(),
    "kernels TP 4": lambda: kernels(model="Llama-3-8B", hardware="H100-SXM", parallel={"tensor_parallel_size": 4}),
    "kernels fp8, TP 8": lambda: kernels(model={"base": "Llama-3-70B", "weight_dtype": "fp8"}, hardware="H200",
                                         parallel={"tensor_parallel_size": 8}),
    "kernels int4, TP 2 x PP 2": lambda: kernels(model={"base": "Llama-3-70B", "weight_dtype": "int4"},
                                                 hardware="A100-40GB", parallel={"tensor_parallel_size": 2,
                                                                                 "pipeline_parallel_size": 2}),
    "fitted": lambda: fitted(),
    "fitted, scaled": lambda: make_cost_model(plan_of(scenario(
        model="SmolLM2-135M", hardware="cpu", workload=SMOL_WORKLOAD,
        cost_model={"profile": str(CPU_PROFILE), "profile_scale": 1.3}))),
    "parallel fitted TP 3": lambda: fitted(tensor_parallel_size=3),
    "parallel fitted PP 2": lambda: fitted(pipeline_parallel_size=2),
    "parallel fitted PP 3": lambda: fitted(pipeline_parallel_size=3),
    "roofline MoE TP 2": lambda: roofline(model="Mixtral-8x7B", hardware="H100-SXM",
                                          parallel={"tensor_parallel_size": 2}),
    "roofline dense DP 2": lambda: roofline(model="Llama-3-8B", hardware="H100-SXM", parallel={"data_parallel_size": 2}),
    "kernels MoE DP 4 x EP": lambda: kernels(model="Qwen3-30B-A3B", hardware="H100-SXM", parallel={
        "data_parallel_size": 4, "enable_expert_parallel": True}, cost_model={"expert_load_imbalance": 1.3}),
    "kernels MLA MoE TP 8": lambda: kernels(model="DeepSeek-V3", hardware="H200", parallel={"tensor_parallel_size": 8}),
}


def random_shapes(seed: int, n: int = 300):
    """Decodes, prompt chunks, mixed steps, verify rows, sampled rows given or not, swaps."""
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(1, 24)
        new = [rng.choice([1, 1, 1, rng.randint(2, 5), rng.randint(1, 2048)]) for _ in range(k)]
        ctx = [q + rng.randint(0, 4000) for q in new]
        shape = shape_of(new, ctx, rng.randint(0, k) if rng.random() < 0.3 else None,
                         rng.randint(0, k) if rng.random() < 0.5 else None)
        if rng.random() < 0.2:
            shape.swap_blocks = rng.randint(1, 64)
        yield shape


@pytest.mark.parametrize("seed, name", list(enumerate(COST_MODELS)))
def test_parts_add_up_to_the_total_and_the_total_is_step_time(seed, name):
    cost = COST_MODELS[name]()
    for shape in random_shapes(seed):
        c = cost.step_cost(shape)
        assert isinstance(c, StepCost)
        assert c.total_s == cost.step_time(shape)  # bit for bit
        assert math.fsum(c.parts().values()) == pytest.approx(c.total_s, rel=1e-12, abs=0)
        assert all(v >= 0 for v in c.parts().values()), c
        assert c.draft_s == 0.0
    for b, s in ((1, 1), (8, 3000), (64, 70000)):
        shape = shape_of([1] * b, [s // b] * b)
        assert cost.step_cost(shape).total_s == cost.decode_time(b, b * (s // b))


def test_the_roofline_gives_the_lm_head_its_share_of_the_linear_layers():
    cost = roofline()
    decode = shape_of([1] * 4, [500] * 4)  # streaming the weights
    c = cost.step_cost(decode)
    assert c.lm_head_s == cost.s_lm_head_weights > 0
    assert c.linear_s > 10 * c.lm_head_s  # Llama-2-7B: 6.5B decoder weights, 0.26B embedding and head
    prompt = shape_of([4096], [4096])  # compute-bound: one sampled row's logits
    c = cost.step_cost(prompt)
    assert c.lm_head_s == cost.s_per_logit_row
    assert c.linear_s == pytest.approx(4096 * cost.s_per_linear_token)
    assert c.communication_s == 0.0 and c.swap_s == 0.0
    assert c.overhead_s == cost.step_overhead_s + cost.per_seq_overhead_s


def test_the_roofline_s_tensor_parallel_communication_is_its_own_part():
    one, four = roofline(model="Llama-3-8B", hardware="H100-SXM"), roofline(
        model="Llama-3-8B", hardware="H100-SXM", parallel={"tensor_parallel_size": 4})
    shape = shape_of([1] * 16, [1000] * 16)
    assert one.step_cost(shape).communication_s == 0.0
    assert four.step_cost(shape).communication_s == four.communication_s(16, 16) > 0
    assert four.step_cost(shape).attention_s == pytest.approx(one.step_cost(shape).attention_s / 4)


def test_a_fitted_model_s_parts_are_its_named_terms():
    cost = FittedCostModel({f: (i + 1) * 1e-5 for i, f in enumerate(FEATURES)}, knot=8, ramp_knot=128)
    shape = shape_of([1, 3, 200], [400, 90, 200], num_prefill=1)  # a decode, a verify row and a prompt chunk
    terms = cost.terms(shape)
    assert list(terms) == list(FEATURES)
    assert sum(terms.values()) == cost.step_time(shape)
    c = cost.step_cost(shape)
    for part in PARTS:
        assert getattr(c, part) == pytest.approx(sum(t for f, t in terms.items() if PART_OF[f] == part), rel=1e-15)
    assert c.lm_head_s == terms["sampled"] and c.draft_s == c.swap_s == c.communication_s == 0.0
    assert set(PART_OF) == set(FEATURES)


def test_a_parallel_fitted_model_s_host_work_is_overhead_and_its_collectives_communication():
    one, three = fitted(), fitted(tensor_parallel_size=3)  # the same profile, composed over three devices
    assert isinstance(three, ParallelFittedCostModel)
    shape = shape_of([1] * 8, [300] * 8)
    terms, host = three._terms(shape)
    c = three.step_cost(shape)
    assert c.communication_s > 0
    assert c.overhead_s == pytest.approx(host + sum(t for f, t in terms.items() if PART_OF[f] == "overhead_s") / 3)
    assert c.attention_s == pytest.approx(sum(t for f, t in terms.items() if PART_OF[f] == "attention_s") / 3)
    assert c.total_s < one.step_time(shape) + c.communication_s
    pp = fitted(pipeline_parallel_size=2)
    stages, send, back = pp.pipeline_stages(shape)
    assert pp.step_cost(shape).communication_s == pytest.approx(send + back)


def test_roofline_parts_are_those_of_its_constructor_numbers():
    """A model built directly (not from a plan) prices by part too."""
    plan = plan_of(scenario())
    cost = RooflineCostModel(plan_blocks(plan), plan.hardware, block_bytes=1e6)
    shape = shape_of([1, 1], [10, 20])
    shape.swap_blocks = 3
    assert cost.step_cost(shape).swap_s == 3 * cost.s_per_swap_block


# ---- the pricer: the whole price of a step (sim/cost/pricer.py) ---------------------------------------------------

def verify_shapes(seed: int, n: int = 200):
    """Steps whose decode rows may carry drafts (verify rows), beside prompt chunks."""
    rng = random.Random(seed)
    for _ in range(n):
        decode = [rng.choice([1, 1 + rng.randint(1, 4)]) for _ in range(rng.randint(0, 12))]
        prompts = [rng.randint(2, 700) for _ in range(rng.randint(0 if decode else 1, 2))]
        new = decode + prompts
        yield shape_of(new, [q + rng.randint(0, 3000) for q in new], num_prefill=len(prompts))


@pytest.mark.parametrize("name", ["roofline", "fitted", "parallel fitted TP 3", "parallel fitted PP 2"])
def test_the_pricer_charges_what_the_replica_charged(name):
    """draft + the cost model's time, times verify_cost_ratio on a step that verifies: as sim/simulator/replica.py
    put it together before the pricer; step_cost's total is step_s bit for bit and its parts add up."""
    cost = COST_MODELS[name]()
    pricer = StepPricer(cost, verify_cost_ratio=1.37)
    rng = random.Random(7)
    verified = 0
    for shape in verify_shapes(3):
        draft = rng.choice([0.0, 0.0012])
        step_s = cost.step_time(shape)
        assert pricer.step_s(shape, draft) == draft + (step_s * 1.37 if shape.num_verify else step_s)
        c = pricer.step_cost(shape, draft)
        assert c.total_s == pricer.step_s(shape, draft)
        assert math.fsum(c.parts().values()) == pytest.approx(c.total_s, rel=1e-12, abs=0)
        assert c.draft_s == draft
        verified += bool(shape.num_verify)
    assert 50 < verified < 200
    assert pricer.decode_time(8, 900) == cost.decode_time(8, 900)
    ends, again = [], []
    assert pricer.decode_run(8, 900, 0.5, 50, math.inf, ends) == cost.decode_run(8, 900, 0.5, 50, math.inf, again)
    assert ends == again


def test_make_pricer_reads_the_plan():
    from sim.cost.build import make_pricer

    sc = scenario(model="Llama-3-8B", hardware="H100-SXM", cost_model={"type": "roofline"},
                  speculative={"num_speculative_tokens": 3, "acceptance_rate": 0.7, "verify_cost_ratio": 1.2})
    pricer = make_pricer(plan_of(sc))
    assert pricer.verify_cost_ratio == 1.2 and pricer.num_stages == 1 and not pricer.prices_stages
    assert make_pricer(plan_of({**sc, "cost_model": {}})).prices_stages  # the GPU kernel model prices stages
    plain = make_pricer(plan_of(scenario()))
    assert plain.verify_cost_ratio == 1.0
    plan = plan_of(scenario(model="Llama-2-13B", parallel={"pipeline_parallel_size": 2}, cost_model={"type": "roofline"}))
    piped = make_pricer(plan)
    m, hw = plan.model, plan.hardware
    assert piped.num_stages == 2
    assert piped.send_s_per_token == m.hidden_size * m.act_bytes / hw.interconnect_bandwidth
    assert piped.send_latency_s == hw.interconnect_latency_s


def test_a_step_priced_whole_is_split_evenly_over_the_stages_with_its_activations_sent():
    """The roofline prices whole steps: each of p stages holds a p-th, tokens x hidden x bytes cross each link."""
    cost = COST_MODELS["roofline PP 2"]()
    assert not isinstance(cost, PricesStages)
    pricer = StepPricer(cost, num_stages=4, send_s_per_token=1e-6, send_latency_s=1e-4)
    shape = shape_of([100], [100])
    stages, send, back = pricer.stages(shape, 0.8)
    assert stages == [0.2] * 4 and send == 100 * 1e-6 + 1e-4 and back == 0.0
    stages, send, back = pricer.decode_stages(8, 800)
    assert stages == [cost.decode_time(8, 800) / 4] * 4 and send == 8 * 1e-6 + 1e-4


def test_a_cost_model_that_prices_stages_gives_the_pipeline_its_own():
    cost = COST_MODELS["parallel fitted PP 2"]()
    assert isinstance(cost, PricesStages)
    pricer = StepPricer(cost, verify_cost_ratio=1.5, num_stages=2, send_s_per_token=1.0, send_latency_s=1.0)
    assert pricer.prices_stages
    shape = shape_of([1] * 6, [300] * 6)
    assert pricer.stages(shape, 1.0) == cost.pipeline_stages(shape, 1.0)  # the link's numbers unused
    assert pricer.decode_stages(6, 1800) == cost.pipeline_stages(shape)
    verify = shape_of([1, 3, 3], [300, 300, 300], num_prefill=0)
    assert pricer.stages_busy_s(verify) == sum(cost.pipeline_stages(verify)[0]) * 1.5
    assert pricer.stages_busy_s(shape) == sum(cost.pipeline_stages(shape)[0])

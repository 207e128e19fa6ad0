"""Tensor parallelism in the simulator: what it checks, what it divides, what it costs in communication, and the
trade-off every serving engineer expects (lower latency per token, more dollars per token at low load)."""
from __future__ import annotations

import pytest

from sim.config.errors import ConfigError
from sim.cost.build import make_cost_model
from sim.policy.batch import BatchShape
from tests.helpers import plan_of, run, scenario

LOW_LOAD = {"seed": 2, "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 60,
            "prompt_len": {"dist": "fixed", "value": 512}, "output_len": {"dist": "fixed", "value": 128}}


def tp(n: int, **kw) -> dict:
    return scenario(parallel={"tensor_parallel_size": n}, **kw)


@pytest.mark.parametrize("model, n, what", [
    ("Llama-2-7B", 3, "does not divide the 32 attention heads"),
    ("SmolLM2-135M", 2, "does not divide the 9 attention heads"),
    ({"base": "Llama-3-8B", "num_heads": 32, "num_kv_heads": 8}, 12, "does not divide"),
])
def test_tensor_parallel_size_must_split_the_heads(model, n, what):
    with pytest.raises(ConfigError) as e:
        plan_of(tp(n, model=model, hardware="H100-SXM"))
    assert e.value.key_path == "parallel.tensor_parallel_size" and what in e.value.message


def test_more_devices_than_kv_heads_keeps_a_copy_of_one_per_device():
    """Llama-3-70B has 8 KV heads: at TP 16 each device holds one KV head (vLLM replicates), no error."""
    p8 = plan_of(tp(8, model="Llama-3-70B", hardware="H100-SXM"))
    p16 = plan_of(tp(16, model="Llama-3-70B", hardware="H100-SXM"))
    assert p8.kv_bytes_per_token == p16.kv_bytes_per_token == p8.model.kv_bytes_per_token / 8


def test_a_model_too_big_for_one_device_says_how_many_it_needs():
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model="Llama-2-70B", hardware="A100-80GB"))
    assert e.value.key_path == "hardware" and "tensor_parallel_size of 2 or more" in e.value.message
    plan = plan_of(tp(2, model="Llama-2-70B", hardware="A100-80GB"))
    assert plan.weight_bytes == pytest.approx(plan.model.weight_bytes / 2) and plan.num_blocks > 0


def test_tensor_parallelism_splits_weights_and_kv_per_device():
    one, two = plan_of(tp(1)), plan_of(tp(2))
    assert two.weight_bytes == one.weight_bytes / 2
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    # half the weights and half the KV per token on each device: more than twice the tokens fit
    assert two.num_blocks > 2 * one.num_blocks


@pytest.mark.parametrize("hardware, hops", [({"base": "A100-80GB", "interconnect_topology": "ring"}, (6, 3)),
                                           ("L4", (6, 3)), ("A100-80GB", (2, 1))])
def test_all_reduce_is_priced_by_the_links_topology(hardware, hops):
    """Two all-reduces of the hidden states a layer: 2(n-1)/n · bytes / bandwidth each, plus 2(n-1) link latencies
    over a ring (PCIe cards) or 2 through a switch (NVSwitch: every peer one hop away); the logits gather n-1 or 1."""
    plan = plan_of(tp(4, model="Llama-2-7B", hardware=hardware, cost_model={"type": "roofline"}))
    cost, m, hw = make_cost_model(plan), plan.model, plan.hardware
    tokens, n = 100, 4
    all_reduce_hops, gather_hops = hops
    per_all_reduce = 2 * (n - 1) / n * tokens * m.hidden_size * 2 / hw.interconnect_bandwidth \
        + all_reduce_hops * hw.interconnect_latency_s
    gather = (n - 1) / n * m.vocab_size * 4 / hw.interconnect_bandwidth
    assert cost.communication_s(tokens, 0) == pytest.approx(2 * m.num_layers * per_all_reduce + gather_hops *
                                                      hw.interconnect_latency_s)
    assert cost.communication_s(tokens, 1) - cost.communication_s(tokens, 0) == pytest.approx(gather)


def test_more_devices_through_a_switch_keep_lowering_latency_at_batch_one():
    """A small model on NVSwitch: each doubling of TP shortens a token (vLLM's measured trend); priced as a ring, the
    2(n-1) latencies of 64 all-reduces a step made TP 8 slower than TP 4 (Llama-3-8B on H100: 5.4 vs 4.6 ms)."""
    def tpot(n, hardware="H100-SXM"):
        return make_cost_model(plan_of(tp(n, model="Llama-3-8B", hardware=hardware))).decode_time(1, 1000)

    times = [tpot(n) for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert tpot(8, {"base": "H100-SXM", "interconnect_topology": "ring"}) > tpot(8)


def test_a_slower_link_costs_only_when_devices_talk():
    """The same step on NVLink and on a PCIe-class link: equal at TP 1, slower over PCIe at TP 4."""
    shape = BatchShape(num_seqs=8, num_new_tokens=8, sum_context=8 * 600, attn_pairs=8 * 600, num_sampled=8)
    times = {}
    for n in (1, 4):
        for link in (600e9, 32e9):
            hw = {"base": "A100-80GB", "interconnect_bandwidth": link}
            times[n, link] = make_cost_model(plan_of(tp(n, hardware=hw))).step_time(shape)
    assert times[1, 600e9] == times[1, 32e9]
    assert times[4, 32e9] > times[4, 600e9]


def test_bulk_decode_runs_equal_single_steps_under_tensor_parallelism():
    a, _, _ = run(tp(4, workload=LOW_LOAD), bulk=True)
    b, _, _ = run(tp(4, workload=LOW_LOAD), bulk=False)
    assert a["tpot_s"] == b["tpot_s"] and a["ttft_s"] == b["ttft_s"]


def test_tensor_parallelism_lowers_latency_per_token_and_raises_cost_per_token_at_low_load():
    """Llama-2-13B on A100s at 0.5 requests/s: each doubling of TP cuts TPOT (each device reads half the weights)
    but the devices sit mostly idle, so the dollars per token go up."""
    reports = {n: run(tp(n, model="Llama-2-13B", hardware="A100-80GB", workload=LOW_LOAD))[0] for n in (1, 2, 4)}
    tpot = [reports[n]["tpot_s"]["p50"] for n in (1, 2, 4)]
    usd = [reports[n]["cost"]["usd_per_million_output_tokens"] for n in (1, 2, 4)]
    assert tpot[0] > tpot[1] > tpot[2]
    assert usd[0] < usd[1] < usd[2]
    assert reports[4]["cost"]["usd_per_hour"] == 4 * reports[1]["cost"]["usd_per_hour"]
    assert reports[4]["scenario"]["tensor_parallel_size"] == 4


def test_sequence_parallelism_shrinks_activation_memory_and_traffic():
    plain, sp = plan_of(tp(4)), plan_of(scenario(parallel={"tensor_parallel_size": 4, "sequence_parallel": True}))
    assert sp.activation_bytes < plain.activation_bytes and sp.num_blocks >= plain.num_blocks
    shape = BatchShape(num_seqs=1, num_new_tokens=2048, sum_context=2048, attn_pairs=2048 * 2049 // 2,
                       num_sampled=1, num_prefill=1)
    assert make_cost_model(sp).step_time(shape) <= make_cost_model(plain).step_time(shape)


def test_a_fitted_profile_without_communication_is_for_one_device(tmp_path):
    import json
    from pathlib import Path

    shipped = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "profiles" / "cpu.json").read_text())
    profile = tmp_path / "one_device.json"
    profile.write_text(json.dumps({k: v for k, v in shipped.items() if k != "comm"}))
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(model="SmolLM2-135M", hardware="cpu", parallel={"tensor_parallel_size": 3},
                         cost_model={"profile": str(profile)}))
    assert e.value.key_path == "parallel.tensor_parallel_size" and "roofline" in e.value.message


# -- pipeline parallelism ---------------------------------------------------------------------------------------

SATURATED = {"seed": 2, "arrival": {"process": "poisson", "rate": 60.0}, "num_requests": 400,
             "prompt_len": {"dist": "fixed", "value": 512}, "output_len": {"dist": "fixed", "value": 128}}


def pp(p: int, engines: int | None = None, **kw) -> dict:
    par = {"pipeline_parallel_size": p} | ({"virtual_engines": engines} if engines else {})
    return scenario(model="Llama-2-13B", hardware="A100-80GB", parallel=par, **kw)


def test_pipeline_checks_and_sizes():
    with pytest.raises(ConfigError) as e:
        plan_of(pp(41))
    assert e.value.key_path == "parallel.pipeline_parallel_size" and "40 layers" in e.value.message
    with pytest.raises(ConfigError) as e:
        plan_of(pp(2, engines=3))
    assert e.value.key_path == "parallel.virtual_engines"
    one, four = plan_of(pp(1)), plan_of(pp(4))
    assert four.weight_bytes == pytest.approx(one.weight_bytes / 4)
    assert four.kv_bytes_per_token == pytest.approx(one.kv_bytes_per_token / 4)
    assert four.virtual_engines == 4 and four.num_blocks * 4 > 3 * one.num_blocks  # each engine: a share


def test_a_lone_step_fills_and_drains_the_pipeline():
    """One request alone: its prefill passes 4 stages of a quarter of the step each and 3 sends between them."""
    import simpy

    from sim.simulator.pipeline import Pipeline

    env = simpy.Environment()
    pipe = Pipeline(env, 4, send_s_per_token=1e-6, send_latency_s=1e-4)
    env.process(pipe.traverse(0.8, tokens=100))
    env.run()
    assert env.now == pytest.approx(0.8 + 3 * (100 * 1e-6 + 1e-4))
    assert sum(pipe.busy_s) / (4 * env.now) == pytest.approx(0.8 / (4 * env.now))


def test_steady_state_one_step_per_stage_time():
    """As many batches in flight as stages, each step 0.4 s: once full, one step ends every 0.1 s."""
    import simpy

    from sim.simulator.pipeline import Pipeline

    env = simpy.Environment()
    pipe = Pipeline(env, 4, send_s_per_token=0.0, send_latency_s=0.0)
    ends = []

    def engine():
        for _ in range(20):
            yield from pipe.traverse(0.4, tokens=1)
            ends.append(env.now)

    for _ in range(4):
        env.process(engine())
    env.run()
    gaps = [b - a for a, b in zip(sorted(ends)[8:], sorted(ends)[9:])]
    assert max(gaps) == pytest.approx(0.1) and min(gaps) == pytest.approx(0.1)


def test_pipeline_bubble_shrinks_with_batches_in_flight():
    """At saturation one batch in flight leaves 3 of 4 stages idle (GPipe's (p-1)/(m+p-1) = 3/4); one per stage
    nearly fills them, and throughput follows."""
    reports = {m: run(pp(4, engines=m, workload=SATURATED))[0] for m in (1, 2, 4)}
    util = [reports[m]["pipeline"]["stage_utilization"] for m in (1, 2, 4)]
    tput = [reports[m]["throughput"]["output_tokens_per_s"] for m in (1, 2, 4)]
    assert util[0] == pytest.approx(0.25, abs=0.03) and util[0] < util[1] < util[2] and util[2] > 0.85
    assert tput[2] > 3 * tput[0]
    for r in reports.values():
        assert r["requests"]["completed"] == 400


def test_pipeline_does_not_cut_latency_at_low_load_but_multiplies_cost():
    low = {"seed": 2, "arrival": {"process": "poisson", "rate": 0.2}, "num_requests": 20,
           "prompt_len": {"dist": "fixed", "value": 512}, "output_len": {"dist": "fixed", "value": 128}}
    one, four = run(pp(1, workload=low))[0], run(pp(4, workload=low))[0]
    assert four["tpot_s"]["p50"] == pytest.approx(one["tpot_s"]["p50"], rel=0.02)  # the same layers, in turn
    assert four["cost"]["usd_per_hour"] == 4 * one["cost"]["usd_per_hour"]


@pytest.mark.parametrize("engines, rate", [(1, 0.3), (1, 8.0), (2, 0.3), (2, 2.0)])
def test_bulk_decode_runs_equal_single_steps_under_pipeline_parallelism(engines, rate):
    """A virtual engine with the stages to itself runs its decode steps as one event; the predictions are exactly
    the step-by-step ones."""
    data = pp(2, engines=engines, workload={"seed": 1, "arrival": {"process": "poisson", "rate": rate},
                                            "num_requests": 120,
                                            "prompt_len": {"dist": "lognormal", "median": 400, "sigma": 0.8},
                                            "output_len": {"dist": "lognormal", "median": 150, "sigma": 0.8}})
    bulk, single = run(data)[0], run(data, bulk=False)[0]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "requests", "pipeline", "engine_steps"):
        assert bulk[key] == single[key], key

"""Disaggregated prefill/decode pools in the simulator: how a scenario describes them, what they cost, that the
hand-off's KV transfer lands where it does on real clusters, and the published results (DistServe, Splitwise)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.config.errors import ConfigError
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.plan import replan
from tests.helpers import plan_of, run, scenario


def workload(rate: float, prompt: int, output: int, n: int = 400, seed: int = 3) -> dict:
    return {"seed": seed, "arrival": {"process": "poisson", "rate": rate}, "num_requests": n,
            "prompt_len": {"dist": "lognormal", "median": prompt, "sigma": 0.3, "max": 4000},
            "output_len": {"dist": "lognormal", "median": output, "sigma": 0.3, "max": 2000}}


def pools(prefill: int = 1, decode: int = 1, **kw) -> dict:
    """A disaggregated Llama-2-7B / A100 scenario; `kw` merges into the scenario (prefill_/decode_ keys into a pool)."""
    p, d = {"replicas": prefill}, {"replicas": decode}
    for key in [k for k in kw if k.startswith(("prefill_", "decode_"))]:
        pool, name = key.split("_", 1)
        (p if pool == "prefill" else d)[name] = kw.pop(key)
    return scenario(pools={"prefill": p, "decode": d, **kw.pop("pools_extra", {})}, **kw)


def test_each_pool_takes_the_scenarios_keys_and_overrides_its_own():
    plan = plan_of(pools(2, 3, router="least_outstanding", serving={"max_num_seqs": 64, "enable_chunked_prefill": True},
                         prefill_hardware="H100-SXM", prefill_serving={"max_num_batched_tokens": 4096},
                         decode_parallel={"tensor_parallel_size": 2}, decode_router="round_robin"))
    p, d = plan.pools.prefill, plan.pools.decode
    assert (p.replicas, d.replicas) == (2, 3) and (p.router, d.router) == ("least_outstanding", "round_robin")
    assert p.hardware.name == "H100-SXM" and d.hardware.name == "A100-80GB"
    assert p.scheduler.max_num_batched_tokens == 4096 and p.scheduler.max_num_seqs == 64  # key by key
    assert d.scheduler.max_num_batched_tokens == 2048 and d.scheduler.enable_chunked_prefill
    assert (p.sharding.tp, d.sharding.tp) == (1, 2)
    # the link defaults to the slower hardware's interconnect, and a transfer spreads over the smaller replica's devices
    a100 = HARDWARE_CATALOG["A100-80GB"]
    assert plan.pools.kv_bandwidth == a100.interconnect_bandwidth and plan.pools.kv_links == 1
    assert plan.pools.transfer_s(1000) == pytest.approx(1000 * plan.model.kv_bytes_per_token / a100.interconnect_bandwidth
                                                        + a100.interconnect_latency_s)


def test_a_pool_prices_its_steps_with_its_own_cost_model_and_replanning_keeps_every_key():
    base = dict(serving={"enable_chunked_prefill": True, "max_num_seqs": 64}, prefill_serving={"max_num_seqs": 32},
                workload=workload(2, 800, 100, n=120))
    slow_data = pools(prefill_cost_model={"step_overhead_s": 0.05}, **base)
    slow = plan_of(slow_data)
    assert slow.pools.prefill.cost.step_overhead_s == 0.05 and slow.pools.decode.cost.step_overhead_s is None
    fast_m, slow_m = run(pools(**base))[0], run(slow_data)[0]
    assert slow_m["ttft_s"]["p50"] > fast_m["ttft_s"]["p50"] + 0.04  # every prompt pays the prefill pool's step
    assert slow_m["tpot_s"]["p50"] == pytest.approx(fast_m["tpot_s"]["p50"], rel=0.05)
    again = replan(slow)  # a pool's sections keep only the keys it set: re-resolved, nothing reverts to defaults
    for name in ("prefill", "decode"):
        assert getattr(again.pools, name).scheduler == getattr(slow.pools, name).scheduler
        assert getattr(again.pools, name).cost == getattr(slow.pools, name).cost
    assert again.pools.prefill.scheduler.enable_chunked_prefill and again.pools.prefill.scheduler.max_num_seqs == 32


@pytest.mark.parametrize("over, where, what", [
    (dict(replicas=2), "", "replicas is set per pool"),
    (dict(decode_hardware={"base": "L4", "memory_gib": 8}), "pools.decode.hardware", "does not fit"),
    (dict(prefill_parallel={"tensor_parallel_size": 3}), "pools.prefill.parallel.tensor_parallel_size",
     "does not divide the 32 attention heads"),
    (dict(decode_kv_cache={"gpu_memory_utilization": 0.17}), "pools.decode.serving.max_model_len",
     "cannot hold one sequence"),
    (dict(decode_serving={"max_model_len": 2048}), "pools.decode.serving.max_model_len", "less than the prefill pool"),
    (dict(decode_serving={"batching": "static"}), "", "need batching: continuous"),
    (dict(speculative={"method": "ngram", "acceptance_rate": 0.5}), "", "speculative decoding with pools"),
    (dict(pools_extra={"kv_transfer": {"bandwidth": 0}}), "pools.kv_transfer.bandwidth", "greater than or equal"),
    (dict(decode_serving={"max_num_seqs": 0}), "pools.decode.serving.max_num_seqs", "greater than 0"),
    (dict(decode_gpus=3), "pools.decode.gpus", "allowed: replicas, hardware, router, parallel, serving, kv_cache, cost_model"),
])
def test_what_cannot_run_is_a_located_one_line_error(over, where, what):
    with pytest.raises(ConfigError) as e:
        plan_of(pools(**over))
    assert e.value.key_path == where and what in e.value.message


def test_every_request_ends_and_every_hand_off_crosses_the_link():
    data = pools(workload={**workload(6, 800, 100), "output_len": {"dist": "uniform", "min": 1, "max": 40}})
    report, result, rec = run(data)
    rq = report["requests"]
    assert rq["arrived"] == 400 == rq["completed"] + rq["rejected"]
    assert all(r.is_done for r in result.requests)
    handed = [r for r in result.requests if r.max_tokens > 1]  # one-token requests end at the prefill instance
    kvt = report["kv_transfer"]
    plan = plan_of(data)
    assert kvt["transfers"] == len(handed) < 400
    assert kvt["bytes"] == sum(r.prompt_len for r in handed) * plan.model.kv_bytes_per_token
    assert {r.replica for r in handed} == {1}  # finished on the decode instance (engines are numbered prefill first)
    assert report["cost"]["usd_per_hour"] == pytest.approx(2 * 1.79)
    assert set(report["pools"]) == {"prefill", "decode"} and report["pools"]["decode"]["engine_steps"] > 0


@pytest.mark.parametrize("over", [
    {},
    dict(decode_kv_cache={"num_blocks": 300}),  # decode memory short: hand-offs wait, decodes are preempted
    dict(serving={"enable_chunked_prefill": True, "max_num_batched_tokens": 512}, prefill_replicas=2,
         decode_replicas=3, router="least_outstanding"),
    dict(decode_parallel={"pipeline_parallel_size": 2}),
    dict(decode_parallel={"tensor_parallel_size": 2}, pools_extra={"kv_transfer": {"bandwidth": 2e9}}),
    dict(decode_kv_cache={"num_blocks": 300, "preemption": "swap"}),
])
def test_runs_of_decode_steps_equal_single_steps(over):
    """Hand-offs and finished transfers cut a decode instance's runs of identical steps at the step in flight: the
    bulk simulation predicts exactly what the step-by-step one does."""
    data = pools(workload=workload(8, 600, 120, n=250), **over)
    bulk, _, _ = run(data)
    single, _, _ = run(data, bulk=False)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "requests", "kv_transfer"):
        assert bulk[key] == single[key], key
    # KV use is sampled per event (a run is one): its time-weighted mean differs, its peak does not
    assert bulk["kv_cache"]["peak_utilization"] == single["kv_cache"]["peak_utilization"]
    assert bulk["kv_cache"]["preemptions"] == single["kv_cache"]["preemptions"]


def test_the_transfer_sits_between_the_first_token_and_the_second():
    """One request on a slow link: TTFT is the prefill's, the first inter-token gap is the transfer plus a decode
    step, the others are decode steps."""
    one = {"seed": 1, "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 1,
           "prompt_len": {"dist": "fixed", "value": 1000}, "output_len": {"dist": "fixed", "value": 5}}
    slow = pools(workload=one, pools_extra={"kv_transfer": {"bandwidth": 1e9, "latency_s": 0.01}})
    fast = pools(workload=one, pools_extra={"kv_transfer": {"bandwidth": 1e12, "latency_s": 0.0}})
    (rs, res_s, _), (rf, res_f, _) = run(slow), run(fast)
    transfer = plan_of(slow).pools.transfer_s(1000)
    assert transfer == pytest.approx(1000 * plan_of(slow).model.kv_bytes_per_token / 1e9 + 0.01)
    assert rs["ttft_s"]["mean"] == pytest.approx(rf["ttft_s"]["mean"])
    gap_s = res_s.replicas[1].handoff_gaps[0]
    gap_f = res_f.replicas[1].handoff_gaps[0]
    assert gap_s - gap_f == pytest.approx(transfer - plan_of(fast).pools.transfer_s(1000))
    assert rs["kv_transfer"]["transfer_s"]["mean"] == pytest.approx(transfer)
    assert rs["itl_s"]["mean"] - rf["itl_s"]["mean"] == pytest.approx((gap_s - gap_f) / 4)
    assert rs["tpot_s"]["mean"] == pytest.approx(rf["tpot_s"]["mean"] + (gap_s - gap_f) / 4)


def test_a_full_decode_pool_makes_hand_offs_wait_and_the_prefill_pool_hold_their_kv():
    roofline = {"type": "roofline"}  # the load is set for the roofline's step times
    roomy, _, _ = run(pools(workload=workload(8, 1200, 200), cost_model=roofline))
    tight, _, _ = run(pools(workload=workload(8, 1200, 200), decode_kv_cache={"num_blocks": 400}, cost_model=roofline))
    assert tight["kv_transfer"]["wait_s"]["p99"] > 10 * roomy["kv_transfer"]["wait_s"]["p99"]
    assert tight["pools"]["prefill"]["kv_peak_utilization"] > 2 * roomy["pools"]["prefill"]["kv_peak_utilization"]
    assert tight["tpot_s"]["p90"] > roomy["tpot_s"]["p90"]
    assert tight["requests"]["completed"] == 400


def test_disaggregation_raises_goodput_at_a_tight_tpot_slo():
    """DistServe: on the same two GPUs, one prefill and one decode instance keep prompt steps from stalling the
    decodes, so more requests meet a tight TPOT SLO than on two colocated replicas (vLLM's prefill-first continuous
    batching, DistServe's baseline). A GQA model: with Llama-2-7B's full-size KV the lone decode instance's KV reads
    (FlashAttention-2's decode rate on the GPU kernel model) cost it more than the interference it escapes."""
    slo = {"ttft_s": 1.0, "tpot_s": 0.02, "quantile": 0.9}
    for rate in (6, 8):
        colocated, _, _ = run(scenario(model="Llama-3-8B", replicas=2, workload=workload(rate, 1500, 150), slo=slo))
        disaggregated, _, _ = run(pools(1, 1, model="Llama-3-8B", workload=workload(rate, 1500, 150), slo=slo))
        assert disaggregated["goodput_requests_per_s"] > 1.15 * colocated["goodput_requests_per_s"], rate
        assert disaggregated["tpot_s"]["p90"] < colocated["tpot_s"]["p90"]


def test_the_best_prefill_to_decode_ratio_follows_the_length_mix():
    """Splitwise: on four GPUs, long prompts with short outputs want more prefill instances, short prompts with long
    outputs more decode instances."""
    slo = {"ttft_s": 1.0, "tpot_s": 0.05, "quantile": 0.9}

    def best(rate, prompt, output):
        goodput = {pd: run(pools(*pd, workload=workload(rate, prompt, output), slo=slo))[0]["goodput_requests_per_s"]
                   for pd in ((1, 3), (2, 2), (3, 1))}
        return max(goodput, key=goodput.get)

    assert best(10, 3000, 30) == (3, 1)
    assert best(12, 200, 600) == (1, 3)


def test_the_itl_sample_holds_every_gap_once():
    """The rebuilt inter-token gaps: one per token after the first, the hand-off's gap included."""
    report, result, rec = run(pools(workload=workload(6, 500, 60, n=150), decode_kv_cache={"num_blocks": 300}))
    tokens = int(np.sum(rec.output_len[rec.completed]))
    assert rec.itl.count == tokens - int(rec.completed.sum())

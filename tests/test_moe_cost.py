"""A mixture of experts' step price (MoE and MLA blocks in the step composition, sim/cost/blocks.py, priced by the
roofline and the GPU kernel model alike): experts priced on the tokens they receive and the weights a step touches,
all-to-all dispatch and combine, latent attention, the grouped GEMM fit; and what the published results say, as
tests."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.kernel_fit import MOE, grouped_truth, read_table
from infersim import api
from sim.config.errors import ConfigError
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.models import MODEL_CATALOG
from sim.cost import routing
from sim.cost.build import make_cost_model, tensor_parallel_blocks
from sim.cost.comm import Interconnect
from sim.cost.gpu import KernelCostModel
from sim.cost.roofline import RooflineCostModel
from sim.policy.batch import shape_of
from tests.helpers import plan_of, run, scenario

PROFILE = "calibration/profiles/cpu.json"


def moe_plan(model="Mixtral-8x7B", hardware="H100-SXM", cost_model=None, **parallel):
    return plan_of(scenario(model=model, hardware=hardware, parallel=parallel, cost_model=cost_model or {},
                            serving={"max_model_len": 4096}))


def decode(cost, batch: int, context: int = 1000):
    return cost.step_cost(shape_of([1] * batch, [context] * batch))


@pytest.mark.parametrize("cost_type", ["roofline", "auto"])
def test_a_decode_reads_the_experts_its_tokens_touch(cost_type):
    cost = make_cost_model(moe_plan(cost_model={"type": cost_type}, tensor_parallel_size=2))
    assert isinstance(cost, RooflineCostModel if cost_type == "roofline" else KernelCostModel)  # one class a source
    one, many = decode(cost, 1).experts_s, decode(cost, 256).experts_s
    touched = routing.distinct_experts(8, 2, 1) / routing.distinct_experts(8, 2, 256)  # 2 of Mixtral's 8, then all
    assert touched == pytest.approx(0.25, rel=1e-3)
    assert one < 0.5 * many and one > 0.2 * many


def test_the_busiest_expert_and_rank_set_the_time():
    even = make_cost_model(moe_plan("Qwen3-30B-A3B", data_parallel_size=4, enable_expert_parallel=True))
    skewed = make_cost_model(moe_plan("Qwen3-30B-A3B", cost_model={"expert_load_imbalance": 2.0},
                                      data_parallel_size=4, enable_expert_parallel=True))
    prompt = shape_of([2048] * 4, [2048] * 4)  # compute-bound: 8192 tokens × 8 experts
    a, b = even.step_cost(prompt), skewed.step_cost(prompt)
    assert b.experts_s > 1.5 * a.experts_s and b.communication_s > 1.5 * a.communication_s
    assert b.linear_s == a.linear_s and b.attention_s == a.attention_s


def test_expert_parallelism_across_data_parallel_ranks_adds_a_dispatch_and_a_combine_per_moe_layer():
    def comm(**parallel):
        return make_cost_model(moe_plan("Qwen3-30B-A3B", cost_model={"type": "roofline"}, **parallel)).communication_s
    link, tokens = Interconnect.of(HARDWARE_CATALOG["H100-SXM"]), 64
    routed = tokens * 8 / 4 * 2048 * 2  # 64 tokens × top-8 over 4 devices, bf16 hidden states
    assert comm(data_parallel_size=4, enable_expert_parallel=True)(tokens, tokens) == \
        pytest.approx(2 * 48 * link.all_to_all_s(routed, 4))
    assert link.all_to_all_s(routed, 4) == pytest.approx(routed * 3 / 4 / link.bandwidth + link.latency_s)
    # one DP rank: every device holds every token, and the layer's all-reduce combines the experts' outputs
    assert comm(tensor_parallel_size=2, enable_expert_parallel=True)(tokens, tokens) == \
        comm(tensor_parallel_size=2)(tokens, tokens) > 0


@pytest.mark.parametrize("cost_type", ["roofline", "auto"])
def test_data_parallel_ranks_without_expert_parallelism_run_every_rank_s_tokens_through_their_slices(cost_type):
    def cost(**parallel):
        return make_cost_model(moe_plan("Qwen3-30B-A3B", cost_model={"type": cost_type}, **parallel))
    dp, tp, alone = cost(data_parallel_size=4), cost(tensor_parallel_size=4), cost()
    # the replica's 256 tokens gathered through a quarter of each expert: what one TP 4 device computes
    assert decode(dp, 256).experts_s == pytest.approx(decode(tp, 256).experts_s)
    assert decode(dp, 256).experts_s != pytest.approx(decode(alone, 64).experts_s)  # not a rank's 64 alone
    assert dp.blocks.experts.of(256) == (256 * 8, routing.distinct_experts(128, 8, 256),
                                         routing.busiest_expert_tokens(128, 8, 256))
    assert decode(dp, 64).communication_s > 0 == decode(alone, 64).communication_s


def test_without_expert_parallelism_the_ranks_gather_and_reduce_scatter_every_token_each_moe_layer():
    def comm(**parallel):
        return make_cost_model(moe_plan("Qwen3-30B-A3B", cost_model={"type": "roofline"}, **parallel)).communication_s
    link, tokens = Interconnect.of(HARDWARE_CATALOG["H100-SXM"]), 64
    hidden, logits = tokens * 2048 * 2, tokens * 128 * 2  # every token's bf16 hidden state and router logits
    gathered = link.gather_s(hidden + logits, 4) + link.gather_s(hidden, 4)
    assert comm(data_parallel_size=4)(tokens, tokens) == pytest.approx(48 * gathered)
    # over each TP rank's DP peers (vLLM's DP group), beside TP's all-reduces of a rank's tokens
    both = comm(tensor_parallel_size=2, data_parallel_size=4)(tokens, tokens)
    assert both == pytest.approx(48 * gathered + comm(tensor_parallel_size=2)(tokens / 4, tokens / 4))


def test_latent_attention_is_read_whole_on_every_tensor_parallel_rank():
    one = make_cost_model(moe_plan("DeepSeek-V3", "H200", cost_model={"type": "roofline"}, data_parallel_size=8,
                                   enable_expert_parallel=True))
    eight = make_cost_model(moe_plan("DeepSeek-V3", "H200", cost_model={"type": "roofline"},
                                     tensor_parallel_size=8))
    # 64 decodes of 4000 tokens: TP ranks each read every row's latent; DP ranks each read their 8 rows'
    assert decode(eight, 64, 4000).attention_s > 4 * decode(one, 64, 4000).attention_s
    m = MODEL_CATALOG["DeepSeek-V3"]
    latent = tensor_parallel_blocks(m, 8).full  # the MLA block on one device of 8
    assert latent.kind == "mla" and latent.kv_heads == 1 and latent.kv_bytes_per_token == m.kv_bytes_per_token / 61
    assert latent.decode_flops_per_key == 2 * 128 * (2 * 512 + 64) / 8  # absorbed: heads meet the latent
    assert latent.prefill_flops_per_pair == 2 * 128 * (192 + 128) / 8  # decompressed


def test_each_data_parallel_rank_pads_its_own_share_to_its_cuda_graph():
    plan = moe_plan("DeepSeek-V3", "H200", data_parallel_size=8, enable_expert_parallel=True)
    cost, top = make_cost_model(plan), plan.engine.max_graph_tokens
    padded = plan.engine.graph_tokens(33, True)  # 33 decodes a rank replay the next captured size
    assert padded > 33 and decode(cost, 8 * 33).linear_s == cost.linear_s(padded)
    # 8 ranks of the largest captured size each replay it (as vLLM's graphs are a rank's); one more a rank: eager
    assert decode(cost, 8 * top).linear_s == cost.linear_s(top)
    assert decode(cost, 8 * (top + 1)).linear_s == cost.linear_s(top + 1)


def test_a_dense_model_s_profile_prices_no_experts_nor_data_parallel_ranks():
    smol_moe = {"base": "SmolLM2-135M", "name": "SmolLM2-MoE", "num_experts": 4, "num_experts_per_tok": 2}
    data = scenario(model=smol_moe, hardware="cpu", cost_model={"profile": PROFILE}, serving={"max_model_len": 4096})
    with pytest.raises(ConfigError) as e:  # a profile prices the model it measured
        plan_of(data)
    assert e.value.key_path == "cost_model.profile" and "measured on a dense model" in e.value.message
    smol = scenario(model="SmolLM2-135M", hardware="cpu", cost_model={"profile": PROFILE},
                    parallel={"data_parallel_size": 2}, serving={"max_model_len": 4096})
    with pytest.raises(ConfigError) as e:
        make_cost_model(plan_of(smol))
    assert e.value.key_path == "cost_model.profile" and "prices no data-parallel ranks" in e.value.message


def test_step_cost_shows_the_experts_and_the_all_to_all():
    data = scenario(model="Qwen3-30B-A3B", hardware="H100-SXM", serving={"max_model_len": 4096},
                    parallel={"tensor_parallel_size": 2, "enable_expert_parallel": True})
    got = api.step_time(data, [1] * 32, [1500] * 32)
    assert got["experts_s"] > 0 and got["communication_s"] > 0 and got["source"] == "gpu_kernels"
    assert sum(got[k] for k in got if k.endswith("_s") and k != "total_s") == pytest.approx(got["total_s"])


def test_the_grouped_gemm_fit_predicts_a_model_it_did_not_see():
    errors = np.abs(grouped_truth(read_table(MOE)))
    assert np.median(errors) < 0.10 and np.percentile(errors, 90) < 0.30  # 5.2% and 18.8% when written


# -- published results ------------------------------------------------------------------------------------------------
DENSE_47B = {"base": "Mixtral-8x7B", "name": "dense-47B", "num_experts": 0, "num_experts_per_tok": 0,
             "intermediate_size": 8 * 14336}  # Mixtral's every expert in one dense MLP: 46.7B parameters
LOW_LOAD = {"seed": 3, "arrival": {"process": "poisson", "rate": 0.2}, "num_requests": 6,
            "prompt_len": {"dist": "fixed", "value": 256}, "output_len": {"dist": "fixed", "value": 64}}
# long prompts, short answers, all at once: compute-bound prefills
HIGH_LOAD = {"seed": 3, "arrival": {"process": "poisson", "rate": 1000.0}, "num_requests": 300,
             "prompt_len": {"dist": "fixed", "value": 2048}, "output_len": {"dist": "fixed", "value": 16}}


def on_two_h100s(model, workload) -> dict:
    report, _, _ = run(scenario(model=model, hardware="H100-SXM", parallel={"tensor_parallel_size": 2},
                                serving={"max_model_len": 4096}, workload=workload))
    return report


def test_at_low_load_a_moe_decodes_like_its_active_size():
    mixtral, dense13, dense47 = (on_two_h100s(m, LOW_LOAD)["tpot_s"]["p50"]
                                 for m in ("Mixtral-8x7B", "Llama-2-13B", DENSE_47B))
    assert MODEL_CATALOG["Mixtral-8x7B"].active_params == pytest.approx(13e9, rel=0.01)
    assert 0.7 < mixtral / dense13 < 1.5  # a batch-1 decode streams the two experts a token picked
    assert mixtral < 0.6 * dense47  # a quarter of the bytes; the all-reduces and host overhead are the same


def test_at_high_load_throughput_follows_the_active_experts_flops():
    tput = {name: on_two_h100s(m, HIGH_LOAD)["throughput"]["output_tokens_per_s"]
            for name, m in (("mixtral", "Mixtral-8x7B"), ("dense13", "Llama-2-13B"), ("dense47", DENSE_47B))}
    # 12.9B active against 46.7B (3.6x the FLOPs; the attention is the same): compute, not the weights, bounds it
    assert tput["mixtral"] > 2.5 * tput["dense47"]
    assert 0.75 < tput["mixtral"] / tput["dense13"] < 1.35


@pytest.mark.parametrize("model, hardware", [("Qwen3-30B-A3B", "H100-SXM"), ("DeepSeek-V3", "H200")])
def test_expert_parallelism_beats_tensor_parallelism_for_many_small_experts_at_large_batch(model, hardware):
    tp = make_cost_model(moe_plan(model, hardware, tensor_parallel_size=8))
    ep = make_cost_model(moe_plan(model, hardware, data_parallel_size=8, enable_expert_parallel=True))
    for batch in (256, 1024):  # decodes of 2000-token contexts on 8 devices
        t, e = decode(tp, batch, 2000), decode(ep, batch, 2000)
        assert e.total_s < 0.85 * t.total_s, (batch, t, e)
        assert e.communication_s < t.communication_s  # two all-to-alls a MoE layer, no all-reduces
        assert e.attention_s < t.attention_s  # each rank attends over its own rows' KV

"""Costs by layer kind (sim/cost/blocks.py, priced by the GPU kernel model and the roofline): sliding-window and
chunked layers read at most their window in decode and attend within it in prefill, linear-attention layers read and
write their fixed state, q/k norms and output gates add their passes, MXFP4 experts run the engine's measured kernel
on Hopper, NVFP4 weights Blackwell's FP4 GEMMs; and what the published behaviour of gpt-oss and Qwen3-Next says, as
tests."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.aic_fit import AicTables, points
from sim.config.models import ModelSpec
from sim.cost.build import make_cost_model
from sim.cost.step import decode_run
from sim.policy.batch import BatchShape, shape_of
from tests.helpers import plan_of, scenario

SLIDING = {"base": "Mistral-7B", "name": "Mistral-7B-sliding", "sliding_window": 4096}  # every layer a 4k window
# gpt-oss-120b's attention and one SwiGLU of its active size, every layer full (tests/test_layer_kinds.py)
DENSE_TWIN = ModelSpec(name="dense-5.7B", num_layers=36, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                       intermediate_size=11584, vocab_size=201088, max_position_embeddings=131072,
                       weight_dtype="bf16").model_dump()
SOURCES = ("auto", "roofline")  # the GPU kernel model (vLLM's kernels) and the roofline


def cost(model, hardware="H100-SXM", source="auto", max_model_len=32768, **over):
    """The step-cost model of `model` on `hardware` served by vLLM (its kernels under the GPU kernel model)."""
    over = {"engine": "vllm", **over}
    return make_cost_model(plan_of(scenario(model=model, hardware=hardware, cost_model={"type": source},
                                            serving={"max_model_len": max_model_len}, **over)))


def decode(c, batch: int, context: int):
    return c.step_cost(shape_of([1] * batch, [context] * batch))


@pytest.mark.parametrize("source", SOURCES)
def test_a_sliding_window_decode_step_s_attention_is_flat_past_the_window(source):
    c = cost(SLIDING, source=source)
    within = decode(c, 8, 2000).attention_s
    past = [decode(c, 8, ctx).attention_s for ctx in (4096, 8192, 16000, 32000)]
    assert within < past[0] and past == [past[0]] * 4  # each row reads its last 4,096 keys, whatever its context
    full = cost("Mistral-7B", source=source)  # the same model with every layer full grows with the context
    assert decode(full, 8, 32000).attention_s > 5 * decode(full, 8, 4096).attention_s


@pytest.mark.parametrize("source", SOURCES)
def test_prompt_chunks_attend_within_the_window(source):
    c, full = cost(SLIDING, source=source), cost("Mistral-7B", source=source)
    # a 2,048-token chunk at the end of a 30k-token prompt: its queries see 4,096 keys each, not 30k
    late = shape_of([2048], [30000])
    assert c.step_cost(late).attention_s < 0.25 * full.step_cost(late).attention_s
    first = shape_of([2048], [2048])  # within the window: the same pairs as full attention
    assert c.step_cost(first).attention_s == pytest.approx(full.step_cost(first).attention_s, rel=0.02)


@pytest.mark.parametrize("model, hardware, tp, source", [
    (SLIDING, "H100-SXM", 1, "auto"), ("gpt-oss-120b", "H100-SXM", 1, "auto"), ("gpt-oss-120b", "H100-SXM", 1, "roofline"),
    ("Qwen3-Next-80B-A3B", "H100-SXM", 4, "auto"), ("Llama-4-Scout", "H200", 8, "roofline")])
def test_windowed_decode_runs_step_as_decode_time_and_step_time_do(model, hardware, tp, source):
    c = cost(model, hardware, source, parallel={"tensor_parallel_size": tp})
    for b, s in ((1, 100), (7, 7 * 120), (32, 32 * 3000)):  # rows crossing their window during the run
        assert c.decode_time(b, s) == c.step_time(BatchShape(b, b, s, s, b))
        ends, one = [], []
        k, clock = c.decode_run(b, s, 0.5, 300, 1e9, ends)
        k1, clock1 = decode_run(c, b, s, 0.5, 300, 1e9, one)
        assert (k, clock, ends) == (k1, clock1, one)


def test_gpt_oss_decodes_long_contexts_faster_than_a_dense_model_of_its_active_size():
    """gpt-oss-120b on one H100 (vLLM): half its layers read a 128-token window, so its decode attention grows half
    as fast with the context as that of a dense model of its active size (every layer full); its experts read more
    weights a step than the twin's one MLP (a batch touches many of the 128), so it is the slower at short contexts
    and the faster at long ones."""
    for source in SOURCES:
        oss, twin = cost("gpt-oss-120b", source=source, max_model_len=65536), \
            cost(DENSE_TWIN, source=source, max_model_len=65536)
        grow = [decode(c, 16, 32000).attention_s - decode(c, 16, 8000).attention_s for c in (oss, twin)]
        assert grow[0] == pytest.approx(grow[1] / 2, rel=0.05)
        assert decode(oss, 16, 2000).total_s > decode(twin, 16, 2000).total_s
        assert decode(oss, 64, 60000).total_s < 0.85 * decode(twin, 64, 60000).total_s


@pytest.mark.parametrize("source", SOURCES)
def test_qwen3_next_s_linear_layers_cost_the_same_at_any_context(source):
    """Qwen3-Next (TP 4): 36 of its 48 layers keep a fixed state; a step's cost grows with the context through its
    12 full-attention layers alone — a quarter of what the same model with every layer full grows by, in decode and
    in a prompt chunk over a cached prefix."""
    full_spec = {"base": "Qwen3-Next-80B-A3B", "name": "Qwen3-Next-all-full", "layer_types": None,
                 "linear_num_key_heads": None, "linear_num_value_heads": None, "linear_key_head_dim": None,
                 "linear_value_head_dim": None, "linear_conv_kernel_dim": None}
    tp4 = {"parallel": {"tensor_parallel_size": 4}}
    hybrid, full = cost("Qwen3-Next-80B-A3B", source=source, **tp4), cost(full_spec, source=source, **tp4)
    for short, long in (([1] * 32, [1] * 32), ([512], [512])):
        n = len(short)
        ctx_short, ctx_long = ([1000] * n, [30000] * n) if n > 1 else ([512], [30000])
        grow = [c.step_cost(shape_of(long, ctx_long)).attention_s - c.step_cost(shape_of(short, ctx_short)).attention_s
                for c in (hybrid, full)]
        assert grow[0] == pytest.approx(grow[1] / 4, rel=0.05)


def test_qk_norms_and_output_gates_add_their_passes_and_sinks_nothing():
    base = {"base": "Qwen3-8B", "name": "plain", "qk_norm": False}
    plain, normed = cost(base), cost({**base, "qk_norm": True})
    gated = cost({**base, "attn_output_gate": True})
    sinks = cost({**base, "attention_sinks": True})
    shape = shape_of([1024], [1024])
    assert normed.step_cost(shape).linear_s > plain.step_cost(shape).linear_s
    assert gated.step_cost(shape).linear_s > normed.step_cost(shape).linear_s  # a second q projection and the gate
    assert sinks.step_cost(shape).total_s == plain.step_cost(shape).total_s  # folded into the attention kernel


def test_mxfp4_experts_run_the_engine_s_measured_kernel_on_hopper():
    """gpt-oss-120b on one H100 under vLLM: every MoE layer priced by the fit to AIConfigurator's timings of vLLM's
    MXFP4 expert kernel (weights dequantized to bf16 in the kernel), within its held-out error of the measured layer;
    without the engine's kernels the experts stream 4.25-bit weights and multiply at the bf16 rate."""
    c = cost("gpt-oss-120b")
    assert c.expert_gemm is c.kernels.grouped_mxfp4 and c.expert_bytes == 4.25 / 8
    t = AicTables()
    rows, _ = t.rows("moe_mxfp4", "moe", "moe_perf", "H100-SXM", "vllm", c.kernels.version)
    layer = {tokens: s for r, tokens, s in points(rows, "t") if (r["experts"], r["tp"], r["ep"]) == (128, 1, 1)}
    errors = [c.experts_s(tokens) / 36 / s - 1 for tokens, s in layer.items()]
    assert np.median(np.abs(errors)) < 0.2
    plain = cost("gpt-oss-20b", "H200", engine="infersim")  # default kernels: no MXFP4 kernel timed
    bf16 = cost({"base": "gpt-oss-20b", "name": "bf16-experts", "expert_weight_dtype": None}, "H200", engine="infersim")
    assert plain.kernels.grouped_mxfp4 is None
    assert plain.experts_s(64) < 0.4 * bf16.experts_s(64)  # a decode batch streams 4.25 bits a weight, not 16


def test_nvfp4_weights_multiply_on_blackwell_s_fp4_tensor_cores():
    model = {"base": "Llama-3-70B", "name": "Llama-3-70B-NVFP4", "weight_dtype": "nvfp4"}
    prompt = shape_of([4096], [4096])
    b200, b200_bf16 = cost(model, "B200", max_model_len=8192), cost("Llama-3-70B", "B200", max_model_len=8192)
    assert b200.gemm is b200.kernels.gemm["fp4"]  # NVFP4 GEMMs as AIConfigurator timed them
    assert b200.step_cost(prompt).linear_s < 0.6 * b200_bf16.step_cost(prompt).linear_s
    h100 = cost(model, "H100-SXM", max_model_len=8192)  # no FP4 tensor cores: weight-only, dequantized to bf16
    assert h100.gemm is h100.kernels.gemm["fp16"] and h100.compute_scale < 1

"""INFERSIM_ISA: the native kernels built for each instruction set (a separate cached build each) compute what the torch
paths compute, every set forced through the environment variable; a set this CPU lacks is skipped here and refused by
the loader in one line."""
from pathlib import Path

import pytest
import torch

from executor.model import attention, layers, native, quantize
from executor.model import llama as model_module
from executor.model.cache_engine import dequantize_kv, quantize_kv
from executor.model.quantize import QuantizedWeight
from sim.config import environment
from sim.config.errors import ConfigError
from tests.test_attention import MIXED, dense_reference, make_batch, rel_err
from tests.test_native_decode_loop import decode_run, model_for

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built (no C++ compiler)")


def _param(isa: str):
    flags = native.cpu_flags()
    lacking = [f for f in native.ISA_CPU_FLAGS[isa] if f not in flags]
    return pytest.param(isa, marks=pytest.mark.skipif(bool(lacking), reason=f"this CPU lacks {', '.join(lacking)}"))


@pytest.fixture(params=[_param(isa) for isa in native.ISA_CPU_FLAGS])
def isa(request, monkeypatch):
    """The kernels built for one instruction set, for the test; the default build again after it."""
    monkeypatch.setenv("INFERSIM_ISA", request.param)
    native.library.cache_clear()
    yield request.param
    monkeypatch.delenv("INFERSIM_ISA")
    native.library.cache_clear()


def test_each_instruction_set_is_a_build_of_its_own(isa):
    lib = native.library()
    assert native.isa() == isa and Path(lib._name).name.startswith(f"kernels-{isa}-")
    assert lib.panel_columns == {"avx2": 16, "avx512": 32}[isa]
    _, flags = native.isa_build(isa, native.cpu_flags())
    assert ("-march=native" in flags) == (isa == "avx512") and ("-mavx2" in flags) == (isa == "avx2")


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13])
@pytest.mark.parametrize("n,k", [(960, 576), (40, 1024), (65, 70), (33, 37)])
def test_quantized_projections_equal_the_dequantized_reference(isa, bits, group, rows, n, k):
    """int8 and int4 at the rows of decodes and verify steps: one row (AVX2's integer int4 tile where K is a multiple
    of 4, 576 and 1024, with groups of 128 that its int16 sums cross), two or three (more independent sums per
    column on AVX2), a K the groups do not divide and odd shapes (the float tiles)."""
    q = QuantizedWeight(torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * k ** -0.5, bits, group)
    assert q.width == native.library().panel_columns
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    assert rel_err(q(x), x @ q.dequantized().T) < 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_gate_up_halves(isa, bits):
    """A split weight's two outputs from one call (the decode loop's gate|up) at one row."""
    width = native.library().panel_columns
    w = torch.randn(4 * width, 64, generator=torch.Generator().manual_seed(bits))
    q = QuantizedWeight(w, bits, 32, split=width)
    x = torch.randn(1, 64)
    ref = x @ q.dequantized().T
    a, b = q.matmul(x)
    assert rel_err(torch.cat([a, b], 1), ref) < 1e-5


def test_fp32_projections_and_elementwise_kernels(isa):
    for rows, k, n in [(1, 576, 960), (5, 1536, 576), (13, 70, 65)]:
        gen = torch.Generator().manual_seed(rows)
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        assert rel_err(native.linear_small(x, native.pack_weight(w)), x @ w.T) < 1e-5
    gate, up = torch.randn(5, 1000) * 30, torch.randn(5, 1000)
    assert rel_err(native.silu_mul(gate, up), torch.nn.functional.silu(gate) * up) < 1e-5


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim", [(9, 3, 16, 64), (8, 2, 4, 16)])
def test_attention_equals_the_dense_reference(isa, kv_int8, heads, kv_heads, block_size, head_dim):
    """Decode rows (a lone one splits its keys), prompts and chunks, over fp32 pools and int8 ones."""
    for query_lens, context_lens in ([[1], [150]], [[1] * 4, [5, 40, 17, 90]], MIXED):
        q, k_pool, v_pool, meta, logical = make_batch(query_lens, context_lens, heads, kv_heads, block_size, head_dim,
                                                      seed=heads + len(query_lens))
        if kv_int8:
            k_pool, v_pool = quantize_kv(k_pool), quantize_kv(v_pool)
            ref = attention.naive_attention(q, dequantize_kv(k_pool), dequantize_kv(v_pool), meta)
        else:
            ref = dense_reference(q, meta, logical)
        assert rel_err(attention.sdpa_attention(q, k_pool, v_pool, meta), ref) < 1e-5


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "fp32_kv8"])
def test_model_decode_equals_the_torch_paths(monkeypatch, isa, name):
    """A tiny model's prompt and decode steps (the native decode loop) against every native kernel switched off."""
    model, kv = model_for(name)
    ours = decode_run(model, kv, [9, 14])
    for module, switch in ((layers, "USE_NATIVE_OPS"), (layers, "USE_NATIVE_LINEAR"), (quantize, "USE_NATIVE_QUANT"),
                           (attention, "USE_NATIVE_ATTENTION"), (model_module, "USE_NATIVE_DECODE_LOOP")):
        monkeypatch.setattr(module, switch, False)
    assert rel_err(ours, decode_run(model, kv, [9, 14])) < 1e-5


TINY = """name: tiny-isa
model: {name: tiny-llama, num_layers: 2, hidden_size: 64, num_heads: 4, num_kv_heads: 2, intermediate_size: 128,
        vocab_size: 512, max_position_embeddings: 512, weight_dtype: fp32}
hardware: cpu
executor: {attention: sdpa, threads: 1, random_weights: true}
serving: {max_num_seqs: 4, max_model_len: 256, max_num_batched_tokens: 256}
kv_cache: {allocator: paged, block_size: 16, num_blocks: 32}
workload: {seed: 1, arrival: {process: poisson, rate: 50.0}, num_requests: 4, prompt_len: {dist: uniform, min: 8, max: 16},
           output_len: {dist: uniform, min: 2, max: 4}}
"""


def test_serve_under_a_bad_instruction_set_is_one_line_exit_2(monkeypatch, tmp_path):
    from tests.test_cli import invoke

    (tmp_path / "tiny.yaml").write_text(TINY)
    monkeypatch.setenv("INFERSIM_ISA", "avx9")
    native.library.cache_clear()
    try:
        r = invoke("serve", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "out"))
    finally:
        monkeypatch.delenv("INFERSIM_ISA")
        native.library.cache_clear()
    assert r.exit_code == 2 and "INFERSIM_ISA='avx9'" in r.output and "Traceback" not in r.output


def test_bad_or_missing_instruction_sets_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("INFERSIM_ISA", "sse9")
    with pytest.raises(ConfigError, match=r"INFERSIM_ISA='sse9' .*allowed: auto, avx2, avx512"):
        environment.isa()
    monkeypatch.setenv("INFERSIM_ISA", " AVX2 ")
    assert environment.isa() == "avx2"
    avx2_only = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    with pytest.raises(ConfigError, match="INFERSIM_ISA=avx512: this CPU lacks avx512f, avx512bw, avx512vl; "
                                          "allowed here: auto, avx2"):
        native.isa_build("avx512", avx2_only)
    assert native.isa_build("auto", avx2_only)[0] == "avx2"
    assert native.isa_build("auto", {"sse2"})[0] == "native"
    assert native.isa_build("avx2", avx2_only) == ("avx2", [*native.BASE_FLAGS, "-mavx2", "-mfma", "-mf16c"])

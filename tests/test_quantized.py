"""Model compression in the executor: int8 / int4 weight-only layers (native kernels and the torch path) and the int8
KV cache under every attention backend, on tiny random-weight models."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine
from executor.core.engine import SamplingParams
from executor.core.model_runner import ModelRunner
from executor.model import attention, native, quantize
from executor.model.attention import AttentionMetadata, get_backend
from executor.model.cache_engine import KVCache, dequantize_kv, quantize_kv
from executor.model.layers import Linear, apply_rope
from executor.model.quantize import QuantizedLinear, QuantizedWeight, quantize_weights, weight_bytes
from executor.model.tiny import tiny_model
from executor.serving.kv_transfer import copy_kv
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler
from tests.test_attention import BACKEND_VARIANTS, MIXED, dense_reference, make_batch, rel_err

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built (no C++ compiler)")
PATHS = [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="torch")]


def weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5


@pytest.mark.parametrize("use_native", PATHS)
@pytest.mark.parametrize("bits,group", [(8, 128), (4, 128), (4, 32)])
@pytest.mark.parametrize("rows", [1, 3, 5, 13, 17, 40, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (65, 70), (33, 37), (40, 1024)])
def test_quantized_matmul_equals_dequantized_reference(monkeypatch, use_native, bits, group, rows, n, k):
    """Every tile height (1 and 3: int4's group-summed tiles, 5, 13, 17: two tiles, 40, 300), an N that the panels
    do not divide, an odd K, a K that ends in a short group (576 = 4 · 128 + 64) and rows 4 KB apart (K = 1024: tiles
    of more than 8 rows read a packed copy)."""
    monkeypatch.setattr(quantize, "USE_NATIVE_QUANT", use_native)
    q = QuantizedWeight(weight(n, k), bits, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert rel_err(q(x), x @ q.dequantized().T) < 1e-5


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
def test_many_rows_dequantize_then_multiply(monkeypatch, bits):
    """Past QUANT_MAX_ROWS_BY_PANEL rows (thousands on AVX-512; 8 here) the weight is dequantized natively and
    multiplied by MKL."""
    monkeypatch.setattr(quantize, "QUANT_MAX_ROWS_BY_PANEL", {32: 8, 16: 8})
    q = QuantizedWeight(weight(65, 70), bits)
    x = torch.randn(40, 70)
    assert rel_err(q(x), x @ q.dequantized().T) < 1e-5


@pytest.mark.parametrize("bits,group", [(8, 128), (4, 128), (4, 32)])
def test_quantization_error_within_half_a_step(bits, group):
    w = weight(70, 300, seed=1)
    q = QuantizedWeight(w, bits, group)
    err = (q.dequantized() - w).abs()
    if bits == 8:
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        g = torch.nn.functional.pad(w, (0, -w.shape[1] % group)).view(70, -1, group)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(group, 1)[:, :300]
    assert (err <= step * 0.5 * 1.01 + 1e-6).all()  # half a step, plus the fp16 rounding of int4's scale and min


@needs_native
@pytest.mark.parametrize("bits,group", [(8, 128), (4, 64)])
def test_native_dequantize_equals_torch(bits, group):
    q = QuantizedWeight(weight(100, 200, seed=2), bits, group)
    ours = native.dequantize_panels(q.panels, q.scales, bits, group, 100, 200)
    assert rel_err(ours.T, quantize.dequantize_panels(q.panels, q.scales, bits, group, 100, 200)) < 1e-6  # FMA


@pytest.mark.parametrize("use_native", PATHS)
def test_outlier_columns_stay_fp32(monkeypatch, use_native):
    """LLM.int8()'s decomposition: the flagged input features multiply their exact fp32 columns."""
    monkeypatch.setattr(quantize, "USE_NATIVE_QUANT", use_native)
    w = weight(48, 64, seed=3)
    w[:, [5, 40]] *= 50
    q = QuantizedWeight(w, 4, 32, outliers=torch.tensor([5, 40]))
    assert torch.equal(q.dequantized()[:, [5, 40]], w[:, [5, 40]])
    x = torch.randn(3, 64)
    x[:, 5] = 60.0
    assert rel_err(q(x), x @ q.dequantized().T) < 1e-5


@pytest.mark.parametrize("use_native", PATHS)
@pytest.mark.parametrize("half", [40, 64])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_splits_give_one_contiguous_output_per_part(monkeypatch, use_native, half, dtype):
    """gate|up: halves that are whole panels (64, whatever the machine's panel width, 16 or 32) are one fused weight
    written to two outputs by one call; others (40) two weights."""
    monkeypatch.setattr(quantize, "USE_NATIVE_QUANT", use_native)
    lin = Linear(32, 2 * half, splits=[half, half])
    with torch.no_grad():
        lin.weight.copy_(weight(2 * half, 32))
    q = QuantizedLinear(lin, dtype)
    assert q.fused == (half == 64)
    for rows in (1, 5):
        x = torch.randn(rows, 32)
        a, b = q(x)
        assert a.shape == b.shape == (rows, half) and a.is_contiguous() and b.is_contiguous()
        assert rel_err(torch.cat([a, b], 1), x @ q.weight.T) < 1e-5
    assert q.weight.shape == (2 * half, 32)
    assert rel_err(q.weight, lin.weight) < (0.01 if dtype == "int8" else 0.1)


def test_bad_arguments_are_one_line_errors():
    model = tiny_model(seed=0)
    with pytest.raises(ValueError, match="allowed: int8, int4, fp8"):
        quantize_weights(model, "int3")
    with pytest.raises(ValueError, match="group_size"):
        quantize_weights(model, "int4", group_size=48)
    with pytest.raises(ValueError, match="lm_head_dtype"):
        quantize_weights(model, "int4", lm_head_dtype="fp8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp8 weights need a CUDA GPU"):
            quantize_weights(model, "fp8")
    quantize_weights(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model, "int8")
    with pytest.raises(ValueError, match="kv_dtype"):
        KVCache.for_model(model.config, 4, 4, kv_dtype="int4")


def linear_bytes(n, k, bits, width, group=32):
    panels = -(-n // width)
    if bits == 8:
        return panels * width * k + panels * width * 4
    return panels * width * k // 2 + panels * -(-k // group) * 2 * width * 2


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_quantized_values_scales_and_the_fp32_rest(tied):
    """The embedding and norms stay fp32; a tied head is counted once before and gets its own quantized copy (int8
    in an int4 model)."""
    c = dict(hidden_size=64, intermediate_size=96, vocab_size=200, num_heads=4, num_kv_heads=2, num_layers=2,
             tie_word_embeddings=tied)
    fp32 = weight_bytes(tiny_model(**c))
    h, i, v, kv = 64, 96, 200, 2 * 16
    shapes = [(h + 2 * kv, h), (h, h), (i, h), (i, h), (h, i)] * 2 + [(v, h)]  # gate and up are parts of their own
    rest = v * h * 4 + (2 * 2 + 1) * h * 4  # embedding, norms
    assert fp32 == rest + sum(n * k * 4 for n, k in shapes[:-1]) + (0 if tied else v * h * 4)
    width = quantize._panel_width()
    for dtype, bits in (("int8", 8), ("int4", 4)):
        got = weight_bytes(quantize_weights(tiny_model(**c), dtype))
        assert got == rest + sum(linear_bytes(n, k, bits, width) for n, k in shapes[:-1]) + linear_bytes(v, h, 8, width)


def test_int8_and_int4_models_track_fp32_logits():
    model = tiny_model(seed=1, num_kv_heads=2)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build([40], [40], [list(range(10))], 4)

    def logits(m):
        return m.compute_logits(m(ids, meta.positions(), meta, KVCache.for_model(m.config, 10, 4)))

    ref = logits(model)
    assert rel_err(logits(quantize_weights(tiny_model(seed=1, num_kv_heads=2), "int8")), ref) < 0.03
    assert rel_err(logits(quantize_weights(tiny_model(seed=1, num_kv_heads=2), "int4", 32)), ref) < 0.25
    mixed = quantize_weights(tiny_model(seed=1, num_kv_heads=2), "int8", outlier_threshold=2.0)
    assert quantize.outlier_columns(mixed) > 0 and rel_err(logits(mixed), ref) < 0.03


def test_kv_rows_round_trip_within_half_a_step():
    x = torch.randn(7, 3, 64) * torch.tensor([0.1, 1.0, 30.0])[None, :, None]
    x[2, 1] = 0.0  # a zero row: scale 0, values 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 68)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_kv(rows) - x).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(dequantize_kv(rows)[2, 1], torch.zeros(64))


@needs_native
def test_native_rope_writes_the_torch_paths_int8_rows():
    gen = torch.Generator().manual_seed(0)
    t, h, kvh, hd = 11, 6, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * hd, generator=gen)
    positions = torch.randint(0, 100, (t,), generator=gen)
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))
    k_pool, v_pool = torch.zeros(40, kvh, hd + 4, dtype=torch.int8), torch.zeros(40, kvh, hd + 4, dtype=torch.int8)
    slots = torch.randperm(40, generator=gen)[:t]
    native.rope_write_kv(qkv, h, kvh, hd, freqs.cos(), freqs.sin(), positions, k_pool, v_pool, slots)
    _, ke, ve = qkv.split([h * hd, kvh * hd, kvh * hd], dim=1)
    k = apply_rope(ke.reshape(t, kvh, hd), freqs.cos()[positions][:, None], freqs.sin()[positions][:, None])
    assert torch.equal(v_pool[slots], quantize_kv(ve.reshape(t, kvh, hd)))
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_kv(k_pool[slots]) - k).abs() <= step * 0.51).all()  # rope's rounding may flip a half step


def int8_pools(k_pool, v_pool):
    return quantize_kv(k_pool), quantize_kv(v_pool)


@pytest.mark.parametrize("use_native", PATHS)
@pytest.mark.parametrize("name,options", BACKEND_VARIANTS, ids=lambda x: str(x))
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim", [(8, 2, 4, 16), (9, 3, 16, 64)])
def test_int8_kv_attention_on_every_backend(monkeypatch, use_native, name, options, heads, kv_heads, block_size,
                                            head_dim):
    """Prompts, chunks and decodes over int8 pools: what the backend gives on the dequantized fp32 pools (so every
    read dequantizes right), and within 2% of fp32 attention."""
    monkeypatch.setattr(attention, "USE_NATIVE_ATTENTION", use_native)
    q, k_pool, v_pool, meta, logical = make_batch(*MIXED, heads, kv_heads, block_size, head_dim, seed=heads)
    kq, vq = int8_pools(k_pool, v_pool)
    backend = get_backend(name, **options)
    ours = backend(q, kq, vq, meta)
    assert rel_err(ours, backend(q, dequantize_kv(kq), dequantize_kv(vq), meta)) < 1e-5
    assert rel_err(ours, dense_reference(q, meta, logical)) < 0.02


@needs_native
@pytest.mark.parametrize("query_lens,context_lens", [([1, 4, 3, 1], [2, 30, 9, 20]), ([11], [40])])
def test_int8_kv_verify_rows_on_the_native_kernel(query_lens, context_lens):
    """Verify rows (the paged kernel's multi-slot rows, and the prefill kernel's short prompts) over int8 pools."""
    q, k_pool, v_pool, meta, _ = make_batch(query_lens, context_lens, 9, 3, 16, 64, seed=5)
    meta = AttentionMetadata(meta.query_lens, meta.context_lens, meta.block_tables, meta.slot_mapping,
                             meta.block_size, num_decode_rows=len(query_lens))
    kq, vq = int8_pools(k_pool, v_pool)
    tables = attention._padded_tables(meta.block_tables, None)
    lens = torch.tensor(context_lens)
    n = max(query_lens)
    qv = torch.randn(len(query_lens), n, 9, 64)
    ours = native.paged_attention(qv, kq, vq, tables, lens, 0.125)
    assert rel_err(ours, native.paged_attention(qv, dequantize_kv(kq), dequantize_kv(vq), tables, lens, 0.125)) < 1e-5
    out = attention.sdpa_attention(q, kq, vq, meta)
    assert rel_err(out, attention.naive_attention(q, dequantize_kv(kq), dequantize_kv(vq), meta)) < 1e-5


def policy(num_blocks=12, swap_blocks=32, **cfg):
    kv = BlockAllocator(num_blocks, 4, num_swap_blocks=swap_blocks)
    cfg = {"max_num_batched_tokens": 64, "prefill_chunk_size": 64, "preemption": "swap", **cfg}
    return make_scheduler(scheduler_config(128, **cfg), kv)


# (weights, KV, the share of fp32's greedy tokens it must reproduce: int4 on a random tiny model diverges early)
@pytest.mark.parametrize("weights,kv_dtype,agree", [("int8", "int8", 0.6), ("int4", None, 0.0), (None, "int8", 0.6)])
def test_engine_completes_every_request(weights, kv_dtype, agree):
    """Quantized weights and an int8 KV cache under swap preemption (the int8 rows and their scales swapped out and
    back); greedy output mostly the fp32 model's."""
    def serve(model, kv):
        engine = make_engine(model, policy(), SamplingParams(ignore_eos=True), kv_dtype=kv)
        g = torch.Generator().manual_seed(0)
        reqs = [Request(i, 0.0, n, 8) for i, n in enumerate([3, 17, 9, 30, 5, 12])]
        for r in reqs:
            engine.add(r, torch.randint(3, 256, (r.prompt_len,), generator=g).tolist())
        while engine.has_work():
            engine.step()
        assert all(r.status is Status.FINISHED for r in reqs)
        assert engine.scheduler.num_preemptions > 0 and any(rec.swapped_blocks for rec in engine.records)
        return [engine.output_ids(r) for r in reqs]

    make = lambda: tiny_model(seed=3, num_kv_heads=2)  # noqa: E731
    ref = serve(make(), None)
    model = make() if weights is None else quantize_weights(make(), weights)
    out = serve(model, kv_dtype)
    same = sum(a == b for x, y in zip(out, ref) for a, b in zip(x, y))
    assert same >= agree * sum(map(len, ref))


def test_int8_cache_bytes_and_copies():
    """bytes_per_block counts the scales; the disaggregated transfer moves int8 rows between pools of different
    block sizes unchanged; graphs refuse an int8 cache."""
    model = tiny_model(seed=0, num_kv_heads=2)
    c = model.config
    assert KVCache.bytes_per_block(c, 16, kv_dtype="int8") == 2 * c.num_layers * 16 * 2 * (c.head_dim + 4)
    src = KVCache.for_model(c, 6, 4, kv_dtype="int8")
    dst = KVCache.for_model(c, 4, 8, kv_dtype="int8")
    assert src.nbytes == KVCache.bytes_per_block(c, 4, kv_dtype="int8") * 6
    src.data.copy_(quantize_kv(torch.randn(*src.data.shape[:-1], c.head_dim, generator=torch.Generator().manual_seed(0))))
    nbytes = copy_kv(src.data, [4, 1, 3], dst.data, [2, 0], 10)
    assert nbytes == 2 * c.num_layers * 10 * 2 * (c.head_dim + 4)
    for layer in range(c.num_layers):
        for a, b in zip(src.read(layer, [4, 1, 3], 10), dst.read(layer, [2, 0], 10)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="int8 KV cache"):
        ModelRunner(model, dst, policy().cfg, use_graphs=True)

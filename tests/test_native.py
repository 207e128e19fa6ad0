"""The native CPU kernels compute what the torch paths they replace compute (and are optional)."""

import pytest
import torch
import torch.nn.functional as F

from executor.model import attention, layers, native
from executor.model.attention import AttentionMetadata, naive_attention, sdpa_attention
from executor.model.layers import apply_rope
from executor.model.tiny import tiny_model
from tests.test_attention import dense_reference, make_batch, rel_err
from tests.test_executor_model import Sequences, random_prompts

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built (no C++ compiler)")


@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (3, 13, 7), (16, 40, 9), (5, 1536, 576), (11, 579, 33),
                                       (12, 64, 32), (13, 70, 65), (32, 64, 5), (64, 96, 130),
                                       (9, 1024, 70), (12, 1024, 33), (17, 1024, 64), (30, 2048, 40)])
def test_linear_small_equals_matmul(rows, k, n):
    """Every tile height (balanced tiles above a dozen rows) and a last panel that is only partly columns; rows 4 KB
    apart (K = 1024, 2048), whose tiles of more than 8 read a packed copy (17 rows: a tile of 8 beside one of 9)."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    assert rel_err(native.linear_small(x, native.pack_weight(w)), x @ w.T) < 1e-5


def test_linear_repacks_when_the_weight_changes():
    """The panel copy follows in-place updates of the weight (a trained draft model, a refitted head)."""
    layer = layers.Linear(24, 40)
    x = torch.randn(3, 24)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)
        assert rel_err(layer(x), 2 * first) < 1e-5


def test_argmax_rows_equals_torch():
    """Greedy sampling's argmax: ties go to the first index and a NaN counts as largest, as in torch."""
    x = torch.randn(7, 1001, generator=torch.Generator().manual_seed(3))
    x[1, 5] = x[1, 900] = 50.0  # a tie
    x[2, 17] = float("nan")
    x[3] = 0.0  # all equal
    x[4, -1] = float("inf")
    assert native.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()
    assert native.argmax_rows(x[:1].contiguous()).tolist() == torch.argmax(x[:1], dim=-1).tolist()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 16), (6, 1, 12), (9, 3, 64)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_paged_decode_equals_dense_reference(heads, kv_heads, head_dim, contiguous):
    """Decodes of different context lengths, blocks scattered over a pool full of garbage elsewhere."""
    lens = [1, 5, 17, 40, 33]
    q, k_pool, v_pool, meta, logical = make_batch([1] * 5, lens, heads, kv_heads, 4, head_dim, seed=heads,
                                                  contiguous=contiguous)
    tables = attention._padded_tables(meta.block_tables, None)
    out = native.paged_attention(q[:, None].contiguous(), k_pool, v_pool, tables, torch.tensor(lens),
                                 head_dim ** -0.5)[:, 0]
    assert rel_err(out, dense_reference(q, meta, logical)) < 1e-5


@pytest.mark.parametrize("query_lens,context_lens,tree_row", [
    ([1, 4, 3, 5, 1], [2, 30, 9, 12, 20], 3),
    ([11], [40], None),  # one verify row: its query slots are split over the threads
    ([5], [23], 0),  # one candidate-tree row, split likewise
])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim", [(8, 2, 4, 16), (9, 3, 16, 64)])
def test_verify_rows_padded_and_tree_equal_torch_path(monkeypatch, query_lens, context_lens, tree_row, heads,
                                                      kv_heads, block_size, head_dim):
    """A padded group of decode rows, chain verify rows and a candidate-tree row (one with a context shorter than
    the padding), and single rows at batch 1: the native kernel gives the torch path's (gathered K/V + SDPA)
    outputs for every real query. SmolLM2's shape (16-token blocks, head_dim 64) takes the kernel's
    transposed-key scores and register-blocked P·V; blocks end part-filled."""
    q, k_pool, v_pool, meta, _ = make_batch(query_lens, context_lens, heads, kv_heads, block_size, head_dim, seed=5)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    trees = {} if tree_row is None else {tree_row: tree}
    meta = AttentionMetadata(meta.query_lens, meta.context_lens, meta.block_tables, meta.slot_mapping,
                             meta.block_size, trees=trees, num_decode_rows=len(query_lens))
    ours = sdpa_attention(q, k_pool, v_pool, meta)
    monkeypatch.setattr(attention, "USE_NATIVE_ATTENTION", False)
    theirs = sdpa_attention(q, k_pool, v_pool, AttentionMetadata(
        meta.query_lens, meta.context_lens, meta.block_tables, meta.slot_mapping, meta.block_size,
        trees=trees, num_decode_rows=len(query_lens)))
    assert rel_err(ours, theirs) < 1e-5
    assert rel_err(ours, naive_attention(q, k_pool, v_pool, meta)) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim", [(9, 3, 16, 64), (8, 2, 5, 32), (4, 4, 1, 16)])
def test_prefill_rows_equal_dense_reference(monkeypatch, heads, kv_heads, block_size, head_dim):
    """Prompts in one native call beside a decode: whole ones of many tiles and tails, a chunk whose earlier
    tokens are cached (its rows start past position 0), blocks that split a key chunk (5) or are single slots."""
    query_lens, context_lens = [40, 1, 100, 17, 203], [40, 9, 130, 17, 203]
    q, k_pool, v_pool, meta, logical = make_batch(query_lens, context_lens, heads, kv_heads, block_size, head_dim,
                                                  seed=heads + block_size)
    calls = []
    monkeypatch.setattr(native, "prefill_attention", lambda *a, _f=native.prefill_attention: calls.append(1) or _f(*a))
    ours = sdpa_attention(q, k_pool, v_pool, meta)
    assert calls  # the prompts went through the kernel
    assert rel_err(ours, dense_reference(q, meta, logical)) < 1e-5


def test_fused_elementwise_kernels_equal_torch():
    gen = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(37, 72, generator=gen), torch.randn(37, 72, generator=gen), torch.randn(72, generator=gen)
    expect_x = x + d
    expect = F.rms_norm(expect_x, (72,), w, 1e-5)
    out = native.add_rms_norm(x, d, w, 1e-5)
    assert torch.allclose(x, expect_x) and rel_err(out, expect) < 1e-5
    assert rel_err(native.add_rms_norm(x, None, w, 1e-6), F.rms_norm(x, (72,), w, 1e-6)) < 1e-5

    gate, up = torch.randn(5, 1000, generator=gen) * 30, torch.randn(5, 1000, generator=gen)
    assert rel_err(native.silu_mul(gate, up), F.silu(gate) * up) < 1e-5

    t, h, kvh, hd = 11, 6, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * hd, generator=gen)
    positions = torch.randint(0, 100, (t,), generator=gen)
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))
    k_pool, v_pool = torch.zeros(40, kvh, hd), torch.zeros(40, kvh, hd)
    slots = torch.randperm(40, generator=gen)[:t]
    q = native.rope_write_kv(qkv, h, kvh, hd, freqs.cos(), freqs.sin(), positions, k_pool, v_pool, slots)
    cos, sin = freqs.cos()[positions][:, None], freqs.sin()[positions][:, None]
    qe, ke, ve = qkv.split([h * hd, kvh * hd, kvh * hd], dim=1)
    assert rel_err(q, apply_rope(qe.view(t, h, hd), cos, sin)) < 1e-6
    assert rel_err(k_pool[slots], apply_rope(ke.reshape(t, kvh, hd), cos, sin)) < 1e-6
    assert torch.equal(v_pool[slots], ve.reshape(t, kvh, hd))


def test_model_with_native_kernels_equals_torch_paths(monkeypatch):
    """Prefill, chunked prefill mixed with decodes, then decodes (rows of 1-3 tokens use the native linear):
    the same logits with every native kernel switched off."""
    model = tiny_model(seed=4, num_heads=8, num_kv_heads=2, head_dim=16)
    prompts = random_prompts([13, 6, 29], model.config.vocab_size, seed=1)

    def run():
        seqs = Sequences(model, block_size=4, num_blocks=64, seed=2)
        out = [seqs.step([(0, prompts[0]), (1, prompts[1][:3])])]
        out.append(seqs.step([(0, [5]), (1, prompts[1][3:]), (2, prompts[2])]))
        for tok in (7, 9, 11):
            out.append(seqs.step([(0, [tok]), (1, [tok + 1]), (2, [tok + 2])]))
        return torch.cat([v for step in out for v in step.values()])

    calls = {}
    for fn in ("linear_small", "paged_attention", "rope_write_kv", "add_rms_norm", "silu_mul"):
        def counted(*args, _fn=getattr(native, fn), _name=fn, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(native, fn, counted)
    ours = run()
    assert len(calls) == 5, calls  # every kernel ran
    for name in ("USE_NATIVE_OPS", "USE_NATIVE_LINEAR"):
        monkeypatch.setattr(layers, name, False)
    monkeypatch.setattr(attention, "USE_NATIVE_ATTENTION", False)
    assert rel_err(ours, run()) < 1e-5


def test_disabled_by_environment(monkeypatch):
    """INFERSIM_NATIVE=0: no library, and the model runs its torch paths."""
    monkeypatch.setenv("INFERSIM_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert not native.available()
        model = tiny_model(seed=1)
        seqs = Sequences(model)
        logits = seqs.step([(0, [3, 4, 5])])[0]
        assert torch.isfinite(logits).all()
    finally:
        monkeypatch.delenv("INFERSIM_NATIVE")
        native.library.cache_clear()
    assert native.available()


def test_tuning_hands_over_where_the_native_kernel_stops_winning(monkeypatch):
    """tune_native_rows keeps the last tried row count at which the native kernel ran no slower: a native kernel
    made slow above 48 rows hands over at 48, for every projection of that shape, and the forward follows it."""
    import types

    fast_native, dense = layers.Linear._native, layers.Linear._dense
    clock = [0.0]  # a clock only the kernels below move, so a loaded machine cannot change the outcome
    monkeypatch.setattr(layers, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def native_slow_above_48(self, x):
        clock[0] += 0.02 if x.shape[0] > 48 else 0.0
        return fast_native(self, x)

    def dense_at_10_ms(self, x):
        clock[0] += 0.01
        return dense(self, x)

    monkeypatch.setattr(layers.Linear, "_native", native_slow_above_48)
    monkeypatch.setattr(layers.Linear, "_dense", dense_at_10_ms)
    model = torch.nn.Sequential(layers.Linear(64, 32), layers.Linear(64, 32), layers.Linear(32, 64))
    found = layers.tune_native_rows(model)
    assert found == {(64, 32, ()): 48, (32, 64, ()): 48}
    assert all(m.native_max_rows == 48 and m._packed is not None and m._panels is not None for m in model)
    assert layers.tune_native_rows(model) == {}  # tuned already: nothing measured again
    calls = []
    monkeypatch.setattr(native, "linear_small",
                        lambda x, p: calls.append(x.shape[0]) or x @ torch.zeros(x.shape[1], p.n))
    with torch.no_grad():
        model[0](torch.randn(48, 64))
        model[0](torch.randn(49, 64))
    assert calls == [48]


def test_a_runner_tunes_its_model_once():
    """Building a runner tunes the model's projections (and drops a decode plan made with the old limits)."""
    from executor.core.model_runner import ModelRunner
    from executor.model.cache_engine import KVCache

    model = tiny_model()
    assert all(m.native_max_rows is None for m in model.modules() if isinstance(m, layers.Linear))
    cache = KVCache.for_model(model.config, 8, 16, torch.float32, "cpu")
    ModelRunner(model, cache, None)
    limits = {m.native_max_rows for m in model.modules() if isinstance(m, layers.Linear)}
    assert limits and limits <= set(layers.NATIVE_ROWS_CANDIDATES)
    assert model.tune_projections() == {}


@pytest.mark.parametrize("lens", [[130], [77, 200], [1, 64, 300], [3]])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 16)])
def test_decode_rows_split_over_their_keys_equal_dense_reference(lens, heads, kv_heads, head_dim):
    """Fewer decode rows than threads want: each row's keys are split in whole blocks and the parts' softmax
    partials merged (a part past a short row's end is empty); short contexts stay whole."""
    q, k_pool, v_pool, meta, logical = make_batch([1] * len(lens), lens, heads, kv_heads, 4, head_dim, seed=len(lens))
    tables = attention._padded_tables(meta.block_tables, None)
    out = native.paged_attention(q[:, None].contiguous(), k_pool, v_pool, tables, torch.tensor(lens),
                                 head_dim ** -0.5)[:, 0]
    assert rel_err(out, dense_reference(q, meta, logical)) < 1e-5

"""Attention backends and the KV cache: every backend agrees with an independent dense reference."""

import pytest
import torch

from executor.model.attention import BACKENDS, AttentionMetadata, get_backend
from executor.model.cache_engine import KVCache
from executor.model.tiny import tiny_config

TOL = 1e-5


def make_batch(query_lens, context_lens, num_heads, num_kv_heads, block_size, head_dim=16, seed=0, contiguous=False):
    """Random K/V per sequence placed in a pool at shuffled block ids (or one max-len block per sequence).

    Returns (q, k_pool, v_pool, meta, per-sequence logical K/V) so a reference can attend densely.
    """
    gen = torch.Generator().manual_seed(seed)
    logical = [tuple(torch.randn(c, num_kv_heads, head_dim, generator=gen) for _ in "kv") for c in context_lens]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen) * 2
    layout = torch.Generator().manual_seed(seed + 1)  # separate stream: same data in every layout
    if contiguous:
        block_size = max(context_lens)
        tables = [[b] for b in torch.randperm(len(context_lens), generator=layout).tolist()]
        num_blocks = len(context_lens)
    else:
        need = [-(-c // block_size) for c in context_lens]
        num_blocks = sum(need) + 3  # spare blocks hold garbage that must never be read
        ids = torch.randperm(num_blocks, generator=layout).tolist()
        tables, start = [], 0
        for n in need:
            tables.append(ids[start:start + n])
            start += n
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=layout) * 100
    v_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=layout) * 100
    for (k, v), table in zip(logical, tables):
        for p in range(k.shape[0]):
            k_pool[table[p // block_size], p % block_size] = k[p]
            v_pool[table[p // block_size], p % block_size] = v[p]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    return q, k_pool, v_pool, meta, logical


def dense_reference(q, meta, logical):
    """Per sequence: repeat kv heads, full causal scores (bottom-right aligned), softmax."""
    out = []
    for i, (k, v) in enumerate(logical):
        s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("lhd,shd->hls", q[s:e].double(), k.double()) / q.shape[-1] ** 0.5
        ctx, length = k.shape[0], e - s
        mask = torch.ones(length, ctx, dtype=torch.bool).tril(diagonal=ctx - length)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hls,shd->lhd", probs, v.double()).float())
    return torch.cat(out)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


MIXED = ([5, 1, 3, 1, 17, 1, 2], [5, 9, 11, 1, 17, 33, 6])  # prefill, decode, chunk, first-token decode, ...
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA, MQA
BACKEND_VARIANTS = [("naive", {}), ("sdpa", {}), ("flash", {"tile_size": 4}), ("flash", {}), ("paged", {})]


@pytest.mark.parametrize("name,options", BACKEND_VARIANTS, ids=lambda x: str(x))
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_backend_matches_dense_reference_mixed_batch(name, options, num_heads, num_kv_heads, block_size):
    q, kp, vp, meta, logical = make_batch(*MIXED, num_heads, num_kv_heads, block_size)
    out = get_backend(name, **options)(q, kp, vp, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, dense_reference(q, meta, logical)) < TOL


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("lens", [([1, 1, 1], [7, 1, 20]), ([9, 4], [9, 13]), ([6], [6])],
                         ids=["decodes", "prefills", "one"])
def test_backends_agree_with_naive(name, lens):
    q, kp, vp, meta, _ = make_batch(*lens, 6, 2, block_size=4, seed=3)
    ref = get_backend("naive")(q, kp, vp, meta)
    assert rel_err(get_backend(name)(q, kp, vp, meta), ref) < TOL


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_contiguous_layout_equals_paged(name):
    paged = make_batch(*MIXED, 8, 2, block_size=4, seed=5)
    contiguous = make_batch(*MIXED, 8, 2, block_size=4, seed=5, contiguous=True)
    assert contiguous[3].block_size == max(MIXED[1])
    torch.testing.assert_close(paged[0], contiguous[0])
    out_paged = get_backend(name)(*paged[:4])
    out_contiguous = get_backend(name)(*contiguous[:4])
    assert rel_err(out_contiguous, out_paged) < TOL


def test_explicit_scale_is_used():
    q, kp, vp, meta, logical = make_batch(*MIXED, 4, 2, block_size=4)
    ref = dense_reference(q * 0.5 * q.shape[-1] ** 0.5, meta, logical)  # scale 0.5 == unscaled q * 0.5
    for name in BACKENDS:
        assert rel_err(get_backend(name)(q, kp, vp, meta, scale=0.5), ref) < TOL, name


def test_bfloat16_inputs_keep_dtype():
    q, kp, vp, meta, logical = make_batch(*MIXED, 4, 2, block_size=4)
    ref = dense_reference(q, meta, logical)
    for name in BACKENDS:
        out = get_backend(name)(q.bfloat16(), kp.bfloat16(), vp.bfloat16(), meta)
        assert out.dtype == torch.bfloat16
        assert rel_err(out.float(), ref) < 3e-2, name


def test_unknown_backend_and_bad_heads():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("triton")
    q, kp, vp, meta, _ = make_batch([2], [2], 3, 2, block_size=4)
    with pytest.raises(ValueError, match="multiple"):
        get_backend("sdpa")(q, kp, vp, meta)


def test_metadata_build_and_validation():
    meta = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    # seq 0: positions 3,4 -> block 7 offset 3, block 2 offset 0; seq 1: position 2 -> block 4 offset 2
    assert meta.slot_mapping.tolist() == [31, 8, 18]
    assert meta.positions().tolist() == [3, 4, 2]
    assert meta.last_token_indices().tolist() == [1, 2]
    assert meta.cu_query_lens == [0, 2, 3]
    assert meta.decode_seqs == [1] and meta.prefill_seqs == [0]
    assert meta.context_slots(0).tolist() == [28, 29, 30, 31, 8]
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [5], [[0]], block_size=4)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3], [2], [[0]], block_size=4)
    with pytest.raises(ValueError, match="one slot per new token"):
        AttentionMetadata([2], [2], [[0]], torch.tensor([0]), block_size=4)


def test_kv_cache_write_read_and_layouts():
    config = tiny_config(num_layers=3, num_kv_heads=2)
    cache = KVCache.for_model(config, num_blocks=6, block_size=4)
    assert cache.data.shape == (3, 2, 6, 4, 2, 16)
    assert cache.nbytes == 6 * KVCache.bytes_per_block(config, 4)
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    meta = AttentionMetadata.build([6], [6], [[5, 1]], block_size=4)
    cache.write(1, meta.slot_mapping, k, v)
    rk, rv = cache.read(1, [5, 1], 6)
    torch.testing.assert_close(rk, k)
    torch.testing.assert_close(rv, v)
    assert cache.layer(0)[0].abs().sum() == 0  # other layers untouched
    cache.copy_blocks([5], [0])
    torch.testing.assert_close(cache.layer(1)[0][0], cache.layer(1)[0][5])

    flat = KVCache.contiguous(config, max_num_seqs=2, max_model_len=32, dtype=torch.bfloat16)
    assert flat.block_size == 32 and flat.num_blocks == 2 and flat.dtype == torch.bfloat16
    meta = AttentionMetadata.build([6], [6], [[1]], block_size=32)
    flat.write(2, meta.slot_mapping, k, v)
    torch.testing.assert_close(flat.read(2, [1], 6)[0], k.bfloat16())


@pytest.mark.parametrize("overhead", [0, 10**9])
def test_sdpa_decode_buckets_match_reference(monkeypatch, overhead):
    """Decodes of very different context lengths, attended in several padded buckets (overhead 0) or one."""
    from executor.model import attention

    monkeypatch.setattr(attention, "BUCKET_OVERHEAD_TOKENS", overhead)
    query_lens, context_lens = [1] * 7 + [5], [3, 70, 9, 33, 1, 70, 17, 5]
    q, kp, vp, meta, logical = make_batch(query_lens, context_lens, 6, 2, block_size=4, seed=11)
    buckets = meta.decode_buckets
    assert (len(buckets) > 1) == (overhead == 0)
    assert sorted(i for rows, *_ in buckets for i in (rows.tolist() if rows is not None else range(7))) == list(range(7))
    assert rel_err(get_backend("sdpa")(q, kp, vp, meta), dense_reference(q, meta, logical)) < TOL


def test_buckets_minimise_padded_keys():
    from executor.model.attention import BUCKET_OVERHEAD_TOKENS, _buckets

    assert _buckets([], 16) == []
    assert _buckets([40, 39, 38], 16) == [(0, 3)]  # same width: one call
    lens = [4000, 3990, 20, 18, 17, 3]
    groups = _buckets(lens, 16)
    assert groups == [(0, 2), (2, 6)]  # the long pair apart from the short rest
    assert BUCKET_OVERHEAD_TOKENS > 0


def test_sdpa_decode_reads_a_contiguous_reservation_only_up_to_the_context():
    """A contiguous cache (one max_model_len block per sequence, mostly empty) attends the same as the
    dense reference: the keys past each context are garbage and must never count."""
    query_lens, context_lens = [1, 1, 1, 4], [3, 40, 17, 9]
    q, kp, vp, meta, logical = make_batch(query_lens, context_lens, 6, 2, block_size=0, seed=5, contiguous=True)
    garbage = torch.randn(kp.shape[0], 3 * kp.shape[1], *kp.shape[2:]) * 100
    kp, vp = torch.cat([kp, garbage], 1), torch.cat([vp, garbage], 1)  # a 160-token reservation each
    meta = AttentionMetadata.build(query_lens, context_lens, meta.block_tables, kp.shape[1])
    assert [w for *_, w in meta.decode_buckets] == [48]  # the longest context, aligned: not 160
    assert rel_err(get_backend("sdpa")(q, kp, vp, meta), dense_reference(q, meta, logical)) < TOL


@pytest.mark.parametrize("overhead", [0, 10**9])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_sdpa_batches_speculative_verify_rows(monkeypatch, overhead, num_heads, num_kv_heads):
    """Short multi-token rows (a last token and its drafts) of two query lengths, mixed with decodes and a
    long prefill, contexts far apart (several buckets with overhead 0): batched, they match the reference."""
    from executor.model import attention

    monkeypatch.setattr(attention, "BUCKET_OVERHEAD_TOKENS", overhead)
    query_lens = [1, 1, 5, 5, 5, 3, 3, 20]
    context_lens = [9, 64, 70, 6, 33, 12, 90, 41]
    q, kp, vp, meta, logical = make_batch(query_lens, context_lens, num_heads, num_kv_heads, block_size=4, seed=13)
    assert [(n, seqs) for n, seqs, *_ in meta.verify_groups] == [(3, [5, 6]), (5, [2, 3, 4])]
    assert rel_err(get_backend("sdpa")(q, kp, vp, meta), dense_reference(q, meta, logical)) < TOL


@pytest.mark.parametrize("overhead", [0, 10**9])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_sdpa_attends_a_steps_decodes_and_verify_rows_in_one_padded_call(monkeypatch, overhead, num_heads,
                                                                         num_kv_heads):
    """The engine marks its decode rows: verify rows of several lengths and plain decodes (one with a context
    shorter than the padding) attend as one group padded to the longest row; a short prompt chunk after them
    keeps its own group; the result matches the reference."""
    import dataclasses

    from executor.model import attention

    monkeypatch.setattr(attention, "BUCKET_OVERHEAD_TOKENS", overhead)
    query_lens = [1, 5, 1, 3, 5, 1, 4, 20]
    context_lens = [2, 70, 64, 12, 33, 90, 9, 41]
    q, kp, vp, meta, logical = make_batch(query_lens, context_lens, num_heads, num_kv_heads, block_size=4, seed=17)
    meta = dataclasses.replace(meta, num_decode_rows=6)
    groups = meta.verify_groups
    assert [(n, seqs) for n, seqs, *_ in groups] == [(5, [0, 1, 2, 3, 4, 5]), (4, [6])]
    assert int(groups[0][3].sum()) == sum(query_lens[:6]) and len(groups[0][2]) == 6 * 5
    assert rel_err(get_backend("sdpa")(q, kp, vp, meta), dense_reference(q, meta, logical)) < TOL

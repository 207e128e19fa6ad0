"""The static-shape decode step that CUDA graphs replay (executor/cuda_graph.py), run eagerly on the CPU: it
gives the engine's own greedy output under every policy, padding rows change nothing in the cache, and its
attention equals the sdpa backend's."""
from __future__ import annotations

import pytest
import torch

from executor.attention import AttentionMetadata, sdpa_attention
from executor.cuda_graph import DecodeGraphs, GraphMeta, graph_decode_attention
from executor.tiny import tiny_model
from sim.request import Request, Status
from tests.test_engine import POLICIES, make_engine, prompts, serve_all

WORK_LENS = [6, 11, 4, 9, 15, 3, 8, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


def run(model, policy, decode_graphs):
    cfg = dict(POLICIES[policy])
    engine = make_engine(model, num_blocks=cfg.pop("num_blocks", 64), swap_blocks=cfg.pop("swap_blocks", 0),
                         decode_graphs=decode_graphs, **cfg)
    reqs = serve_all(engine, list(zip(prompts(8), WORK_LENS)))
    assert all(r.status is Status.FINISHED for r in reqs)
    return [engine.output_ids(r) for r in reqs], engine


@pytest.mark.parametrize("policy", list(POLICIES))
def test_static_decode_step_gives_the_engines_output(model, policy):
    want, eager = run(model, policy, False)
    got, graphed = run(model, policy, True)
    assert got == want
    assert eager.graphs is None
    decode_only = sum(rec.num_prefill == 0 for rec in graphed.records)  # static batching's padding rows too
    assert graphed.graphs.replays == decode_only > 0
    if policy == "static":
        assert any(rec.num_padding and not rec.num_prefill for rec in graphed.records)


def test_padding_rows_leave_the_cache_as_the_eager_step_does(model):
    """3 rows padded to 4: the K/V written equal the eager step's, and nothing else in the pool changes."""
    eager, graphed = (make_engine(model, num_blocks=16, max_model_len=64, decode_graphs=g) for g in (False, True))
    for engine in (eager, graphed):
        for i, p in enumerate(prompts(3)):
            engine.add(Request(i, 0.0, len(p), 4), p)
        assert engine.step().num_prefill == 3  # all three prompts in one step
        before = engine.kv_cache.data.clone()
        engine.step()  # three plain decodes
        assert engine.records[-1].num_decode == 3 and engine.records[-1].num_prefill == 0
        engine.changed = (engine.kv_cache.data != before).any(dim=(0, 1, 4, 5))  # [blocks, slots]
    assert graphed.graphs.replays == 1 and graphed.graphs.batch_sizes[2] == 4
    assert torch.equal(eager.changed, graphed.changed) and int(graphed.changed.sum()) == 3
    torch.testing.assert_close(graphed.kv_cache.data, eager.kv_cache.data, rtol=1e-5, atol=1e-6)


def test_graph_attention_equals_sdpa_on_a_paged_cache():
    g = torch.Generator().manual_seed(0)
    blocks, bs, kvh, d, h = 12, 4, 2, 8, 6
    k_cache, v_cache = (torch.randn(blocks, bs, kvh, d, generator=g) for _ in range(2))
    ctx = [5, 13, 1]
    tables = [[3, 7], [0, 9, 2, 11], [5]]
    q = torch.randn(3, h, d, generator=g)
    meta = AttentionMetadata.build([1, 1, 1], ctx, tables, bs)
    want = sdpa_attention(q, k_cache, v_cache, meta)
    padded = torch.tensor([t + [t[0]] * (8 - len(t)) for t in tables])  # 8 blocks: up to 32 keys
    for width in (16, 32):
        got = graph_decode_attention(q, k_cache, v_cache,
                                     GraphMeta(meta.slot_mapping, padded, torch.tensor(ctx), bs, width))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_captured_shapes_cover_the_engine_limits(model):
    from executor.kv_cache import KVCache

    kv = KVCache.for_model(model.config, 300, 16)
    graphs = DecodeGraphs(model, kv, max_num_seqs=40, max_model_len=3000, capture=False)
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graphs.widths == [256, 512, 1024, 2048, 3008] and graphs.max_blocks == 188
    assert graphs.fits(40, [3000]) and not graphs.fits(41, [10]) and not graphs.fits(1, [3009])


def test_gemm_row_attention_gives_the_sdpa_output(model, monkeypatch):
    """Decode and verify rows attended through batched GEMMs (the GPU's path) give the engine's greedy output
    under every policy and with prompt-lookup drafts; masked_attention equals SDPA under a mask."""
    from executor import attention
    from executor.speculative import PromptLookup

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 20, 8, generator=g), torch.randn(2, 3, 20, 8, generator=g)
    mask = torch.rand(2, 1, 4, 20, generator=g) > 0.3
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(attention.masked_attention(q, k, v, mask, 0.3), want, rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(attention, "USE_NATIVE_ATTENTION", False)
    calls = []
    gemm_attention = attention.masked_attention
    monkeypatch.setattr(attention, "masked_attention", lambda *a: calls.append(a[0].shape) or gemm_attention(*a))
    runs = {}
    for gemm in (False, True):
        monkeypatch.setattr(attention, "GEMM_ROW_ATTENTION", gemm)
        runs[gemm] = [run(model, policy, False)[0] for policy in POLICIES]
        engine = make_engine(model, num_speculative_tokens=3)
        engine.drafter = PromptLookup(3, 1)
        reqs = serve_all(engine, [(p + p, n) for p, n in zip(prompts(8), WORK_LENS)])
        runs[gemm].append([engine.output_ids(r) for r in reqs])
        assert sum(rec.num_drafted for rec in engine.records) > 0
    assert runs[True] == runs[False]
    assert any(shape[2] > 2 for shape in calls) and any(shape[2] == 2 for shape in calls)  # verify rows, decodes

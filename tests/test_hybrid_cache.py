"""The hybrid KV cache (executor/model/hybrid_cache.py) and the attention of each kind over it
(executor/model/window_attention.py): sliding-window, chunked-local and sink attention over paged blocks against a
dense reference that keeps every key, and a chunked-local model whose allocator frees the chunks behind it serving
exactly what keeping every block serves."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine, run_offline
from executor.model.attention import AttentionMetadata
from executor.model.families import init_random
from executor.model.from_spec import model_spec
from executor.model.hybrid import HybridConfig, HybridModel
from executor.model.sampling import SamplingParams
from executor.model.window_attention import kind_attention
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.build import model_allocator
from sim.policy.scheduler import make_scheduler
from tests.test_executor_model import random_prompts


def dense_reference(q, k, v, positions, scale, kind, window, sinks):
    """Attention of queries q [n, H, D] at `positions` over every key k, v [L, kvh, D] of the sequence, masked by
    the kind's rule position by position."""
    h, kvh = q.shape[1], k.shape[1]
    out = torch.empty(q.shape[0], h, v.shape[-1])
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if kind == "sliding_window" else p // window * window if kind == "chunked_local" \
            else 0
        for head in range(h):
            kv = head // (h // kvh)
            scores = (k[lo:p + 1, kv] @ q[i, head]) * scale
            logits = scores if sinks is None else torch.cat([scores, sinks[head:head + 1]])
            weights = logits.softmax(0)[:scores.shape[0]]
            out[i, head] = weights @ v[lo:p + 1, kv]
    return out


@pytest.mark.parametrize("kind,window,sinks", [("full", 0, True), ("sliding_window", 5, False),
                                               ("sliding_window", 7, True), ("chunked_local", 6, False)])
def test_paged_kind_attention_equals_the_dense_reference(kind, window, sinks):
    """Rows of a packed step — decodes, a prompt chunk after cached context, a whole prompt — over shuffled 4-token
    blocks, each reading only its window's or chunk's blocks; stale values in the blocks the window left (as
    when another sequence reuses them) change nothing."""
    gen = torch.Generator().manual_seed(0)
    bs, kvh, h, d = 4, 2, 4, 8
    lens, news = [23, 9, 30, 17], [1, 1, 6, 17]  # context after the step, new tokens
    pool_k, pool_v = torch.randn(40, bs, kvh, d, generator=gen), torch.randn(40, bs, kvh, d, generator=gen)
    order = torch.randperm(40, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-c // bs))] for c in lens]
    sink = torch.randn(h, generator=gen) if sinks else None
    meta = AttentionMetadata.build(news, lens, tables, bs)
    q = torch.randn(sum(news), h, d, generator=gen)
    for i, c in enumerate(lens):
        lo = max(0, c - news[i] - window + 1) if kind == "sliding_window" else \
            (c - news[i]) // window * window if kind == "chunked_local" else 0
        for b in tables[i][:lo // bs]:  # blocks no query of this row attends: the allocator freed them
            pool_k[b], pool_v[b] = 1e4, -1e4
    out = kind_attention(q, pool_k, pool_v, meta, 0.3, kind, window, sink)
    for i, (c, n) in enumerate(zip(lens, news)):
        k = pool_k[tables[i]].flatten(0, 1)[:c]
        v = pool_v[tables[i]].flatten(0, 1)[:c]
        s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
        want = dense_reference(q[s:e], k, v, range(c - n, c), 0.3, kind, window, sink)
        torch.testing.assert_close(out[s:e], want, rtol=1e-5, atol=1e-5)


def chunked_model() -> HybridModel:
    """Llama-4's pattern at a tiny size: three chunked-local layers of 8-token chunks to one full layer."""
    config = HybridConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                          layer_types=("chunked_attention",) * 3 + ("full_attention",), attention_chunk_size=8)
    return init_random(HybridModel(config), seed=3)


def test_chunks_behind_are_freed_and_the_output_is_keeping_every_block_s():
    model = chunked_model()
    prompts, steps = random_prompts([21, 35, 13, 27], 300, seed=4), [22, 14, 30, 18]
    cfg = scheduler_config(256, max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=16,
                           prefill_chunk_size=16)
    kept = make_engine(model, make_scheduler(cfg, BlockAllocator(128, 4)), SamplingParams())
    expected = [kept.output_ids(r) for r in run_offline(kept, prompts, steps)]
    alloc = model_allocator(model_spec(model.config), 40, 4, 256, 16)
    engine = make_engine(model, make_scheduler(cfg, alloc), SamplingParams())
    assert [engine.output_ids(r) for r in run_offline(engine, prompts, steps)] == expected
    # three chunked groups each held at most a chunk and a step's tokens, the full group every block
    assert alloc.window_frees > 0 and alloc.peak_by_kind["chunked_local"] / 3 < alloc.peak_by_kind["full"] / 2
    layout = engine.kv_cache.layout
    assert layout.kinds == (("chunked_local", 8), ("full", 0)) and layout.group_size == 1  # 3 chunked groups, 1 full
    assert [s.slot for s in layout.layers] == [0, 0, 0, 0] and [s.group for s in layout.layers] == [0, 1, 2, 0]


def test_a_linear_state_needs_the_hybrid_allocator():
    from executor.model.families import tiny_twin

    with pytest.raises(ValueError, match="linear-attention layers keep a state"):
        tiny_twin("qwen3_next").make_cache(BlockAllocator(8, 16), 8, torch.float32, "cpu")

"""The static-shape steps that CUDA graphs replay (executor/model/cuda_graph.py), run eagerly on the CPU: they give the
engine's own greedy output under every policy, padding rows and padding prompt tokens change nothing in the cache,
and their attention equals the sdpa backend's."""
from __future__ import annotations

import pytest
import torch

from executor.model.attention import AttentionMetadata, sdpa_attention
from executor.model.cache_engine import KVCache
from executor.model.cuda_graph import (
    DecodeGraphs,
    GraphMeta,
    PromptGraphs,
    VerifyGraphs,
    graph_decode_attention,
    graph_prompt_attention,
    graph_verify_attention,
)
from executor.model.tiny import tiny_model
from sim.policy.request import Request, Status
from tests.test_engine import POLICIES, make_engine, prompts, serve_all

WORK_LENS = [6, 11, 4, 9, 15, 3, 8, 10]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


def run(model, policy, use_graphs):
    cfg = dict(POLICIES[policy])
    engine = make_engine(model, num_blocks=cfg.pop("num_blocks", 64), swap_blocks=cfg.pop("swap_blocks", 0),
                         use_graphs=use_graphs, **cfg)
    reqs = serve_all(engine, list(zip(prompts(8), WORK_LENS)))
    assert all(r.status is Status.FINISHED for r in reqs)
    return [engine.output_ids(r) for r in reqs], engine


@pytest.mark.parametrize("policy", list(POLICIES))
def test_static_steps_give_the_engines_output(model, policy):
    want, eager = run(model, policy, False)
    got, graphed = run(model, policy, True)
    assert got == want
    assert eager.graphs is None
    decode_only = sum(rec.num_prefill == 0 for rec in graphed.records)  # static batching's padding rows too
    prompt_only = [rec for rec in graphed.records if rec.num_prefill and not rec.num_decode and not rec.num_padding]
    lone = sum(len(rec.new_tokens) == 1 for rec in prompt_only)
    packed = sum(len(rec.new_tokens) > 1 and rec.new_tokens == rec.context_lens for rec in prompt_only)
    assert graphed.graphs.replays == {"decode": decode_only, "prompt": lone, "prompts": packed}
    assert decode_only > 0 and lone > 0
    if policy == "static":
        assert packed > 0  # a static batch's prompts prefill together
    if policy == "static":
        assert any(rec.num_padding and not rec.num_prefill for rec in graphed.records)


def changed_slots(engine, step):
    before = engine.kv_cache.data.clone()
    step()
    return (engine.kv_cache.data != before).any(dim=(0, 1, 4, 5))  # [blocks, slots]


def test_padding_rows_and_tokens_leave_the_cache_as_the_eager_step_does(model):
    """A 13-token prompt padded to 16 tokens, then 3 decode rows padded to 4: the K/V written equal the eager
    steps', and nothing else in the pool changes."""
    eager, graphed = (make_engine(model, num_blocks=16, max_model_len=64, use_graphs=g) for g in (False, True))
    changed = {}
    for name, engine in (("eager", eager), ("graphed", graphed)):
        p = prompts(3)
        engine.add(Request(0, 0.0, 13, 4), (p[1] + p[2])[:13])
        changed[name, "prompt"] = changed_slots(engine, engine.step)
        for i in (1, 2):
            engine.add(Request(i, 0.0, len(p[0]) + i, 4), (p[0] + p[1])[:len(p[0]) + i])
        assert engine.step().num_prefill == 2  # both prompts in one step (eager)
        changed[name, "decode"] = changed_slots(engine, engine.step)
        assert engine.records[-1].num_decode == 3 and engine.records[-1].num_prefill == 0
    assert graphed.graphs.replays == {"decode": 1, "prompt": 1, "prompts": 1}
    assert graphed.graphs.prompt.prompt_sizes[0] == 16 and graphed.graphs.decode.batch_sizes[2] == 4
    for kind, slots in (("prompt", 13), ("decode", 3)):
        assert torch.equal(changed["eager", kind], changed["graphed", kind])
        assert int(changed["graphed", kind].sum()) == slots
    torch.testing.assert_close(graphed.kv_cache.data, eager.kv_cache.data, rtol=1e-5, atol=1e-6)


def test_packed_prompts_attend_only_within_their_own_prompt():
    """Three whole prompts packed, padded with copies of the last token that are no one's key: each token's output
    equals SDPA's for its own prompt (keys read back from the slots the step wrote), the padding's the last
    token's."""
    from executor.model.cuda_graph import graph_packed_prompt_attention

    k_cache, v_cache, g = paged_cache(3)
    lens, tables = [5, 3, 6], [[2, 7], [4], [9, 1]]
    meta = AttentionMetadata.build(lens, lens, tables, 4)
    q = torch.randn(sum(lens), 6, 8, generator=g)
    want = sdpa_attention(q, k_cache, v_cache, meta)
    pad = [13] * 2  # two padding tokens repeating the last one
    index = list(range(sum(lens))) + pad
    seq = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)] + [-3, -3])  # padding: no one's key
    got = graph_packed_prompt_attention(q[index], k_cache, v_cache, GraphMeta(
        meta.slot_mapping[index], torch.zeros(0, 1, dtype=torch.long), seq, 4, 0, meta.positions()[index]))
    torch.testing.assert_close(got[:sum(lens)], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[sum(lens):], want[-1:].expand(2, -1, -1), rtol=1e-5, atol=1e-6)


def paged_cache(seed=0, blocks=12, bs=4, kvh=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, bs, kvh, d, generator=g), torch.randn(blocks, bs, kvh, d, generator=g), g


def test_graph_decode_attention_equals_sdpa_on_a_paged_cache():
    k_cache, v_cache, g = paged_cache()
    ctx, tables = [5, 13, 1], [[3, 7], [0, 9, 2, 11], [5]]
    q = torch.randn(3, 6, 8, generator=g)
    meta = AttentionMetadata.build([1, 1, 1], ctx, tables, 4)
    want = sdpa_attention(q, k_cache, v_cache, meta)
    padded = torch.tensor([t + [t[0]] * (8 - len(t)) for t in tables])  # 8 blocks: up to 32 keys
    for width in (16, 32):
        got = graph_decode_attention(q, k_cache, v_cache, GraphMeta(meta.slot_mapping, padded, torch.tensor(ctx), 4,
                                                                    width))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("query_len", [13, 5])  # a whole prompt, a chunk after 8 cached tokens
def test_graph_prompt_attention_equals_sdpa_on_a_paged_cache(query_len):
    k_cache, v_cache, g = paged_cache(1)
    table = [4, 10, 1, 6]
    q = torch.randn(query_len, 6, 8, generator=g)
    meta = AttentionMetadata.build([query_len], [13], [table], 4)
    want = sdpa_attention(q, k_cache, v_cache, meta)
    for width in (16, 32):
        got = graph_prompt_attention(q, k_cache, v_cache, GraphMeta(
            meta.slot_mapping, torch.tensor([table + [0] * 4]), torch.tensor([13]), 4, width, meta.positions()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma", [3, 5])
def test_verify_steps_give_the_engines_output(model, gamma):
    """Decode steps whose rows carry prompt-lookup drafts (some rows none, others up to gamma), each row padded at
    its front to gamma + 1 slots: the greedy output of the eager verify path, and the cache it leaves."""
    from executor.speculative.ngram import PromptLookup

    work = [(p + p[:5] + p, n) for p, n in zip(prompts(8), WORK_LENS)]  # repeats, so that lookups find drafts
    runs = {}
    for graphs in (False, True):
        engine = make_engine(model, num_speculative_tokens=gamma, max_model_len=256, max_num_batched_tokens=128,
                             prefill_chunk_size=128, use_graphs=graphs,
                             drafter=PromptLookup(3, 1))
        reqs = serve_all(engine, work)
        runs[graphs] = [engine.output_ids(r) for r in reqs], engine
    (want, eager), (got, graphed) = runs[False], runs[True]
    assert got == want
    verify = [rec for rec in graphed.records if rec.num_drafted and not rec.num_prefill]
    assert graphed.graphs.replays["verify"] == len(verify) > 5
    assert any(len(set(rec.new_tokens)) > 1 for rec in verify)  # rows with different draft counts in one step
    torch.testing.assert_close(graphed.kv_cache.data, eager.kv_cache.data, rtol=1e-5, atol=1e-6)


def test_graph_verify_attention_equals_sdpa_on_a_paged_cache():
    k_cache, v_cache, g = paged_cache(2)
    query_lens, ctx, tables = [3, 1, 2], [9, 5, 13], [[3, 7, 2], [0, 9], [5, 1, 8, 11]]
    q = torch.randn(sum(query_lens), 6, 8, generator=g)
    meta = AttentionMetadata.build(query_lens, ctx, tables, 4, num_decode_rows=3)
    want = sdpa_attention(q, k_cache, v_cache, meta)
    n = 4  # every row padded at its front to 4 slots repeating its first token
    index = [meta.cu_query_lens[i] + max(0, j - (n - ql)) for i, ql in enumerate(query_lens) for j in range(n)]
    pos = torch.tensor([c - ql + max(0, j - (n - ql)) for ql, c in zip(query_lens, ctx) for j in range(n)])
    padded = torch.tensor([t + [0] * (8 - len(t)) for t in tables])
    keep = [i * n + j for i, ql in enumerate(query_lens) for j in range(n - ql, n)]
    for width in (16, 32):
        got = graph_verify_attention(q[index], k_cache, v_cache, GraphMeta(
            meta.slot_mapping[index], padded, torch.tensor(ctx), 4, width, pos))
        torch.testing.assert_close(got[keep], want, rtol=1e-5, atol=1e-6)


def test_captured_shapes_cover_the_engine_limits(model):
    kv = KVCache.for_model(model.config, 300, 16)
    decode = DecodeGraphs(model, kv, max_model_len=3000, max_num_seqs=40)
    assert decode.batch_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode.widths == [256, 512, 1024, 2048, 3008] and decode.max_blocks == 188
    assert decode.fits(40, [3000]) and not decode.fits(41, [10]) and not decode.fits(1, [3009])
    assert (40, 256) in decode.shapes() and len(decode.shapes()) == 8 * 5
    prompt = PromptGraphs(model, kv, max_model_len=3000, max_num_batched_tokens=600)
    assert prompt.prompt_sizes == [16, 32, 64, 128, 256, 512, 600]
    assert prompt.fits(600, 3000) and not prompt.fits(601, 601)
    assert (600, 3008) in prompt.shapes() and (512, 256) not in prompt.shapes()
    verify = VerifyGraphs(model, kv, max_model_len=3000, max_num_seqs=40, n=5)
    assert (40, 3008) in verify.shapes() and verify.fits([5, 1], [9, 9]) and not verify.fits([6], [9])
    assert verify.hidden.shape[0] == 200 and verify.tokens(8) == 40


def test_graph_sets_are_shared_by_the_limits_that_shape_them(model):
    """Off the GPU nothing is cached; the sets an engine gets follow its limits (a verify set only with a chain
    drafter and num_speculative_tokens)."""
    from executor.speculative.ngram import PromptLookup

    plain = make_engine(model, use_graphs=True, max_num_seqs=8)
    assert plain.graphs.verify is None and plain.graphs.decode.batch_sizes[-1] == 8
    assert plain.graphs.prompt.prompt_sizes[-1] == 64  # make_engine's token budget
    spec = make_engine(model, use_graphs=True, num_speculative_tokens=3, drafter=PromptLookup(3, 1))
    assert spec.graphs.verify.n == 4 and "_graph_sets" not in model.__dict__


def test_gemm_row_attention_gives_the_sdpa_output(model, monkeypatch):
    """Decode and verify rows attended through batched GEMMs (the GPU's path) give the engine's greedy output
    under every policy and with prompt-lookup drafts; masked_attention equals SDPA under a mask."""
    from executor.model import attention
    from executor.speculative.ngram import PromptLookup

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


def test_cached_sets_are_shared_and_do_not_keep_a_cache_alive(monkeypatch):
    """On a GPU the sets are cached on the model by the limits that shape them and the cache's address (capture
    stubbed here): the same limits share a set, the prompt sets do not depend on max_num_seqs, and a cached set
    holds its KV cache weakly, so a finished engine's cache is freed and the next one can take its address."""
    import dataclasses
    import gc
    import weakref

    from executor.model.cuda_graph import GraphSet, step_graphs
    from sim.config.plan import scheduler_config

    monkeypatch.setattr(GraphSet, "capture", lambda self, scratch_slot=0: self)
    net = tiny_model(seed=6, num_layers=1, vocab_size=64)
    kv = KVCache.for_model(net.config, 32, 4)
    cfg = scheduler_config(64, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = step_graphs(net, kv, cfg), step_graphs(net, kv, cfg)
    c = step_graphs(net, kv, dataclasses.replace(cfg, max_num_seqs=8))
    assert a.decode is b.decode and a.prompt is b.prompt and c.decode is not a.decode and c.prompt is a.prompt
    assert c.prompts is a.prompts and len(net.__dict__["_graph_sets"]) == 4
    freed = weakref.ref(kv)
    del kv
    gc.collect()
    assert freed() is None


def test_a_failed_capture_is_one_line_with_the_way_out(monkeypatch):
    """Out of GPU memory (or an op that cannot be captured) while capturing: a one-line error on the scenario key
    that turns the graphs off, not a traceback."""
    from executor.model.cuda_graph import GraphSet, step_graphs
    from sim.config.errors import ConfigError
    from sim.config.plan import scheduler_config

    def fail(self, scratch_slot=0):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(GraphSet, "capture", fail)
    net = tiny_model(seed=7, num_layers=1, vocab_size=64)
    with pytest.raises(ConfigError) as e:
        step_graphs(net, KVCache.for_model(net.config, 32, 4), scheduler_config(64, max_num_seqs=4))
    assert e.value.key_path == "executor.cuda_graphs" and "\n" not in e.value.message
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in e.value.message and "cuda_graphs: false" in e.value.message

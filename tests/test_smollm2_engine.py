"""The real SmolLM2-135M through the engine: continuous batching with paged KV (and chunked prefill),
prompts of different lengths arriving at different steps, gives token for token the greedy output
of transformers' generate — also through the static-shape steps that CUDA graphs replay on a GPU."""
from __future__ import annotations

import pytest
import torch

from executor.core.engine import Engine, SamplingParams
from executor.core.prompts import corpus_ids, prompt_ids
from executor.model.cache_engine import KVCache
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from executor.model.weights import load_hf_model, load_transformers_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, hf_config, tokenizer = load_hf_model(path)
    hf, _ = load_transformers_model(str(path.parent), path.name)
    return model, hf, tokenizer


@pytest.fixture(scope="module")
def generated(smollm2):
    """Four prompts of different lengths and transformers' greedy output for each (computed once for every variant)."""
    _, hf, tokenizer = smollm2
    corpus = corpus_ids(tokenizer)
    work = [(prompt_ids(corpus, n, i), m) for i, (n, m) in enumerate([(7, 12), (85, 10), (30, 16), (160, 8)])]
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p, m in work]
    return work, refs


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("graphs", [False, True])  # True: the CUDA graphs' static-shape steps, run eagerly here
def test_continuous_paged_greedy_equals_generate(smollm2, generated, chunked, graphs):
    model = smollm2[0]
    work, refs = generated
    cfg = scheduler_config(512, max_num_batched_tokens=64 if chunked else 512,
                           prefill_chunk_size=64 if chunked else 512, enable_chunked_prefill=chunked)
    kv = BlockAllocator(48, 16)
    c = model.config
    engine = Engine(model, make_scheduler(cfg, kv), KVCache.for_model(c, 48, 16), SamplingParams(), use_graphs=graphs)
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(work)]
    step = 0
    while step < 4 or engine.scheduler.has_work():
        if step < len(reqs):  # one new request per step, joining a running batch
            engine.add(reqs[step], work[step][0])
        engine.step()
        step += 1
    for r, (p, _), ref in zip(reqs, work, refs):
        assert r.status is Status.FINISHED
        assert engine.output_ids(r) == ref, f"request {r.id} ({len(p)}-token prompt)"
    assert max(len(rec.new_tokens) for rec in engine.records) >= 3  # they really ran together
    if graphs:
        assert engine.graphs.replays["decode"] > 0 and engine.graphs.replays["prompt"] > 0


def test_prompt_lookup_verify_steps_through_graph_shapes_equal_plain_decoding(smollm2):
    """Prompt lookup (γ 10) with its verify steps (and the three prompts, packed) through the CUDA graphs' static
    shapes (run eagerly here) gives plain greedy decoding's output on prompts that repeat themselves."""
    from executor.speculative.ngram import PromptLookup

    model, _, tokenizer = smollm2
    corpus = corpus_ids(tokenizer)
    work = [((prompt_ids(corpus, n, i) * 2)[:n], m) for i, (n, m) in enumerate([(60, 24), (140, 30), (90, 20)])]
    outs = {}
    for spec in (False, True):
        cfg = scheduler_config(512, max_num_batched_tokens=512, num_speculative_tokens=10 if spec else 0)
        engine = Engine(model, make_scheduler(cfg, BlockAllocator(48, 16)), KVCache.for_model(model.config, 48, 16),
                        SamplingParams(), drafter=PromptLookup(3, 1) if spec else None, use_graphs=spec)
        reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(work)]
        for r, (p, _) in zip(reqs, work):
            engine.add(r, p)
        while engine.scheduler.has_work():
            engine.step()
        outs[spec] = [engine.output_ids(r) for r in reqs]
    assert outs[True] == outs[False]
    assert engine.graphs.replays["verify"] > 3 and sum(r.num_accepted for r in reqs) > 10
    assert engine.graphs.replays["prompts"] == 1  # the three prompts, packed in one step

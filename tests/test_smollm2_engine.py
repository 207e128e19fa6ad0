"""The real SmolLM2-135M through the engine: continuous batching with paged KV (and chunked prefill),
prompts of different lengths arriving at different steps, gives token for token the greedy output
of transformers' generate."""
from __future__ import annotations

import pytest
import torch

from executor.engine import Engine, SamplingParams
from executor.kv_cache import KVCache
from executor.prompts import corpus_ids, prompt_ids
from sim.kv_cache import BlockAllocator
from sim.request import Request, Status
from sim.scheduler import SchedulerConfig, make_scheduler

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from executor.weights import load_hf_model, load_transformers_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, hf_config, tokenizer = load_hf_model(path)
    hf, _ = load_transformers_model(str(path.parent), path.name)
    return model, hf, tokenizer


@pytest.mark.parametrize("chunked", [False, True])
def test_continuous_paged_greedy_equals_generate(smollm2, chunked):
    model, hf, tokenizer = smollm2
    corpus = corpus_ids(tokenizer)
    work = [(prompt_ids(corpus, n, i), m) for i, (n, m) in enumerate([(7, 12), (85, 10), (30, 16), (160, 8)])]
    cfg = SchedulerConfig(max_num_batched_tokens=64 if chunked else 512, prefill_chunk_size=64 if chunked else 512,
                          enable_chunked_prefill=chunked, max_model_len=512)
    kv = BlockAllocator(48, 16)
    c = model.config
    engine = Engine(model, make_scheduler(cfg, kv), KVCache.for_model(c, 48, 16), SamplingParams())
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(work)]
    step = 0
    while step < 4 or engine.scheduler.has_work():
        if step < len(reqs):  # one new request per step, joining a running batch
            engine.add(reqs[step], work[step][0])
        engine.step()
        step += 1
    for r, (p, m) in zip(reqs, work):
        assert r.status is Status.FINISHED
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert engine.output_ids(r) == ref, f"request {r.id} ({len(p)}-token prompt)"
    assert max(len(rec.new_tokens) for rec in engine.records) >= 3  # they really ran together

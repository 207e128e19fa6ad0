"""The executor's engine on a tiny random-weight model: exact greedy outputs under every policy."""
from __future__ import annotations

import pytest
import torch

from executor.core.engine import Engine, SamplingParams
from executor.model.cache_engine import KVCache
from executor.model.tiny import tiny_model, to_transformers
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy continuation by transformers' generate, one prompt at a time."""
    hf = to_transformers(model)
    cache = {}

    def ref(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                              pad_token_id=0, eos_token_id=None)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]
    return ref


def make_engine(model, num_blocks=64, block_size=4, swap_blocks=0, device="cpu", use_graphs=None, drafter=None,
                kv_dtype=None, **cfg):
    cfg = {"max_num_batched_tokens": 64, "max_model_len": 128, "prefill_chunk_size": 64, **cfg}
    contiguous = cfg.pop("contiguous", False)
    if contiguous:
        block_size = cfg["max_model_len"]
    kv = BlockAllocator(num_blocks, block_size, num_swap_blocks=swap_blocks, contiguous=contiguous)
    sched = make_scheduler(scheduler_config(cfg.pop("max_model_len"), **cfg), kv)
    c = model.config
    host = KVCache(c.num_layers, swap_blocks, block_size, c.num_kv_heads, c.head_dim) if swap_blocks else None
    cache = KVCache.for_model(c, num_blocks, block_size, device=device, kv_dtype=kv_dtype)
    return Engine(model, sched, cache, SamplingParams(), host_cache=host, use_graphs=use_graphs, drafter=drafter)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 9, 30, 5, 12, 22, 7][:n]
    return [torch.randint(3, 256, (L,), generator=g).tolist() for L in lens]


def serve_all(engine, work, arrive_every=2):
    """Submit work = [(prompt, max_tokens)] one every `arrive_every` steps; run to completion."""
    reqs = [Request(i, 0.0, len(p), n) for i, (p, n) in enumerate(work)]
    pending = list(zip(reqs, work))
    steps = 0
    while pending or engine.scheduler.has_work():
        if pending and steps % arrive_every == 0:
            r, (p, _) = pending.pop(0)
            engine.add(r, p)
        engine.step()
        steps += 1
        assert steps < 5000
    return reqs


POLICIES = {
    "continuous_paged": {},
    "chunked_prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 8, "prefill_chunk_size": 8},
    "contiguous": {"contiguous": True, "num_blocks": 4},
    "static": {"batching": "static", "batch_size": 3},
    "recompute_preemption": {"num_blocks": 12},
    "swap_preemption": {"num_blocks": 12, "preemption": "swap", "swap_blocks": 32},
    "tgi_gate": {"waiting_served_ratio": 1.5, "max_waiting_tokens": 3},
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_output_equals_transformers_generate(model, reference, policy):
    cfg = dict(POLICIES[policy])
    engine = make_engine(model, num_blocks=cfg.pop("num_blocks", 64), swap_blocks=cfg.pop("swap_blocks", 0), **cfg)
    work = [(p, n) for p, n in zip(prompts(8), [6, 11, 4, 9, 15, 3, 8, 10])]
    reqs = serve_all(engine, work)
    for r, (p, n) in zip(reqs, work):
        assert r.status is Status.FINISHED
        assert engine.output_ids(r) == reference(p, n), f"request {r.id}"
        assert len(r.token_times) == n and r.token_times == sorted(r.token_times)
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks
    if "preemption" in policy:
        assert engine.scheduler.num_preemptions > 0
    if policy == "swap_preemption":
        assert any(rec.swapped_blocks for rec in engine.records)


def test_rejected_requests_are_counted_not_run(model):
    engine = make_engine(model, max_model_len=32)
    too_long = Request(0, 0.0, 30, 10)
    assert not engine.add(too_long, list(range(3, 33)))
    assert too_long.status is Status.REJECTED and "max_model_len" in too_long.reject_reason
    assert engine.step() is None


def test_sampling_is_seeded_and_respects_top_k(model):
    outs = []
    for seed in (1, 1, 2):
        engine = make_engine(model)
        engine.sampling = SamplingParams(temperature=1.0, top_k=5, seed=seed)
        engine.__post_init__()
        reqs = serve_all(engine, [(prompts(1)[0], 12)])
        outs.append(engine.output_ids(reqs[0]))
    assert outs[0] == outs[1] and outs[0] != outs[2]

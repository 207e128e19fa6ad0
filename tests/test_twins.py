"""Tiny random-weight twins of gpt-oss (sinks, alternating sliding-window and full layers, top-k-softmax routing,
clamped SwiGLU experts with biases, YaRN), Qwen3-Next (Gated DeltaNet layers with their convolution and recurrent
state, gated full attention with q/k norms and partial rotary, experts with a gated shared expert) and DeepSeek-V2
(latent attention: decompressed for prompts, absorbed for decode; group-limited routing; a dense first layer),
executed by infersim's engine over the hybrid KV cache: the same logits and the same greedy tokens as transformers'
own implementation of each config, through mixed prefill and decode, chunked prefill, prefix-cache hits and
preemption (recompute and swap)."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine, run_offline
from executor.model import families
from executor.model.families import tiny_twin, to_transformers
from executor.model.from_spec import model_spec
from executor.model.hybrid import HybridModel
from executor.model.sampling import SamplingParams
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.build import model_allocator
from sim.policy.request import Request
from sim.policy.scheduler import make_scheduler
from tests.test_executor_model import hf_greedy, random_prompts, rel_err

TOL = 1e-4
PROMPTS = random_prompts([9, 17, 4, 23, 12, 40], 300, seed=5)
STEPS = [10, 6, 12, 8, 9, 14]
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "prefill_chunk_size": 16}
# prompts that share a 32-token system prompt: a later one finds its blocks (and a linear layer's states) cached
SHARED = [PROMPTS[5][:32] + p for p in random_prompts([5, 11, 8], 300, seed=9)]


def policy(model: HybridModel, num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = False,
           swap_blocks: int = 0, **knobs):
    """The scheduler and the allocator a plan makes for the twin (its KV groups by attention kind)."""
    cfg = scheduler_config(256, **{"max_num_seqs": 3, "max_num_batched_tokens": 256, **knobs})
    alloc = model_allocator(model_spec(model.config), num_blocks, block_size, 256, cfg.prefill_chunk_size,
                            prefix_caching, swap_blocks)
    return make_scheduler(cfg, alloc)


def serve(model: HybridModel, prompts, steps, **kw) -> tuple[list[list[int]], object]:
    """Greedy outputs of the prompts, all queued at t=0 (with prefix caching, each with its blocks' content hashes:
    the allocator finds blocks of equal content), and the engine."""
    engine = make_engine(model, policy(model, **kw), SamplingParams(ignore_eos=False),
                         eos_token_id=model.config.eos_token_id)
    bs = engine.scheduler.kv.block_size
    reqs = [Request(i, 0.0, len(p), n) for i, (p, n) in enumerate(zip(prompts, steps))]
    for r, p in zip(reqs, prompts):
        if kw.get("prefix_caching"):  # as the simulator's requests get them (sim/policy/prefix.py)
            r.block_hashes = tuple(hash(tuple(p[:(j + 1) * bs])) for j in range(len(p) // bs))
        engine.add(r, p)
    while engine.has_work():
        engine.step()
    return [engine.output_ids(r) for r in reqs], engine


@pytest.fixture(scope="module", params=families.FAMILIES)
def twin(request):
    """(our twin, transformers' model of the family with the same weights, its greedy tokens for PROMPTS, SHARED)."""
    model = tiny_twin(request.param, seed=1)
    hf = to_transformers(model)
    return model, hf, [hf_greedy(hf, p, n)[0] for p, n in zip(PROMPTS, STEPS)], \
        [hf_greedy(hf, p, 8)[0] for p in SHARED]


def test_config_round_trips_through_transformers(twin):
    model, hf, _, _ = twin
    assert families.from_hf(hf.config) == model.config


def packed_logits(model: HybridModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt prefilled in one packed step over blocks the twin's allocator hands out; logits per position."""
    kv = policy(model, num_blocks=128).kv
    reqs = [Request(i, 0.0, len(p), 1) for i, p in enumerate(prompts)]
    for r in reqs:
        kv.allocate(r, r.prompt_len)
    cache = model.make_cache(kv, kv.num_blocks, torch.float32, "cpu")
    lens = [len(p) for p in prompts]
    meta = cache.step_metadata(lens, lens, [r.group_tables or r.block_table for r in reqs])
    logits = model.compute_logits(model(torch.tensor([t for p in prompts for t in p]), meta.positions(), meta, cache))
    return [logits[s:e] for s, e in zip(meta.cu_query_lens, meta.cu_query_lens[1:])]


def test_logits_match_transformers(twin):
    model, hf, _, _ = twin
    with torch.no_grad():
        for p, ours in zip(PROMPTS[:4], packed_logits(model, PROMPTS[:4])):
            assert rel_err(ours, hf(torch.tensor([p])).logits[0]) < TOL


@pytest.mark.parametrize("case", ["mixed", "chunked"])
def test_engine_greedy_is_transformers_generate(twin, case):
    """More requests than max_num_seqs: prompts join running decodes; chunked: 16-token chunks beside decodes."""
    model, _, expected, _ = twin
    got, _ = serve(model, PROMPTS, STEPS, **(CHUNKED if case == "chunked" else {}))
    assert got == expected


def test_prefix_cache_hits_give_the_same_tokens(twin):
    """With prefix caching (a linear layer's states kept at block boundaries), later prompts start from cached
    blocks and still decode transformers' tokens."""
    model, _, _, expected = twin
    got, engine = serve(model, SHARED, [8] * len(SHARED), prefix_caching=True, max_num_seqs=1, **CHUNKED)
    assert got == expected
    assert engine.scheduler.kv.hit_tokens >= 32


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests_resume_exactly(twin, preemption):
    model, _, expected, _ = twin
    # too few blocks for the six at once (Qwen3-Next's hold 16 tokens, raised for its state; DeepSeek's one layer
    # kind runs the plain allocator)
    blocks = {"gpt_oss": 40, "qwen3_next": 9, "deepseek_v2": 24}[model.config.family]
    got, engine = serve(model, PROMPTS, STEPS, num_blocks=blocks, swap_blocks=64, preemption=preemption,
                        max_num_seqs=6, **CHUNKED)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_sliding_window_blocks_are_freed_and_reused():
    """gpt-oss's sliding layers hold only their window: blocks that left it go back to the pool and other sequences
    write into them; the output is that of keeping every token (the plain allocator, vLLM's
    --disable-hybrid-kv-cache-manager)."""
    model = tiny_twin("gpt_oss", seed=2)
    prompts, steps = random_prompts([30, 25, 41, 19], 300, seed=3), [20, 24, 12, 30]
    kept_all = make_engine(model, make_scheduler(scheduler_config(256, max_num_seqs=4), BlockAllocator(128, 4)),
                           SamplingParams(ignore_eos=False), eos_token_id=model.config.eos_token_id)
    reference = [kept_all.output_ids(r) for r in run_offline(kept_all, prompts, steps)]
    got, engine = serve(model, prompts, steps, num_blocks=48, max_num_seqs=4)
    kv = engine.scheduler.kv
    assert kv.window_frees > 0 and kv.peak_by_kind["sliding_window"] < kv.peak_by_kind["full"]
    assert got == reference


def test_latent_attention_absorbed_equals_decompressed():
    """DeepSeek's decode rows attend absorbed (W_UK folded into the query, W_UV after); the same rows attended
    decompressed (every head's keys and values expanded) give the same output."""
    model = tiny_twin("deepseek_v2", seed=3)
    attn = model.layers[1].self_attn
    latents = torch.randn(6, 4, attn.latent_width)
    from executor.model.attention import AttentionMetadata

    meta = AttentionMetadata.build([1, 1], [13, 21], [[0, 1, 2, 3], [5, 4, 3, 2, 1, 0]], 4)
    q_nope, q_pe = torch.randn(2, attn.num_heads, attn.nope), torch.randn(2, attn.num_heads, attn.rope_dim)
    absorbed = attn.absorbed(q_nope, q_pe, latents, meta, [0, 1])
    for i in range(2):
        expanded = attn.decompressed(q_nope[i:i + 1], q_pe[i:i + 1], latents, meta, i)
        torch.testing.assert_close(absorbed[i:i + 1], expanded, rtol=1e-5, atol=1e-5)


def test_loads_a_checkpoint_transformers_wrote(tmp_path, twin):
    """save_pretrained's directory through the executor's loader (transformers reads it, the family maps it)."""
    from executor.model.weights import load_hf_model

    model, hf, _, _ = twin
    hf.save_pretrained(tmp_path)
    loaded, _, _ = load_hf_model(tmp_path)
    assert isinstance(loaded, HybridModel) and loaded.config == model.config
    for (k, theirs), ours in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(theirs, ours), k


def test_state_block_follows_the_allocator():
    """A linear layer reads the state block of its last computed token and writes the one of its last new token."""
    model = tiny_twin("qwen3_next", seed=4)
    sched = policy(model, prefix_caching=True, **CHUNKED)
    r = Request(0, 0.0, 40, 4)
    sched.kv.allocate(r, 32)
    meta = make_engine(model, sched).kv_cache.step_metadata([32], [32], [r.group_tables])
    linear = next(i for i, k in enumerate(sched.kv.kind_names) if k == "linear")
    slots = meta.states(linear, 0)
    assert slots.read == [-1] and slots.write == [r.group_tables[linear][-1][0]]

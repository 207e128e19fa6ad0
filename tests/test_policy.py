"""Scheduler and KV allocator objects on their own, stepped by hand (no SimPy, no torch)."""
from __future__ import annotations

import pytest

from sim.config.models import MODEL_CATALOG
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request, Status
from sim.policy.scheduler import Scheduler
from sim.policy.static_scheduler import StaticScheduler


def test_kv_bytes_llama2_7b_4096_tokens_is_2_gib():
    m = MODEL_CATALOG["Llama-2-7B"]
    assert m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert m.kv_bytes_per_token * 4096 == 2 * 2**30


def test_gqa_divides_kv_bytes_by_group_size():
    mha, gqa = MODEL_CATALOG["Llama-2-7B"], MODEL_CATALOG["Llama-3-8B"]
    assert mha.kv_bytes_per_token / gqa.kv_bytes_per_token == mha.num_heads / gqa.num_kv_heads == 4
    assert MODEL_CATALOG["SmolLM2-135M"].kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_catalog_param_counts_match_published_sizes():
    assert MODEL_CATALOG["Llama-2-7B"].num_params == pytest.approx(6.74e9, rel=0.01)
    assert MODEL_CATALOG["Llama-2-70B"].num_params == pytest.approx(69.0e9, rel=0.01)
    assert MODEL_CATALOG["Llama-3-8B"].num_params == pytest.approx(8.03e9, rel=0.01)
    assert MODEL_CATALOG["SmolLM2-135M"].num_params == pytest.approx(134.5e6, rel=0.01)


def drive(sched: Scheduler, max_steps: int = 100_000) -> list:
    """Step a scheduler by hand until idle; returns the batches. Checks block tables every step."""
    batches = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert batch, "work queued but nothing scheduled"
        check_blocks(sched)
        sched.complete_step(batch)
        batches.append(batch)
    return batches


def check_blocks(sched: Scheduler) -> None:
    """No block is owned twice, free + owned = all, and each running request has room for its tokens."""
    kv = sched.kv
    owned = [b for r in sched.running for b in r.block_table]
    assert len(owned) == len(set(owned))
    assert sorted(owned + kv.free_blocks) == list(range(kv.num_blocks))
    for r in sched.running:
        if r.status is Status.RUNNING:
            assert len(r.block_table) * kv.block_size >= min(r.num_computed + 1, r.prompt_len + r.max_tokens - 1) \
                or kv.contiguous


def make(num_blocks=64, block_size=4, **cfg):
    cfg.setdefault("max_num_batched_tokens", 256)
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("prefill_chunk_size", cfg["max_num_batched_tokens"])
    kv = BlockAllocator(num_blocks, block_size, num_swap_blocks=cfg.pop("swap_blocks", 0))
    return Scheduler(scheduler_config(cfg.pop("max_model_len"), **cfg), kv)


def reqs(spec):
    return [Request(i, 0.0, p, o) for i, (p, o) in enumerate(spec)]


def test_every_request_gets_exactly_its_tokens_and_frees_its_blocks():
    s = make()
    rs = reqs([(10, 5), (3, 1), (30, 12), (7, 20)])
    for r in rs:
        assert s.add(r)
    drive(s)
    assert all(r.status is Status.FINISHED and r.num_generated == r.max_tokens for r in rs)
    assert s.kv.num_free == s.kv.num_blocks


def test_rejections_have_reasons():
    s = make(num_blocks=8, block_size=4, max_model_len=64)
    too_long = Request(0, 0.0, 60, 10)
    too_big_for_cache = Request(1, 0.0, 30, 10)  # 39 tokens > 8 blocks x 4
    assert not s.add(too_long) and "max_model_len" in too_long.reject_reason
    assert not s.add(too_big_for_cache) and "KV cache" in too_big_for_cache.reject_reason
    assert too_long.status is too_big_for_cache.status is Status.REJECTED


def test_prefill_first_then_decode_batches_all_running():
    s = make()
    a, b = reqs([(8, 3), (8, 3)])
    s.add(a)
    first = s.schedule()
    assert [r for r, _ in first.prefill] == [a] and not first.decodes
    s.complete_step(first)
    s.add(b)
    second = s.schedule()  # b's prefill goes first (vLLM prioritizes prefills), a waits
    assert [r for r, _ in second.prefill] == [b] and not second.decodes
    s.complete_step(second)
    third = s.schedule()
    assert third.decode_only and set(third.decode) == {a, b}


def test_no_drafting_for_a_step_that_will_run_prompts_alone():
    """Speculative decoding without chunked prefill: while a waiting prompt can be admitted the next step runs
    it alone, so drafters are told not to draft; with chunked prefill decodes run beside prompts and draft."""
    s = make(num_speculative_tokens=3)
    a, b = reqs([(8, 6), (8, 6)])
    s.add(a)
    s.complete_step(s.schedule())
    assert s.drafting
    s.add(b)
    assert not s.drafting
    step = s.schedule()
    assert not step.decodes
    s.complete_step(step)
    assert s.drafting
    c = make(num_speculative_tokens=3, enable_chunked_prefill=True, max_num_batched_tokens=64, prefill_chunk_size=16)
    x, y = reqs([(8, 6), (8, 6)])
    c.add(x)
    c.complete_step(c.schedule())
    c.add(y)
    assert c.drafting and c.schedule().decodes


def test_recompute_preemption_takes_the_newest_and_everyone_finishes():
    s = make(num_blocks=10, block_size=4)
    rs = reqs([(8, 12), (8, 12), (8, 12)])
    for r in rs:
        s.add(r)
    drive(s)
    assert s.num_preemptions > 0
    assert rs[-1].num_preemptions > 0 and rs[0].num_preemptions == 0
    assert all(r.num_generated == 12 for r in rs)
    assert s.kv.num_free == 10


def test_swap_preemption_moves_blocks_to_host_and_back():
    s = make(num_blocks=10, block_size=4, preemption="swap", swap_blocks=16)
    rs = reqs([(8, 12), (8, 12), (8, 12)])
    for r in rs:
        s.add(r)
    batches = drive(s)
    assert s.num_preemptions > 0
    assert any(b.swapped_in for b in batches) and any(b.shape.swap_blocks for b in batches)
    assert all(r.num_generated == 12 for r in rs)
    assert s.kv.num_free_swap_blocks == 16 and s.kv.num_free == 10


def test_chunked_prefill_splits_long_prompt_and_keeps_decoding():
    s = make(enable_chunked_prefill=True, max_num_batched_tokens=16, prefill_chunk_size=16)
    short, long_ = reqs([(4, 30), (100, 2)])
    s.add(short)
    s.complete_step(s.schedule())
    s.add(long_)
    chunks = []
    while long_.num_generated == 0:
        b = s.schedule()
        assert b.shape.num_new_tokens <= 16
        assert short in s.decoding  # the decode keeps running beside the chunks
        chunks += [n for r, n in b.prefill if r is long_]
        s.complete_step(b)
    assert sum(chunks) == 100 and max(chunks) == 15  # 16-token budget minus the decode's token


def test_waiting_served_ratio_holds_prefills_until_enough_wait():
    s = make(waiting_served_ratio=2.0)
    running = reqs([(4, 50), (4, 50)])
    for r in running:
        s.add(r)
    s.complete_step(s.schedule())
    late = Request(9, 0.0, 4, 5)
    s.add(late)
    b = s.schedule()  # 1 waiting < 2.0 x 2 running: keep decoding
    assert b.decode_only and late.status is Status.WAITING
    s.complete_step(b)
    for i in range(3):
        s.add(Request(10 + i, 0.0, 4, 5))
    b = s.schedule()  # 4 waiting ≥ 4: prefill them
    assert len(b.prefill) == 4 and not b.decodes


def test_max_waiting_tokens_forces_the_prefill():
    s = make(waiting_served_ratio=10.0, max_waiting_tokens=3)
    s.add(Request(0, 0.0, 4, 50))
    s.complete_step(s.schedule())
    late = Request(1, 0.0, 4, 5)
    s.add(late)
    kinds = []
    for _ in range(5):
        b = s.schedule()
        kinds.append("prefill" if b.prefill else "decode")
        s.complete_step(b)
    assert kinds[:4] == ["decode", "decode", "decode", "prefill"]


def test_contiguous_reserves_max_model_len_per_request():
    kv = BlockAllocator(num_blocks=3, block_size=256, contiguous=True)
    s = Scheduler(scheduler_config(256, max_num_batched_tokens=256, prefill_chunk_size=256), kv)
    rs = reqs([(5, 5)] * 5)
    for r in rs:
        s.add(r)
    b = s.schedule()
    assert len(b.prefill) == 3 and kv.num_free == 0  # three slots, however short the requests
    s.complete_step(b)
    drive(s)
    assert all(r.num_generated == 5 for r in rs)


def test_static_batch_pads_and_holds_rows_until_the_longest_ends():
    kv = BlockAllocator(num_blocks=100, block_size=4)
    s = StaticScheduler(scheduler_config(256, batching="static", batch_size=2), kv)
    a, b, c = reqs([(4, 2), (10, 6), (3, 3)])
    for r in (a, b, c):
        s.add(r)
    first = s.schedule()
    assert first.shape.num_seqs == 2 and first.shape.num_new_tokens == 4 + 10  # prompts unpadded
    s.complete_step(first)
    for _ in range(5):  # b's remaining 5 tokens; a's row keeps computing padding after a finished
        bt = s.schedule()
        assert bt.shape.num_seqs == 2 and bt.decode_only  # a finished row still computes padding
        assert bt.shape.sum_context == 4 + 10 + 2 * (len(b.token_times) + b.num_generated)
        if a.status is Status.FINISHED and b.status is Status.RUNNING:
            assert len(a.block_table) > 0  # a's row holds its memory until the batch is released
        s.complete_step(bt)
    assert a.status is Status.FINISHED and b.status is Status.FINISHED and c.status is Status.WAITING
    assert kv.num_free == 100
    nxt = s.schedule()
    assert [r for r, _ in nxt.prefill] == [c] and nxt.shape.num_seqs == 1
    s.complete_step(nxt)
    drive(s)
    assert c.num_generated == 3 and kv.num_free == 100

"""Prefix caching (vLLM's automatic prefix caching) in the shared policy, the simulator and the executor."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario, scheduler_config
from sim.config.workload import RequestSpec
from sim.policy.block_manager import PrefixCachingAllocator
from sim.policy.prefix import PrefixHashes, request_maker
from sim.policy.request import Request, Status
from sim.policy.scheduler import make_scheduler
from tests.helpers import plan_of, run, scenario, tiny_checkpoint, write_tiny_scenario
from tests.test_kv_invariants import SchedulerMachine

SHARED = {"arrival": {"process": "poisson", "rate": 8.0}, "num_requests": 300,
          "prompt_len": {"dist": "uniform", "min": 1500, "max": 2500},
          "output_len": {"dist": "uniform", "min": 50, "max": 150},
          "shared_prefix": {"prefix_len": 1024, "num_prefixes": 4}}


def check_shared_blocks(kv: PrefixCachingAllocator, holders: list[Request]) -> None:
    """Every block's references are the tables holding it; the free ones are those nobody holds; a block
    registered under a hash holds that content for every request that has it where its hashes reach."""
    count = [0] * kv.num_blocks
    for r in holders:
        for b in r.block_table:
            count[b] += 1
    assert count == kv.ref, "reference counts are not the tables' holdings"
    assert kv.shared_refs == sum(c - 1 for c in count if c > 1)
    assert len(kv.free_blocks) == count.count(0), "free blocks are not the unreferenced ones"
    assert kv.num_used + kv.num_free == kv.num_blocks
    assert {b: h for h, b in kv.cached.items()} == kv.hash_of
    for r in holders:
        for j, b in enumerate(r.block_table[:len(r.block_hashes)]):
            if b in kv.hash_of and j < r.num_computed // kv.block_size:
                assert kv.hash_of[b] == r.block_hashes[j], "a block shared between different prompt contents"


def make_request(i: int, prompt: int, output: int, prefix: int, block_size: int) -> Request:
    spec = RequestSpec(i, 0.0, prompt, output, (prefix,), 24)
    return request_maker(True, block_size, 1 << 20)(spec)


def test_a_second_prompt_of_the_same_prefix_computes_only_its_own_part():
    cfg = scheduler_config(256, max_num_seqs=4, max_num_batched_tokens=256)
    kv = PrefixCachingAllocator(32, 4)
    sched = make_scheduler(cfg, kv)
    first, second, other = (make_request(i, 40, 3, p, 4) for i, p in enumerate((0, 0, 1)))
    sched.add(first)
    batch = sched.schedule()
    assert batch.prefill == [(first, 40)]
    sched.complete_step(batch)
    sched.add(second)
    sched.add(other)
    batch = sched.schedule()
    # 24 shared tokens = 6 blocks of 4: the second prompt's first 6 blocks are the first's
    assert batch.prefill == [(second, 16), (other, 40)]
    assert second.block_table[:6] == first.block_table[:6] and other.block_table[0] not in first.block_table
    assert kv.hit_tokens == 24 and kv.queried_tokens == 3 * 40
    check_shared_blocks(kv, [first, second, other])


def test_freed_prefixes_stay_until_their_blocks_are_needed():
    """A finished request's prefix blocks are free but still found; handed out again (least recently freed
    first), they are forgotten."""
    cfg = scheduler_config(256, max_num_seqs=4, max_num_batched_tokens=256)
    kv = PrefixCachingAllocator(16, 4)
    sched = make_scheduler(cfg, kv)
    a = make_request(0, 30, 1, 0, 4)
    sched.add(a)
    sched.complete_step(sched.schedule())
    assert a.status is Status.FINISHED and kv.num_free == 16 and len(kv.cached) == 6
    b = make_request(1, 30, 1, 0, 4)
    sched.add(b)
    batch = sched.schedule()
    assert batch.prefill == [(b, 6)] and kv.num_free == 16 - 8
    sched.complete_step(batch)
    big = Request(2, 0.0, 60, 1)  # 15 of the 16 blocks: the prefix's, freed tail first, go but its first block
    sched.add(big)
    sched.complete_step(sched.schedule())
    assert len(kv.cached) == 1
    c = make_request(3, 30, 1, 0, 4)
    sched.add(c)
    assert sched.schedule().prefill == [(c, 26)]


def test_a_prompt_found_whole_still_computes_its_last_token():
    cfg = scheduler_config(256, max_num_seqs=4, max_num_batched_tokens=256)
    kv = PrefixCachingAllocator(32, 4)
    sched = make_scheduler(cfg, kv)
    a, b = make_request(0, 24, 2, 0, 4), make_request(1, 24, 2, 0, 4)
    sched.add(a)
    sched.complete_step(sched.schedule())
    sched.add(b)
    batch = sched.schedule()
    assert (b, 4) in batch.prefill  # 5 of its 6 blocks found: the last one is computed for the logits


class PrefixSchedulerMachine(SchedulerMachine):
    """The scheduler over a prefix-caching allocator under KV pressure (test_kv_invariants' machine, its steps and
    drain): shared blocks stay consistent, and every request ends finished or rejected."""

    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4]), chunked=st.booleans(),
                preemption=st.sampled_from(["recompute", "swap"]), gamma=st.sampled_from([0, 0, 3]))
    def setup(self, num_blocks, block_size, chunked, preemption, gamma):
        cfg = scheduler_config(64, max_num_seqs=4, max_num_batched_tokens=32 if chunked else 64,
                               enable_chunked_prefill=chunked, preemption=preemption, num_speculative_tokens=gamma)
        kv = PrefixCachingAllocator(num_blocks, block_size, num_swap_blocks=num_blocks if preemption == "swap" else 0)
        self.sched = make_scheduler(cfg, kv)
        self.hashes = PrefixHashes(block_size, 1 << 20)
        self.reqs: list[Request] = []
        self.gamma = gamma

    @rule(prompt=st.integers(1, 40), output=st.integers(1, 20), prefix=st.integers(-1, 2))
    def arrive(self, prompt, output, prefix):
        r = Request(len(self.reqs), 0.0, prompt, output)
        r.block_hashes = self.hashes(RequestSpec(r.id, 0.0, prompt, output, () if prefix < 0 else (prefix,), 16))
        self.reqs.append(r)
        accepted = self.sched.add(r)
        assert accepted or (r.status is Status.REJECTED and r.reject_reason)

    def check(self) -> None:
        check_shared_blocks(self.sched.kv, self.reqs)


TestPrefixScheduler = PrefixSchedulerMachine.TestCase
TestPrefixScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_simulator_skips_cached_prefixes():
    """Prompts of 1,500-2,500 tokens, the first 1,024 one of 4 system prompts, on Llama-3-8B / A100 at 8 requests/s:
    without caching the prefill work outruns the GPU; with it 3/4 of each 1,024-token prefix is found."""
    on = run(scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True},
                      workload=SHARED))[0]
    off = run(scenario(model="Llama-3-8B", hardware="A100-80GB", workload=SHARED))[0]
    assert on["requests"]["completed"] == off["requests"]["completed"] == 300
    assert "prefix_cache_hit_rate" not in off["kv_cache"]
    # 1,024 of ~2,000 prompt tokens shared: all but each prefix's first few requests find them
    assert 0.45 < on["kv_cache"]["prefix_cache_hit_rate"] < 0.52
    assert on["ttft_s"]["p50"] < 0.2 * off["ttft_s"]["p50"]
    assert on == run(scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True},
                              workload=SHARED))[0] | {"wall_time_s": on["wall_time_s"]}


def test_prompts_that_share_nothing_run_as_without_caching():
    plain = {**SHARED, "num_requests": 100}
    plain.pop("shared_prefix")
    on = run(scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True},
                      workload=plain))[0]
    off = run(scenario(model="Llama-3-8B", hardware="A100-80GB", workload=plain))[0]
    assert on["kv_cache"]["prefix_cache_hit_rate"] == 0.0
    assert on["ttft_s"] == off["ttft_s"] and on["tpot_s"] == off["tpot_s"]


def test_shared_prefixes_leave_the_other_draws_alone():
    plain = {**SHARED}
    plain.pop("shared_prefix")
    a = generate_requests(plan_of(scenario(workload=SHARED)).workload)
    b = generate_requests(plan_of(scenario(workload=plain)).workload)
    assert [(s.arrival_s, s.prompt_len, s.output_len) for s in a] == [(s.arrival_s, s.prompt_len, s.output_len)
                                                                      for s in b]
    assert {s.prefix for s in a} == {(0,), (1,), (2,), (3,)} and {s.prefix for s in b} == {()}


@pytest.mark.parametrize("change, where", [
    ({"kv_cache": {"enable_prefix_caching": True, "allocator": "contiguous"}}, "kv_cache.enable_prefix_caching"),
    ({"kv_cache": {"enable_prefix_caching": True}, "serving": {"batching": "static"}}, "enable_prefix_caching"),
    ({"workload": {**SHARED, "shared_prefix": {"prefix_len": 0}}}, "workload.shared_prefix.prefix_len"),
    ({"workload": {**SHARED, "shared_prefix": {"prefix_len": 10, "num_prefixes": 0}}},
     "workload.shared_prefix.num_prefixes"),
])
def test_prefix_caching_where_it_cannot_apply(change, where):
    with pytest.raises(ConfigError) as e:
        plan_of(scenario(**change))
    assert where in e.value.one_line()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def test_the_executor_reuses_cached_blocks_and_generates_the_same_tokens(tmp_path, checkpoint):
    """A tiny model served twice on prompts that share 4 prefixes: with prefix caching fewer prompt tokens are
    computed, yet every request's greedy output is the one computed from scratch."""
    from executor.serving.serve import serve

    outputs, prompt_tokens, reports = {}, {}, {}
    for caching in (False, True):
        path = write_tiny_scenario(tmp_path, checkpoint, name=f"tiny-prefix-{caching}",
                                   kv_cache={"num_blocks": 96, "block_size": 8, "enable_prefix_caching": caching},
                                   serving={"max_num_seqs": 4},
                                   workload={"arrival": {"process": "poisson", "rate": 200.0},
                                             "prompt_len": {"dist": "uniform", "min": 40, "max": 90},
                                             "shared_prefix": {"prefix_len": 32, "num_prefixes": 3}})
        _, plan = load_scenario(path)
        specs = generate_requests(plan.workload, plan.base_dir)
        torch.manual_seed(0)
        records, traces, engine, requests, wall, _ = serve(plan, specs, "cpu", threads=1)
        assert all(r.status is Status.FINISHED for r in requests)
        outputs[caching] = {r.id: engine.output_ids(r) for r in requests}
        prompt_tokens[caching] = sum(sum(n for n in rec.new_tokens) for rec in engine.records if rec.num_prefill)
        reports[caching] = traces[0]
        if caching:  # the warm-up's prompts are not counted: what the simulator counts for the same requests
            assert traces[0].prefix_queried_tokens == sum(s.prompt_len for s in specs)
    assert outputs[True] == outputs[False]
    assert prompt_tokens[True] < prompt_tokens[False]
    assert reports[True].prefix_hit_tokens > 0 and reports[False].prefix_hit_tokens == 0


MOONCAKE = [{"timestamp": 0, "input_length": 1200, "output_length": 8, "hash_ids": [11, 12, 13]},
            {"timestamp": 2000, "input_length": 1100, "output_length": 8, "hash_ids": [11, 12, 14]},
            {"timestamp": 4000, "input_length": 700, "output_length": 8, "hash_ids": [21, 22]},
            {"timestamp": 6000, "input_length": 300, "output_length": 8, "hash_ids": [12]}]


def write_jsonl(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_mooncake_trace_s_hash_ids_are_what_its_prompts_share(tmp_path):
    """Mooncake's hash_ids name 512-token blocks (each id covers the blocks before it): the second prompt finds the
    first one's first 1,024 tokens; the fourth, starting with the first one's second id, finds nothing."""
    trace = write_jsonl(tmp_path / "mooncake.jsonl", MOONCAKE)
    data = {**scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True}),
            "workload": {"trace": {"path": trace}}}
    specs = generate_requests(plan_of(data).workload)
    assert [s.prefix for s in specs] == [(11, 12, 13), (11, 12, 14), (21, 22), (12,)]
    assert {s.prefix_unit for s in specs} == {512}
    hashes = PrefixHashes(16, 1 << 20)
    first, second, _, fourth = (hashes(s) for s in specs)
    assert len(first) == 75 and first[:64] == second[:64] and first[64] != second[64]
    assert not set(fourth) & set(first)
    assert run(data)[0]["kv_cache"]["prefix_cache_hit_tokens"] == 1024


@pytest.mark.parametrize("hash_ids", ["abc", [-1], [1.5], [[1]], ["7"], {"a": 1}, [True]])
def test_mooncake_hash_ids_that_are_not_block_ids(tmp_path, hash_ids):
    from tests.test_bad_input_more import invoke, one_line_error

    trace = write_jsonl(tmp_path / "bad.jsonl", [MOONCAKE[0], {**MOONCAKE[1], "hash_ids": hash_ids}])
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nmodel: Llama-3-8B\nhardware: A100-80GB\nworkload: {{trace: {{path: {trace}}}}}\n")
    one_line_error(invoke("run", path, "-q", "--no-plots"), "workload.trace.path", "row 2", "hash_ids")


def test_prompt_ids_follow_the_shared_content():
    from executor.core.prompts import prompt_ids

    corpus = list(range(3, 1000))
    a = prompt_ids(corpus, 1200, 0, (11, 12, 13), 512)
    b = prompt_ids(corpus, 1100, 1, (11, 12, 14), 512)
    c = prompt_ids(corpus, 300, 3, (12,), 512)
    assert len(a) == 1200 and len(b) == 1100 and len(c) == 300
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert c != a[:300]
    assert prompt_ids(corpus, 40, 5) == prompt_ids(corpus, 40, 5, (), 0)


class _Replica:
    """What a router reads of a replica: its outstanding requests and its scheduler's KV cache."""

    def __init__(self, outstanding: int, kv):
        self.num_outstanding = outstanding
        self.scheduler = type("S", (), {"kv": kv})()


def cached_kv(prefix: int, tokens: int) -> PrefixCachingAllocator:
    kv = PrefixCachingAllocator(64, 4)
    sched = make_scheduler(scheduler_config(256, max_num_seqs=4, max_num_batched_tokens=256), kv)
    req = make_request(0, tokens, 1, prefix, 4)
    sched.add(req)
    sched.complete_step(sched.schedule())
    return kv


def test_the_cache_aware_router_follows_the_cached_prefix_within_the_load_bounds():
    from sim.policy.router import make_router

    router = make_router("cache_aware")
    req = make_request(9, 40, 4, 1, 4)  # 24 shared tokens of 40
    holder, other = cached_kv(1, 40), cached_kv(2, 40)
    assert router.pick([_Replica(3, other), _Replica(5, holder)], req) == 1  # its prefix: 24 of 40 tokens > 0.3
    assert router.pick([_Replica(10, other), _Replica(80, holder)], req) == 0  # 70 more and 8x the load: balance
    assert router.pick([_Replica(3, other), _Replica(5, other)], req) == 0  # cached nowhere: the least loaded
    short = make_request(10, 100, 4, 1, 4)  # 24 of 100 tokens shared: under the threshold
    assert router.pick([_Replica(3, other), _Replica(5, holder)], short) == 0
    assert router.pick([_Replica(3, other), _Replica(5, holder)], Request(11, 0.0, 40, 4)) == 0


def test_cache_aware_routing_keeps_each_prefix_on_one_replica():
    """4 replicas of Llama-3-8B / L40S (200k KV tokens each), prompts of 4.2-5k tokens beginning with one of 64
    4,096-token prefixes (262k tokens of them): routed in turn, every replica must hold every prefix and evicts them
    (47% found); routed by cache, each prefix lives on one replica (79%) and prompts start sooner."""
    workload = {"arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 600,
                "prompt_len": {"dist": "uniform", "min": 4200, "max": 5000},
                "output_len": {"dist": "uniform", "min": 50, "max": 150},
                "shared_prefix": {"prefix_len": 4096, "num_prefixes": 64}}
    reports = {router: run(scenario(model="Llama-3-8B", hardware="L40S", replicas=4, router=router,
                                    kv_cache={"enable_prefix_caching": True}, workload=workload))[0]
               for router in ("round_robin", "cache_aware")}
    rr, ca = reports["round_robin"], reports["cache_aware"]
    assert ca["kv_cache"]["prefix_cache_hit_rate"] > rr["kv_cache"]["prefix_cache_hit_rate"] + 0.2
    assert ca["ttft_s"]["p50"] < 0.8 * rr["ttft_s"]["p50"]
    assert ca["requests"]["completed"] == rr["requests"]["completed"] == 600


def test_a_hot_prefix_found_again_and_again_keeps_the_free_queue_small():
    """Each hit leaves a stale entry in the free queue; one prefix freed and found 2,000 times over does not grow it
    without bound."""
    cfg = scheduler_config(256, max_num_seqs=4, max_num_batched_tokens=256)
    kv = PrefixCachingAllocator(32, 4)
    sched = make_scheduler(cfg, kv)
    for i in range(2000):
        sched.add(make_request(i, 25, 1, 0, 4))
        sched.complete_step(sched.schedule())
    assert kv.hit_tokens == 1999 * 24 and kv.free_blocks.num_entries <= 4 * 32 + 64 + 8
    assert sorted(kv.free_blocks) == list(range(32))


def test_a_capacity_search_scales_requests_with_what_their_prompts_share():
    """W: the probes of `search` and `validate --capacity` were rebuilt from (arrival, prompt, output) alone, so every
    configuration with prefix caching was searched as if nothing were shared (capacity with and without caching
    came out equal in scenarios/search/llama3_8b_prefix_caching.yaml: 4.24 req/s on 4 replicas; now 9.72)."""
    from sim.report.capacity import probe_rows, scaled

    specs = generate_requests(plan_of(scenario(workload=SHARED)).workload)[:50]
    probes = scaled(probe_rows(specs), 2.0)
    assert [(p.prompt_len, p.output_len, p.prefix, p.prefix_unit) for p in probes] == \
        [(s.prompt_len, s.output_len, s.prefix, s.prefix_unit) for s in specs]
    assert probes[-1].arrival_s == pytest.approx(49 / 2.0)


def test_a_mooncake_line_without_hash_ids_leaves_the_other_lines_theirs(tmp_path):
    """The JSON lines' columns are every key any line has: a first line without hash_ids (a prompt sharing nothing)
    does not hide the others'."""
    bare = {k: v for k, v in MOONCAKE[0].items() if k != "hash_ids"}
    trace = write_jsonl(tmp_path / "m.jsonl", [bare] + MOONCAKE[:2])
    data = {**scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True}),
            "workload": {"trace": {"path": trace}}}
    assert [s.prefix for s in generate_requests(plan_of(data).workload)][1:] == [(11, 12, 13), (11, 12, 14)]
    assert run(data)[0]["kv_cache"]["prefix_cache_hit_tokens"] == 1024


def test_a_mooncake_trace_s_closed_loop_and_shared_prefix(tmp_path):
    """A closed loop sends a Mooncake trace's rows as it sends any trace's (they kept arriving at their timestamps,
    all at once here, before); a shared prefix would replace its hash_ids, and is refused at its key."""
    trace = write_jsonl(tmp_path / "m.jsonl", MOONCAKE)
    base = scenario(model="Llama-3-8B", hardware="A100-80GB", kv_cache={"enable_prefix_caching": True})
    loop = {**base, "workload": {"trace": {"path": trace}, "closed_loop": {"users": 1, "think_time_s": 1.0}}}
    specs = generate_requests(plan_of(loop).workload)
    assert all(s.users == 1 and s.prefix for s in specs)
    report, result, _ = run(loop)
    sent = sorted(r.arrival_s for r in result.requests)
    assert sent[0] > 0 and all(b > a for a, b in zip(sent, sent[1:]))
    assert report["closed_loop"]["mean_in_flight"] <= 1
    shared = {**base, "workload": {"trace": {"path": trace}, "shared_prefix": {"prefix_len": 100}}}
    with pytest.raises(ConfigError) as e:
        generate_requests(plan_of(shared).workload)
    assert e.value.key_path == "workload.shared_prefix" and "hash_ids" in e.value.message

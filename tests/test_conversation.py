"""Multi-turn conversations (workload.conversation), closed loop: generation, the simulator, the executor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario
from sim.config.scenario import parse_scenario
from sim.config.workload import RequestSpec
from sim.policy.conversation import CONVERSATION_ENDED
from sim.policy.prefix import PrefixHashes
from sim.policy.request import Status
from sim.report.capacity import probe_rows, scaled
from sim.simulator.cluster import simulate
from tests.helpers import plan_of, run, scenario, tiny_checkpoint, write_tiny_scenario

CHAT = {"arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 60,
        "prompt_len": {"dist": "uniform", "min": 300, "max": 900},
        "output_len": {"dist": "uniform", "min": 50, "max": 300},
        "conversation": {"turns": {"dist": "uniform", "min": 1, "max": 6}, "think_time_s": 8.0,
                         "user_len": {"dist": "uniform", "min": 20, "max": 120}}}


def chat(**workload) -> dict:
    return scenario(workload={**CHAT, **workload})


def by_id(requests) -> dict:
    return {r.id: r for r in requests}


def test_each_turn_s_prompt_is_the_conversation_so_far():
    specs = generate_requests(parse_scenario(chat()).workload)
    assert [s.id for s in specs] == list(range(len(specs)))
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    later = [s for s in specs if s.after >= 0]
    assert len(specs) > 60 and later
    for s in later:
        before = specs[s.after]
        assert before.id < s.id and before.conversation == s.conversation
        assert 20 <= s.prompt_len - before.prompt_len - before.output_len <= 120
        assert s.arrival_s == pytest.approx(before.arrival_s + s.think_s) and s.think_s >= 0
    counts = np.bincount([s.conversation for s in specs])
    assert len(counts) == 60 and counts.min() >= 1 and counts.max() <= 6
    # the first turns are the workload's requests, drawn as without conversations
    plain = generate_requests(parse_scenario(scenario(workload={k: v for k, v in CHAT.items()
                                                                 if k != "conversation"})).workload)
    assert [(s.arrival_s, s.prompt_len, s.output_len) for s in specs if s.after < 0] == \
        [(s.arrival_s, s.prompt_len, s.output_len) for s in plain]
    assert generate_requests(parse_scenario(chat()).workload) == specs


def test_a_later_turn_arrives_its_think_time_after_the_turn_before_it_ends():
    _, result, rec = run(chat())
    reqs = by_id(result.requests)
    specs = generate_requests(parse_scenario(chat()).workload)
    assert len(reqs) == len(specs) and all(r.status is Status.FINISHED for r in reqs.values())
    for s in specs:
        r = reqs[s.id]
        if s.after >= 0:
            assert r.arrival_s == pytest.approx(reqs[s.after].finish_s + s.think_s, abs=1e-9)
            assert r.arrival_s >= s.arrival_s  # never before it could: the turns before it took time
    # bulk decode runs cut short by a turn that became known during them: the same run as step by step
    _, eager, _ = run(chat(), bulk=False)
    e = by_id(eager.requests)
    assert all(reqs[i].first_token_s == pytest.approx(e[i].first_token_s, abs=1e-9) and
               reqs[i].finish_s == pytest.approx(e[i].finish_s, abs=1e-9) for i in reqs)


def test_a_rejected_turn_ends_its_conversation_and_nothing_is_lost():
    data = chat(prompt_len={"dist": "uniform", "min": 300, "max": 1500})
    data["serving"] = {"max_model_len": 2048}
    report, result, _ = run(data)
    reqs = by_id(result.requests)
    specs = generate_requests(parse_scenario(data).workload)
    assert len(reqs) == len(specs) == report["requests"]["arrived"]
    ended = [s for s in specs if reqs[s.id].reject_reason == CONVERSATION_ENDED]
    assert ended and report["requests"]["completed"] + report["requests"]["rejected"] == len(specs)
    for s in ended:
        assert reqs[s.after].status is Status.REJECTED
        assert reqs[s.id].arrival_s == pytest.approx(reqs[s.after].arrival_s)  # known when the turn before it was
    for s in specs:  # a completed turn's turn before it completed too
        if s.after >= 0 and reqs[s.id].status is Status.FINISHED:
            assert reqs[s.after].status is Status.FINISHED


def test_the_report_s_conversations_section_counts_turns_and_splits_first_and_later_ttft():
    """report.json's conversations section against the requests themselves: every conversation counted, those with
    a rejected turn not answered, the first turns' TTFT apart from the later turns', each answered conversation's
    length from its first arrival to its last token."""
    data = chat(prompt_len={"dist": "uniform", "min": 300, "max": 1500})
    data["serving"] = {"max_model_len": 2048}
    report, result, _ = run(data)
    conv = report["conversations"]
    specs = generate_requests(parse_scenario(data).workload)
    reqs = by_id(result.requests)
    turns: dict[int, list] = {}
    for s in specs:
        turns.setdefault(s.conversation, []).append(reqs[s.id])
    answered = [t for t in turns.values() if all(r.status is Status.FINISHED for r in t)]
    assert conv["conversations"] == 60 and 0 < conv["answered"] == len(answered) < 60
    assert conv["turns_mean"] == pytest.approx(len(specs) / 60)
    ttft = lambda rs: [r.first_token_s - r.arrival_s for r in rs if r.status is Status.FINISHED]  # noqa: E731
    first = ttft(reqs[s.id] for s in specs if s.after < 0)
    later = ttft(reqs[s.id] for s in specs if s.after >= 0)
    assert conv["first_turn_ttft_s"]["p90"] == pytest.approx(np.percentile(first, 90))
    assert conv["later_turn_ttft_s"]["p50"] == pytest.approx(np.percentile(later, 50))
    lengths = [max(r.finish_s for r in t) - min(r.arrival_s for r in t) for t in answered]
    assert conv["duration_s"]["p50"] == pytest.approx(np.percentile(lengths, 50))
    plain, _, _ = run(scenario())
    assert "conversations" not in plain


def test_a_turn_finds_the_turn_before_it_prompt_and_answer_cached():
    """Two turns, far apart, alone on the replica: the second finds every full block of the first's prompt and
    answer (all but the answer's last token have K/V) and computes the rest of its prompt."""
    specs = [RequestSpec(0, 0.0, 500, 100, conversation=0),
             RequestSpec(1, 30.0, 650, 20, conversation=0, after=0, think_s=30.0)]
    plan = plan_of(scenario(kv_cache={"enable_prefix_caching": True, "block_size": 16}))
    result = simulate(plan, specs)
    trace = result.replicas[0]
    assert trace.prefix_hit_tokens == (500 + 100 - 1) // 16 * 16
    assert trace.prefix_queried_tokens == 500 + 650
    hashes = PrefixHashes(16, 1 << 20)
    assert hashes(specs[1])[:len(hashes(specs[0]))] == hashes(specs[0])
    # another conversation's blocks are its own; a shared system prompt's are everyone's
    other = RequestSpec(2, 0.0, 500, 100, (7,), 64, conversation=1)
    mine = RequestSpec(3, 0.0, 500, 100, (7,), 64, conversation=0)
    assert not set(hashes(other)) & set(hashes(specs[0]))
    assert hashes(other)[:4] == hashes(mine)[:4] and hashes(other)[4:] != hashes(mine)[4:]


def test_prefix_caching_pays_off_on_conversations():
    off, _, _ = run(chat())
    on, _, _ = run({**chat(), "kv_cache": {"enable_prefix_caching": True}})
    assert on["kv_cache"]["prefix_cache_hit_rate"] > 0.6
    assert on["ttft_s"]["p50"] < off["ttft_s"]["p50"]


def test_conversations_on_disaggregated_pools_and_pipelines_end_every_turn():
    pools = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    for extra in ({"pools": pools}, {"parallel": {"pipeline_parallel_size": 2}}):
        data = {**chat(), **extra}
        report, result, _ = run(data)
        assert report["requests"]["completed"] == len(result.requests) == \
            len(generate_requests(parse_scenario(data).workload))
        reqs = by_id(result.requests)
        for s in generate_requests(parse_scenario(data).workload):
            if s.after >= 0:
                assert reqs[s.id].arrival_s == pytest.approx(reqs[s.after].finish_s + s.think_s, abs=1e-9)


def test_a_capacity_probe_keeps_the_conversations_and_their_think_times():
    specs = generate_requests(parse_scenario(chat()).workload)
    for rate in (0.5, 4.0):
        probe = scaled(probe_rows(specs), rate)
        assert [s.arrival_s for s in probe] == sorted(s.arrival_s for s in probe)
        firsts = [s for s in probe if s.after < 0]
        # as fast as `rate` requests/s if every turn were answered at once
        assert (len(firsts) - 1) / (firsts[-1].arrival_s - firsts[0].arrival_s) == \
            pytest.approx(rate * len(firsts) / len(probe))
        assert sorted((s.prompt_len, s.output_len, s.think_s) for s in probe) == \
            sorted((s.prompt_len, s.output_len, s.think_s) for s in specs)
        for s in probe:
            if s.after >= 0:
                before = probe[s.after]
                assert before.conversation == s.conversation and s.prompt_len > before.prompt_len
                assert s.arrival_s == pytest.approx(before.arrival_s + s.think_s)


@pytest.mark.parametrize("conversation, where", [
    ({"turns": {"dist": "fixed", "value": 0}, "user_len": {"dist": "fixed", "value": 5}}, "workload.conversation.turns"),
    ({"turns": {"dist": "fixed", "value": 2}, "user_len": {"dist": "fixed", "value": 5}, "think_time_s": -1},
     "workload.conversation.think_time_s"),
    ({"turns": {"dist": "fixed", "value": 2}}, "workload.conversation.user_len"),
    ({"turns": {"dist": "fixed", "value": 200_000}, "user_len": {"dist": "fixed", "value": 5}},
     "workload.conversation.turns"),
])
def test_conversation_errors_name_their_key(conversation, where):
    with pytest.raises(ConfigError) as e:
        generate_requests(parse_scenario(chat(num_requests=20, conversation=conversation)).workload)
    assert where in e.value.one_line()


def test_a_trace_s_hash_ids_and_conversations_are_refused(tmp_path):
    from tests.test_prefix_caching import MOONCAKE, write_jsonl

    trace = write_jsonl(tmp_path / "m.jsonl", MOONCAKE)
    data = {**scenario(), "workload": {"trace": {"path": trace}, "conversation": CHAT["conversation"]}}
    with pytest.raises(ConfigError) as e:
        generate_requests(parse_scenario(data).workload)
    assert "workload.conversation" in e.value.one_line()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7)


def test_the_executor_sends_each_answer_back_and_reuses_its_blocks(tmp_path, checkpoint):
    """A tiny model serves conversations with and without prefix caching: each later turn's prompt is the turn before
    it (its prompt and generated tokens) and new tokens; with caching it computes fewer prompt tokens, yet generates
    exactly what it generates from scratch (the answer's cached K/V is the answer's)."""
    from executor.serving.serve import serve

    outputs, computed, traces = {}, {}, {}
    for caching in (False, True):
        path = write_tiny_scenario(
            tmp_path, checkpoint, name=f"tiny-chat-{caching}",
            kv_cache={"num_blocks": 128, "block_size": 8, "enable_prefix_caching": caching},
            serving={"max_num_seqs": 4},
            workload={"num_requests": 6, "arrival": {"process": "poisson", "rate": 50.0},
                      "prompt_len": {"dist": "uniform", "min": 20, "max": 40},
                      "output_len": {"dist": "uniform", "min": 4, "max": 12},
                      "conversation": {"turns": {"dist": "uniform", "min": 2, "max": 4}, "think_time_s": 0.01,
                                       "user_len": {"dist": "uniform", "min": 3, "max": 9}}})
        _, plan = load_scenario(path)
        specs = generate_requests(plan.workload, plan.base_dir)
        torch.manual_seed(0)
        _, trace, engine, requests, _, _ = serve(plan, specs, "cpu", threads=1)
        assert len(requests) == len(specs) > 6 and all(r.status is Status.FINISHED for r in requests)
        reqs = by_id(requests)
        for s in specs:
            if s.after >= 0:
                before, r = reqs[s.after], reqs[s.id]
                assert r.arrival_s >= before.finish_s + s.think_s - 1e-9
                assert engine.tokens[r][:before.prompt_len + before.num_generated] == engine.tokens[before]
        outputs[caching] = {r.id: engine.output_ids(r) for r in requests}
        computed[caching] = sum(sum(rec.new_tokens) for rec in engine.records if rec.num_prefill)
        traces[caching] = trace[0]
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]
    assert traces[True].prefix_hit_tokens > 0


def test_a_capacity_probe_of_conversations_started_at_once_is_not_a_sustained_rate():
    """At a huge rate the first turns all arrive at once and the later ones follow the answers: a bounded load that
    meets any SLO a roomy deployment can. The verdict needs the first turns spread over twice a conversation's
    lifetime; the search marks a capacity the probe's length bounds."""
    from infersim.commands.search import run_probe

    data = {**chat(num_requests=120), "replicas": 8, "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}
    plan = plan_of(data)
    rows = probe_rows(generate_requests(plan.workload))
    ok, _, why = run_probe(plan, scaled(rows, 1.0))
    assert ok and why == ""
    ok, metrics, why = run_probe(plan, scaled(rows, 1000.0))
    assert not ok and why == "unsteady" and metrics["slo"]["met_counting_rejected"]


def test_the_session_router_keeps_a_conversation_on_one_replica():
    data = {**chat(), "replicas": 4, "router": "session", "kv_cache": {"enable_prefix_caching": True}}
    report, result, _ = run(data)
    where: dict[int, set] = {}
    specs = {s.id: s for s in generate_requests(parse_scenario(data).workload)}
    for r in result.requests:
        where.setdefault(specs[r.id].conversation, set()).add(r.replica)
    assert all(len(v) == 1 for v in where.values())
    assert len(set().union(*where.values())) == 4  # the conversations spread over the replicas
    rr, _, _ = run({**data, "router": "round_robin"})
    assert report["kv_cache"]["prefix_cache_hit_rate"] > rr["kv_cache"]["prefix_cache_hit_rate"] + 0.2
    # a request of no conversation goes to the least loaded
    from sim.policy.router import SessionRouter

    class Busy:
        def __init__(self, n):
            self.num_outstanding = n

    assert SessionRouter().pick([Busy(3), Busy(1), Busy(2)], None) == 1

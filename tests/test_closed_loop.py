"""A closed loop of users (workload.closed_loop): generation, the simulator, the executor, and what refuses it."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import load_scenario
from sim.config.scenario import parse_scenario
from sim.policy.conversation import CONVERSATION_ENDED
from sim.policy.request import Status
from sim.report.capacity import check_scalable
from tests.helpers import in_flight, run, scenario, tiny_checkpoint, write_tiny_scenario

LOOP = {"seed": 4, "num_requests": 300, "prompt_len": {"dist": "uniform", "min": 100, "max": 2000},
        "output_len": {"dist": "uniform", "min": 20, "max": 400}, "closed_loop": {"users": 16, "think_time_s": 2.0}}


def users(n: int, think: float = 2.0, **workload) -> dict:
    data = scenario(workload={**LOOP, "closed_loop": {"users": n, "think_time_s": think}, **workload})
    data["workload"].pop("arrival")
    return data


def assert_users_take_the_units_in_order(specs, requests, users: int, abs: float = 1e-9, late: float = 0.0) -> None:
    """The closed loop's units (a request, or a conversation) go in order to the first user free: the first `users`
    are sent at their think times, unit j after that the j-th end of a unit (in time order) plus its own think time. A
    unit ends with its last request (finished, or rejected: on arrival, or unsent with its conversation), when its
    client knows (the client's transport: the engine's end plus its out_s and close_s), and a request reaches the
    engine at least its in_s + front_s after it was sent (more while the front end works on others: client_in_s).
    `late`: how much later than that a unit may be sent (a replay on the wall clock of a busy machine), never earlier."""
    reqs = {r.id: r for r in requests}
    units = [s for s in specs if s.users]
    assert units and all(s.users == users and s.after < 0 for s in units)
    ends: dict[int, float] = {}
    for s in specs:
        r = reqs[s.id]
        unit = s.conversation if s.conversation >= 0 else s.id
        end = r.finish_s if r.status is Status.FINISHED else r.arrival_s
        if r.reject_reason != CONVERSATION_ENDED:  # an unsent turn ends when its client learned of it
            end += s.out_s + s.close_s
        ends[unit] = max(ends.get(unit, -np.inf), end)
    freed = sorted(ends.values())
    for j, s in enumerate(units):
        expected = s.think_s if j < users else freed[j - users] + s.think_s
        r = reqs[s.id]
        assert r.arrival_s - r.client_in_s == pytest.approx(expected + late / 2, abs=abs + late / 2), (j, s.id)
        assert r.client_in_s >= s.in_s + s.front_s - 1e-12


def test_a_closed_loop_s_units_are_the_workload_s_requests_each_with_its_think_time():
    specs = generate_requests(parse_scenario(users(16)).workload)
    plain = generate_requests(parse_scenario(scenario(workload={**LOOP, "closed_loop": None})).workload)
    assert len(specs) == 300 and [s.id for s in specs] == list(range(300))
    assert [(s.prompt_len, s.output_len) for s in specs] == [(s.prompt_len, s.output_len) for s in plain]
    assert all(s.users == 16 and s.after < 0 and s.arrival_s == 0 and s.think_s > 0 for s in specs)
    assert np.mean([s.think_s for s in specs]) == pytest.approx(2.0, rel=0.15)
    at_once = generate_requests(parse_scenario(users(16, think=0.0)).workload)
    assert all(s.think_s == 0 and s.users == 16 for s in at_once)
    assert generate_requests(parse_scenario(users(16)).workload) == specs  # same seed, same requests


def test_users_take_the_next_request_when_theirs_ends_not_one_dealt_in_advance():
    """Whichever user is free first takes the next request (genai-perf's and LLMPerf's workers, vLLM's semaphore):
    no user idles while requests wait, so a run ends with its last few requests, not a tail of the users who drew
    long ones (requests dealt in advance left the last 10% of completions spread over a fifth of the run)."""
    report, result, _ = run(users(16, think=0.0))
    assert_users_take_the_units_in_order(generate_requests(parse_scenario(users(16, think=0.0)).workload),
                                         result.requests, 16)
    finish = np.sort([r.finish_s for r in result.requests])
    tail = finish[-1] - finish[int(0.9 * len(finish))]
    assert tail < 0.1 * finish[-1]
    assert report["closed_loop"]["mean_in_flight"] > 0.9 * 16


CHATS = {"turns": {"dist": "uniform", "min": 1, "max": 5}, "think_time_s": 3.0,
         "user_len": {"dist": "uniform", "min": 10, "max": 50}}


def test_users_hold_conversations_one_after_another():
    """With conversations, the workload's requests are first turns, dealt to the users in turn: a conversation's first
    turn follows the last turn of its user's conversation before it, after the loop's think time; its later turns
    follow each other after the conversation's. Every turn arrives no earlier than the one it follows."""
    specs = generate_requests(parse_scenario(users(8, num_requests=40, conversation=CHATS)).workload)
    alone = generate_requests(parse_scenario(scenario(workload={**LOOP, "num_requests": 40, "closed_loop": None,
                                                                "conversation": CHATS})).workload)
    key = lambda s: (s.conversation, s.prompt_len, s.output_len)  # noqa: E731
    assert sorted(map(key, specs)) == sorted(map(key, alone))  # the same conversations, turn for turn
    assert [s.id for s in specs] == list(range(len(specs))) and len({s.conversation for s in specs}) == 40
    turns = {}
    for s in specs:
        turns.setdefault(s.conversation, []).append(s)
    assert [conv[0].conversation for conv in turns.values()] == sorted(turns)  # opened in the workload's order
    for c, conv in turns.items():
        first = conv[0]
        assert first.after == -1 and first.users == 8 and first.think_s > 0  # a unit: a user's think time first
        assert all(t.after == prev.id and t.users == 0 for prev, t in zip(conv, conv[1:]))  # later turns: their own
    assert [s.id for s in specs if s.users] == sorted(s.id for s in specs if s.users)
    assert all(s.arrival_s >= specs[s.after].arrival_s for s in specs if s.after >= 0)
    assert generate_requests(parse_scenario(users(8, num_requests=40, conversation=CHATS)).workload) == specs
    for n in (30, 40, 41, 79, 80, 81):  # more users than conversations (or requests): each holds at most one
        for conv in (CHATS, None):
            few = generate_requests(parse_scenario(users(n, num_requests=40, conversation=conv)).workload)
            assert sum(s.users == n for s in few) == 40


def test_a_rejected_turn_ends_its_conversation_not_its_user():
    """A turn too long for max_model_len ends its conversation (the turns after it are rejected unsent); the user
    opens its next conversation a think time later all the same. At most the users are in flight, everything ends."""
    data = users(3, think=0.5, num_requests=24, conversation=CHATS)
    data["serving"] = {"max_model_len": 2048}
    report, result, _ = run(data)
    reqs = {r.id: r for r in result.requests}
    rq = report["requests"]
    specs = generate_requests(parse_scenario(data).workload)
    assert rq["arrived"] == len(specs) == rq["completed"] + rq["rejected"] and rq["rejected"] > 0
    assert in_flight(result.requests) <= 3 and report["conversations"]["conversations"] == 24
    cut = 0
    for s in specs:
        if s.after < 0:
            continue
        before, me = reqs[s.after], reqs[s.id]
        if before.status is Status.REJECTED:
            cut += 1
            assert me.status is Status.REJECTED and "conversation was rejected" in me.reject_reason
        else:
            assert me.arrival_s == pytest.approx(before.finish_s + s.think_s, abs=1e-9)
    assert cut > 0
    assert_users_take_the_units_in_order(specs, result.requests, 3)  # a cut conversation frees its user


def test_a_trace_s_lengths_are_sent_by_the_users_in_its_order():
    trace = {"trace": {"path": "builtin:azure_conv", "max_requests": 50}}
    loop = {**scenario(), "workload": {**trace, "closed_loop": {"users": 5}}}
    specs = generate_requests(parse_scenario(loop).workload)
    rows = generate_requests(parse_scenario({**scenario(), "workload": trace}).workload)
    assert [(s.prompt_len, s.output_len) for s in specs] == [(s.prompt_len, s.output_len) for s in rows]
    assert all(s.arrival_s == 0 and s.users == 5 for s in specs)


def test_at_most_the_users_are_in_flight_and_the_load_follows_the_deployment_s_speed():
    rates, ttft = [], []
    for n in (2, 8, 32, 128):
        report, result, _ = run(users(n))
        reqs = {r.id: r for r in result.requests}
        assert report["requests"]["completed"] == 300 and in_flight(result.requests) <= n
        assert_users_take_the_units_in_order(generate_requests(parse_scenario(users(n)).workload), reqs.values(), n)
        assert 0 < report["closed_loop"]["mean_in_flight"] <= n and report["closed_loop"]["users"] == n
        rates.append(report["throughput"]["requests_per_s"])
        ttft.append(report["ttft_s"]["p90"])
    assert rates == sorted(rates) and rates[1] > 3 * rates[0]  # more users, more load, until the engine is full
    assert rates[3] < 2 * rates[2] and ttft[3] > 5 * ttft[0]  # then only the queue grows
    # disaggregated pools and bulk decode runs cut short by a request known mid-run: the same invariants
    pools, result, _ = run({**users(8), "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}})
    assert pools["requests"]["completed"] == 300 and in_flight(result.requests) <= 8
    _, bulk, _ = run(users(8))
    _, eager, _ = run(users(8), bulk=False)
    assert [r.finish_s for r in bulk.requests] == pytest.approx([r.finish_s for r in eager.requests], abs=1e-9)


def test_a_rejected_request_does_not_end_its_user():
    data = users(4, prompt_len={"dist": "uniform", "min": 100, "max": 3000})
    data["serving"] = {"max_model_len": 2048}
    report, result, _ = run(data)
    rq = report["requests"]
    assert rq["rejected"] > 0 and rq["arrived"] == 300 == rq["completed"] + rq["rejected"]
    assert_users_take_the_units_in_order(generate_requests(parse_scenario(data).workload), result.requests, 4)


@pytest.mark.parametrize("change, words", [
    ({"arrival": {"process": "poisson", "rate": 1.0}}, "drop 'arrival'"),
    ({"duration_s": 60.0, "num_requests": None}, "give 'num_requests', not 'duration_s'"),
    ({"bursts": [{"at_s": 1.0, "count": 3}]}, "drop 'bursts'"),
    ({"closed_loop": {"users": 0}}, "workload.closed_loop.users"),
    ({"closed_loop": {"users": 3, "think_time_s": -1}}, "workload.closed_loop.think_time_s"),
])
def test_what_a_closed_loop_cannot_go_with_is_one_line(change, words):
    data = users(4)
    data["workload"].update(change)
    data["workload"] = {k: v for k, v in data["workload"].items() if v is not None}
    with pytest.raises(ConfigError) as e:
        parse_scenario(data)
    assert words in f"{e.value.key_path}: {e.value.message}" and "\n" not in e.value.message


def loop_spec(**over) -> dict:
    base = users(16, think=1.0, num_requests=400)
    base["slo"] = {"ttft_s": 0.5, "tpot_s": 0.04, "quantile": 0.9}
    return {"name": "u", "scenario": base, "target": {"users": 40}, "space": {"replicas": [1, 2]},
            "search": {"max_requests": 400, "precision": 0.1, "prune_costlier": False}, **over}


def test_a_closed_loop_s_capacity_is_the_most_users_within_the_slos(tmp_path):
    """The search counts users on a closed loop: a whole number of them, the probe at capacity passes and the one
    just above fails, two replicas hold about twice the users, and a probe with too few requests per user shows its
    capacity as a lower bound."""
    from infersim.commands.search import parse_search_spec, probes_of, run_probe, run_search
    from sim.config.plan import make_plan
    from sim.report.capacity import STEADY_ROUNDS, users_probe

    search = parse_search_spec(loop_spec())
    assert search.unit == "users" and search.target_rate == 40
    result = run_search(search, workers=1)
    one, two = result.rows
    assert result.unit == "users" and result.to_json()["unit"] == "users"
    assert one.capacity_rps == int(one.capacity_rps) and one.missed_at_rps == int(one.missed_at_rps)
    assert 1.6 * one.capacity_rps <= two.capacity_rps <= 2.5 * one.capacity_rps
    plan = make_plan(parse_scenario(probes_of(search)[0].data))
    probe = lambda n: users_probe(plan.workload, plan.base_dir, n, 400)  # noqa: E731
    assert run_probe(plan, probe(int(one.capacity_rps)), users=int(one.capacity_rps))[0]
    assert not run_probe(plan, probe(int(one.missed_at_rps)), users=int(one.missed_at_rps))[0]
    same = [(s.prompt_len, s.output_len) for s in probe(3)]  # every count of users sees the same requests
    assert sorted(same) == sorted((s.prompt_len, s.output_len) for s in probe(30)) and len(same) == 400
    short = run_search(parse_search_spec(loop_spec(search={"max_requests": 60, "precision": 0.1,
                                                           "prune_costlier": False})), workers=1)
    limited = short.rows[1]
    assert limited.probe_limited and limited.capacity_rps <= 60 / STEADY_ROUNDS
    assert "too few to show a sustained load" in limited.reason and short.recommended is None


@pytest.mark.parametrize("target, where", [({"rate": 3.0}, "target.rate"), ({"users": 0}, "target.users")])
def test_a_closed_loop_s_search_target_is_users(target, where):
    from infersim.commands.search import parse_search_spec

    with pytest.raises(ConfigError) as e:
        parse_search_spec(loop_spec(target=target))
    assert e.value.key_path == where
    with pytest.raises(ConfigError) as e:  # and users are a closed loop's only
        parse_search_spec({**loop_spec(target={"users": 5}), "scenario": scenario()})
    assert e.value.key_path == "target.users"


def test_scaling_a_closed_loop_s_rate_is_refused_with_its_key():
    with pytest.raises(ConfigError) as e:
        check_scalable(generate_requests(parse_scenario(users(4)).workload), "workload")
    assert e.value.key_path == "workload.closed_loop" and "arrival process" in e.value.message


def test_cli_search_of_users_writes_users(tmp_path):
    from tests.cli_runner import run_cli

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(loop_spec(space={"replicas": [1]}, target={"users": 20})))
    r = run_cli(["search", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "target 20 users" in r.output and "users (margin" in r.output
    assert "capacity users" in (tmp_path / "out" / "search.md").read_text()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=11)


def serve_users(tmp_path, checkpoint, name: str, **sections):
    """A tiny-model closed loop (the workload's arrival dropped) served on the executor: (plan, specs, engine,
    requests)."""
    from executor.serving.serve import serve

    path = write_tiny_scenario(tmp_path, checkpoint, name=name, kv_cache={"num_blocks": 128}, **sections)
    data = yaml.safe_load(path.read_text())
    data["workload"].pop("arrival")
    path.write_text(yaml.safe_dump(data))
    _, plan = load_scenario(path)
    specs = generate_requests(plan.workload, plan.base_dir)
    _, _, engine, requests, _, _ = serve(plan, specs, "cpu", threads=1)
    return plan, specs, engine, requests


def test_the_executor_keeps_the_users_loop_and_rejects_what_the_simulator_rejects(tmp_path, checkpoint):
    """A tiny model served by 3 users: never more than 3 in flight, each request sent its think time after a user's
    one ended (the first user free), the too-long ones rejected as the simulator rejects them, and the users go on."""
    from sim.simulator.cluster import simulate

    plan, specs, _, requests = serve_users(tmp_path, checkpoint, "tiny-users", serving={"max_model_len": 64},
                                           workload={"num_requests": 18,
                                                     "prompt_len": {"dist": "uniform", "min": 4, "max": 80},
                                                     "closed_loop": {"users": 3, "think_time_s": 0.005}})
    reqs = {r.id: r for r in requests}
    assert len(reqs) == 18 and all(r.is_done for r in requests) and in_flight(requests) <= 3
    # a request the engine refuses ends when the replay sends it, a loop's turn after its arrival time
    assert_users_take_the_units_in_order(specs, requests, 3, abs=1e-3, late=0.5)  # wall clock: a busy CI is late
    rejected = {r.id for r in requests if r.status is Status.REJECTED}
    assert rejected == {s.id for s in specs if s.prompt_len + s.output_len > 64} != set()
    assert {q.id for q in simulate(plan, specs).requests if q.status is Status.REJECTED} == rejected


def test_the_executor_s_users_hold_conversations_one_after_another(tmp_path, checkpoint):
    """A tiny model served by 2 users holding conversations: a later turn resends its conversation so far, sent its
    think time after the turn before it ended; a conversation opens when a user's ends, with a prompt of its own; never
    more than 2 in flight."""
    _, specs, engine, requests = serve_users(
        tmp_path, checkpoint, "tiny-chat-users",
        workload={"num_requests": 6, "prompt_len": {"dist": "uniform", "min": 8, "max": 20},
                  "output_len": {"dist": "uniform", "min": 2, "max": 6},
                  "closed_loop": {"users": 2, "think_time_s": 0.005},
                  "conversation": {"turns": {"dist": "uniform", "min": 1, "max": 3}, "think_time_s": 0.005,
                                   "user_len": {"dist": "fixed", "value": 4}}})
    reqs = {r.id: r for r in requests}
    assert len(reqs) == len(specs) > 6 and all(r.status is Status.FINISHED for r in requests)
    assert in_flight(requests) <= 2
    for s in specs:
        me = reqs[s.id]
        if s.after < 0:
            assert me.prompt_len == s.prompt_len
            continue
        before = reqs[s.after]
        assert me.arrival_s == pytest.approx(before.finish_s + s.think_s, abs=1e-9)
        so_far = engine.tokens[before]
        assert engine.tokens[me][:len(so_far)] == so_far
    assert_users_take_the_units_in_order(specs, requests, 2)


def test_a_closed_loop_s_capacity_verdict_leaves_out_its_first_wave():
    """With no think time every user's first request arrives at t = 0: a burst no steady load of that many users
    sees again, which decided the capacity on short probes (a users search moved 90 -> 239 users with the probe's
    length). The verdict judges the run without each user's first unit (a conversation: all its turns)."""
    from infersim.commands.search import run_probe
    from sim.config.plan import make_plan
    from sim.report.capacity import warm_up
    from sim.report.metrics import compute_metrics
    from sim.simulator.cluster import sim_records, simulate

    data = users(64, think=0.0, num_requests=600, client={"transport": "none"})  # the first wave at once
    data["slo"] = {"ttft_s": 0.4, "quantile": 0.9}  # TTFT p90: 0.56 s with the first wave, 0.24 s without
    plan = make_plan(parse_scenario(data))
    specs = generate_requests(plan.workload)
    assert warm_up(specs) == set(range(64))
    whole = compute_metrics(sim_records(simulate(plan, specs)), plan.slo)
    ok, judged, _ = run_probe(plan, specs, early_stop=False, users=64)
    assert judged["requests"]["arrived"] == 600 - 64
    assert judged["slo"]["ttft_at_quantile_s"] < whole["slo"]["ttft_at_quantile_s"]
    assert ok and not whole["slo"]["met"]
    assert run_probe(plan, specs, users=64)[0] == ok  # stopping early skips the first wave's misses too
    chats = generate_requests(parse_scenario(users(4, num_requests=20, conversation=CHATS)).workload)
    first = {s.conversation for s in chats if s.users}
    first = sorted(first)[:4]
    assert warm_up(chats) == {s.id for s in chats if s.conversation in first}

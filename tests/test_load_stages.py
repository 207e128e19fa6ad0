"""Load stages (workload.load_stages) and a pool of prompts (workload.shared_prefix.prompts_per_prefix): what
inference-perf sends (docs/published-runs.md). Its stage timer, one stage held back until the one before it has
ended, the pool's prompts coming back in one order every stage, the report per stage, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

from infersim.api import simulate_data
from sim.config.generator import generate_requests
from sim.config.stages import stage_bounds, stage_times
from sim.config.workload import WorkloadConfig
from sim.report.stages import keeps_up
from tests.test_bad_input_more import BASE, invoke, run_broken, scenario, write

STAGED = {"seed": 3, "load_stages": {"stages": [{"rate": 4, "duration_s": 5}, {"rate": 10, "duration_s": 3}]},
          "prompt_len": {"dist": "uniform", "min": 40, "max": 60}, "output_len": {"dist": "fixed", "value": 6}}
POOL = {"prefix_len": 16, "num_prefixes": 3, "prompts_per_prefix": 4}


def _specs(**changes):
    return generate_requests(WorkloadConfig(**{**STAGED, **changes}))


@pytest.mark.parametrize("process", ["poisson_fixed_count", "poisson", "constant"])
def test_a_stage_sends_int_rate_times_duration(process):
    t = stage_times(process, 7.3, 10.0, np.random.default_rng(0))
    assert len(t) == 73 and np.all(np.diff(t) >= 0)
    if process == "poisson_fixed_count":  # inference-perf's timer: the gaps scaled to end at the stage's end
        assert t[-1] == pytest.approx(10.0) and t[0] > 0
    if process == "constant":
        assert t[0] == 0 and np.diff(t) == pytest.approx(1 / 7.3)


def test_stages_are_id_ranges_in_send_order_each_after_the_one_before():
    specs = _specs()
    cfg = WorkloadConfig(**STAGED).load_stages
    assert stage_bounds(cfg) == [(0, 20), (20, 50)] and len(specs) == 50
    assert [s.stage for s in specs] == [0] * 20 + [1] * 30
    assert [s.id for s in specs] == list(range(50))
    last0 = specs[19].arrival_s
    assert specs[19].arrival_s == pytest.approx(5.0)
    first1 = specs[20]
    # the earliest stage 1 could start: stage 0 answered at its last send, then the 2 s gap
    assert first1.arrival_s == pytest.approx(last0 + first1.stage_delay_s)
    assert all(s.stage_delay_s >= 2.0 for s in specs[20:]) and all(s.stage_delay_s == 0 for s in specs[:20])


def test_the_pool_sends_its_prompts_in_one_order_again_and_again_each_stage_from_its_start():
    specs = _specs(shared_prefix=POOL)
    prompts = [(s.prefix, s.prompt_len) for s in specs]
    assert len(set(prompts)) == 12  # 3 prefixes x 4 prompts, each with its own length
    assert prompts[:20] == prompts[:12] + prompts[:8]  # stage 0: the shuffled pool, then again
    assert prompts[20:] == (prompts[:12] * 3)[:30]  # stage 1 starts the order over
    for prefix, n in set(prompts):  # its group's prefix unit, then its own id over the rest of its length
        assert prefix[0] in range(3) and set(prefix[1:]) <= set(range(3, 15)) and len(prefix) == 1 + -(-(n - 16) // 16)
    groups = {}
    for prefix, _ in set(prompts):
        groups.setdefault(prefix[0], set()).add(prefix[1])
    assert all(len(v) == 4 for v in groups.values())  # four questions per system prompt
    assert all(s.prefix_unit == 16 for s in specs)


def test_the_same_seed_draws_the_same_stages_and_pool():
    assert _specs(shared_prefix=POOL) == _specs(shared_prefix=POOL)
    assert _specs(shared_prefix=POOL) != _specs(shared_prefix=POOL, seed=4)


def _run(workload: dict, **scenario_changes):
    data = {**BASE, "model": "Llama-3.2-1B", "hardware": "H100-SXM", "kv_cache": {"enable_prefix_caching": True},
            "workload": workload, **scenario_changes}
    return simulate_data(data)


def test_a_stage_starts_after_every_request_of_the_one_before_ended():
    out = _run(STAGED)
    rec = out.records
    assert rec.completed.all()
    end0 = rec.stream_end_s[rec.id < 20].max()  # the client's end: its last stream closed, as inference-perf waits
    assert end0 > rec.finish_s[rec.id < 20].max()  # the way out and the close come after the last token
    first1 = rec.arrival_s[rec.id >= 20].min()
    specs = generate_requests(WorkloadConfig(**STAGED))
    assert first1 == pytest.approx(end0 + specs[20].stage_delay_s)
    stages = out.report["stages"]
    assert [s["sent"] for s in stages] == [20, 30] and [s["rate"] for s in stages] == [4, 10]
    assert all(s["requests"]["completed"] == s["sent"] and s["keeps_up"] for s in stages)
    assert stages[1]["start_s"] == pytest.approx(first1)
    assert "itl_s" not in stages[0] and stages[0]["tpot_s"]["mean"] > 0


def test_the_pool_hits_the_prefix_cache_where_fresh_prompts_do_not():
    pooled = _run({**STAGED, "shared_prefix": POOL}).report["kv_cache"]["prefix_cache_hit_rate"]
    fresh = _run({**STAGED, "shared_prefix": {"prefix_len": 16, "num_prefixes": 3}}).report["kv_cache"][
        "prefix_cache_hit_rate"]
    assert pooled > 0.6 > fresh


def test_an_overloaded_stage_does_not_keep_up():
    slow = {**STAGED, "load_stages": {"stages": [{"rate": 400, "duration_s": 2}]},
            "prompt_len": {"dist": "fixed", "value": 3000}}
    stage = _run(slow, serving={"max_num_seqs": 4}).report["stages"][0]
    assert not stage["keeps_up"] and stage["requests"]["completed"] == 800


def test_keeps_up_rule():
    assert keeps_up(100, 100, 0.05, 600) and keeps_up(1000, 990, 5.9, 600)
    assert not keeps_up(1000, 989, 0.05, 600)  # requests lost
    assert not keeps_up(4800, 4796, 120.0, 1200)  # a backlog: the mean wait grows with the stage
    assert not keeps_up(0, 0, None, 10)


def test_the_console_prints_a_row_per_stage(tmp_path):
    path = write(tmp_path / "s.yaml", {**BASE, "model": "Llama-3.2-1B", "hardware": "H100-SXM", "workload": STAGED})
    r = invoke("run", path, "--no-plots")
    assert r.exit_code == 0, r.output
    assert "per stage" in r.output and "kept up" in r.output


BAD = {
    "stages-with-arrival": ({**STAGED, "arrival": {"process": "poisson", "rate": 1}}, "workload"),
    "stages-with-num_requests": ({**STAGED, "num_requests": 4}, "workload"),
    "stages-with-closed_loop": ({**STAGED, "closed_loop": {"users": 2}}, "workload"),
    "stages-with-bursts": ({**STAGED, "bursts": [{"at_s": 1, "count": 2}]}, "workload"),
    "stages-without-output_len": ({k: v for k, v in STAGED.items() if k != "output_len"}, "workload"),
    "stage-of-no-request": ({**STAGED, "load_stages": {"stages": [{"rate": 0.5, "duration_s": 1}]}},
                            "workload.load_stages"),
    "no-stages": ({**STAGED, "load_stages": {"stages": []}}, "workload.load_stages.stages"),
    "rate-0": ({**STAGED, "load_stages": {"stages": [{"rate": 0, "duration_s": 1}]}},
               "workload.load_stages.stages[0].rate"),
    "duration-inf": ({**STAGED, "load_stages": {"stages": [{"rate": 1, "duration_s": ".inf"}]}},
                     "workload.load_stages.stages[0].duration_s"),
    "process-unknown": ({**STAGED, "load_stages": {**STAGED["load_stages"], "process": "sweep"}},
                        "workload.load_stages.process"),
    "gap-negative": ({**STAGED, "load_stages": {**STAGED["load_stages"], "gap_s": -1}},
                     "workload.load_stages.gap_s"),
    "too-many-requests": ({**STAGED, "load_stages": {"stages": [{"rate": 1e6, "duration_s": 1e3}]}},
                          "workload.load_stages"),
    "pool-with-conversation": ({"seed": 0, "arrival": {"process": "poisson", "rate": 1}, "num_requests": 3,
                                "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8},
                                "shared_prefix": POOL, "conversation": {"turns": {"dist": "fixed", "value": 2},
                                                                        "user_len": {"dist": "fixed", "value": 4}}},
                               "workload"),
    "pool-with-trace": ({"trace": {"path": "builtin:azure_conv", "max_requests": 5}, "shared_prefix": POOL},
                        "workload"),
    "pool-too-big": ({**STAGED, "shared_prefix": {"prefix_len": 4, "num_prefixes": 1000, "prompts_per_prefix": 1001}},
                     "workload.shared_prefix"),
    "pool-of-none": ({**STAGED, "shared_prefix": {**POOL, "prompts_per_prefix": 0}},
                     "workload.shared_prefix.prompts_per_prefix"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_stages_and_pools_are_one_line_errors(tmp_path, name):
    workload, key = BAD[name]
    data = scenario()
    data["workload"] = workload
    if name == "duration-inf":
        data["workload"] = {**STAGED, "load_stages": {"stages": [{"rate": 1, "duration_s": float("inf")}]}}
    line = run_broken(tmp_path, data, key)
    assert "Traceback" not in line


def test_the_executor_holds_a_stage_until_the_one_before_it_ended(tmp_path):
    """A tiny model served on the executor (the wall clock): stage 1's first request is sent its delay after the last
    request of stage 0 ended, every request ends, and the pool's prompts come back with their cached blocks."""
    import yaml

    from executor.serving.serve import serve
    from sim.config.plan import load_scenario
    from sim.policy.request import Status
    from sim.report.outputs import build_report
    from tests.helpers import tiny_checkpoint, write_tiny_scenario

    checkpoint = tiny_checkpoint(tmp_path / "tiny", seed=5)
    workload = {"seed": 1, "load_stages": {"stages": [{"rate": 40, "duration_s": 0.3}, {"rate": 60, "duration_s": 0.2}],
                                           "gap_s": 0.05},
                "prompt_len": {"dist": "uniform", "min": 20, "max": 40}, "output_len": {"dist": "fixed", "value": 4},
                "shared_prefix": {"prefix_len": 8, "num_prefixes": 2, "prompts_per_prefix": 2}}
    path = write_tiny_scenario(tmp_path, checkpoint, name="tiny-stages", kv_cache={"enable_prefix_caching": True})
    data = yaml.safe_load(path.read_text())
    data["workload"] = workload
    path.write_text(yaml.safe_dump(data))
    plan = load_scenario(path)[1]
    specs = generate_requests(plan.workload, plan.base_dir)
    records, traces, _, requests, wall_s, _ = serve(plan, specs, "cpu", threads=1)
    report = build_report(plan, records, traces, wall_s, engine="executor")
    assert all(r.status is Status.FINISHED for r in requests) and len(requests) == 24
    end0 = records.finish_s[records.id < 12].max()
    first1 = records.arrival_s[records.id >= 12].min()
    assert end0 + specs[12].stage_delay_s - 1e-6 <= first1 <= end0 + specs[12].stage_delay_s + 0.05
    assert [s["sent"] for s in report["stages"]] == [12, 12] and report["kv_cache"]["prefix_cache_hit_rate"] > 0.3


def test_a_capacity_search_refuses_load_stages():
    from sim.config.errors import ConfigError
    from sim.report.capacity import check_scalable

    with pytest.raises(ConfigError) as e:
        check_scalable(_specs())
    assert e.value.key_path == "workload.load_stages"

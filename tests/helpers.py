"""Small builders shared by the simulator tests."""
from __future__ import annotations

import copy

from sim.cluster import sim_records, simulate
from sim.report import build_report
from sim.scenario import make_plan, parse_scenario

BASE = {
    "model": "Llama-2-7B",
    "hardware": "A100-80GB",
    "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 300,
                 "prompt_len": {"dist": "lognormal", "median": 400, "sigma": 0.8, "max": 2000},
                 "output_len": {"dist": "lognormal", "median": 150, "sigma": 0.8, "max": 1000}},
}


def scenario(**overrides) -> dict:
    """BASE with nested overrides: scenario(serving={"max_num_seqs": 8}, workload={"seed": 3})."""
    s = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(s.get(key), dict):
            s[key] = {**s[key], **value}
        else:
            s[key] = value
    return s


def plan_of(data: dict):
    return make_plan(parse_scenario(data))


def run(data: dict, bulk: bool = True):
    """Simulate; returns (report.json content without wall_time_s, RunResult, RequestRecords)."""
    plan = plan_of(data)
    result = simulate(plan, bulk=bulk)
    rec = sim_records(result)
    report = build_report(plan, rec, result.replicas, wall_time_s=0.0)
    return report, result, rec

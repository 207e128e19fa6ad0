"""Pipeline parallelism on the executor (executor/distributed/pipeline.py): two stages give the single process's
greedy output with one and two batches in flight, and every stage's start and end is recorded."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine
from executor.distributed.pipeline import pipeline, stage_bounds
from tests.parallel_workloads import CASES, model, outputs, policy


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {c: outputs(make_engine(model(), policy(**k))) for c, k in CASES.items()}


@pytest.fixture(scope="module")
def pp2():
    with pipeline(model(), 2, timeout_s=30) as pipe:
        yield pipe


@pytest.mark.parametrize("engines", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_pipeline_greedy_output_is_the_single_process_s(pp2, reference, case, engines):
    engine = pp2.engine([policy(**CASES[case]) for _ in range(engines)])
    assert outputs(engine) == reference[case]
    assert {r.virtual_engine for r in engine.records} == set(range(engines))


def test_pipeline_records_every_stage_and_keeps_batches_in_flight(pp2):
    engine = pp2.engine([policy(), policy()])
    outputs(engine)
    recs = engine.records
    for r in recs:
        (a0, b0), (a1, b1) = r.stages
        assert r.start_s <= a0 <= b0 <= a1 <= b1 <= r.end_s  # stage 0, then stage 1, within the step
    # two batches in flight: a step of one virtual engine starts before the other's step in flight has ended
    assert any(b.start_s < a.end_s and a.virtual_engine != b.virtual_engine for a, b in zip(recs, recs[1:]))
    assert all(busy > 0 for busy in engine.stage_busy_s())


def test_stage_bounds_split_layers_evenly_later_stages_taking_the_rest():
    assert stage_bounds(30, 2) == [(0, 15), (15, 30)]
    assert stage_bounds(5, 2) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError):
        stage_bounds(4, 5)

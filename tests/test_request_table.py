"""A workload's requests are generated as columns and built as RequestSpecs once (issue 59): the specs are those
RequestSpec's own constructor makes, frozen and hashable like them; a table that is not one is refused."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from sim.config.workload import RequestSpec, specs_of

TABLE = {"id": [0, 1, 2], "arrival_s": [0.0, 0.5, 0.25], "prompt_len": [10, 20, 30], "output_len": [1, 2, 3],
         "prefix": [(7,), (), (7, 8)], "prefix_unit": [16, 0, 16], "conversation": [-1, 4, 4], "after": [-1, -1, 1],
         "think_s": [0.0, 0.0, 1.5], "users": [0, 2, 0], "stage": [-1, 0, 1], "stage_delay_s": [0.0, 0.1, 0.2],
         "in_s": [0.01, 0.02, 0.03], "front_s": [0.0, 0.001, 0.002], "out_s": [0.1, 0.2, 0.3],
         "close_s": [0.0, 0.5, 0.0], "warmup": [True, False, False]}


def test_every_field_as_the_constructor_sets_it():
    assert [f.name for f in dataclasses.fields(RequestSpec)] == list(TABLE)
    built = specs_of(TABLE)
    assert built == [RequestSpec(*row) for row in zip(*TABLE.values())]
    assert [repr(s) for s in built] == [repr(RequestSpec(*row)) for row in zip(*TABLE.values())]
    assert pickle.loads(pickle.dumps(built)) == built
    assert len({*built, *built}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].arrival_s = 1.0


def test_a_field_left_out_takes_its_default():
    plain = {k: TABLE[k] for k in ("id", "arrival_s", "prompt_len", "output_len")}
    assert specs_of(plain) == [RequestSpec(*row) for row in zip(*plain.values())]
    assert specs_of({k: [] for k in plain}) == []


@pytest.mark.parametrize("table", [{k: v for k, v in TABLE.items() if k != "output_len"},
                                   {**TABLE, "priority": [0, 0, 0]}, {**TABLE, "think_s": [0.0, 0.0]}])
def test_a_table_that_is_not_one_is_refused(table):
    with pytest.raises(TypeError, match="a request table needs"):
        specs_of(table)


def test_requestspec_has_no_post_init_that_specs_of_would_skip():
    assert not hasattr(RequestSpec, "__post_init__")

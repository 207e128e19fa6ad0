"""The dashboard's widgets take their choices, defaults and bounds from the scenario schema (dashboard/schema.py)."""
from __future__ import annotations

from dashboard.schema import choices, default, upper
from sim.config.models import ModelSpec
from sim.config.scenario import KVCacheConfig, ParallelConfig, ServingConfig, SpeculativeConfig


def test_choices_are_a_literal_fields_values_in_order_without_none():
    assert choices(ServingConfig, "batching") == ["continuous", "static"]
    assert choices(KVCacheConfig, "preemption") == ["recompute", "swap"]
    assert choices(ModelSpec, "kv_dtype") == ["fp32", "fp16", "bf16", "fp8", "int8"]  # Literal[...] | None
    assert choices(ModelSpec, "sparsity", exclude=("none",)) == ["2:4"]
    assert choices(ServingConfig, "max_num_seqs") == []  # not a Literal


def test_defaults_and_bounds_are_the_schemas():
    assert default(ServingConfig, "max_num_seqs") == ServingConfig().max_num_seqs
    assert default(KVCacheConfig, "block_size") == KVCacheConfig().block_size
    assert upper(ParallelConfig, "tensor_parallel_size") == 64
    assert upper(SpeculativeConfig, "num_speculative_tokens") == 64
    assert upper(ServingConfig, "max_num_seqs") is None

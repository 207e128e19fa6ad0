"""Tensor parallelism on the executor (executor/distributed/tensor_parallel.py): two ranks give the single
process's greedy output (mixed prefill/decode, chunked prefill, the sdpa and paged backends, swap preemption), each
holding its heads, KV heads and vocabulary slice."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine
from executor.distributed.tensor_parallel import check_tensor_parallel, tensor_parallel
from executor.model.tiny import tiny_config
from tests.parallel_workloads import CASES, model, outputs, policy


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the single-process engine, per attention backend and case."""
    torch.set_num_threads(1)
    return {(b, c): outputs(make_engine(model(b), policy(**k))) for b in ("sdpa", "paged") for c, k in CASES.items()}


@pytest.fixture(scope="module")
def tp2():
    with tensor_parallel(model(), 2, timeout_s=30) as tp:
        yield tp


@pytest.mark.parametrize("backend", ["sdpa", "paged"])
@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_greedy_output_is_the_single_process_s(tp2, reference, case, backend):
    tp2.model.attn_backend = backend  # the workers take the driver's backend with each new engine
    assert outputs(tp2.engine(policy(**CASES[case]))) == reference[backend, case]


def test_tensor_parallel_shards_heads_and_the_kv_cache(tp2):
    tp = tp2
    engine = tp.engine(policy())
    c = tp.model.config
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (2, 1, 64)
    assert engine.kv_cache.data.shape[-2] == 1  # this rank's KV head only
    assert tp.model.lm_head.weight.shape[0] == 150  # its half of the vocabulary


def test_tensor_parallel_swaps_blocks_on_every_rank(tp2, reference):
    """Too few blocks: requests are preempted to host memory and back; the output is unchanged."""
    tp2.model.attn_backend = "sdpa"
    engine = tp2.engine(policy(num_blocks=20, swap_blocks=64, preemption="swap"))
    assert outputs(engine) == reference["sdpa", "mixed"]
    assert engine.scheduler.num_preemptions > 0


def test_tensor_parallel_size_must_split_heads_and_columns():
    smollm2 = tiny_config(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
    check_tensor_parallel(smollm2, 3)
    with pytest.raises(ValueError, match="does not divide the 9 attention heads"):
        check_tensor_parallel(smollm2, 2)

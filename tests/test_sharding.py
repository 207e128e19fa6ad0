"""One rule for how a model splits over tensor parallelism (sim/config/sharding.py), and its readers agree on it."""
from __future__ import annotations

import pytest

from sim.config.models import catalog_model
from sim.config.plan import plan_of
from sim.config.sharding import LayerShape, shard, vocab_shard
from sim.cost.kernels import layer_gemms


def test_heads_split_and_kv_heads_are_replicated_past_their_count():
    s = shard(LayerShape(64, 8, 28672), 8)
    assert (s.heads, s.kv_heads, s.kv_replicas, s.intermediate) == (8, 1, 1, 3584)
    s = shard(LayerShape(64, 8, 28672), 16)  # more devices than KV heads: a copy of one on each pair
    assert (s.heads, s.kv_heads, s.kv_replicas) == (4, 1, 2)
    assert [s.kv_head_of(rank) for rank in range(16)] == [r // 2 for r in range(16)]
    assert s.kv_bytes(1024.0) == 128.0  # one of the 8 KV heads' share
    assert vocab_shard(32000, 3) == 10667


@pytest.mark.parametrize("shape, tp, message", [
    (LayerShape(32, 8, 11008), 3, "3 does not divide the 32 attention heads; allowed: 1, 2, 4, 8, 16, 32"),
    (LayerShape(9, 3, 1536), 2, "2 does not divide the 9 attention heads"),
    (LayerShape(12, 8, 1536), 6, "6 neither divides nor is a multiple of the 8 KV heads"),
])
def test_a_split_the_heads_do_not_allow_says_what_does(shape, tp, message):
    with pytest.raises(ValueError, match=message):
        shard(shape, tp)


def test_the_plan_the_roofline_and_the_kernel_shapes_read_the_same_split():
    model = catalog_model("Llama-3-70B")
    plan = plan_of({"name": "t", "model": "Llama-3-70B", "hardware": "H100-SXM",
                    "parallel": {"tensor_parallel_size": 8},
                    "workload": {"arrival": {"process": "poisson", "rate": 1}, "num_requests": 1,
                                 "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8}}})
    s = shard(model, 8)
    assert plan.kv_bytes_per_token == model.kv_bytes_per_token * s.kv_heads / model.num_kv_heads
    qkv = layer_gemms(model.hidden_size, model.num_heads, model.num_kv_heads, model.head_size,
                      model.intermediate_size, 8, 1)[0]
    assert qkv[2] == (s.heads + 2 * s.kv_heads) * model.head_size

"""Compression on the executor, apart from the quantized kernels (tests/test_quantized.py): 2:4 pruning, the quality
measures (perplexity through the executor's own forward, greedy agreement), and scenarios that compress the model
served end to end with every request accounted for."""
from __future__ import annotations

import math

import pytest
import torch

from executor.model.quality import agreement, perplexity
from executor.model.sparsity import decoder_linears, prune_2_4_, prune_model_2_4, sparsity
from executor.model.tiny import tiny_model, to_transformers
from sim.config.errors import ConfigError
from tests.helpers import tiny_checkpoint, write_tiny_scenario


def test_2_4_pruning_keeps_the_two_largest_of_every_four_inputs():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 4.0, 1.0, -1.5, 0.0]])
    prune_2_4_(w)
    assert w.tolist() == [[0.0, -3.0, 2.0, 0.0, 4.0, 0.0, -1.5, 0.0]]
    big = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    kept = prune_2_4_(big.clone()).view(64, 24, 4)
    assert ((kept != 0).sum(-1) == 2).all()  # exactly 2 of every 4
    with pytest.raises(ValueError, match="divisible by 4"):
        prune_2_4_(torch.ones(4, 6))


def test_pruning_a_model_zeroes_half_its_decoder_weights_and_leaves_the_rest():
    model = tiny_model(seed=1, num_layers=2)
    head = model.lm_head.weight.clone() if hasattr(model, "lm_head") else None
    assert sparsity(model) < 0.01
    prune_model_2_4(model)
    assert sparsity(model) == pytest.approx(0.5)
    assert len(decoder_linears(model)) >= 2 * 4
    if head is not None:
        assert torch.equal(model.lm_head.weight, head)  # embedding and LM head are not pruned


def test_perplexity_through_the_paged_forward_is_transformers_loss():
    model = tiny_model(seed=2, num_layers=2, vocab_size=256)
    ids = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = perplexity(model, ids, window=100)
    with torch.no_grad():
        loss = to_transformers(model)(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert ours == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert perplexity(model, ids, window=32) > 1.0  # windows of fresh context: defined, finite
    assert math.isfinite(perplexity(model, ids, window=32))


def test_agreement_counts_tokens_up_to_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    a = agreement(ref, [[1, 2, 9, 4], [5, 6], [7, 8]])
    assert a.first_divergence == [2, None, 2]
    assert a.token_agreement == pytest.approx((2 + 2 + 2) / 9) and a.exact_match == pytest.approx(1 / 3)
    assert agreement(ref, ref).token_agreement == 1.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=4)


@pytest.mark.parametrize("model", [{"sparsity": "2:4"}, {"weight_dtype": "int8"}, {"weight_dtype": "int4"},
                                   {"weight_dtype": "int8", "kv_dtype": "int8"}])
def test_a_compressed_scenario_serves_every_request(tmp_path, checkpoint, model):
    from infersim.api import serve_scenario

    path = write_tiny_scenario(tmp_path, checkpoint, model=model)
    rq = serve_scenario(path, None, quiet=True, plots=False)["requests"]
    assert rq["arrived"] == 24 == rq["completed"] + rq["rejected"] and rq["completed"] == 24


@pytest.mark.parametrize("model, where, what", [
    ({"weight_dtype": "fp8"}, "model.weight_dtype", "fp8 weights need a GPU"),
    ({"kv_dtype": "fp8"}, "model.kv_dtype", "int8 or leave it out"),
])
def test_what_the_cpu_executor_cannot_run_is_one_line(tmp_path, checkpoint, model, where, what):
    from infersim.api import serve_scenario

    path = write_tiny_scenario(tmp_path, checkpoint, model=model)
    with pytest.raises(ConfigError) as e:
        serve_scenario(path, None, quiet=True, plots=False)
    assert e.value.key_path == where and what in e.value.message


def test_a_parallel_serve_of_a_compressed_model_is_one_line(tmp_path, checkpoint):
    from infersim.api import serve_scenario

    path = write_tiny_scenario(tmp_path, checkpoint, model={"weight_dtype": "int8"},
                               parallel={"tensor_parallel_size": 2})
    with pytest.raises(ConfigError) as e:
        serve_scenario(path, None, quiet=True, plots=False)
    assert e.value.key_path == "model" and "uncompressed" in e.value.message

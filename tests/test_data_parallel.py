"""Data-parallel ranks of a MoE model (executor/distributed/data_parallel.py): two processes, each its own requests, KV
cache and attention, with the experts spread over them either whole (expert parallelism: half the experts each, rows
exchanged by all-to-all over gloo) or sliced (without it: half of every expert's columns each, every rank's tokens
gathered and the outputs reduce-scattered, gathered_moe.py). The greedy tokens are one process's with every expert;
without EP the bytes each rank moves are the simulator's for the same tokens (sim/cost/blocks.py:
gather_combine_s)."""
from __future__ import annotations

import functools

import pytest
import torch

from executor.core.build import make_engine, run_offline
from executor.distributed.data_parallel import data_parallel_outputs, data_parallel_run, moe_blocks
from executor.distributed.gathered_moe import sliced_experts
from executor.model.families import tiny_twin
from executor.model.from_spec import model_spec
from executor.model.sampling import SamplingParams
from sim.config.expert_parallel import ExpertLayout
from sim.config.plan import scheduler_config
from sim.config.sharding import shard
from sim.cost.blocks import step_blocks
from sim.cost.comm import Interconnect
from sim.policy.build import model_allocator
from sim.policy.scheduler import make_scheduler
from tests.parallel_workloads import MAX_TOKENS, PROMPTS

CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24, "prefill_chunk_size": 24}


def twin_policy(spec, num_blocks: int = 96, **knobs):
    """A rank's scheduler over the twin's KV groups (module level: it travels pickled to the ranks)."""
    cfg = scheduler_config(256, **{"max_num_seqs": 3, "max_num_batched_tokens": 256, **knobs})
    return make_scheduler(cfg, model_allocator(spec, num_blocks, 8, 256, cfg.prefill_chunk_size))


def twin(family: str):
    """The family's tiny twin and its ranks' policy maker (gpt-oss's with chunked prefill)."""
    model = tiny_twin(family, seed=7, vocab_size=300)
    return model, functools.partial(twin_policy, model_spec(model.config), **(CHUNKED if family == "gpt_oss" else {}))


def one_process(model, make_policy, prompts, steps) -> list[list[int]]:
    one = make_engine(model, make_policy(), SamplingParams())
    return [one.output_ids(r) for r in run_offline(one, prompts, steps)]


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "sliced"])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2"])
def test_two_data_parallel_ranks_give_one_process_s_tokens(family, expert_parallel):
    """gpt-oss's twin (its 4 experts, biases and clamped SwiGLU split 2 + 2, or each expert's 32 columns 16 + 16,
    the down bias added once) and DeepSeek's (latent attention on each rank, 8 experts split 4 + 4 or sliced, a
    dense first layer); the ranks get different numbers of requests and prompt lengths, so one often steps idle
    while the other computes. Sliced, each token's output is two partial sums added: the tokens stay the same."""
    model, make_policy = twin(family)
    prompts, steps = PROMPTS[:7], MAX_TOKENS[:7]
    expected = one_process(model, make_policy, prompts, steps)
    assert data_parallel_outputs(model, 2, make_policy, prompts, steps, SamplingParams(),
                                 expert_parallel=expert_parallel) == expected


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2"])
def test_the_ranks_slices_sum_to_the_whole_experts(family, world):
    """Every rank's slice run on the same tokens, summed, is the experts' output whole (gpt-oss's down bias counted
    once), to fp32 rounding: the partial sums are added in another order than one matmul's (measured: 5e-7 at
    most against outputs up to 2.7), which the greedy tokens above do not notice."""
    block = moe_blocks(twin(family)[0])[0]
    x = torch.randn(50, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    weights, experts = block.route(x)
    whole = block.experts(x, weights, experts)
    parts = sum(sliced_experts(block.experts, r, world)(x, weights, experts) for r in range(world))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def simulated_bytes(model, world: int, tokens: int) -> float:
    """The simulator's bytes one device moves in the MoE layers' exchanges of `tokens` gathered tokens, DP `world`
    without EP: its gather_combine_s over a link of 1 byte/s and no latency."""
    spec = model_spec(model.config)
    blocks = step_blocks(spec, shard(spec, 1), ExpertLayout(1, world, False), 0.0, spec.act_bytes)
    return blocks.gather_combine_s(Interconnect(1.0, 0.0, "switch"), tokens)


def test_sliced_ranks_move_the_bytes_the_simulator_prices():
    """Each rank gathers the tokens it does not hold (hidden states and router logits) and reduce-scatters the
    partial outputs of the tokens others hold; averaged over the ranks that is (n−1)/n of every gathered token's
    H + E and H values, what the simulator prices a device of balanced ranks, whatever the ranks' imbalance."""
    model, make_policy = twin("deepseek_v2")
    prompts, steps = PROMPTS[1:6], [9, 4, 13, 6, 8]
    run = data_parallel_run(model, 2, make_policy, prompts, steps, SamplingParams(), expert_parallel=False)
    assert run.outputs == one_process(model, make_policy, prompts, steps)
    a, b = run.traffic
    assert a.tokens == b.tokens > 0  # every rank gathers every token of every MoE layer
    assert a.gather_sent + b.gather_sent == a.gather_received + b.gather_received > 0
    assert a.scatter_sent + b.scatter_sent == a.scatter_received + b.scatter_received > 0
    assert a.gather_received != b.gather_received  # the ranks ran different numbers of tokens
    assert (a.gather_received + a.scatter_sent + b.gather_received + b.scatter_sent) / 2 == \
        simulated_bytes(model, 2, a.tokens)
    c = model.config  # a gathered row: hidden state and router logits, fp32
    assert a.gather_received + b.gather_received == a.tokens * (c.hidden_size + c.num_experts) * 4


def test_a_rank_with_no_requests_takes_part_in_every_exchange():
    """One request over two ranks: rank 1 runs every MoE layer's gather and reduce-scatter with no tokens of its
    own, all along."""
    model, make_policy = twin("gpt_oss")
    prompts, steps = PROMPTS[2:3], [10]
    run = data_parallel_run(model, 2, make_policy, prompts, steps, SamplingParams(), expert_parallel=False)
    assert run.outputs == one_process(model, make_policy, prompts, steps)
    busy, idle = run.traffic
    assert idle.gather_sent == idle.scatter_received == busy.gather_received == busy.scatter_sent == 0
    assert idle.gather_received == busy.gather_sent > 0 and idle.tokens == busy.tokens


def test_ranks_must_divide_an_expert_s_columns():
    model, make_policy = twin("gpt_oss")  # experts 32 columns wide, 4 experts
    with pytest.raises(ValueError, match="data_parallel_size 3 does not divide an expert's 32 columns"):
        data_parallel_outputs(model, 3, make_policy, PROMPTS[:2], MAX_TOKENS[:2], expert_parallel=False)
    with pytest.raises(ValueError, match="data_parallel_size 3 does not divide the 4 experts"):
        data_parallel_outputs(model, 3, make_policy, PROMPTS[:2], MAX_TOKENS[:2])

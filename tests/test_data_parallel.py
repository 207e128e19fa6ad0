"""Data-parallel ranks of a MoE model (executor/distributed/data_parallel.py): two processes, each its own requests, KV
cache and attention, with the experts spread over them sliced (without expert parallelism: half of every expert's
columns each) or whole (expert parallelism: half the experts each), the tokens exchanged over gloo on vLLM's default
all2all backend (every rank's tokens gathered and the outputs reduce-scattered, gathered_moe.py) or, with EP, on the
all_to_all one (rows dispatched to their experts' owners, dispatched_moe.py). The greedy tokens are one process's
with every expert; the bytes each rank moves are what the simulator prices for the same tokens and backend
(sim/cost/blocks.py: dispatch_s)."""
from __future__ import annotations

import functools

import pytest
import torch

from executor.core.build import make_engine, run_offline
from executor.distributed.data_parallel import data_parallel_outputs, data_parallel_run
from executor.distributed.expert_shares import OwnedExperts, sliced_experts
from executor.model.families import tiny_twin
from executor.model.from_spec import model_spec
from executor.model.moe import moe_blocks
from executor.model.mxfp4 import pack_experts
from executor.model.sampling import SamplingParams
from sim.config.expert_parallel import ExpertLayout
from sim.config.plan import scheduler_config
from sim.config.sharding import shard
from sim.cost.blocks import step_blocks
from sim.cost.comm import Interconnect
from sim.policy.build import model_allocator
from sim.policy.scheduler import make_scheduler
from tests.parallel_workloads import MAX_TOKENS, PROMPTS

# (expert_parallel, all2all_backend) of each form the ranks run
FORMS = {"sliced": (False, "allgather_reducescatter"), "ep": (True, "allgather_reducescatter"),
         "ep_all_to_all": (True, "all_to_all")}
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


def form(name: str) -> dict:
    """data_parallel_run's keywords for one of FORMS."""
    expert_parallel, backend = FORMS[name]
    return {"expert_parallel": expert_parallel, "all2all_backend": backend}


@pytest.mark.parametrize("name", list(FORMS))
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2"])
def test_two_data_parallel_ranks_give_one_process_s_tokens(family, name):
    """gpt-oss's twin (its 4 experts, biases and clamped SwiGLU split 2 + 2, or each expert's 32 columns 16 + 16,
    the down bias added once) and DeepSeek's (latent attention on each rank, 8 experts split 4 + 4 or sliced, a
    dense first layer); the ranks get different numbers of requests and prompt lengths, so one often steps idle
    while the other computes. Gathered (sliced, or EP on vLLM's default backend), each token's output is two partial
    sums added: the tokens stay the same."""
    model, make_policy = twin(family)
    prompts, steps = PROMPTS[:7], MAX_TOKENS[:7]
    expected = one_process(model, make_policy, prompts, steps)
    assert data_parallel_outputs(model, 2, make_policy, prompts, steps, SamplingParams(), **form(name)) == expected


@pytest.mark.parametrize("share", [sliced_experts, OwnedExperts.of], ids=["sliced", "owned"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2"])
def test_the_ranks_shares_sum_to_the_whole_experts(family, world, share):
    """Every rank's share run on the same tokens — a slice of every expert, or its own experts on the choices routed
    to them — summed, is the experts' output whole (gpt-oss's down bias counted once; MXFP4 experts dequantized), to
    fp32 rounding: the partial sums are added in another order than one matmul's (measured: 5e-7 at most against
    outputs up to 2.7), which the greedy tokens above do not notice."""
    model = twin(family.removesuffix("_mxfp4"))[0]
    if family.endswith("_mxfp4"):
        pack_experts(model)
    block = moe_blocks(model)[0]
    x = torch.randn(50, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    weights, experts = block.route(x)
    whole = block.experts(x, weights, experts)
    parts = [share(block.experts, r, world)(x, weights, experts) for r in range(world)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert all(p.abs().sum() > 0 for p in parts)  # every rank's share did part of the work


def simulated_bytes(model, world: int, tokens: int, expert_parallel: bool = False,
                    backend: str = "allgather_reducescatter") -> float:
    """The simulator's bytes one device moves in the MoE layers' exchanges across `world` DP ranks of `tokens` tokens
    (every rank's, summed over the MoE layers) on `backend`: its dispatch_s over a link of 1 byte/s and no latency,
    for tokens / layers a layer (it is linear in them)."""
    spec = model_spec(model.config)
    blocks = step_blocks(spec, shard(spec, 1), ExpertLayout(1, world, expert_parallel, backend), 0.0, spec.act_bytes)
    return blocks.dispatch_s(Interconnect(1.0, 0.0, "switch"), tokens / blocks.moe_layers)


def bytes_run(name: str):
    """The DeepSeek twin's 5 requests over two ranks of form `name`: the run, after checking its tokens."""
    model, make_policy = twin("deepseek_v2")
    prompts, steps = PROMPTS[1:6], [9, 4, 13, 6, 8]
    run = data_parallel_run(model, 2, make_policy, prompts, steps, SamplingParams(), **form(name))
    assert run.outputs == one_process(model, make_policy, prompts, steps)
    return model, run


@pytest.mark.parametrize("name", ["sliced", "ep"])
def test_gathering_ranks_move_the_bytes_the_simulator_prices(name):
    """Each rank gathers the tokens it does not hold (hidden states and router logits) and reduce-scatters the
    partial outputs of the tokens others hold; averaged over the ranks that is (n−1)/n of every gathered token's
    H + E and H values, what the simulator prices a device of balanced ranks, whatever the ranks' imbalance — with
    the experts sliced or, on vLLM's default backend, whole: the same bytes (193,120 a rank, 710 tokens)."""
    model, run = bytes_run(name)
    a, b = run.traffic
    assert a.tokens == b.tokens == 710  # every rank gathers every token of every MoE layer
    assert a.dispatch_sent + b.dispatch_sent == a.dispatch_received + b.dispatch_received > 0
    assert a.combine_sent + b.combine_sent == a.combine_received + b.combine_received > 0
    assert a.dispatch_received != b.dispatch_received  # the ranks ran different numbers of tokens
    mean = (a.dispatch_received + a.combine_sent + b.dispatch_received + b.combine_sent) / 2
    assert mean == pytest.approx(simulated_bytes(model, 2, a.tokens, *FORMS[name]), rel=1e-12)
    assert mean == 193_120
    c = model.config  # a gathered row: hidden state and router logits, fp32
    assert a.dispatch_received + b.dispatch_received == a.tokens * (c.hidden_size + c.num_experts) * 4


def test_all_to_all_ranks_move_the_simulator_s_bytes_at_its_routing():
    """On the all_to_all backend a rank sends each of its rows (a token's choice) routed to another rank's expert
    and gets its output back; the simulator prices a device (n−1)/n of its T·k/n rows each way, uniform routing.
    The executor's bytes are the simulator's once scaled by the share of rows that really crossed ranks against
    (n−1)/n: the per-row bytes (H, fp32), the row per chosen expert and the two exchanges are the simulator's."""
    model, run = bytes_run("ep_all_to_all")
    a, b = run.traffic
    c = model.config
    row = c.hidden_size * 4
    assert a.tokens == b.tokens == 0 and a.rows != b.rows  # nothing gathered; the ranks ran different tokens
    assert (a.rows + b.rows) == 710 * c.num_experts_per_tok  # every token's k choices, as the gathered runs' 710
    assert a.dispatch_sent == b.dispatch_received == b.combine_sent == a.combine_received > 0
    assert b.dispatch_sent == a.dispatch_received == a.combine_sent == b.combine_received > 0
    crossed = (a.dispatch_sent + b.dispatch_sent) / row / (a.rows + b.rows)
    mean = (a.dispatch_sent + a.combine_sent + b.dispatch_sent + b.combine_sent) / 2
    uniform = simulated_bytes(model, 2, (a.rows + b.rows) // c.num_experts_per_tok, *FORMS["ep_all_to_all"])
    assert mean == pytest.approx(uniform * crossed / (1 / 2), rel=1e-12)
    print(f"all_to_all: {mean:.0f} bytes a rank, simulator {uniform:.0f}, rows crossing {crossed:.4f}")


@pytest.mark.parametrize("name", list(FORMS))
def test_a_rank_with_no_requests_takes_part_in_every_exchange(name):
    """One request over two ranks: rank 1 runs every MoE layer's exchanges with no tokens of its own, all along."""
    model, make_policy = twin("gpt_oss")
    prompts, steps = PROMPTS[2:3], [10]
    run = data_parallel_run(model, 2, make_policy, prompts, steps, SamplingParams(), **form(name))
    assert run.outputs == one_process(model, make_policy, prompts, steps)
    busy, idle = run.traffic
    assert idle.dispatch_sent == idle.combine_received == busy.dispatch_received == busy.combine_sent == 0
    assert idle.dispatch_received == busy.dispatch_sent > 0 and idle.combine_sent == busy.combine_received > 0
    assert idle.tokens == busy.tokens and idle.rows == 0


def test_ranks_must_divide_an_expert_s_columns():
    model, make_policy = twin("gpt_oss")  # experts 32 columns wide, 4 experts
    with pytest.raises(ValueError, match="data_parallel_size 3 does not divide an expert's 32 columns"):
        data_parallel_outputs(model, 3, make_policy, PROMPTS[:2], MAX_TOKENS[:2], expert_parallel=False)
    with pytest.raises(ValueError, match="data_parallel_size 3 does not divide the 4 experts"):
        data_parallel_outputs(model, 3, make_policy, PROMPTS[:2], MAX_TOKENS[:2])


def test_backends_the_executor_does_not_run_are_one_line_errors():
    model, make_policy = twin("gpt_oss")
    with pytest.raises(ValueError, match="all2all_backend 'deepep_low_latency' is not run by the executor's "
                                         "data-parallel ranks; allowed: allgather_reducescatter"):
        data_parallel_outputs(model, 2, make_policy, PROMPTS[:2], MAX_TOKENS[:2], all2all_backend="deepep_low_latency")
    with pytest.raises(ValueError, match="all2all_backend all_to_all sends routed rows to experts held whole"):
        data_parallel_outputs(model, 2, make_policy, PROMPTS[:2], MAX_TOKENS[:2], expert_parallel=False,
                              all2all_backend="all_to_all")

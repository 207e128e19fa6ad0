"""Data-parallel attention ranks over expert-parallel MoE (executor/distributed/data_parallel.py): two processes, each
its own requests, KV cache and attention, half of every MoE layer's experts, the rows exchanged by all-to-all over
gloo; the greedy tokens are one process's with every expert."""
from __future__ import annotations

import functools

import pytest

from executor.core.build import make_engine, run_offline
from executor.distributed.data_parallel import data_parallel_outputs
from executor.model.families import tiny_twin
from executor.model.from_spec import model_spec
from executor.model.sampling import SamplingParams
from sim.config.plan import scheduler_config
from sim.policy.build import model_allocator
from sim.policy.scheduler import make_scheduler
from tests.parallel_workloads import MAX_TOKENS, PROMPTS


def twin_policy(spec, num_blocks: int = 96, **knobs):
    """A rank's scheduler over the twin's KV groups (module level: it travels pickled to the ranks)."""
    cfg = scheduler_config(256, **{"max_num_seqs": 3, "max_num_batched_tokens": 256, **knobs})
    return make_scheduler(cfg, model_allocator(spec, num_blocks, 8, 256, cfg.prefill_chunk_size))


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2"])
def test_two_data_parallel_ranks_give_one_process_s_tokens(family):
    """gpt-oss's twin (its 4 experts, biases and clamped SwiGLU split 2 + 2) and DeepSeek's (latent attention
    on each rank, 8 experts split 4 + 4, a dense first layer); the ranks get different numbers of requests and
    prompt lengths, so one often steps idle while the other computes."""
    model = tiny_twin(family, seed=7, vocab_size=300)
    make_policy = functools.partial(twin_policy, model_spec(model.config), **({"enable_chunked_prefill": True,
                                                                                "max_num_batched_tokens": 24,
                                                                                "prefill_chunk_size": 24}
                                                                               if family == "gpt_oss" else {}))
    prompts, steps = PROMPTS[:7], MAX_TOKENS[:7]
    one = make_engine(model, make_policy(), SamplingParams())
    expected = [one.output_ids(r) for r in run_offline(one, prompts, steps)]
    assert data_parallel_outputs(model, 2, make_policy, prompts, steps, SamplingParams()) == expected

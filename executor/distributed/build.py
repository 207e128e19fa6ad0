"""A plan's tensor- or pipeline-parallel engine for serving: the process group started, the model split, the
engine built over it, and all of it torn down when the serve ends."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from executor.distributed.pipeline import pipeline
from executor.distributed.tensor_parallel import check_tensor_parallel, tensor_parallel
from executor.model.llama import LlamaModel
from executor.model.sampling import SamplingParams
from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.policy.build import make_policy

TIMEOUT_S = 300.0  # the longest the driver waits on a worker in one step (a 2048-token prompt step takes ~2 s)


def parallel_threads(plan: Plan, threads: int | None = None) -> int:
    """torch threads per process: `threads`, else executor.threads, else the cores shared among the processes."""
    world = plan.sharding.tp * plan.pipeline_parallel_size
    return threads or plan.executor.threads or max(1, (os.cpu_count() or 1) // world)


def check_parallel(plan: Plan, model: LlamaModel) -> None:
    """What the executor's parallel engines run, as one-line errors: TP or PP (not both yet), no speculation."""
    tp, pp = plan.sharding.tp, plan.pipeline_parallel_size
    if tp > 1 and pp > 1:
        raise ConfigError(f"the executor runs tensor or pipeline parallelism, not both (here {tp} x {pp}); the "
                          "simulator prices both", "parallel.pipeline_parallel_size")
    if plan.speculative is not None:
        raise ConfigError("the executor's parallel engines run without speculative decoding; remove speculative "
                          "or set tensor_parallel_size and pipeline_parallel_size to 1", "speculative")
    m = plan.model
    if m.weight_dtype in ("int8", "int4", "fp8") or m.kv_dtype == "int8" or m.sparsity != "none":
        raise ConfigError("the executor's parallel engines shard uncompressed weights and KV (compressed, they "
                          "would run dequantized: no gain); allowed with parallel: fp32/bf16 weights and KV, no "
                          "sparsity", "model")
    if pp > 1 and model.config.num_experts:  # a stage's layers are numbered from 0: MoE placement would shift
        raise ConfigError("the executor splits a mixture of experts over tensor-parallel ranks (with or without "
                          "enable_expert_parallel), not pipeline stages", "parallel.pipeline_parallel_size")
    if tp > 1:
        try:
            check_tensor_parallel(model.config, tp)
        except ValueError as e:
            raise ConfigError(str(e), "parallel.tensor_parallel_size") from None


@contextmanager
def parallel_engine(plan: Plan, model: LlamaModel, sampling: SamplingParams, eos_token_id: int | None,
                    threads: int | None = None) -> Iterator:
    """(the plan's engine, the worker processes' pids): an Engine over tensor_parallel_size ranks or a
    PipelineEngine over pipeline_parallel_size stages with virtual_engines batches in flight, `parallel_threads`
    torch threads a process."""
    # where the plan's layout meets the model: a mixture of experts sharded whole or sliced (moe_parallel.py)
    model.config = replace(model.config, expert_parallel=plan.expert_layout.enable_expert_parallel)
    check_parallel(plan, model)
    n = parallel_threads(plan, threads)
    if plan.sharding.tp > 1:
        with tensor_parallel(model, plan.sharding.tp, n, TIMEOUT_S) as tp:
            yield tp.engine(make_policy(plan, eager=True), sampling, eos_token_id), tp.group.pids
    else:
        with pipeline(model, plan.pipeline_parallel_size, n, TIMEOUT_S) as pipe:
            policies = [make_policy(plan, eager=True) for _ in range(plan.virtual_engines)]
            yield pipe.engine(policies, sampling, eos_token_id, plan.router), pipe.group.pids

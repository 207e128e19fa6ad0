"""Building an engine over a model and a policy, and running it to completion offline."""
from __future__ import annotations

from executor.cache_engine import KVCache
from executor.engine import Engine
from executor.model import LlamaModel
from executor.sampling import SamplingParams
from sim.policy.request import Request
from sim.policy.scheduler import Scheduler


def make_engine(model: LlamaModel, policy: Scheduler, sampling: SamplingParams | None = None,
                eos_token_id: int | None = None, drafter=None, use_graphs: bool | None = None,
                runner_factory=None) -> Engine:
    """An engine running `model` under `policy` (a scheduler and its block allocator), with KV tensors for the
    allocator's blocks in the model's dtype on its device, and host swap space for its swap blocks. The one
    place engines are built: serves, profile sweeps, distillation and the benches. `runner_factory`: the runner
    of a rank's shard or a stage's layers (executor.distributed), made as Engine makes its ModelRunner."""
    p = next(model.parameters())
    kv = policy.kv
    cache = KVCache.for_model(model.config, kv.num_blocks, kv.block_size, p.dtype, p.device)
    host = KVCache.for_model(model.config, kv.num_swap_blocks, kv.block_size, p.dtype, "cpu") \
        if kv.num_swap_blocks else None
    return Engine(model, policy, cache, sampling or SamplingParams(), eos_token_id, host_cache=host,
                  drafter=drafter, use_graphs=use_graphs, runner_factory=runner_factory)


def run_offline(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Offline inference: every prompt queued at t=0, steps run until all are done; the requests, in order."""
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r, p in zip(reqs, prompts):
        engine.add(r, p)
    while engine.has_work():
        engine.step()
    return reqs

"""Building an engine over a model and a policy, and running it to completion offline."""
from __future__ import annotations

from executor.core.engine import Engine
from executor.core.engine_core import run_until_done
from executor.model.cache_engine import KVCache
from executor.model.llama import LlamaModel
from executor.model.sampling import SamplingParams
from sim.policy.request import Request
from sim.policy.scheduler import Scheduler


def make_engine(model: LlamaModel, policy: Scheduler, sampling: SamplingParams | None = None,
                eos_token_id: int | None = None, drafter=None, use_graphs: bool | None = None,
                runner_factory=None, kv_dtype: str | None = None) -> Engine:
    """An engine running `model` under `policy` (a scheduler and its block allocator), with KV tensors for the
    allocator's blocks in the model's dtype on its device (`kv_dtype="int8"`: int8 with a scale per token and head),
    and host swap space for its swap blocks. The one place engines are built: serves, profile sweeps,
    distillation and the benches. `runner_factory`: the runner of a rank's shard or a stage's layers
    (executor.distributed), made as Engine makes its ModelRunner. `kv_dtype` None: the model's own `kv_dtype`
    attribute if it has one (executor.serving.serve.compress sets it). An int8 KV cache runs eagerly (use_graphs None
    means off then; True is an error); so do a mixture-of-experts model and a hybrid one (its own `make_cache`)."""
    p = next(model.parameters())
    kv_dtype = kv_dtype or getattr(model, "kv_dtype", None)  # a served model carries its scenario's (executor.serving.serve)
    dtype = model.embed_tokens.weight.dtype  # the activations' dtype (quantized layers hold int8 buffers)
    kv = policy.kv
    if kv_dtype is not None and use_graphs is None:
        use_graphs = False
    if model.config.num_experts:  # routing sorts tokens by expert with host-side counts: no static graph holds it
        use_graphs = False
    if hasattr(model, "make_cache"):  # a hybrid model's pages follow the allocator's groups (executor.model.hybrid)
        if kv_dtype is not None or use_graphs:
            raise ValueError("a hybrid model keeps its KV in its own dtype and runs eagerly: no int8 KV, no graphs")
        use_graphs = False
        cache = model.make_cache(kv, kv.num_blocks, dtype, p.device)
        host = model.make_cache(kv, kv.num_swap_blocks, dtype, "cpu") if kv.num_swap_blocks else None
    else:
        cache = KVCache.for_model(model.config, kv.num_blocks, kv.block_size, dtype, p.device, kv_dtype)
        host = KVCache.for_model(model.config, kv.num_swap_blocks, kv.block_size, dtype, "cpu", kv_dtype) \
            if kv.num_swap_blocks else None
    return Engine(model, policy, cache, sampling or SamplingParams(), eos_token_id, host_cache=host,
                  drafter=drafter, use_graphs=use_graphs, runner_factory=runner_factory)


def run_offline(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Offline inference: every prompt queued at t=0, the engine core run until all are done; the requests, in
    order."""
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    run_until_done(engine, zip(reqs, prompts))
    return reqs

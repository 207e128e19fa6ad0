"""Tensor parallelism, Megatron-style, over the ranks of a process group (launch.py).

Each rank holds a shard: the qkv projection column-parallel (its query heads and its KV heads), gate·up
column-parallel (its columns of the MLP), o_proj and down_proj row-parallel with one all-reduce of their output
after each (two a layer), the KV cache of its KV heads only; the embedding and the norms are replicated, so every
rank carries the same residual stream. The LM head is vocab-parallel: each rank computes the logits of a 1/n slice
of the vocabulary and rank 0 gathers them. On the driver it would have streamed the whole [vocab, hidden] matrix
(SmolLM2-135M: 28M of its 135M weights, the cost of ~8 of its 30 layers in a decode step) while the other ranks
waited; split, it costs each rank a 1/n share plus a gather of the sampled rows' logits.

The driver (rank 0) keeps the Engine — scheduler, sampling, the serve loop — and its own shard: each step it
broadcasts the step's inputs (messages.py) and then every rank runs the same forward (`TensorParallelRunner`, a
ModelRunner that broadcasts first; the workers run plain ModelRunners in `tp_worker`). All-reduce and gather go
through shared memory on the CPU (shm.py), through torch.distributed elsewhere (NCCL on CUDA, untested here).
"""
from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from executor.core.build import make_engine
from executor.core.engine import Engine
from executor.core.malloc_tuning import keep_freed_memory
from executor.core.model_runner import ModelRunner, StepInput
from executor.distributed import messages
from executor.distributed.launch import Group, collective, launch
from executor.distributed.moe_parallel import (
    check_moe_parallel,
    moe_shard_fields,
    moe_shard_state,
    parallel_moe_block,
    swiglu_columns,
)
from executor.distributed.shm import ShmCollectives, make_buffers
from executor.model.cache_engine import KVCache
from executor.model.layers import Linear
from executor.model.llama import LlamaConfig, LlamaModel
from executor.model.moe import SparseMoeBlock
from executor.model.sampling import SamplingParams
from sim.config.sharding import shard, vocab_shard

SHM_CAPACITY = 1 << 20  # floats per rank per shared-memory operation (4 MiB): larger ones go in chunks


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """ValueError (one line) unless `tp` ranks can split the model Megatron-style: the query heads and the MLP's
    columns evenly, the KV heads evenly or (more ranks than KV heads) a copy of one on each."""
    c = config
    if c.num_heads % tp or c.intermediate_size % tp:
        ok = [d for d in range(1, c.num_heads + 1) if c.num_heads % d == 0 and c.intermediate_size % d == 0]
        raise ValueError(f"tensor_parallel_size {tp} does not divide the {c.num_heads} attention heads and "
                         f"{c.intermediate_size} MLP columns; allowed: {', '.join(map(str, ok))}")
    try:
        shard(c, tp)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size {e}") from None
    check_moe_parallel(config, tp)


def shard_config(config: LlamaConfig, tp: int) -> LlamaConfig:
    """One rank's shapes: its query heads, its KV heads (at least one), its MLP columns; the LM head is not tied
    (its vocabulary slice replaces it); a MoE model's experts or their columns (moe_parallel.py)."""
    s = shard(config, tp)
    return replace(config, num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_size=s.intermediate,
                   tie_word_embeddings=False, **moe_shard_fields(config, tp))


def shard_state(model: LlamaModel, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights under the shard model's names (contiguous copies in host memory)."""
    c = model.config
    s = shard(c, tp)
    d, hq, hk = c.head_dim, s.heads, s.kv_heads
    q0, k0 = rank * hq * d, s.kv_head_of(rank) * d  # first query row, first KV row of this rank
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    vs = vocab_shard(c.vocab_size, tp)
    head = torch.zeros(vs, c.hidden_size, dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
    part = model.lm_head.weight[rank * vs:(rank + 1) * vs]
    head[:part.shape[0]] = part
    sd = {"embed_tokens.weight": model.embed_tokens.weight, "norm.weight": model.norm.weight, "lm_head.weight": head}
    for n, layer in enumerate(model.layers):
        p, qkv = f"layers.{n}.", layer.self_attn.qkv_proj.weight
        if isinstance(layer.mlp, SparseMoeBlock):
            moe = moe_shard_state(layer.mlp, c.expert_parallel, tp, rank)
            sd.update({p + "mlp." + k: v for k, v in moe.items()})
        else:
            gate_up, down = swiglu_columns(layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, tp, rank)
            sd.update({p + "mlp.gate_up_proj.weight": gate_up, p + "mlp.down_proj.weight": down})
        sd.update({
            p + "self_attn.qkv_proj.weight": torch.cat([qkv[q0:q0 + hq * d], qkv[q_size + k0:q_size + k0 + hk * d],
                                                        qkv[q_size + kv_size + k0:q_size + kv_size + k0 + hk * d]]),
            p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight[:, q0:q0 + hq * d],
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
        if layer.self_attn.q_norm is not None:  # per head, the same on every head: replicated
            sd.update({p + "self_attn.q_norm.weight": layer.self_attn.q_norm.weight,
                       p + "self_attn.k_norm.weight": layer.self_attn.k_norm.weight})
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}  # host copies: they travel


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features, its partial output summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, comm):
        super().__init__(in_features, out_features, bias=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelHead(Linear):
    """The LM head's slice of the vocabulary on each rank; rank 0 gets the whole logits, the others None."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: int, comm):
        super().__init__(hidden_size, vocab_shard(vocab_size, tp), bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.comm.gather(super().forward(x))
        return None if parts is None else torch.cat(parts, dim=1)[:, :self.vocab_size]


def shard_model(config: LlamaConfig, tp: int, comm, attn_backend="sdpa") -> LlamaModel:
    """A rank's model (weights uninitialized: load a shard_state): sharded attention and MLP, the row-parallel
    projections, vocab-parallel head and MoE blocks communicating through `comm`."""
    c = shard_config(config, tp)
    model = LlamaModel(c, attn_backend=attn_backend)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, comm)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = parallel_moe_block(c, comm)
        else:
            layer.mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, comm)
    model.lm_head = VocabParallelHead(c.hidden_size, config.vocab_size, tp, comm)
    return model.eval()


class DistCollectives:
    """All-reduce and gather through torch.distributed (gloo, or NCCL on CUDA)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        if dist.get_rank() == 0:
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.gather(x, parts, dst=0)
            return parts
        dist.gather(x, dst=0)
        return None


def default_collectives(device: str) -> str:
    """'shm' on an x86-64 CPU (shm.py's flags rely on its store order), else 'dist'."""
    return "shm" if device == "cpu" and platform.machine() in ("x86_64", "AMD64") else "dist"


def _collectives(kind: str, buffers, rank: int, alive, timeout_s: float | None):
    return ShmCollectives(buffers, rank, alive, timeout_s) if kind == "shm" else DistCollectives()


def _driver_alive(driver_pid: int):
    def alive() -> None:
        if os.getppid() != driver_pid:
            raise RuntimeError("the driver process has exited")
    return alive


def tp_worker(rank: int, config: LlamaConfig, tp: int, state: dict, kind: str, buffers, attn_backend,
              device: str, driver_pid: int) -> None:
    """A worker rank's loop: build its shard, then run every step the driver broadcasts until told to stop. A CACHE
    message (re)allocates its KV cache (blocks, block size, swap blocks) and sets the attention backend."""
    keep_freed_memory()  # as every Engine does: a step's activations reuse mapped pages
    comm = _collectives(kind, buffers, rank, _driver_alive(driver_pid), None)
    model = shard_model(config, tp, comm, attn_backend)
    model.load_state_dict(state)
    model = model.to(device)
    del state
    dtype = next(model.parameters()).dtype
    runner = None
    while True:
        what, *values = messages.decode(messages.broadcast(device=device))
        if what == messages.STOP:
            return
        if what == messages.CACHE:
            num_blocks, block_size, swap_blocks, model.attn_backend = values
            runner = None  # the old cache is freed before the new one is made
            cache = KVCache.for_model(model.config, num_blocks, block_size, dtype, device)
            host = KVCache.for_model(model.config, swap_blocks, block_size, dtype, "cpu") if swap_blocks else None
            runner = ModelRunner(model, cache, None, host)
        else:
            runner.run(values[1])


class TensorParallelRunner(ModelRunner):
    """The driver's runner: broadcasts each step to the workers, then runs its own shard's forward with them. A
    failed collective becomes the group's WorkerError (which rank, why)."""

    def __init__(self, model, kv_cache, cfg, host_cache=None, use_graphs=False, verify_graphs=False, *,
                 parallel: "TensorParallel"):
        super().__init__(model, kv_cache, cfg, host_cache)  # eager: collectives do not go into graphs here
        self.parallel = parallel

    def run(self, step: StepInput):
        with collective(self.parallel):
            messages.broadcast(messages.encode_step(step), self.parallel.device)
            return super().run(step)


class TensorParallel:
    """The driver's handle on a running tensor-parallel group: its own shard (`model`), the workers, the
    collectives. `engine()` builds an Engine over the group (a fresh KV cache on every rank); many engines may be
    built one after another (a profile sweep)."""

    def __init__(self, group: Group, model: LlamaModel, comm, device: str):
        self.group, self.model, self.comm, self.device = group, model, comm, device
        self.broken = False

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world_size

    def engine(self, policy, sampling: SamplingParams | None = None, eos_token_id: int | None = None) -> Engine:
        """An engine under `policy` whose KV cache (the allocator's blocks, each rank its KV heads) and forward
        are sharded over the group; every rank attends with `self.model`'s attention backend."""
        kv = policy.kv
        messages.broadcast(messages.encode(messages.CACHE, kv.num_blocks, kv.block_size, kv.num_swap_blocks,
                                           self.model.attn_backend), self.device)
        return make_engine(self.model, policy, sampling, eos_token_id, use_graphs=False,
                           runner_factory=functools.partial(TensorParallelRunner, parallel=self))

    def close(self) -> None:
        """Tell the workers to stop (if the group still works); abort any shared-memory wait."""
        if not self.broken:
            try:
                messages.broadcast(messages.encode(messages.STOP), self.device)
            except RuntimeError:
                pass  # a worker already gone: the launcher reaps the rest
        if isinstance(self.comm, ShmCollectives):
            self.comm.abort()


@contextmanager
def tensor_parallel(model: LlamaModel, tp: int, threads: int = 1, timeout_s: float = 120.0,
                    collectives: str | None = None) -> Iterator[TensorParallel]:
    """Split `model` over `tp` ranks (this process and tp - 1 children, `threads` torch threads each) for the
    block's duration. `collectives`: 'shm' or 'dist' (default: default_collectives of the model's device)."""
    check_tensor_parallel(model.config, tp)
    device = next(model.parameters()).device.type
    kind = collectives or default_collectives(device)
    buffers = make_buffers(tp, SHM_CAPACITY) if kind == "shm" else None
    states = [shard_state(model, tp, r) for r in range(1, tp)]
    args = [(model.config, tp, s, kind, buffers, model.attn_backend, device, os.getpid()) for s in states]
    del states
    with launch(tp_worker, args, threads, timeout_s, "nccl" if device == "cuda" else "gloo") as group:
        comm = _collectives(kind, buffers, 0, group.check, timeout_s)
        shard = shard_model(model.config, tp, comm, model.attn_backend)
        shard.load_state_dict(shard_state(model, tp, 0))
        handle = TensorParallel(group, shard.to(device), comm, device)
        try:
            yield handle
        finally:
            handle.close()

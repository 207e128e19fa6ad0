"""The workload the executor's parallel tests share: mixed prompts and outputs on the tiny model, and its greedy
output on any engine."""
from __future__ import annotations

from executor.model.tiny import tiny_model
from sim.config.plan import scheduler_config
from sim.policy.block_manager import BlockAllocator
from sim.policy.request import Request
from sim.policy.scheduler import make_scheduler

# mixed prompts (7..140 tokens) and outputs, more requests than max_num_seqs: prefill beside decode rows
PROMPTS = [[(7 * i + j) % 290 + 3 for j in range(7 + 19 * i)] for i in range(8)]
MAX_TOKENS = [12, 7, 20, 3, 15, 9, 11, 6]
CASES = {"mixed": {}, "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24,
                                  "prefill_chunk_size": 24}}


def policy(num_blocks: int = 64, block_size: int = 8, swap_blocks: int = 0, **knobs):
    cfg = scheduler_config(256, **{"max_num_seqs": 4, "max_num_batched_tokens": 256, **knobs})
    return make_scheduler(cfg, BlockAllocator(num_blocks, block_size, num_swap_blocks=swap_blocks))


def model(backend: str = "sdpa"):
    """The tiny model, 4 layers, 4 heads over 2 KV heads (two ranks split both)."""
    return tiny_model(seed=3, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=300, attn_backend=backend)


def outputs(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """Greedy outputs of the prompts on any engine (a pipelined one spreads the requests over its virtual
    engines)."""
    reqs = [Request(i, 0.0, len(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r, p in zip(reqs, prompts):
        assert engine.add(r, p)
    while engine.has_work():
        engine.step()
    subs = getattr(engine, "engines", [engine])
    return [next(s.output_ids(r) for s in subs if r in s.tokens) for r in reqs]

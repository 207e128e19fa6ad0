"""Block hashes for prefix caching: what a request's prompt shares with others, block by block.

A workload describes shared content (RequestSpec.prefix: content ids, each naming `prefix_unit` tokens of the prompt's
beginning: workload.shared_prefix gives one id per prompt, a Mooncake trace its hash_ids); the hash of a full block
names the prompt's content up to and including it, so two requests' blocks of one hash hold the same K/V. The simulator and the executor take a request's hashes from here alike (the executor builds the prompt's
token ids to match: executor/core/prompts.py), so both see the same hits.

A conversation's turns (workload.conversation) are one token stream: each turn's prompt is the turn before it, that
turn's answer and new tokens. Its blocks past any shared prefix are named by (conversation, block index), through its
answer, so a turn finds the blocks of the turn before it, prompt and answer (vLLM caches blocks as decode fills them;
the executor sends the answer's own tokens back in the next prompt).
"""
from __future__ import annotations

from dataclasses import replace

from sim.config.workload import RequestSpec
from sim.policy.request import Request


class PrefixHashes:
    """Per request spec, the hashes of its prompt's full blocks of shared content (an empty tuple when none); the
    tuples of requests that share a prefix are shared too (a workload of 20k requests holds a few of them). Only the
    blocks within `max_model_len` are named: a request longer than that is turned away before any block of it is
    cached (naming a million-token prompt's blocks one by one took seconds per turn)."""

    def __init__(self, block_size: int, max_model_len: int):
        self.block_size = block_size
        self.max_blocks = max_model_len // block_size
        self._made: dict[tuple[int, int], tuple] = {}

    def __call__(self, spec: RequestSpec) -> tuple:
        if spec.conversation >= 0:
            shared = self(replace(spec, conversation=-1))  # the shared prefix's full blocks, as any prompt's
            # every token but the last has its K/V computed when the turn ends
            n = min((spec.prompt_len + spec.output_len - 1) // self.block_size, self.max_blocks)
            return shared + tuple(hash(("conversation", spec.conversation, j)) for j in range(len(shared), n))
        if not spec.prefix:
            return ()
        unit, bs = spec.prefix_unit, self.block_size
        n = min(min(len(spec.prefix) * unit, spec.prompt_len) // bs, self.max_blocks)
        key = (spec.prefix, unit, n)
        hashes = self._made.get(key)
        if hashes is None:
            # the content up to block j: the chain of ids through the unit holding the block's last token, and j
            chain, through = [], []
            for cid in spec.prefix[:-(-n * bs // unit)]:
                chain.append(hash((chain[-1] if chain else 0, cid)))
            for j in range(n):
                through.append(hash((chain[((j + 1) * bs - 1) // unit], j)))
            hashes = tuple(through)
            if len(spec.prefix) == 1:  # one prefix of many requests: keep it (a trace's chains are mostly their own)
                self._made[key] = hashes
        return hashes


def request_maker(enable_prefix_caching: bool, block_size: int, max_model_len: int):
    """RequestSpec -> the scheduler's Request, with its block hashes where the plan caches prefixes."""
    hashes = PrefixHashes(block_size, max_model_len) if enable_prefix_caching else None

    def make(spec: RequestSpec) -> Request:
        req = Request(spec.id, spec.arrival_s, spec.prompt_len, spec.output_len, conversation=spec.conversation,
                      client_out_s=spec.out_s, client_close_s=spec.close_s,
                      warmup=spec.warmup)
        if hashes is not None and (spec.prefix or spec.conversation >= 0):  # none shared: no hashes, without the call
            req.block_hashes = hashes(spec)
        return req
    return make

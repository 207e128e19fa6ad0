"""A fixed pool of whole prompts that the requests take in turn (workload.shared_prefix.prompts_per_prefix), as
inference-perf's shared_prefix data generator sends them: num_groups system prompts, num_prompts_per_group questions
of each, every prompt its group's system prompt and its own question; the pool shuffled once, and request n of a
stage given prompt n mod the pool's size, so each prompt comes back every pool-size requests."""
from __future__ import annotations

import numpy as np

from sim.config.workload import SharedPrefixConfig


def pool_prefixes(sp: SharedPrefixConfig, lengths: np.ndarray) -> list[tuple]:
    """Each pool prompt's content ids in units of prefix_len tokens (RequestSpec.prefix): its group's prefix, then
    its own id over the rest of its length, so a block holding any of its question's tokens is its own (a group's
    prompts share only the blocks that hold nothing but the system prompt, as vLLM's block hashes do)."""
    unit, groups = sp.prefix_len, sp.num_prefixes
    return [(k // sp.prompts_per_prefix,) + (groups + k,) * -(-max(0, int(n) - unit) // unit)
            for k, n in enumerate(lengths.tolist())]


def pool_columns(positions: np.ndarray, sp: SharedPrefixConfig, lengths: np.ndarray, rng) -> dict[str, list]:
    """The prompts the requests take (in id order; `positions`: each one's index among the requests of its stage), as
    columns of a RequestTable: request i takes pool prompt order[positions[i] mod size], its length from `lengths`
    (one per pool prompt, group-major) instead of its own draw."""
    order = rng.permutation(len(lengths))  # inference-perf shuffles the pool once
    prefixes = pool_prefixes(sp, lengths)
    pick = order[positions % len(lengths)]
    return {"prompt_len": lengths[pick].tolist(), "prefix": [prefixes[k] for k in pick.tolist()],
            "prefix_unit": [sp.prefix_len] * len(pick)}

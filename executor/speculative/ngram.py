"""Prompt lookup (n-gram) drafting: no model, drafts copied from the request's own tokens."""
from __future__ import annotations

import numpy as np

from executor.speculative.drafter import Drafter


class PromptLookup(Drafter):
    """Prompt lookup decoding (transformers' `prompt_lookup_num_tokens`, vLLM's ngram drafter): find the
    request's last n tokens earlier in its prompt or output, longest n first, and propose what followed
    that match. Costs no model call; it pays off where the output copies the input (summaries, rewrites,
    code edits, extraction)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids` (none when no n-gram matches)."""
        if k <= 0 or len(token_ids) < self.min_ngram + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            # windows that start early enough to have a continuation, i.e. all but the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match: nearest context, likeliest continuation
                return ids[start:start + k].tolist()
        return []

"""What the engine asks of a drafter, and a random one that calibration uses to time verify steps."""
from __future__ import annotations

import numpy as np
import torch


class Drafter:
    """What the engine asks of a drafter: `propose_batch`, drafts for every decoding request at once. One
    that drafts each sequence on its own only defines `propose(token_ids, k)`."""

    # tokens the drafter's own model read in its last call to catch up on the requests' tokens (a draft model:
    # a new request's whole prompt, then what was decoded since); 0 for drafters without a model of their own
    fed_tokens: int = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, items: list[tuple[object, list[int], int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """(drafts, q) per (request, its tokens so far, most drafts); q None: each draft is a point mass."""
        return [(self.propose(tokens, k), None) for _, tokens, k in items]


class RandomDrafter(Drafter):
    """Proposes k uniformly random tokens: almost all rejected. Calibration uses it to time verify steps
    of every draft length without depending on how well a real drafter matches the text. With `rate` < 1
    a request drafts only that share of the time (seeded), so verify rows share steps with plain decodes,
    as with prompt lookup."""

    def __init__(self, vocab_size: int, seed: int = 0, rate: float = 1.0):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.vocab_size, self.rate = vocab_size, rate
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or (self.rate < 1.0 and self.rng.random() >= self.rate):
            return []
        return self.rng.integers(0, self.vocab_size, k).tolist()

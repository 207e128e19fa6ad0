"""Speculative decoding in expectation: how many tokens a verify step yields and what it buys.

A drafter proposes γ tokens; the target model checks them in one forward pass of γ + 1 positions per
sequence and keeps the longest accepted prefix plus one token of its own. With each draft token accepted
independently with probability α (Leviathan et al., 2023, "Fast Inference from Transformers via
Speculative Decoding"), the tokens per verify step are a truncated geometric sum. These are the numbers the
simulator's speculative policy charges per step; the executor measures α.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.policy.batch import shape_of

# Rows from which one numpy call with an array of p beats a call per row (~10 µs to set up, ~0.7 µs a row).
GEOMETRIC_ARRAY_ROWS = 16


def _check(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"draft length gamma must be >= 0, got {gamma}")


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens emitted by one verify step] = (1 − α^(γ+1)) / (1 − α): accepted drafts plus the target's
    own token (γ + 1 when every draft is accepted)."""
    _check(alpha, gamma)
    if alpha == 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_accepted_drafts(alpha: float, gamma: int) -> float:
    """E[draft tokens accepted per verify step] (the mean accepted length the executor reports)."""
    return expected_tokens_per_step(alpha, gamma) - 1.0


def walltime_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Leviathan et al.'s expected wall-time improvement over plain decoding when one drafter step costs
    `cost_ratio` (c) target steps and a verify step costs one: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    if cost_ratio < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {cost_ratio}")
    return expected_tokens_per_step(alpha, gamma) / (gamma * cost_ratio + 1.0)


def best_draft_length(alpha: float, cost_ratio: float, max_gamma: int = 16) -> int:
    """The γ in 0..max_gamma with the largest walltime_speedup (γ = 0 is plain decoding)."""
    return max(range(max_gamma + 1), key=lambda g: (walltime_speedup(alpha, g, cost_ratio), -g))


def estimate_alpha(accepted: int, rejections: int) -> float | None:
    """Maximum-likelihood α from verify steps: `accepted` drafts in all, `rejections` steps that ended at a
    rejected draft (a step accepting j of γ drafts has likelihood α^j (1 − α), or α^γ if it accepted all)."""
    if accepted + rejections == 0:
        return None
    return accepted / (accepted + rejections)


def tree_expected_tokens(tree: list[tuple[int, ...]], rank_probs: list[list[float]]) -> float:
    """E[tokens per verify step] for a Medusa tree: 1 (the target's own token) + Σ over nodes of the chance
    that every rank on its path is the one that follows (rank_probs[d][r]: depth d's token has rank r among
    head d's candidates, given the earlier depths were accepted)."""
    total = 1.0
    for p in tree:
        prob = 1.0
        for d, r in enumerate(p):
            prob *= rank_probs[d][r] if d < len(rank_probs) else 0.0
        total += prob
    return total


def best_tree(rank_probs: list[list[float]], size: int, topk: int) -> list[tuple[int, ...]]:
    """The `size` nodes with the largest chance of being accepted (Medusa's tree construction); a child is
    never likelier than its parent, so the set is a tree. Parents come first."""
    frontier = [((r,), rank_probs[0][r]) for r in range(min(topk, len(rank_probs[0]) - 1))]
    tree: list[tuple[int, ...]] = []
    while frontier and len(tree) < size:
        frontier.sort(key=lambda x: (-x[1], len(x[0]), x[0]))
        node, prob = frontier.pop(0)
        tree.append(node)
        d = len(node)
        if d < len(rank_probs):
            frontier += [(node + (r,), prob * rank_probs[d][r]) for r in range(min(topk, len(rank_probs[d]) - 1))]
    return sorted(tree, key=lambda p: (len(p), p))


def reference_step_s(cost) -> float:
    """A cost model's time for one request decoding one token at context 256: the unit in which the drafter's
    measured times travel between profiles (`draft_s_reference_step`)."""
    return cost.step_time(shape_of([1], [256]))


class MedusaWalks:
    """Medusa acceptances read off a buffer of the generator's uniforms. A row's walk draws the rank of each
    depth's true token, rng.choice(len(p), p=p), until the path leaves the tree; rng.choice with p is
    searchsorted(cdf(p), rng.random()), so the buffer gives the same ranks in the same order, and a step costs a
    few list look-ups instead of a numpy call per depth and row. For every buffer position j, reach[j][k] is the largest tree index on the path of ranks drawn from
    u[j], ..., u[j + k] (len(tree) off the tree), so a walk from j over tree[:d] accepts the depths whose
    reach is below d, and uses one draw more than it accepts (all of them, when it accepts every depth)."""

    CHUNK = 1 << 14  # uniforms drawn at a time

    def __init__(self, rng: np.random.Generator, tree: list[tuple[int, ...]], rank_probs: list[list[float]]):
        self.rng = rng
        self.depths = len(rank_probs)
        self.size = len(tree)
        self.cdfs = []
        for p in rank_probs:  # as rng.choice builds it
            cdf = np.asarray(p, float).cumsum()
            cdf /= cdf[-1]
            self.cdfs.append(cdf)
        # ranks past the largest one in the tree at a depth share one code: the tables stay small
        self.radix = [max((n[k] for n in tree if len(n) > k), default=-1) + 2 for k in range(self.depths)]
        self.index = []  # per depth: tree index of each path code (len(tree): not a node)
        size = 1
        for k in range(self.depths):
            size *= self.radix[k]
            table = np.full(size, self.size, np.int64)
            for i, node in enumerate(tree):
                if len(node) == k + 1:
                    table[self._code(node)] = i
            self.index.append(table)
        self.u = np.zeros(0)
        self.pos = 0
        self._reach = np.zeros((0, self.depths), np.int64)
        self._full: list[int] = []  # accepted depths from each position over the whole tree

    def _code(self, path) -> int:
        code = 0
        for k, rank in enumerate(path):
            code = code * self.radix[k] + min(rank, self.radix[k] - 1)
        return code

    def reserve(self, n: int) -> None:
        """Make sure n uniforms past the read position are drawn (and their walks tabled)."""
        if self.pos + n <= len(self.u):
            return
        self.u = np.concatenate((self.u[self.pos:], self.rng.random(max(self.CHUNK, n))))
        self.pos = 0
        pad = np.concatenate((self.u, np.ones(self.depths)))  # past the end: read by no walk (walks reserve enough)
        reach = np.empty((len(self.u), self.depths), np.int64)
        code = np.zeros(len(self.u), np.int64)
        top = np.zeros(len(self.u), np.int64)
        for k in range(self.depths):
            rank = np.searchsorted(self.cdfs[k], pad[k:k + len(self.u)], side="right")
            code = code * self.radix[k] + np.minimum(rank, self.radix[k] - 1)
            np.maximum(top, self.index[k][code], out=top)
            reach[:, k] = top
        self._reach = reach
        self._full = (reach < self.size).sum(axis=1).tolist()

    def uniforms(self, n: int) -> list[float]:
        """The next n uniforms, as rng.random() would return them."""
        self.reserve(n)
        out = self.u[self.pos:self.pos + n].tolist()
        self.pos += n
        return out

    def walks(self, drafts: list[int]) -> list[int]:
        """Depths accepted by each of a step's verify rows, over the first d tree nodes of each (d > 0)."""
        depths, size = self.depths, self.size
        self.reserve(len(drafts) * depths)
        full, reach, pos = self._full, self._reach, self.pos
        out = []
        for d in drafts:
            a = full[pos] if d == size else int((reach[pos] < d).sum())
            out.append(a)
            pos += a + 1 if a < depths else depths
        self.pos = pos
        return out


@dataclass
class SpeculationModel:
    """The simulator's drafter: each step every decoding request gets γ drafts (or, with probability
    1 − proposal_rate, none), each accepted independently with probability α up to the first rejection.
    With `request_rates` each request instead takes one calibration request's (proposal_rate, α) for its whole
    life: requests differ as they do on the executor (a prompt-lookup request that copies its prompt drafts at
    most steps and keeps most drafts; one that does not, rarely and few), which moves the median request's TPOT.
    A step in which drafting is on costs the drafter's time, draft_s_per_step + draft_s_per_seq × drafting
    requests (prompt lookup searches every step, whether or not it finds an n-gram) + draft_s_per_token × tokens a
    draft model catches up on (as the executor's does: a request's whole context at its first draft, afterwards
    what was decoded since it last fed it, its accepted drafts already cached), before its forward (both as
    `infersim serve --profile` measures them; the verify forward's own cost is the pricer's: sim/cost/pricer.py).
    Seeded: the same scenario draws the same acceptances."""

    num_speculative_tokens: int
    acceptance_rate: float
    proposal_rate: float = 1.0
    draft_s_per_seq: float = 0.0
    draft_s_per_step: float = 0.0
    seed: int = 0
    tree: list[tuple[int, ...]] | None = None  # Medusa: the candidate tree (num_speculative_tokens = its nodes)
    rank_probs: list[list[float]] | None = None  # Medusa: per depth, the chance of each candidate rank (+ miss)
    request_rates: list[tuple[float, float]] | None = None  # per calibration request: (proposal_rate, α)
    draft_s_per_token: float = 0.0
    # EAGLE / MTP: the drafter reads the target's hidden states, and its own drafts' entries are made again
    feeds_features: bool = False
    rng: np.random.Generator = field(init=False, repr=False)
    _rates: dict = field(init=False, repr=False, default_factory=dict)
    # request id -> tokens the draft model holds (an EAGLE head: request -> (positions it read, preemptions then))
    _cached: dict = field(init=False, repr=False, default_factory=dict)
    _walks: MedusaWalks | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        if self.tree is None:
            _check(self.acceptance_rate, self.num_speculative_tokens)
        else:
            if self.request_rates:  # the walks' buffer draws ahead: no other draw may come between
                raise ValueError("request_rates is for ngram and draft_model (trees: rank_probs)")
            self.num_speculative_tokens = len(self.tree)
            self.rank_probs = [list(np.asarray(p, float) / np.sum(p)) for p in self.rank_probs]
        self.rng = np.random.default_rng(self.seed)
        self._walks = MedusaWalks(self.rng, self.tree, self.rank_probs) if self.tree is not None else None

    def propose(self, requests) -> float:
        """Set each request's num_draft for the next step; returns the drafter's time (as `infersim serve`
        fits it): a fixed part in every step the drafter runs for, and a part per drafting request (a draft
        model's passes run for the whole batch at once)."""
        if self.request_rates:
            known = [self._rates.get(r.id) for r in requests]
            if None in known:  # a request's first step draws its rates, between the other requests' draws
                drafting = self._propose_in_turn(requests)
            else:
                drafting = self._draw_proposals(requests, [k[0] for k in known])
        elif self.proposal_rate >= 1.0:
            for r in requests:
                r.num_draft = self.num_speculative_tokens
            drafting = len(requests) if self.num_speculative_tokens else 0
        else:
            drafting = self._draw_proposals(requests, [self.proposal_rate] * len(requests))
        if not requests:
            return 0.0
        fed = 0
        if self.draft_s_per_token:
            fed = self._feed_features(requests) if self.feeds_features else self._catch_up(requests)
        return drafting * self.draft_s_per_seq + self.draft_s_per_step + fed * self.draft_s_per_token

    def _draw_proposals(self, requests, rates: list[float]) -> int:
        """Each request drafts with its proposal rate (one uniform per rate below 1, drawn in request order);
        returns how many do."""
        gamma = self.num_speculative_tokens
        draws = iter(self._uniforms(sum(rate < 1.0 for rate in rates)))
        drafting = 0
        for r, rate in zip(requests, rates):
            r.num_draft = d = gamma if rate >= 1.0 or next(draws) < rate else 0
            drafting += d > 0
        return drafting

    def _propose_in_turn(self, requests) -> int:
        """propose's draws one request at a time, in the generator's order; returns the drafting requests."""
        gamma = self.num_speculative_tokens
        drafting = 0
        for r in requests:
            rate = self.rates_of(r)[0]
            r.num_draft = gamma if rate >= 1.0 or self._uniforms(1)[0] < rate else 0
            drafting += r.num_draft > 0
        return drafting

    def _uniforms(self, n: int) -> list[float]:
        """The generator's next n uniforms (Medusa's come from its walks' buffer, which draws ahead)."""
        if not n:
            return []
        return self._walks.uniforms(n) if self._walks is not None else self.rng.random(n).tolist()

    def _catch_up(self, requests) -> int:
        """Tokens the draft model reads this step before drafting (the executor's DraftModelDrafter): of each
        request it is asked for, those after the longest prefix it still holds (never the last: its logits give
        the first draft); then it holds the request's tokens and all drafts but the last (fed to draft the next).
        Requests not asked for are forgotten, as the executor's drafter forgets them."""
        gamma, held_by = self.num_speculative_tokens, self._cached.get
        fed, cached = 0, {}
        for r in requests:
            num_tokens = r.prompt_len + r.num_generated
            k = r.max_tokens - r.num_generated - 1
            if k > gamma:
                k = gamma
            held = held_by(r.id, 0)
            if k <= 0:
                cached[r.id] = held
                continue
            fed += num_tokens - held if held < num_tokens - 1 else 1
            cached[r.id] = num_tokens + k - 1
        self._cached = cached
        return fed

    def _feed_features(self, requests) -> int:
        """Positions an EAGLE head reads this step before drafting (the executor's EagleDrafter): of each request it
        drafts for, those since it last read it — its whole prompt at its first draft, then the tokens the last
        verify step kept (its accepted drafts' entries were made from its own outputs, not the target's). It keeps a
        request's place while the request does not draft, and reads everything again after a preemption."""
        held = self._cached
        fed = 0
        for r in requests:
            if r.max_tokens - r.num_generated <= 1:
                continue  # no drafts: nothing read
            n = r.prompt_len + r.num_generated - 1  # positions 0 .. n - 1 hold the target's hidden states
            was, preemptions = held.get(r, (0, r.num_preemptions))
            fed += n - (was if preemptions == r.num_preemptions else 0)
            held[r] = (n, r.num_preemptions)
        if len(held) > 4 * len(requests) + 64:  # forget the requests that ended, now and then
            self._cached = {q: v for q, v in held.items() if not q.is_done}
        return fed

    def rates_of(self, r) -> tuple[float, float]:
        """(proposal_rate, α) of request r: the scenario's, or the calibration request r drew at its first step."""
        if not self.request_rates:
            return self.proposal_rate, self.acceptance_rate
        if r.id not in self._rates:
            self._rates[r.id] = self.request_rates[int(self.rng.integers(len(self.request_rates)))]
        return self._rates[r.id]

    def accept(self, rows) -> dict:
        """Drafts accepted per row (the scheduler may have cut a row's drafts to fit)."""
        drafted = [r for r in rows if r.num_draft]
        if not drafted:
            return {}
        if self._walks is not None:
            return dict(zip(drafted, self._walks.walks([r.num_draft for r in drafted])))
        if self.request_rates:
            known = [self._rates.get(r.id) for r in drafted]
            if None in known:  # a row not proposed for (set by hand): its rates drawn in turn
                return {r: self._accept_one(r) for r in drafted}
            alphas = [k[1] for k in known]
        else:
            alphas = [self.acceptance_rate] * len(drafted)
        # trials up to the first rejection, less the rejected one; α = 1 never rejects
        trials = iter(self._geometric([1.0 - a for a in alphas if a < 1.0]))
        out = {}
        for r, alpha in zip(drafted, alphas):
            d = r.num_draft
            if alpha < 1.0:
                accepted = next(trials) - 1
                if accepted < d:
                    d = accepted
            out[r] = d
        return out

    def _geometric(self, ps: list[float]) -> list[int]:
        """One geometric draw per p, in order (numpy draws an array's, or a size's, one after the other)."""
        if not ps:
            return []
        if not self.request_rates:  # every row has the scenario's α
            return self.rng.geometric(ps[0], len(ps)).tolist()
        if len(ps) > GEOMETRIC_ARRAY_ROWS:
            return self.rng.geometric(ps).tolist()
        geometric = self.rng.geometric
        return [int(geometric(p)) for p in ps]

    def _accept_one(self, r) -> int:
        alpha = self.rates_of(r)[1]
        # trials up to the first rejection, less the rejected one; α = 1 never rejects
        return r.num_draft if alpha >= 1.0 else min(r.num_draft, int(self.rng.geometric(1.0 - alpha)) - 1)

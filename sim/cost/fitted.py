"""A step-cost model fitted to executor measurements (same interface as the roofline model).

time = c_step + c_token·new tokens + c_decode·decoding sequences + c_prefill·prefilling sequences
       + c_has_prefill·[the step carries a prompt chunk] + c_batched_prefill·[... beside decode rows]
       + c_has_verify·[some decode row carries drafts]
       + c_sample·sampled rows + c_pair·attention (query, key) pairs + c_kv·KV tokens read
       + c_prefill_kv·the prompt chunks' context + c_few·max(0, knot − new tokens) + c_ramp·min(new tokens, ramp_knot)
       + c_experts·MoE layers × the experts the step's tokens touch (a mixture of experts only)
       + c_window_kv·keys a sliding-window layer reads + c_window_pairs·its (query, key) pairs (sliding windows only)

Each term is one kind of work: the fixed cost of a step (weights read once, launch and Python
overhead), linear layers per token, per-sequence bookkeeping (a decode row and a prompt chunk cost
differently: a chunk gets its own causal attention call per layer), the prefill path's fixed cost
(mask, context gather, the extra attention pass), the verify path's (a step whose decode rows carry drafts
attends them through one padded masked call), the lm_head per sampled row, attention compute, and
attention memory traffic; the last term is the roofline's kink of the linear layers — below `knot` tokens a
step's projections stream the weights at a cost that no longer falls with fewer rows (max(a, b·T) = b·T +
b·max(0, a/b − T)); the fit picks the knot. The ramp term is the GEMMs' climb to full efficiency: up to
`ramp_knot` rows each token costs c_ramp more, so a 64-256-token prompt step pays more per token than a 2000-token
one (a single per-token slope, set by the long prompts, left SmolLM2's 128-token chunks 1.08-1.12x their prediction
and mixed chunk+decode steps 1.08x; with it 1.05x and 1.01x, held-out MAPE 6.6 -> 6.4%). The form was chosen on
the profile's held-out samples and served steps:
one per-sequence term and no prefill-step term left steps with a prompt chunk 6-11% under-predicted, and
with no verify-step term a step in which one of four rows verifies drafts ran 1.11x its prediction. The
batched-prefill term is what a step mixing prompt chunks with decode rows costs more: on a GPU plain decodes and
prompts alone replay CUDA graphs and such a step runs eagerly (the H200 profile of 2026-11-30 fitted again with
it: held-out MAPE 12.4% -> 8.8%, R² 0.90 -> 0.96; counting every multi-sequence prompt step instead: 10.6%); on
the CPU profile 0.3 ms, held-out MAPE unchanged (2.64 -> 2.66%).
A mixture of experts' routed experts cost per token (the per-token term takes them: every token runs k of them) and
per expert a step touches: its weights are read once and its grouped matmul launched, whichever of its tokens it
serves. The touched experts are the expectation under uniform routing (sim.cost.routing.distinct_experts), in the fit
as in the simulator, which knows no routing; through expert parallelism the fit prices the layout it measured (each
rank's share of the experts, the all-to-alls: per token and per step).
A model with sliding-window layers (gpt-oss) reads at most W keys a query there: the kv_tokens and attn_pairs terms
price its full layers' attention and window_kv / window_pairs its windowed layers' — the same counts with each row's
context capped at W. The features see a step's totals only (a BatchShape: the simulator's decode set keeps the sum
of its rows' contexts, not each), so a group of rows is counted at its mean context: n · min(c̄, W) keys, and a
prompt chunk's queries at positions c̄ − n̄ + 1 … c̄ each min(p, W) — exact for rows of one context, an upper bound
(min is concave) otherwise; fitted and priced alike. A linear-attention layer (Gated DeltaNet) reads no context: its
state update is work per row and per token, which a profile of the model itself prices through decode_seqs,
prefill_seqs and new_tokens, and its full layers' attention through the context terms; it needs no term of its own.
Fitted by non-negative least squares on relative error, so short decode steps weigh as much as long
prefills.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.config.layers import kind_counts
from sim.config.models import ModelSpec
from sim.config.moe import moe_layers
from sim.config.profile import FEATURES, ProfileFile, read_profile
from sim.cost.routing import distinct_experts
from sim.cost.step import StepCost, decode_run
from sim.policy.batch import BatchShape

# candidate knots of the few_tokens and ramp_tokens terms (0: none); the fit keeps the pair with the least
# training error
KNOTS = (0, 2, 4, 6, 8, 12, 16, 24, 32)
RAMP_KNOTS = (0, 64, 128, 256, 512)

# the part of a step (StepCost) each term prices. The per-token, few-token (weight streaming) and ramp (GEMM
# efficiency) terms are the linear layers; a prompt chunk's own causal attention call goes with attention; the
# sampled rows are the LM head; the per-step and per-decode-row terms and the fixed costs of the prefill, batched
# prefill and verify paths are the host's and launches' (scheduling, input preparation, masks, sampling).
PART_OF = {"step": "overhead_s", "new_tokens": "linear_s", "decode_seqs": "overhead_s", "prefill_seqs": "attention_s",
           "has_prefill": "overhead_s", "batched_prefill": "overhead_s", "has_verify": "overhead_s",
           "sampled": "lm_head_s", "attn_pairs": "attention_s", "kv_tokens": "attention_s",
           "prefill_kv": "attention_s", "few_tokens": "linear_s", "ramp_tokens": "linear_s",
           "experts_touched": "experts_s", "window_kv": "attention_s", "window_pairs": "attention_s"}
FEW, RAMP = FEATURES.index("few_tokens"), FEATURES.index("ramp_tokens")


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture of experts' routing as the fit prices it: each of `moe_layers` layers sends every token to `top_k`
    of `num_experts` experts."""

    num_experts: int
    top_k: int
    moe_layers: int

    def touched(self, tokens: int) -> float:
        """Experts a step of `tokens` tokens touches, over all MoE layers (expected, uniform routing)."""
        return self.moe_layers * distinct_experts(self.num_experts, self.top_k, tokens)


def routed_experts(model: ModelSpec | dict | None) -> RoutedExperts | None:
    """The routing of a model (its spec, or a profile's record of it); None for a dense model."""
    if isinstance(model, dict):
        model = ModelSpec.model_validate(model) if model.get("num_experts") else None
    if model is None or not model.num_experts:
        return None
    return RoutedExperts(model.num_experts, model.num_experts_per_tok, moe_layers(model))


def attention_window(model: ModelSpec | dict | None) -> int | None:
    """The window W of a model's sliding-window layers (its spec, or a profile's record of it); None without any."""
    if isinstance(model, dict):
        model = ModelSpec.model_validate(model) if model.get("sliding_window") else None
    if model is None or "sliding_window" not in kind_counts(model):
        return None
    return model.sliding_window


def window_keys(rows: int, context: float, window: int) -> float:
    """Keys `rows` decode rows of mean context `context` read in a sliding-window layer (each at most `window`)."""
    return rows * min(context / rows, window) if rows else 0.0


def window_pairs(rows: int, tokens: float, context: float, window: int) -> float:
    """(query, key) pairs of `rows` prompt chunks of `tokens` new tokens and `context` tokens after them in all, in a
    sliding-window layer: each chunk at the mean, its queries at positions a … c attending min(p, W) keys."""
    if not rows:
        return 0.0
    n, c = tokens / rows, context / rows
    a = c - n + 1
    if c <= window:
        return rows * (a + c) * n / 2
    if a >= window:
        return rows * n * window
    return rows * ((a + window) * (window - a + 1) / 2 + (c - window) * window)


def features(shape: BatchShape, knot: int = 0, ramp_knot: int = 0, experts: RoutedExperts | None = None,
             window: int | None = None) -> tuple[float, ...]:
    """The fit's feature vector of a step (FEATURES order)."""
    p = shape.num_prefill
    wkv = wpairs = 0
    if window is not None:
        d = shape.num_seqs - p
        decode = window_keys(d, shape.sum_context - shape.prefill_context, window)
        wkv = decode + window_keys(p, shape.prefill_context, window)
        wpairs = decode + window_pairs(p, shape.prefill_tokens, shape.prefill_context, window)
    return (1, shape.num_new_tokens, shape.num_seqs - p, p, 1 if p else 0, 1 if p and shape.num_seqs > p else 0,
            1 if shape.num_verify else 0, shape.num_sampled, shape.attn_pairs, shape.sum_context, shape.prefill_context,
            max(0, knot - shape.num_new_tokens), min(shape.num_new_tokens, ramp_knot),
            experts.touched(shape.num_new_tokens) if experts is not None else 0, wkv, wpairs)


def parts_of(terms: dict[str, float]) -> dict[str, float]:
    """Fitted terms' seconds (name → seconds) summed by the part of a step each prices (PART_OF)."""
    parts = dict.fromkeys(PART_OF.values(), 0.0)
    for name, t in terms.items():
        parts[PART_OF[name]] += t
    return parts


def _upgrade(coefs: dict) -> dict:
    """Coefficients of an older profile (one `seqs` term for every sequence) in the current form."""
    if "seqs" in coefs and "decode_seqs" not in coefs:
        coefs = {**coefs, "decode_seqs": coefs["seqs"], "prefill_seqs": coefs["seqs"]}
    return coefs


@dataclass
class FittedCostModel:
    coefs: dict[str, float]
    meta: dict = field(default_factory=dict)
    knot: int = 0  # tokens below which a step costs c_few more per missing token (see the module docstring)
    ramp_knot: int = 0  # tokens up to which each costs c_ramp more
    experts: RoutedExperts | None = None  # a mixture of experts' routing (the experts_touched term)
    window: int | None = None  # the sliding window of a model with such layers (the window terms)

    def __post_init__(self):
        coefs = _upgrade(self.coefs)
        self._c = tuple(float(coefs.get(f, 0.0)) for f in FEATURES)

    def step_time(self, shape: BatchShape) -> float:
        # the fit's own feature vector, so the priced form cannot drift from the fitted one
        return sum(c * x for c, x in zip(self._c, features(shape, self.knot, self.ramp_knot, self.experts,
                                                            self.window)))

    def terms(self, shape: BatchShape) -> dict[str, float]:
        """Each term's seconds in this step (coefficient × feature), by name in FEATURES order: their sum in that
        order is step_time."""
        x = features(shape, self.knot, self.ramp_knot, self.experts, self.window)
        return dict(zip(FEATURES, [c * v for c, v in zip(self._c, x)]))

    def step_cost(self, shape: BatchShape) -> StepCost:
        """step_time's terms by the part of a step each prices (PART_OF)."""
        terms = self.terms(shape)
        return StepCost(sum(terms.values()), **parts_of(terms))

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        # no prefill or verify terms: adding 0.0 is exact
        c0, ct, cd, _, _, _, _, csa, cpair, ckv, _, cfew, cramp, ctouched, cwkv, cwpairs = self._c
        t = (c0 + ct * num_seqs + cd * num_seqs + csa * num_seqs + cpair * sum_context + ckv * sum_context
             + (cfew * (self.knot - num_seqs) if num_seqs < self.knot else 0.0)
             + cramp * min(num_seqs, self.ramp_knot))
        if self.experts is not None:
            t = t + ctouched * self.experts.touched(num_seqs)
        if self.window is not None:  # a decode row's pairs are its keys
            keys = window_keys(num_seqs, sum_context, self.window)
            t = t + cwkv * keys + cwpairs * keys
        return t

    def decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end):
        return decode_run(self, num_seqs, sum_context, clock, k_max, until, step_end)

    def scaled(self, factor: float) -> "FittedCostModel":
        """Every step `factor` times as long (the same machine running slower or faster than when profiled)."""
        if factor == 1.0:
            return self
        return FittedCostModel({k: v * factor for k, v in self.coefs.items()}, {**self.meta, "scale": factor},
                               self.knot, self.ramp_knot, self.experts, self.window)

    @classmethod
    def from_profile(cls, prof: ProfileFile) -> "FittedCostModel":
        """The profile's fit, with the routing and the sliding window of the model it measured."""
        model = prof.data.get("model")
        return cls(dict(prof.coefs), prof.data, prof.knot, prof.ramp_knot, routed_experts(model),
                   attention_window(model))

    @classmethod
    def load(cls, path: Path, key_path: str = "cost_model.profile") -> "FittedCostModel":
        return cls.from_profile(read_profile(path, None, key_path))


def load_profile(path: Path, model, key_path: str = "cost_model.profile") -> FittedCostModel:
    """A fitted model from a profile, checked to be for this model (its coefficients are model-specific)."""
    return FittedCostModel.from_profile(read_profile(path, model, key_path))


def fit(shapes: list[BatchShape], times: list[float], holdout_every: int = 5,
        experts: RoutedExperts | None = None, window: int | None = None) -> dict:
    """Fit the coefficients (non-negative, relative-error least squares) on all but every
    `holdout_every`-th sample, for each pair of candidate knots (few_tokens, ramp_tokens), keeping the pair with
    the least training error; report MAPE and R² on the held-out samples and on everything. `experts`: the
    routing of the mixture of experts measured (its experts_touched term); `window`: its sliding window (the window
    terms)."""
    from scipy.optimize import nnls

    y = np.asarray(times, float)
    held = np.zeros(len(y), bool)
    held[::holdout_every] = True
    train = ~held if held.sum() < len(y) else held
    x = np.array([features(s, experts=experts, window=window) for s in shapes], float)
    tokens = x[:, FEATURES.index("new_tokens")]
    best = None
    for knot, ramp_knot in itertools.product(KNOTS, RAMP_KNOTS):
        x = x.copy()
        x[:, FEW] = np.maximum(0, knot - tokens)  # features(shape, knot, ramp_knot)'s columns
        x[:, RAMP] = np.minimum(tokens, ramp_knot)
        scale = x[train].max(axis=0)
        scale[scale == 0] = 1.0
        a = x[train] / scale / y[train, None]  # rows divided by y: minimise relative error
        c, residual = nnls(a, np.ones(train.sum()))
        if best is None or residual < best[0] - 1e-12:
            best = (residual, knot, ramp_knot, x, c / scale)
    _, knot, ramp_knot, x, c = best

    def score(mask):
        pred = x[mask] @ c
        mape = float(np.mean(np.abs(pred - y[mask]) / y[mask]))
        ss = float(((y[mask] - y[mask].mean()) ** 2).sum())
        r2 = 1 - float(((pred - y[mask]) ** 2).sum()) / ss if ss > 0 else 1.0
        return {"mape": mape, "r2": r2, "n": int(mask.sum())}

    return {"coefs": dict(zip(FEATURES, map(float, c))), "knot": knot, "ramp_knot": ramp_knot,
            "heldout": score(held), "all": score(np.ones(len(y), bool))}

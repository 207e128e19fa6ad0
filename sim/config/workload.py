"""The scenario's `workload:` section: its schema (arrivals, length distributions, trace replay, bursts, shared
prefixes, conversations, closed loops) and the requests it yields (`RequestSpec`).

A workload is either *synthetic* (an arrival process plus prompt/output length distributions) or a *trace replay* (a
public trace's file: sim/config/traces.py), with optional bursts on top; sim/config/generator.py draws its requests,
deterministically for a seed.

Each length distribution has `sample(rng, n, load) -> int64 array of n lengths >= 1`, where
`load(path)` returns a trace's arrays (used only by `empirical` with `trace`).
"""

import math
from collections import deque
from dataclasses import MISSING, dataclass, fields
from itertools import repeat
from typing import Annotated, Literal, Optional, Union

import numpy as np
from pydantic import Field, model_validator

from sim.config.client import ClientConfig, check_client_fits
from sim.config.limits import MAX_ARRIVAL_S, MAX_LENGTH, MAX_PROMPT_POOL, MAX_REQUESTS
from sim.config.schema_base import ON_USE, OnUse, StrictModel
from sim.config.traces import check_trace_name

MAX_ZIPF_SUPPORT = 10_000_000  # the inverse-CDF table holds one float per support value


class ArrivalConfig(StrictModel):
    """Base arrival process at `rate` requests/s, first arrival at t=0.

    `cv` (gamma only) is the coefficient of variation of the gaps: 1 is Poisson, > 1 bursty.
    """

    process: Literal["poisson", "gamma", "constant"]
    rate: float = Field(gt=0, le=1e6)
    # outside these the gamma draws underflow to 0 or overflow (shape 1/cv^2)
    cv: Optional[float] = Field(default=None, ge=1e-3, le=1e3)

    @model_validator(mode="after")
    def _cv_only_for_gamma(self) -> "ArrivalConfig":
        if self.process == "gamma" and self.cv is None:
            raise ValueError("process 'gamma' needs 'cv' (1 = Poisson, > 1 = bursty)")
        if self.process != "gamma" and self.cv is not None:
            raise ValueError(f"'cv' applies only to process 'gamma', not '{self.process}'")
        return self


class BurstConfig(StrictModel):
    """`count` extra requests that all arrive at `at_s` (simulation seconds)."""

    model_config = ON_USE

    at_s: float = Field(ge=0, le=MAX_ARRIVAL_S)
    count: int = Field(gt=0, le=MAX_REQUESTS)


class _Bounded(StrictModel):
    """Length distributions with `min`/`max` bounds check their order. Built on use (OnUse), as each distribution."""

    model_config = ON_USE

    @model_validator(mode="after")
    def _ordered(self):
        if getattr(self, "max", None) is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class FixedLength(StrictModel):
    """Every request has length `value`."""

    model_config = ON_USE

    dist: Literal["fixed"]
    value: int = Field(ge=1, le=MAX_LENGTH)

    def sample(self, rng, n, load) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class UniformLength(_Bounded):
    """Integers in [min, max], both inclusive."""

    dist: Literal["uniform"]
    min: int = Field(ge=1, le=MAX_LENGTH)
    max: int = Field(ge=1, le=MAX_LENGTH)

    def sample(self, rng, n, load) -> np.ndarray:
        return rng.integers(self.min, self.max + 1, size=n, dtype=np.int64)


class LognormalLength(_Bounded):
    """exp(Normal(ln median, sigma)), rounded to integers and clipped to [min, max]."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0, le=MAX_LENGTH)
    sigma: float = Field(ge=0, le=100)
    min: int = Field(default=1, ge=1, le=MAX_LENGTH)
    max: Optional[int] = Field(default=None, ge=1, le=MAX_LENGTH)

    def sample(self, rng, n, load) -> np.ndarray:
        x = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=n))
        # an unbounded tail still has to fit an int64 (a huge sigma overflows to inf)
        hi = self.max if self.max is not None else MAX_LENGTH
        return np.clip(x, self.min, hi).astype(np.int64)


class NormalLength(_Bounded):
    """Normal(mean, stddev) rounded to integers and clipped to [min, max]: the synthetic lengths of genai-perf's and
    aiperf's `--synthetic-input-tokens-mean/-stddev`, `--output-tokens-mean/-stddev` and guidellm's `prompt_tokens`
    / `prompt_tokens_stdev` (genai-perf truncates and floors at 0, aiperf redraws until positive and rounds up:
    within a token of this)."""

    dist: Literal["normal"]
    mean: float = Field(gt=0, le=MAX_LENGTH)
    stddev: float = Field(ge=0, le=MAX_LENGTH)
    min: int = Field(default=1, ge=1, le=MAX_LENGTH)
    max: Optional[int] = Field(default=None, ge=1, le=MAX_LENGTH)

    def sample(self, rng, n, load) -> np.ndarray:
        x = np.rint(rng.normal(self.mean, self.stddev, size=n))
        return np.clip(x, self.min, self.max if self.max is not None else MAX_LENGTH).astype(np.int64)


class ZipfLength(_Bounded):
    """Power law P(k) ∝ k^-a over the integers min..max (inverse-CDF sampling)."""

    dist: Literal["zipf"]
    a: float = Field(gt=1)
    min: int = Field(default=1, ge=1, le=MAX_LENGTH)
    max: int = Field(ge=1, le=MAX_LENGTH)

    @model_validator(mode="after")
    def _small_support(self):
        if self.max - self.min + 1 > MAX_ZIPF_SUPPORT:
            raise ValueError(f"max - min + 1 must be <= {MAX_ZIPF_SUPPORT:,}")
        return self

    def sample(self, rng, n, load) -> np.ndarray:
        support = np.arange(self.min, self.max + 1, dtype=np.int64)
        cdf = np.cumsum(support.astype(float) ** -self.a)
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
        # guard against the float edge case u*total == total
        return support[np.minimum(idx, len(support) - 1)]


class EmpiricalLength(StrictModel):
    """Either `values` (+ optional `weights`, drawn ∝ weight) or a trace `column` to resample."""

    model_config = ON_USE

    dist: Literal["empirical"]
    values: Optional[list[Annotated[int, Field(ge=1, le=MAX_LENGTH)]]] = None
    weights: Optional[list[Annotated[float, Field(ge=0)]]] = None
    trace: Optional[str] = Field(default=None, description='a trace file (as workload.trace reads) or '
                                                          '"builtin:azure_conv"')
    # the prompt or the output lengths, named by Azure's columns whatever the file's format
    column: Optional[Literal["ContextTokens", "GeneratedTokens"]] = None

    @model_validator(mode="after")
    def _one_source(self):
        with_values = (self.values, self.weights) != (None, None)
        if with_values == (self.trace is not None or self.column is not None):
            raise ValueError("empirical takes either 'values' (+ optional 'weights') "
                             "or 'trace' + 'column' (ContextTokens or GeneratedTokens)")
        if with_values:
            if not self.values:
                raise ValueError("'values' must be a non-empty list")
            w = self.weights
            if w is not None and (len(w) != len(self.values) or not 0 < sum(w) < math.inf):
                raise ValueError(f"'weights' ({len(w)} entries) must match 'values' "
                                 f"({len(self.values)} entries) and have a positive, finite sum")
        elif self.trace is None or self.column is None:
            raise ValueError("empirical from a trace needs both 'trace' and 'column'")
        else:
            check_trace_name(self.trace)
        return self

    def sample(self, rng, n, load) -> np.ndarray:
        if self.values is not None:
            p = None
            if self.weights is not None:
                p = np.asarray(self.weights, dtype=float) / sum(self.weights)
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, p=p)
        _, prompt, output = load(self.trace)
        col = prompt if self.column == "ContextTokens" else output
        return np.maximum(col[rng.integers(0, len(col), size=n)], 1)


LengthDist = Annotated[
    Union[FixedLength, UniformLength, LognormalLength, ZipfLength, EmpiricalLength, NormalLength],
    Field(discriminator="dist"),
]


class TraceConfig(StrictModel):
    """Replay a trace file: the Azure LLM traces' CSV (TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT's CSV
    (Timestamp, Request tokens, Response tokens), Mooncake's JSONL (timestamp in ms, input_length, output_length)
    or a CSV of arrival_s, prompt_len, output_len; told apart by their columns.

    `path` is relative to the scenario file's folder, or "builtin:azure_conv" for the shipped
    trace.  `start_s`/`end_s` select rows by trace seconds since the first row ([start, end)),
    then `max_requests` keeps the first N of those.  Kept arrivals are re-based so the first is
    at t=0, then inter-arrival times are DIVIDED by `time_scale`: 2.0 replays twice as fast
    (double the load), 0.5 at half speed.  `prompt_len`/`output_len`, if given, replace the
    trace's lengths (trace timing, synthetic lengths).
    """

    model_config = ON_USE

    path: str
    time_scale: float = Field(default=1.0, gt=0)
    start_s: float = Field(default=0.0, ge=0)
    end_s: Optional[float] = None
    max_requests: Optional[int] = Field(default=None, gt=0)
    prompt_len: Optional[LengthDist] = None
    output_len: Optional[LengthDist] = None

    @model_validator(mode="after")
    def _check(self):
        check_trace_name(self.path)
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be > start_s ({self.start_s})")
        return self


class SharedPrefixConfig(StrictModel):
    """Prompts that begin alike (vLLM's prefix-repetition benchmark): each request's first `prefix_len` tokens are
    one of `num_prefixes` shared prefixes (a system prompt, a few-shot preamble, a document asked about), drawn
    uniformly; the rest of its prompt_len is its own. A prompt shorter than the prefix is the prefix's beginning."""

    model_config = ON_USE

    prefix_len: int = Field(gt=0, le=10_000_000)
    num_prefixes: int = Field(1, gt=0, le=1_000_000)
    prompts_per_prefix: Optional[int] = Field(default=None, gt=0, le=MAX_PROMPT_POOL, description=(
        "a fixed pool of num_prefixes x prompts_per_prefix whole prompts (inference-perf's shared_prefix data: "
        "num_groups x num_prompts_per_group): each its prefix and a question of its own, its length drawn once "
        "from prompt_len; the requests take them in one shuffled order, over and over (with load_stages, from its "
        "start in every stage), so every prompt is sent again and again; null: every request's rest is its own"))

    @model_validator(mode="after")
    def _small_pool(self):
        if self.prompts_per_prefix is not None and self.num_prefixes * self.prompts_per_prefix > MAX_PROMPT_POOL:
            raise ValueError(f"num_prefixes x prompts_per_prefix is {self.num_prefixes * self.prompts_per_prefix:,}; "
                             f"allowed: at most {MAX_PROMPT_POOL:,} prompts in the pool")
        return self


class ConversationConfig(StrictModel):
    """Multi-turn chat, closed loop (vLLM's multi-turn benchmark): every request the workload describes opens a
    conversation of `turns` turns. Turn k+1 is sent `think_time_s` after turn k's last token (exponential with this
    mean; 0: at once) and never before it; its prompt is the whole conversation so far (turn k's prompt and answer)
    and `user_len` new tokens; its answer is drawn from the workload's output lengths. A turn rejected ends its
    conversation: the turns after it are rejected with it."""

    model_config = ON_USE

    turns: LengthDist
    think_time_s: float = Field(default=0.0, ge=0, le=MAX_ARRIVAL_S)
    user_len: LengthDist


class ClosedLoopConfig(StrictModel):
    """A closed loop of `users` (genai-perf's concurrency, LLMPerf's concurrent requests): each user sends a request,
    waits for its last token (or its rejection), thinks `think_time_s` (exponential with this mean; 0: not at all)
    and sends the next, so the load follows the deployment's own speed and at most `users` requests are in flight.
    The workload's requests go in order to the first user free (as those tools' workers take the next request), each
    after its own think time; the first `users` after theirs from t = 0. The arrival rate is then what the run
    measures, not an input. With `conversation`, the requests are conversations' first turns: a user holds one
    conversation at a time, and opens the next waiting one a think time after its last turn ends (or is rejected)."""

    model_config = ON_USE

    users: int = Field(gt=0, le=MAX_REQUESTS)
    think_time_s: float = Field(default=0.0, ge=0, le=MAX_ARRIVAL_S)


class LoadStage(StrictModel):
    """One load stage: requests sent at `rate` per second for `duration_s` seconds."""

    model_config = ON_USE

    rate: float = Field(gt=0, le=1e6)
    duration_s: float = Field(gt=0, le=MAX_ARRIVAL_S)


class LoadStagesConfig(StrictModel):
    """Rates one after another in one run, each reported on its own (inference-perf's `load.stages`). A stage sends
    int(rate x duration_s) requests: `poisson_fixed_count` (inference-perf's `constant` load) draws that many
    exponential gaps and scales them to end at duration_s, so the last request is sent as the stage ends; `poisson`
    keeps the gaps as drawn; `constant` spaces them evenly (rate apart, the first at the stage's start). The next
    stage starts `gap_s` after every request of this one ended (inference-perf waits for them, then its `interval`
    of 1 s and 1 s more to fill its queue)."""

    model_config = ON_USE

    stages: list[LoadStage] = Field(min_length=1, max_length=1000)
    process: Literal["poisson_fixed_count", "poisson", "constant"] = "poisson_fixed_count"
    gap_s: float = Field(default=2.0, ge=0, le=MAX_ARRIVAL_S)

    @model_validator(mode="after")
    def _counts(self):
        for k, stage in enumerate(self.stages):
            if int(stage.rate * stage.duration_s) < 1:
                raise ValueError(f"stage {k} sends int(rate x duration_s) = 0 requests; allowed: at least one")
        total = sum(int(s.rate * s.duration_s) for s in self.stages)
        if total > MAX_REQUESTS:
            raise ValueError(f"the stages send {total:,} requests; allowed: at most {MAX_REQUESTS:,} in one run")
        return self

    def counts(self) -> list[int]:
        """The requests each stage sends, in order."""
        return [int(s.rate * s.duration_s) for s in self.stages]


class WorkloadConfig(StrictModel):
    """Either `trace`, or synthetic: `arrival`, `prompt_len`, `output_len` and exactly one of
    `num_requests` / `duration_s`.  `bursts` add requests on top of either. With `conversation`, each of those
    requests is a conversation's first turn. With `closed_loop`, users send the requests (no `arrival`; a trace's
    lengths in its order, its times unused), or hold the conversations."""

    seed: int = Field(default=0, ge=0)
    trace: Annotated[Optional[TraceConfig], OnUse()] = None
    arrival: Optional[ArrivalConfig] = None
    prompt_len: Annotated[Optional[LengthDist], OnUse()] = None
    output_len: Annotated[Optional[LengthDist], OnUse()] = None
    num_requests: Optional[int] = Field(default=None, gt=0, le=MAX_REQUESTS)
    duration_s: Optional[float] = Field(default=None, gt=0)
    bursts: Annotated[list[BurstConfig], OnUse()] = []
    shared_prefix: Annotated[Optional[SharedPrefixConfig], OnUse()] = None
    conversation: Annotated[Optional[ConversationConfig], OnUse()] = None
    closed_loop: Annotated[Optional[ClosedLoopConfig], OnUse()] = None
    max_concurrency: Optional[int] = Field(default=None, gt=0, le=MAX_REQUESTS, description=(
        "the client's own limit on requests in flight (vLLM's benchmark --max-concurrency): a request whose time "
        "comes while this many are in flight waits, first come first served, and is sent when one ends; its "
        "latencies count from when it was sent"))
    client: Annotated[Optional[ClientConfig], OnUse()] = Field(None, description=(
        "the benchmark client that sends the workload and the time between it and the engine (sim/config/client.py); "
        "left out, none, except that a closed loop with no think time gets the measured transport"))
    load_stages: Annotated[Optional[LoadStagesConfig], OnUse()] = None

    @model_validator(mode="after")
    def _pool_of_own_prompts(self):
        sp = self.shared_prefix
        if sp is not None and sp.prompts_per_prefix is not None:
            clash = [k for k in ("trace", "conversation") if getattr(self, k) is not None]
            if clash:
                raise ValueError(f"shared_prefix.prompts_per_prefix draws a pool of prompts from prompt_len: not "
                                 f"with {clash}")
        return self

    @model_validator(mode="after")
    def _one_mode(self):
        if self.load_stages is not None:
            _check_load_stages(self)
            return self
        synthetic = {k: getattr(self, k) for k in
                     ("arrival", "prompt_len", "output_len", "num_requests", "duration_s")}
        if self.closed_loop is not None:
            _check_closed_loop(self)
            if self.trace is None:
                synthetic.pop("arrival")
        if self.trace is not None:
            given = [k for k, v in synthetic.items() if v is not None]
            if given:
                raise ValueError(f"with 'trace', drop {given}: use either 'trace' (lengths may be "
                                 "overridden inside it) or arrival/prompt_len/output_len + "
                                 "num_requests|duration_s")
            return self
        missing = [k for k in ("arrival", "prompt_len", "output_len") if k in synthetic and synthetic[k] is None]
        if missing:
            raise ValueError(f"missing {missing}: give either 'trace', or 'arrival' (or 'closed_loop': users), "
                             "'prompt_len', 'output_len' and one of 'num_requests' / 'duration_s'")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of 'num_requests' or 'duration_s'")
        expected = self.num_requests or self.arrival.rate * self.duration_s  # a closed loop: num_requests
        if expected + sum(b.count for b in self.bursts) > MAX_REQUESTS:
            raise ValueError(f"about {expected + sum(b.count for b in self.bursts):.3g} requests (rate x duration_s, "
                             f"num_requests and bursts); allowed: at most {MAX_REQUESTS:,} in one run")
        return self

    @model_validator(mode="after")
    def _client_fits(self) -> "WorkloadConfig":
        check_client_fits(self)
        return self


def _check_closed_loop(w: "WorkloadConfig") -> None:
    """What a closed loop cannot go with, as the validator's one-line reasons."""
    if w.arrival is not None:
        raise ValueError("with 'closed_loop', drop 'arrival': the users send each request when the one before it ends")
    if w.duration_s is not None:
        raise ValueError("with 'closed_loop', give 'num_requests', not 'duration_s': how long a closed loop runs is "
                         "what the deployment's speed makes it")
    if w.bursts:
        raise ValueError("with 'closed_loop', drop 'bursts': the users send every request")
    if w.trace is not None and "time_scale" in w.trace.model_fields_set:
        raise ValueError("with 'closed_loop', drop 'trace.time_scale': the users send the trace's rows, its "
                         "timestamps unused")
    if w.max_concurrency is not None:
        raise ValueError("with 'closed_loop', drop 'max_concurrency': the users already bound the requests in flight")


def _check_load_stages(w: "WorkloadConfig") -> None:
    """What load stages need and cannot go with, as the validator's one-line reasons: the stages are the arrivals."""
    clash = [k for k in ("trace", "arrival", "num_requests", "duration_s", "conversation", "closed_loop",
                         "max_concurrency") if getattr(w, k) is not None] + (["bursts"] if w.bursts else [])
    if clash:
        raise ValueError(f"with 'load_stages', drop {clash}: the stages send every request, at their rates")
    missing = [k for k in ("prompt_len", "output_len") if getattr(w, k) is None]
    if missing:
        raise ValueError(f"with 'load_stages', give {missing} too")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    # what the prompt shares with others: content ids, each naming `prefix_unit` tokens of its beginning (equal ids
    # at equal positions after equal ids: equal tokens); workload.shared_prefix gives one id, a Mooncake trace its
    # hash_ids (512 tokens each)
    prefix: tuple = ()
    prefix_unit: int = 0
    # workload.conversation: the conversation (-1: none), the turn this one follows (-1: the first) and how long after
    # that turn's last token it is sent; its arrival_s is then the earliest it could arrive (the turns before it
    # answered at once), the run's own arrival comes from the previous turn's end. workload.closed_loop: `users` (0:
    # not a closed loop's) on each unit the users take in turn (a request, or a conversation's first turn): the next
    # unit goes to the first user free, sent `think_s` after the user's unit before it ended (its first: after t = 0)
    conversation: int = -1
    after: int = -1
    think_s: float = 0.0
    users: int = 0
    # workload.load_stages: the stage it is sent in (-1: none); a request of a stage after the first is sent
    # `stage_delay_s` after every request of the stage before it ended (the gap, then its time within its stage), its
    # arrival_s the earliest that could be (the stages before it answered at once)
    stage: int = -1
    stage_delay_s: float = 0.0
    # workload.client (sim/config/client_requests.py): the request's time from sending to the server, the server's
    # work on it before the engine sees it (one request at a time per front end), from a token's emission to the
    # client, and from its last token to the stream's close; a warm-up request is sent before the others start and
    # left out of the report
    in_s: float = 0.0
    front_s: float = 0.0
    out_s: float = 0.0
    close_s: float = 0.0
    warmup: bool = False


RequestTable = dict  # a workload's requests as columns: field name -> one value per request, in id order
_SPEC_DEFAULTS = {f.name: f.default for f in fields(RequestSpec)}
_SLOT_SETTERS = {name: getattr(RequestSpec, name).__set__ for name in _SPEC_DEFAULTS}  # a slot's member descriptor


def table_column(table: RequestTable, name: str) -> list:
    """One field of every request of `table`: its column, or the field's default for each where it has none."""
    return table[name] if name in table else [_SPEC_DEFAULTS[name]] * len(table["id"])


def specs_of(table: RequestTable) -> list[RequestSpec]:
    """The requests of `table` (a field left out takes its default), built once, a column at a time: a workload's
    generation works on columns and ends here. Each column goes through its slot's own setter, what RequestSpec's
    frozen __init__ does a field at a time through object.__setattr__, in half the time (it has no __post_init__)."""
    n = len(table.get("id", ()))
    required = {name for name, default in _SPEC_DEFAULTS.items() if default is MISSING}
    wrong = (table.keys() - _SPEC_DEFAULTS.keys()) | (required - table.keys())
    if wrong or any(len(column) != n for column in table.values()):
        raise TypeError(f"a request table needs a column of {n} values for each of id, arrival_s, prompt_len and "
                        f"output_len, and may hold other RequestSpec fields; got {sorted(wrong) or 'unequal columns'}")
    specs = list(map(object.__new__, repeat(RequestSpec, n)))
    for name, default in _SPEC_DEFAULTS.items():
        deque(map(_SLOT_SETTERS[name], specs, table[name] if name in table else repeat(default, n)), maxlen=0)
    return specs

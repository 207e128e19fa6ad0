"""The scenario's `workload:` section and the request generator it drives.

A workload is either *synthetic* (an arrival process plus prompt/output length
distributions) or a *trace replay* (a public trace's file: TRACE_FORMATS), with optional
bursts on top.  Generation is fully deterministic for a seed.

Each length distribution has `sample(rng, n, load) -> int64 array of n lengths >= 1`, where
`load(path)` returns a trace's arrays (used only by `empirical` with `trace`).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import numpy as np
from pydantic import Field, model_validator

from sim.config.errors import ConfigError
from sim.config.limits import MAX_ARRIVAL_S, MAX_LENGTH, MAX_REQUESTS, MAX_TRACE_BYTES
from sim.config.schema_base import StrictModel

BUILTIN_TRACES = {"builtin:azure_conv": Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_conv.csv"}
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# the trace files planners bring, told apart by their columns: name -> (arrival, prompt tokens, output tokens,
# seconds per arrival unit; None: a date-time). Azure's LLM inference traces 2023/2024; BurstGPT (seconds since its
# start); Mooncake's JSONL (milliseconds); and a plain CSV of seconds.
TRACE_FORMATS = {"azure": (*TRACE_COLUMNS, None),
                 "burstgpt": ("Timestamp", "Request tokens", "Response tokens", 1.0),
                 "mooncake": ("timestamp", "input_length", "output_length", 1e-3),
                 "seconds": ("arrival_s", "prompt_len", "output_len", 1.0)}
_MINUTE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}")
# Azure's seconds: plain digits and an optional fraction (float() also takes 1e1, -0, 1_0, inf); checked in bulk
_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")
_ALL_SECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?|nan)(?:\n(?:[0-9]+(?:\.[0-9]+)?|nan))*")
_TRACE_CACHE: dict = {}  # (resolved path, mtime_ns, size) -> arrays
MOONCAKE_BLOCK_TOKENS = 512  # the tokens one of a Mooncake trace's hash_ids names
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

    at_s: float = Field(ge=0, le=MAX_ARRIVAL_S)
    count: int = Field(gt=0, le=MAX_REQUESTS)


class _Bounded(StrictModel):
    """Length distributions with `min`/`max` bounds check their order."""

    @model_validator(mode="after")
    def _ordered(self):
        if getattr(self, "max", None) is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class FixedLength(StrictModel):
    """Every request has length `value`."""

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
            _check_trace_name(self.trace)
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
    Union[FixedLength, UniformLength, LognormalLength, ZipfLength, EmpiricalLength],
    Field(discriminator="dist"),
]


def _check_trace_name(path: str) -> None:
    if path.startswith("builtin:") and path not in BUILTIN_TRACES:
        raise ValueError(f"unknown builtin trace '{path}'; known: {', '.join(BUILTIN_TRACES)}")


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

    path: str
    time_scale: float = Field(default=1.0, gt=0)
    start_s: float = Field(default=0.0, ge=0)
    end_s: Optional[float] = None
    max_requests: Optional[int] = Field(default=None, gt=0)
    prompt_len: Optional[LengthDist] = None
    output_len: Optional[LengthDist] = None

    @model_validator(mode="after")
    def _check(self):
        _check_trace_name(self.path)
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be > start_s ({self.start_s})")
        return self


class SharedPrefixConfig(StrictModel):
    """Prompts that begin alike (vLLM's prefix-repetition benchmark): each request's first `prefix_len` tokens are
    one of `num_prefixes` shared prefixes (a system prompt, a few-shot preamble, a document asked about), drawn
    uniformly; the rest of its prompt_len is its own. A prompt shorter than the prefix is the prefix's beginning."""

    prefix_len: int = Field(gt=0, le=10_000_000)
    num_prefixes: int = Field(1, gt=0, le=1_000_000)


class ConversationConfig(StrictModel):
    """Multi-turn chat, closed loop (vLLM's multi-turn benchmark): every request the workload describes opens a
    conversation of `turns` turns. Turn k+1 is sent `think_time_s` after turn k's last token (exponential with this
    mean; 0: at once) and never before it; its prompt is the whole conversation so far (turn k's prompt and answer)
    and `user_len` new tokens; its answer is drawn from the workload's output lengths. A turn rejected ends its
    conversation: the turns after it are rejected with it."""

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

    users: int = Field(gt=0, le=MAX_REQUESTS)
    think_time_s: float = Field(default=0.0, ge=0, le=MAX_ARRIVAL_S)


class WorkloadConfig(StrictModel):
    """Either `trace`, or synthetic: `arrival`, `prompt_len`, `output_len` and exactly one of
    `num_requests` / `duration_s`.  `bursts` add requests on top of either. With `conversation`, each of those
    requests is a conversation's first turn. With `closed_loop`, users send the requests (no `arrival`; a trace's
    lengths in its order, its times unused), or hold the conversations."""

    seed: int = Field(default=0, ge=0)
    trace: Optional[TraceConfig] = None
    arrival: Optional[ArrivalConfig] = None
    prompt_len: Optional[LengthDist] = None
    output_len: Optional[LengthDist] = None
    num_requests: Optional[int] = Field(default=None, gt=0, le=MAX_REQUESTS)
    duration_s: Optional[float] = Field(default=None, gt=0)
    bursts: list[BurstConfig] = []
    shared_prefix: Optional[SharedPrefixConfig] = None
    conversation: Optional[ConversationConfig] = None
    closed_loop: Optional[ClosedLoopConfig] = None
    max_concurrency: Optional[int] = Field(default=None, gt=0, le=MAX_REQUESTS, description=(
        "the client's own limit on requests in flight (vLLM's benchmark --max-concurrency): a request whose time "
        "comes while this many are in flight waits, first come first served, and is sent when one ends; its "
        "latencies count from when it was sent"))

    @model_validator(mode="after")
    def _one_mode(self):
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


def _bad(path: Path, key_path: str, what: str) -> ConfigError:
    return ConfigError(f"trace file '{path}': {what} (expected Azure's {', '.join(TRACE_COLUMNS)}, BurstGPT's or "
                       "Mooncake's columns, or arrival_s, prompt_len, output_len)", key_path)


def _read_rows(path: Path) -> tuple[list[list[str]], int]:
    """The file's rows as cells and the file row of the first data row: a CSV (a header line, then row 2), or JSON
    lines (Mooncake) as a header of every key any object has (in the order first seen) and one row of cells per
    object (from row 1; a key an object lacks: an empty cell)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        text = f.read()
    if not text.lstrip().startswith("{"):
        # only \n, \r\n and \r end a row (splitlines also splits at \f, U+2028, ... and inside quoted cells)
        return [r for r in csv.reader(io.StringIO(text, newline="")) if r], 2
    lines = io.StringIO(text, newline="")
    objects = [_json_object(line, i) for i, line in enumerate(lines, 1) if line.strip()]
    header = list(dict.fromkeys(k for o in objects for k in o))
    return [header] + [["" if o.get(k) is None else str(o.get(k)) for k in header] for o in objects], 1


def _json_object(line: str, number: int) -> dict:
    """One JSON line's object; ValueError naming the line for anything else, or a key given twice."""
    def unique(pairs: list) -> dict:
        o = dict(pairs)
        if len(o) < len(pairs):  # json.loads keeps the last silently: which one the trace meant is unknown
            seen = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ValueError(f"line {number}: key {twice[:40]!r} given twice")
        return o

    try:
        o = json.loads(line, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {number}: {e.msg} at column {e.colno}") from None
    if not isinstance(o, dict):
        raise ValueError(f"line {number}: a JSON line is not an object")
    return o


def _trace_format(header: list[str]) -> tuple | None:
    """The first TRACE_FORMATS entry whose three columns the header has."""
    return next((f for f in TRACE_FORMATS.values() if all(c in header for c in f[:3])), None)


def _real_minute(m: str) -> bool:
    """A "YYYY-MM-DD HH:MM" that names a real minute (no month 13, no hour 25)."""
    try:
        datetime.strptime(m.replace("T", " "), "%Y-%m-%d %H:%M")
        return True
    except ValueError:
        return False


def _num(s: str) -> float:
    try:
        return float(s) if _plain(s) else math.nan
    except ValueError:
        return math.nan


def _plain(s: str) -> bool:
    """No underscores (float() reads 1_000) and ASCII only (float() reads other scripts' digits)."""
    return "_" not in s and s.isascii()


def _column(cells, shown, name, expect, ok, path, key_path, first_row: int = 2) -> np.ndarray:
    """Parse `cells` as floats in bulk; report the first cell that isn't a number or fails `ok` (by its row in the
    file: `first_row` is the first cell's)."""
    try:
        if not _plain("".join(cells)):
            raise ValueError("an odd number")  # float() would read it: find the cell one by one
        v = np.array(cells, dtype=float)
    except ValueError:
        v = np.array([_num(c) for c in cells])
    bad = np.flatnonzero(~ok(v))
    if len(bad):
        raise _bad(path, key_path, f"row {bad[0] + first_row}: {name} {shown[bad[0]]!r} is not {expect}")
    return v


def load_trace(path: str | Path, key_path: str = "workload.trace.path"
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read a trace file (any of TRACE_FORMATS) into (arrival_s, prompt_len, output_len) numpy arrays.

    Arrays are in file order; arrival_s is seconds since the first (earliest) row.  `path` may be
    "builtin:azure_conv".  Any problem with the file raises ConfigError at `key_path`.  Results
    are cached per (file, mtime, size) and returned read-only, as sweeps replay one trace often.
    """
    return _load_trace(path, key_path)[:3]


def trace_hash_ids(path: str | Path, key_path: str = "workload.trace.path") -> list[tuple] | None:
    """A Mooncake trace's `hash_ids` per row (file order): the ids of the prompt's 512-token blocks, equal ids for
    equal content (each id covers its block and every block before it); None for a trace without them."""
    return _load_trace(path, key_path)[3]


def _load_trace(path: str | Path, key_path: str) -> tuple:
    """(arrival_s, prompt_len, output_len, hash_ids or None) of a trace file, cached (see load_trace)."""
    path = BUILTIN_TRACES.get(str(path), Path(path))
    try:
        st = path.stat()
        cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        cache_key = None  # open() below reports the problem
    if cache_key in _TRACE_CACHE:
        return _TRACE_CACHE[cache_key]
    if path.exists() and not path.is_file():  # a device or FIFO (/dev/zero) never ends
        raise _bad(path, key_path, "not a regular file")
    if cache_key is not None and cache_key[2] > MAX_TRACE_BYTES:
        raise _bad(path, key_path, f"{cache_key[2] / 2**20:.0f} MiB; allowed: at most {MAX_TRACE_BYTES // 2**20} MiB")
    try:
        rows, first = _read_rows(path)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, RecursionError) as e:
        raise _bad(path, key_path, f"cannot read it ({e.__class__.__name__}: {str(e)[:80]})") from None
    header = [h.strip() for h in rows[0]] if rows else []
    fmt = _trace_format(header)
    if fmt is None:
        # the header's cells are not echoed: the file may be anything (a user's private file)
        missing = [c for c in TRACE_COLUMNS if c not in header]
        raise _bad(path, key_path, f"missing column(s) {missing} in its first line ({len(header)} cells)")
    twice = next((c for c in fmt[:3] if header.count(c) > 1), None)
    if twice is not None:  # which of the two the trace means is unknown
        raise _bad(path, key_path, f"column {twice!r} named twice in its first line")
    if len(rows) < 2:
        raise _bad(path, key_path, "no data rows")
    if len(rows) - 1 > MAX_REQUESTS:
        raise _bad(path, key_path, f"{len(rows) - 1:,} rows; allowed: at most {MAX_REQUESTS:,} requests in one run")
    idx = [header.index(c) for c in fmt[:3]]
    short = next((i for i, r in enumerate(rows[1:]) if len(r) <= max(idx)), None)
    if short is not None:
        raise _bad(path, key_path, f"row {short + first} has too few cells")
    ts, ctx, gen = ([r[i].strip() for r in rows[1:]] for i in idx)
    arrival = _arrivals(ts, fmt, path, key_path, first)
    count = f"an integer in 0..{MAX_LENGTH:,}"
    is_count = lambda v: np.isfinite(v) & (v >= 0) & (v <= MAX_LENGTH) & (v == np.round(v))  # noqa: E731
    prompt = _column(ctx, ctx, fmt[1], count, is_count, path, key_path, first)
    output = _column(gen, gen, fmt[2], count, is_count, path, key_path, first)
    hash_ids = None
    if fmt == TRACE_FORMATS["mooncake"] and "hash_ids" in header:
        col = header.index("hash_ids")
        cells = [r[col] if len(r) > col else "" for r in rows[1:]]
        hash_ids = [_hash_ids(c, i + first, path, key_path) for i, c in enumerate(cells)]
    result = (arrival - arrival.min(), prompt.astype(np.int64), output.astype(np.int64))
    for a in result:
        a.flags.writeable = False
    result = (*result, hash_ids)
    if cache_key is not None:
        _TRACE_CACHE[cache_key] = result
    return result


def _hash_ids(cell: str, row: int, path: Path, key_path: str) -> tuple:
    """A Mooncake row's hash_ids (as the JSON line reader wrote its list: "[1, 2, 3]"); () where absent."""
    text = cell.strip()
    if text in ("", "[]"):
        return ()
    if not (text.startswith("[") and text.endswith("]")):
        raise _bad(path, key_path, f"row {row}: hash_ids is not a list of block ids")
    parts = [p.strip() for p in text[1:-1].split(",")]
    if len(parts) > MAX_LENGTH // MOONCAKE_BLOCK_TOKENS + 1 or \
            not all(p.isascii() and p.isdigit() and len(p) <= 19 for p in parts):
        raise _bad(path, key_path, f"row {row}: hash_ids holds something other than block ids (integers >= 0), "
                   f"or more than a {MAX_LENGTH:,}-token prompt has blocks")
    return tuple(int(p) for p in parts)


def _arrivals(ts: list[str], fmt: tuple, path: Path, key_path: str, first: int) -> np.ndarray:
    """Each row's arrival in seconds (any origin): a number of the format's unit, or Azure's date-times."""
    name, unit = fmt[0], fmt[3]
    if unit is not None:
        return unit * _column(ts, ts, name, "a time >= 0", lambda v: np.isfinite(v) & (v >= 0) & (v < 1e12),
                              path, key_path, first)
    # Per-row datetime parsing is slow and fromisoformat (< 3.11) rejects 7 fractional digits, so
    # split "YYYY-MM-DD HH:MM" (few distinct values, parsed by numpy) from the seconds (floats).
    minutes = {m: i for i, m in enumerate(dict.fromkeys(t[:16] for t in ts))}
    good = {m for m in minutes if _MINUTE.fullmatch(m) and _real_minute(m)}
    secs = _plain_seconds([t[17:] if t[16:17] == ":" and t[:16] in good else "nan" for t in ts])
    seconds = _column(secs, ts, "TIMESTAMP", "a date-time like 2023-11-16 18:15:46.6805900",
                      lambda v: (v >= 0) & (v < 61), path, key_path)
    base = np.array([m.replace(" ", "T") for m in minutes], dtype="datetime64[m]")
    whole = (base - base.min()).astype(np.int64)[[minutes[t[:16]] for t in ts]]
    return whole * 60.0 + seconds


def _plain_seconds(secs: list[str]) -> list[str]:
    """`secs` with "nan" for each cell that is not plain digits and an optional fraction."""
    if _ALL_SECONDS.fullmatch("\n".join(secs)):  # one regex over all rows: the usual, clean file
        return secs
    return [c if _SECONDS.fullmatch(c) else "nan" for c in secs]


class _Traces:
    """Trace access for one scenario: relative paths resolve against the scenario's folder."""

    def __init__(self, base_dir: Path | None):
        self.base_dir = base_dir

    def _resolve(self, path: str) -> str:
        if path not in BUILTIN_TRACES and self.base_dir is not None:
            path = str(Path(self.base_dir) / path)  # an absolute path survives the join unchanged
        return path

    def load(self, path: str, key_path: str):
        return load_trace(self._resolve(path), key_path)

    def hash_ids(self, path: str, key_path: str) -> list[tuple] | None:
        return trace_hash_ids(self._resolve(path), key_path)

    def draw(self, dist, rng, n: int, key_path: str) -> np.ndarray:
        return dist.sample(rng, n, lambda p: self.load(p, f"{key_path}.trace"))


def _synthetic_arrivals(a: ArrivalConfig, n: int | None, duration: float | None, rng) -> np.ndarray:
    """Arrival times starting at t=0: the first `n`, or all those < `duration`."""
    if a.process == "constant":
        count = n if n is not None else math.ceil(duration * a.rate)
        # the last arrival before numpy divides: a rate of 1e-308 overflows there, a RuntimeWarning on stderr
        _check_span((count - 1) / a.rate, "workload.arrival.rate", f"{count:,} requests at rate {a.rate:g}/s arrive")
        t = np.arange(count) / a.rate  # i/rate, not a cumsum, so gaps are exact
        return t if duration is None else t[t < duration]

    def gaps(m: int) -> np.ndarray:
        if a.process == "poisson":
            return rng.exponential(1.0 / a.rate, size=m)
        k = 1.0 / a.cv ** 2
        # rate k underflows to 0 for a rate of 5e-324 (ZeroDivisionError): gaps past any bound, as they are
        return rng.gamma(k, 1.0 / (a.rate * k) if a.rate * k > 0 else math.inf, size=m)

    if n is not None:
        return np.concatenate(([0.0], np.cumsum(gaps(n - 1))))
    chunks, drawn = [np.zeros(1)], 1
    while chunks[-1][-1] < duration and drawn <= MAX_REQUESTS:  # usually one chunk; more when the draw runs short
        chunks.append(chunks[-1][-1] + np.cumsum(gaps(max(1024, int(1.1 * duration * a.rate)))))
        drawn += len(chunks[-1])
    t = np.concatenate(chunks)
    t = t[t < duration]
    if len(t) > MAX_REQUESTS:  # a very bursty gamma packs far more than rate x duration_s into the window
        what = f"{a.process} arrivals" + (f" with cv {a.cv:g}" if a.cv is not None else "")
        raise ConfigError(f"{what} put {'over ' if drawn == len(t) else ''}{len(t):,} requests into duration_s "
                          f"{duration:g}; allowed: at most {MAX_REQUESTS:,} in one run (a smaller cv or duration_s, "
                          "or num_requests)", "workload.arrival.cv" if a.cv is not None else "workload.duration_s")
    return t


def _check_span(arrivals: np.ndarray | float, key_path: str, what: str) -> None:
    """Arrivals (or the last one) within MAX_ARRIVAL_S: past it a step's milliseconds vanish in the clock's float
    (latencies of 0)."""
    last = float(np.max(arrivals, initial=0.0))
    if not last <= MAX_ARRIVAL_S:
        raise ConfigError(f"{what} over {last:.3g} s; allowed: arrivals within {MAX_ARRIVAL_S:.0e} s of the first "
                          "(the clock's resolution there is still microseconds)", key_path)


def generate_requests(cfg: WorkloadConfig, base_dir: Path | None = None) -> list[RequestSpec]:
    """All requests of the workload, sorted by arrival (stable), ids 0..n-1 in that order.

    `base_dir` is the scenario file's folder, for relative trace paths.  Arrivals, each length
    stream and the bursts use independent child generators of `seed`, so changing a length
    distribution or adding bursts leaves the other draws unchanged.
    """
    rng_arr, rng_p, rng_o, rng_bp, rng_bo, rng_prefix, rng_conv, rng_users = (
        np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(8))
    traces = _Traces(base_dir)
    n_burst = sum(b.count for b in cfg.bursts)
    chains = None  # a Mooncake trace's hash_ids, per kept row
    if cfg.trace is not None:
        tr, key = cfg.trace, "workload.trace"
        t, prompt, output = traces.load(tr.path, f"{key}.path")
        end = tr.end_s if tr.end_s is not None else np.inf
        rows = np.flatnonzero((t >= tr.start_s) & (t < end))
        rows = rows[np.argsort(t[rows], kind="stable")][:tr.max_requests]
        if len(rows) == 0:
            raise ConfigError(f"the window [{tr.start_s}, {'end' if tr.end_s is None else tr.end_s}) s selects no requests "
                              f"from '{tr.path}' (its rows span 0..{t.max():.1f} s)", key)
        if cfg.closed_loop is not None:  # the rows in the trace's order; the users send them
            arrivals = np.zeros(len(rows))
        else:
            span = float(t[rows[-1]] - t[rows[0]])  # rows in time order
            # before numpy divides: a time_scale of 1e-308 overflows there, a RuntimeWarning on the user's stderr
            _check_span(span / tr.time_scale, f"{key}.time_scale", f"time_scale {tr.time_scale:g} stretches the "
                        f"trace's {span:.4g} s")
            arrivals = (t[rows] - t[rows[0]]) / tr.time_scale
        if len(rows) + n_burst > MAX_REQUESTS:
            raise ConfigError(f"{len(rows):,} trace rows and {n_burst:,} burst requests; allowed: at most "
                              f"{MAX_REQUESTS:,} requests in one run", "workload.bursts")
        # burst requests copy the lengths of randomly chosen kept rows, keeping prompt/output paired
        kept_output = np.maximum(output[rows], 1)
        rows = np.concatenate((rows, rng_bp.choice(rows, size=n_burst)))
        prompt, output = np.maximum(prompt[rows], 1), np.maximum(output[rows], 1)
        hash_ids = traces.hash_ids(tr.path, f"{key}.path")
        if hash_ids is not None:
            chains = [hash_ids[r] for r in rows.tolist()]
        if tr.prompt_len is not None:
            prompt = traces.draw(tr.prompt_len, rng_p, len(rows), f"{key}.prompt_len")
        if tr.output_len is not None:
            output = traces.draw(tr.output_len, rng_o, len(rows), f"{key}.output_len")
            more_outputs = lambda rng, n: traces.draw(tr.output_len, rng, n, f"{key}.output_len")  # noqa: E731
        else:  # a later turn's answer: one of the kept rows'
            more_outputs = lambda rng, n: kept_output[rng.integers(0, len(kept_output), n)]  # noqa: E731
    else:
        if cfg.closed_loop is not None:  # the users' think times make the arrivals (_closed_loop)
            arrivals = np.zeros(cfg.num_requests)
        else:
            arrivals = _synthetic_arrivals(cfg.arrival, cfg.num_requests, cfg.duration_s, rng_arr)
            _check_span(arrivals, "workload.arrival.rate", f"{len(arrivals):,} requests at rate "
                        f"{cfg.arrival.rate:g}/s arrive")
        n, kp, ko = len(arrivals), "workload.prompt_len", "workload.output_len"
        prompt = np.concatenate((traces.draw(cfg.prompt_len, rng_p, n, kp),
                                 traces.draw(cfg.prompt_len, rng_bp, n_burst, kp)))
        output = np.concatenate((traces.draw(cfg.output_len, rng_o, n, ko),
                                 traces.draw(cfg.output_len, rng_bo, n_burst, ko)))
        more_outputs = lambda rng, n: traces.draw(cfg.output_len, rng, n, ko)  # noqa: E731
    arrivals = np.concatenate([arrivals] + [np.full(b.count, b.at_s) for b in cfg.bursts])
    order = np.argsort(arrivals, kind="stable")
    columns = (arrivals[order].tolist(), prompt[order].tolist(), output[order].tolist())
    if chains is not None:
        for key, what in (("conversation", "a conversation's turns would share more"),
                          ("shared_prefix", "a shared prefix would replace them")):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"the trace's hash_ids already say what its prompts share; {what}: drop "
                                  f"workload.{key}, or use a trace without hash_ids", f"workload.{key}")
        chains = [chains[k] for k in order.tolist()]
        specs = [RequestSpec(i, *row, c, MOONCAKE_BLOCK_TOKENS) for i, (row, c) in enumerate(zip(zip(*columns), chains))]
    elif cfg.shared_prefix is None:
        specs = [RequestSpec(i, *row) for i, row in enumerate(zip(*columns))]
    else:
        sp = cfg.shared_prefix
        prefix = rng_prefix.integers(0, sp.num_prefixes, len(arrivals))[order].tolist()
        specs = [RequestSpec(i, *row, (p,), sp.prefix_len) for i, (row, p) in enumerate(zip(zip(*columns), prefix))]
    if cfg.conversation is not None:
        return _conversations(specs, cfg.conversation, rng_conv, more_outputs, traces, cfg.closed_loop, rng_users)
    if cfg.closed_loop is not None:
        return _closed_loop(specs, cfg.closed_loop, rng_users)
    return specs


def _closed_loop(specs: list[RequestSpec], loop: ClosedLoopConfig, rng) -> list[RequestSpec]:
    """`specs`, in order, as the units of a closed loop (ClosedLoopConfig): each taken by the first user free and sent
    its own think time later (RequestSpec.users); arrival_s 0, the run's own arrival comes from the users."""
    n = len(specs)
    waited, think = _user_starts(np.zeros(n), loop, rng)
    _check_span(waited, "workload.closed_loop.think_time_s", f"{n:,} requests with think times of "
                f"{loop.think_time_s:g} s on average arrive")
    return [replace(s, arrival_s=0.0, think_s=float(t), users=loop.users) for s, t in zip(specs, think.tolist())]


def _user_starts(spans: np.ndarray, loop: ClosedLoopConfig, rng) -> tuple[np.ndarray, np.ndarray]:
    """The think time before each of a closed loop's units (requests, or conversations), and the earliest each could
    start were unit i user i % users's (each a think time after the user's unit before it ends, its first think time
    included; `spans`: how long each unit lasts at the least, a conversation's own think times): a bound on how far
    the run spreads. Returns (the earliest starts, the think times)."""
    n, users = len(spans), loop.users
    think = rng.exponential(loop.think_time_s, n) if loop.think_time_s > 0 else np.zeros(n)
    rounds = -(-n // users)  # unit i is round i // users of user i % users
    step = np.zeros(rounds * users)
    step[:n] = think
    if n > users:  # after the user's unit before it (a sum, so never before that one's end)
        step[users:n] += spans[:n - users]
    return np.cumsum(step.reshape(rounds, users), axis=0).reshape(-1)[:n], think


def _arrival_order(arrival: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Requests that follow others, put in order of their earliest arrival (stable: one after the request it follows):
    (the order, and per request in its old position the new id of the request it follows, -1: none), from `before`,
    the old position each follows (negative: none)."""
    order = np.argsort(arrival, kind="stable")
    new_id = np.empty(len(arrival), np.int64)
    new_id[order] = np.arange(len(arrival))
    return order, np.where(before >= 0, new_id[np.maximum(before, 0)], -1)


def _conversations(first: list[RequestSpec], conv: ConversationConfig, rng, more_outputs, traces: _Traces,
                   loop: ClosedLoopConfig | None = None, rng_users=None) -> list[RequestSpec]:
    """Each of `first` opens a conversation (its index); its later turns follow (see ConversationConfig). With a
    closed `loop`, the conversations are its units (first turns at 0, each opened by the first user free, its think
    time after that user's conversation before it ended). Sorted by the earliest each could arrive (stable: a turn
    after the one it follows), ids 0..n-1 in that order."""
    key = "workload.conversation"
    rng_turns, rng_user, rng_out, rng_think = rng.spawn(4)
    turns = traces.draw(conv.turns, rng_turns, len(first), f"{key}.turns")
    total = int(turns.sum())
    if total > MAX_REQUESTS:
        raise ConfigError(f"{len(first):,} conversations of {turns.mean():.3g} turns on average are {total:,} "
                          f"requests; allowed: at most {MAX_REQUESTS:,} in one run", f"{key}.turns")
    # conversation-major rows: each conversation's turns in order, a turn right after the one it follows
    start = np.concatenate(([0], np.cumsum(turns)[:-1]))
    owner = np.repeat(np.arange(len(first)), turns)
    later = np.ones(total, bool)
    later[start] = False
    n_later = total - len(first)
    output = np.empty(total, np.int64)
    output[start] = [s.output_len for s in first]
    output[later] = more_outputs(rng_out, n_later)
    grow = np.empty(total, np.int64)  # a turn's prompt: the one before, its answer and the user's new tokens
    grow[start] = [s.prompt_len for s in first]
    grow[later] = output[np.flatnonzero(later) - 1] + traces.draw(conv.user_len, rng_user, n_later, f"{key}.user_len")
    total_grow = np.cumsum(grow)
    prompt = np.minimum(total_grow - (total_grow[start] - grow[start])[owner], MAX_LENGTH)
    think = np.zeros(total)
    if conv.think_time_s > 0:
        think[later] = rng_think.exponential(conv.think_time_s, n_later)
    waited = np.cumsum(think)
    offset = waited - waited[start][owner]  # a turn's earliest time after its conversation's first
    before = np.where(later, np.arange(total) - 1, -1)
    users = np.zeros(total, np.int64)
    if loop is None:
        opens = spread = np.array([s.arrival_s for s in first])
    else:
        last = np.r_[start[1:], total] - 1
        spread, gap = _user_starts(offset[last], loop, rng_users)
        opens = np.zeros(len(first))
        think[start], users[start] = gap, loop.users
    arrival = opens[owner] + offset
    longer = "workload.closed_loop" if loop is not None and loop.think_time_s > conv.think_time_s else key
    _check_span(spread[owner] + offset, f"{longer}.think_time_s", f"{total:,} turns with think times of "
                f"{conv.think_time_s:g} s " + (f"(and {loop.think_time_s:g} s between conversations) "
                                               if loop is not None else "") + "on average arrive")
    order, after = _arrival_order(arrival, before)
    rows = zip(arrival[order].tolist(), prompt[order].tolist(), output[order].tolist(), owner[order].tolist(),
               after[order].tolist(), think[order].tolist(), users[order].tolist())
    return [RequestSpec(i, a, p, o, first[c].prefix, first[c].prefix_unit, c, parent, th, u)
            for i, (a, p, o, c, parent, th, u) in enumerate(rows)]

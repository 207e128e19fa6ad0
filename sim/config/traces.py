"""Trace files a workload replays: Azure's LLM inference traces, BurstGPT, Mooncake's JSONL (with hash_ids), or a
CSV of seconds, told apart by their columns (TRACE_FORMATS); read once per file into numpy arrays, every problem a
one-line ConfigError naming the file, the row and what is allowed."""
from __future__ import annotations

import csv
import io
import json
import math
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from sim.config.errors import ConfigError
from sim.config.limits import MAX_LENGTH, MAX_REQUESTS, MAX_TRACE_BYTES

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


def check_trace_name(path: str) -> None:
    """ValueError for a builtin: name that is not shipped (the schema checks it as it reads a scenario)."""
    if path.startswith("builtin:") and path not in BUILTIN_TRACES:
        raise ValueError(f"unknown builtin trace '{path}'; known: {', '.join(BUILTIN_TRACES)}")


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


class Traces:
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

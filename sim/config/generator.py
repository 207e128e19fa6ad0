"""The requests a workload yields: arrivals (synthetic, a trace's window or load stages), prompt and output lengths,
bursts, shared prefixes (or a pool of prompts), conversations' later turns and closed loops' users, deterministic for
a seed."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sim.config.client import resolve_client
from sim.config.client_requests import with_client
from sim.config.errors import ConfigError
from sim.config.limits import MAX_ARRIVAL_S, MAX_LENGTH, MAX_REQUESTS
from sim.config.prompt_pool import pool_columns
from sim.config.stages import stage_arrivals, stage_bounds
from sim.config.traces import MOONCAKE_BLOCK_TOKENS, Traces
from sim.config.workload import (
    ArrivalConfig,
    ClosedLoopConfig,
    ConversationConfig,
    RequestSpec,
    RequestTable,
    WorkloadConfig,
    specs_of,
    table_column,
)


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


_WORKLOAD_CLIENT = object()  # generate_requests' default: the client the workload names, no engine's front end


def generate_requests(cfg: WorkloadConfig, base_dir: Path | None = None, client=_WORKLOAD_CLIENT) -> list[RequestSpec]:
    """All requests of the workload, sorted by arrival (stable), ids 0..n-1 in that order, as `client` sends them
    (sim/config/client_requests.py; default: the workload's own, resolve_client; None: none)."""
    if client is _WORKLOAD_CLIENT:
        client = resolve_client(cfg)
    return specs_of(with_client(cfg, _workload_table(cfg, base_dir), client))


def plan_requests(plan) -> list[RequestSpec]:
    """A plan's requests as its client sends them: the workload's, through the serving engine's front end."""
    return generate_requests(plan.workload, plan.base_dir, plan.client)


@dataclass(eq=False, repr=False)
class _Streams:
    """Independent random streams of one seed (SeedSequence.spawn, in this order): changing one draw (a length
    distribution, adding bursts) leaves the others unchanged."""

    arrival: np.random.Generator
    prompt: np.random.Generator
    output: np.random.Generator
    burst_prompt: np.random.Generator
    burst_output: np.random.Generator
    prefix: np.random.Generator
    conversation: np.random.Generator
    users: np.random.Generator

    @classmethod
    def of(cls, seed: int) -> "_Streams":
        """The eight streams of `seed`."""
        return cls(*(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(8)))


@dataclass(eq=False, repr=False)
class _Columns:
    """A workload's draws before the bursts' arrivals join them: `arrivals` (without the bursts'), `prompt` and
    `output` lengths (with them), a later turn's answer lengths (`more_outputs(rng, n)`), a Mooncake trace's
    hash_ids per row (`chains`) and the load stages' (stage, delay) per request (`staged`)."""

    arrivals: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    more_outputs: Callable
    chains: list | None = None
    staged: list | None = None


def _workload_table(cfg: WorkloadConfig, base_dir: Path | None = None) -> RequestTable:
    """All requests of the workload as columns, sorted by arrival (stable), ids 0..n-1 in that order.

    `base_dir` is the scenario file's folder, for relative trace paths.  Arrivals, each length
    stream and the bursts use independent child generators of `seed`, so changing a length
    distribution or adding bursts leaves the other draws unchanged.
    """
    streams = _Streams.of(cfg.seed)
    traces = Traces(base_dir)
    n_burst = sum(b.count for b in cfg.bursts)
    cols = (_trace_columns(cfg, traces, n_burst, streams) if cfg.trace is not None
            else _synthetic_columns(cfg, traces, n_burst, streams))
    arrivals = np.concatenate([cols.arrivals] + [np.full(b.count, b.at_s) for b in cfg.bursts])
    order = np.argsort(arrivals, kind="stable")
    columns = (arrivals[order].tolist(), cols.prompt[order].tolist(), cols.output[order].tolist())
    table = _request_table(cfg, columns, order, cols.chains, streams.prefix, traces, streams.prompt)
    if cfg.load_stages is not None:
        return _with_stages(table, *cols.staged)
    if cfg.conversation is not None:
        return _conversations(table, cfg.conversation, streams.conversation, cols.more_outputs, traces, cfg.closed_loop,
                              streams.users)
    if cfg.closed_loop is not None:
        return _closed_loop(table, cfg.closed_loop, streams.users)
    return table


def _trace_rows(tr, t: np.ndarray) -> np.ndarray:
    """The rows of a trace's window (workload.trace start_s, end_s), in time order (stable), the first max_requests."""
    end = tr.end_s if tr.end_s is not None else np.inf
    rows = np.flatnonzero((t >= tr.start_s) & (t < end))
    rows = rows[np.argsort(t[rows], kind="stable")][:tr.max_requests]
    if len(rows) == 0:
        raise ConfigError(f"the window [{tr.start_s}, {'end' if tr.end_s is None else tr.end_s}) s selects no requests "
                          f"from '{tr.path}' (its rows span 0..{t.max():.1f} s)", "workload.trace")
    return rows


def _trace_columns(cfg: WorkloadConfig, traces: Traces, n_burst: int, streams: _Streams) -> _Columns:
    """A trace's window: its rows' arrivals (scaled by time_scale; all 0 for a closed loop, whose users send them)
    and lengths (or lengths drawn from prompt_len / output_len), bursts copying the lengths of random kept rows."""
    tr, key = cfg.trace, "workload.trace"
    t, prompt, output = traces.load(tr.path, f"{key}.path")
    rows = _trace_rows(tr, t)
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
    rows = np.concatenate((rows, streams.burst_prompt.choice(rows, size=n_burst)))
    prompt, output = np.maximum(prompt[rows], 1), np.maximum(output[rows], 1)
    hash_ids = traces.hash_ids(tr.path, f"{key}.path")
    chains = [hash_ids[r] for r in rows.tolist()] if hash_ids is not None else None
    if tr.prompt_len is not None:
        prompt = traces.draw(tr.prompt_len, streams.prompt, len(rows), f"{key}.prompt_len")
    if tr.output_len is not None:
        output = traces.draw(tr.output_len, streams.output, len(rows), f"{key}.output_len")
        more_outputs = lambda rng, n: traces.draw(tr.output_len, rng, n, f"{key}.output_len")  # noqa: E731
    else:  # a later turn's answer: one of the kept rows'
        more_outputs = lambda rng, n: kept_output[rng.integers(0, len(kept_output), n)]  # noqa: E731
    return _Columns(arrivals, prompt, output, more_outputs, chains=chains)


def _synthetic_columns(cfg: WorkloadConfig, traces: Traces, n_burst: int, streams: _Streams) -> _Columns:
    """Drawn requests: arrivals (the arrival process, the load stages', or all 0 for a closed loop's users) and
    lengths from prompt_len / output_len, the bursts' lengths from their own streams."""
    staged = None
    if cfg.closed_loop is not None:  # the users' think times make the arrivals (_closed_loop)
        arrivals = np.zeros(cfg.num_requests)
    elif cfg.load_stages is not None:
        arrivals, *staged = stage_arrivals(cfg.load_stages, streams.arrival)
    else:
        arrivals = _synthetic_arrivals(cfg.arrival, cfg.num_requests, cfg.duration_s, streams.arrival)
        _check_span(arrivals, "workload.arrival.rate", f"{len(arrivals):,} requests at rate "
                    f"{cfg.arrival.rate:g}/s arrive")
    n, kp, ko = len(arrivals), "workload.prompt_len", "workload.output_len"
    prompt = np.concatenate((traces.draw(cfg.prompt_len, streams.prompt, n, kp),
                             traces.draw(cfg.prompt_len, streams.burst_prompt, n_burst, kp)))
    output = np.concatenate((traces.draw(cfg.output_len, streams.output, n, ko),
                             traces.draw(cfg.output_len, streams.burst_output, n_burst, ko)))
    more_outputs = lambda rng, n: traces.draw(cfg.output_len, rng, n, ko)  # noqa: E731
    return _Columns(arrivals, prompt, output, more_outputs, staged=staged)


def _request_table(cfg: WorkloadConfig, columns: tuple, order: np.ndarray, chains: list | None,
                   rng_prefix, traces: Traces, rng_p) -> RequestTable:
    """The requests of `columns` (arrival, prompt, output, in arrival order; `order` took them there), with what
    their prompts share: a trace's hash_ids (`chains`, in the rows' first order), or workload.shared_prefix's ids
    (with prompts_per_prefix, its pool's prompts, their lengths drawn from prompt_len)."""
    n = len(order)
    table = dict(zip(("id", "arrival_s", "prompt_len", "output_len"), (list(range(n)), *columns)))
    if chains is not None:
        for key, what in (("conversation", "a conversation's turns would share more"),
                          ("shared_prefix", "a shared prefix would replace them")):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"the trace's hash_ids already say what its prompts share; {what}: drop "
                                  f"workload.{key}, or use a trace without hash_ids", f"workload.{key}")
        return {**table, "prefix": [chains[k] for k in order.tolist()], "prefix_unit": [MOONCAKE_BLOCK_TOKENS] * n}
    if cfg.shared_prefix is None:
        return table
    sp = cfg.shared_prefix
    if sp.prompts_per_prefix is not None:
        lengths = traces.draw(cfg.prompt_len, rng_p, sp.num_prefixes * sp.prompts_per_prefix, "workload.prompt_len")
        return {**table, **pool_columns(_pool_positions(cfg, n), sp, lengths, rng_prefix)}
    prefix = rng_prefix.integers(0, sp.num_prefixes, n)[order].tolist()
    return {**table, "prefix": [(p,) for p in prefix], "prefix_unit": [sp.prefix_len] * n}


def _pool_positions(cfg: WorkloadConfig, n: int) -> np.ndarray:
    """Each request's index among those of its stage (inference-perf counts every stage's requests from 0), or among
    all of them without stages: which prompt of the pool it takes."""
    if cfg.load_stages is None:
        return np.arange(n)
    return np.concatenate([np.arange(end - first) for first, end in stage_bounds(cfg.load_stages)])


def _with_stages(table: RequestTable, stage: np.ndarray, delay: np.ndarray) -> RequestTable:
    """`table` (in send order) with the stage each is sent in and its delay after the stage before it ended."""
    _check_span(np.array(table["arrival_s"][-1:]), "workload.load_stages",
                f"{len(table['id']):,} requests over the stages arrive")
    return {**table, "stage": stage.tolist(), "stage_delay_s": delay.tolist()}


def _closed_loop(table: RequestTable, loop: ClosedLoopConfig, rng) -> RequestTable:
    """`table`'s requests, in order, as the units of a closed loop (ClosedLoopConfig): each taken by the first user free and sent
    its own think time later (RequestSpec.users); arrival_s 0, the run's own arrival comes from the users."""
    n = len(table["id"])
    waited, think = _user_starts(np.zeros(n), loop, rng)
    _check_span(waited, "workload.closed_loop.think_time_s", f"{n:,} requests with think times of "
                f"{loop.think_time_s:g} s on average arrive")
    return {**table, "arrival_s": [0.0] * n, "think_s": think.tolist(), "users": [loop.users] * n}


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


def _conversations(first: RequestTable, conv: ConversationConfig, rng, more_outputs, traces: Traces,
                   loop: ClosedLoopConfig | None = None, rng_users=None) -> RequestTable:
    """Each request of `first` opens a conversation (its index); its later turns follow (see ConversationConfig). With a
    closed `loop`, the conversations are its units (first turns at 0, each opened by the first user free, its think
    time after that user's conversation before it ended). Sorted by the earliest each could arrive (stable: a turn
    after the one it follows), ids 0..n-1 in that order."""
    key = "workload.conversation"
    rng_turns, rng_user, rng_out, rng_think = rng.spawn(4)
    n_first = len(first["id"])
    turns = traces.draw(conv.turns, rng_turns, n_first, f"{key}.turns")
    total = int(turns.sum())
    if total > MAX_REQUESTS:
        raise ConfigError(f"{n_first:,} conversations of {turns.mean():.3g} turns on average are {total:,} "
                          f"requests; allowed: at most {MAX_REQUESTS:,} in one run", f"{key}.turns")
    # conversation-major rows: each conversation's turns in order, a turn right after the one it follows
    start = np.concatenate(([0], np.cumsum(turns)[:-1]))
    owner = np.repeat(np.arange(n_first), turns)
    later = np.ones(total, bool)
    later[start] = False
    n_later = total - n_first
    output = np.empty(total, np.int64)
    output[start] = first["output_len"]
    output[later] = more_outputs(rng_out, n_later)
    grow = np.empty(total, np.int64)  # a turn's prompt: the one before, its answer and the user's new tokens
    grow[start] = first["prompt_len"]
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
        opens = spread = np.array(first["arrival_s"], float)
    else:
        last = np.r_[start[1:], total] - 1
        spread, gap = _user_starts(offset[last], loop, rng_users)
        opens = np.zeros(n_first)
        think[start], users[start] = gap, loop.users
    arrival = opens[owner] + offset
    longer = "workload.closed_loop" if loop is not None and loop.think_time_s > conv.think_time_s else key
    _check_span(spread[owner] + offset, f"{longer}.think_time_s", f"{total:,} turns with think times of "
                f"{conv.think_time_s:g} s " + (f"(and {loop.think_time_s:g} s between conversations) "
                                               if loop is not None else "") + "on average arrive")
    order, after = _arrival_order(arrival, before)
    owners, prefix, unit = owner[order].tolist(), table_column(first, "prefix"), table_column(first, "prefix_unit")
    return {"id": list(range(total)), "arrival_s": arrival[order].tolist(), "prompt_len": prompt[order].tolist(),
            "output_len": output[order].tolist(), "prefix": [prefix[c] for c in owners],
            "prefix_unit": [unit[c] for c in owners], "conversation": owners, "after": after[order].tolist(),
            "think_s": think[order].tolist(), "users": users[order].tolist()}

"""Capacity: the highest arrival rate at which a deployment still meets its SLOs — one definition for the
simulator's search (`infersim search`) and the executor's measurement (`infersim validate --capacity`).

A run at a rate passes when the SLO quantiles hold with rejected requests counted as misses, and it keeps up:
in the second half of its arrival window it completes KEEP_UP of that half's arrivals or more (a burst that drains
within the SLOs is not a rate the deployment sustains; the first half is the ramp and the drain after the last
arrival is not judged, so a request's latency weighs on the verdict only in a probe shorter than about two of them).
A workload of conversations (closed loop: a later turn arrives when the turn before it ends) must also have run
steady: its first turns spread over STEADY_SPANS times a conversation's mean lifetime or more
(a probe too short starts its conversations nearly at once: a bounded load, which every deployment that holds them
all passes, however high the rate). Rates lie on a grid anchored at a target rate, target · (1 + precision)^k: from the target,
jumps of 2× up or down until the verdict flips, then bisection on the grid, so the capacity is found within one
grid step and the same rates are tried whoever runs them."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.scenario import SLOConfig
from sim.config.workload import RequestSpec
from sim.report.metrics import compute_metrics, measured

KEEP_UP = 0.8  # a run passes only if it completes this share of its arrivals, both counted in its steady half
STEADY_SPANS = 2.0  # conversations: the first turns' span over their mean lifetime a passing run needs
STEADY_ROUNDS = 4  # a closed loop: requests per user a passing run needs (else its first wave is most of it)
# requests a rate probe needs: the keep-up rule counts ~half of them, and the last to arrive cannot end by its
# window's end, so with k counted a deployment that keeps up paces (k − 1) / k at best (under KEEP_UP below 5)
MIN_PROBE_REQUESTS = 20
# a run that falls behind while its first requests took longer than this share of its arrival window to end is too
# short to tell: a deployment that keeps up paces 1 while its requests take under half the window, less beyond
RAMP_SHARE = 0.25


def probe_rows(specs: list[RequestSpec]) -> tuple:
    """The requests a capacity search scales, as plain rows: (arrival_s, prompt_len, output_len, prefix, prefix_unit,
    conversation, after, think_s, users) each — what their prompts share and which turn follows which go with them."""
    return tuple((s.arrival_s, s.prompt_len, s.output_len, s.prefix, s.prefix_unit, s.conversation, s.after, s.think_s,
                  s.users)
                 for s in specs)


def scaled(specs: tuple, rate: float) -> list[RequestSpec]:
    """Requests (probe_rows, ids their positions) with their arrival gaps scaled so that they arrive at `rate`
    requests/s on average: every rate sees the same requests and burst pattern. A conversation's later turns keep
    their think times; its first turns are spread so that all turns would arrive at `rate` if each were answered at
    once (the rate a closed loop offers an infinitely fast server)."""
    firsts = [row[0] for row in specs if row[6] < 0]
    first, span = firsts[0], firsts[-1] - firsts[0]
    factor = (len(firsts) - 1) / (rate * span * len(firsts) / len(specs)) if span > 0 else 0.0
    arrival = []
    for a, *_, after, think, _ in specs:  # a turn follows one before it in the rows
        arrival.append((a - first) * factor if after < 0 else arrival[after] + think)
    if len(firsts) == len(specs):
        return [RequestSpec(i, t, *row[1:]) for i, (t, row) in enumerate(zip(arrival, specs))]
    order = sorted(range(len(specs)), key=arrival.__getitem__)  # stable: a turn after the one it follows
    new_id = {k: i for i, k in enumerate(order)}
    return [RequestSpec(i, arrival[k], *specs[k][1:6], specs[k][6] if specs[k][6] < 0 else new_id[specs[k][6]],
                        specs[k][7]) for i, k in enumerate(order)]


def check_scalable(specs: list[RequestSpec], key_path: str = "workload", count_key: str | None = None) -> None:
    """A capacity search scales the workload's arrival gaps (its first turns', for conversations): it needs two
    requests or more at distinct times (all at one instant, every rate scales them to that instant and no rate
    passes), and MIN_PROBE_REQUESTS for its keep-up rule to judge (`count_key`: what sets their number, if not the
    workload)."""
    if any(s.users for s in specs):
        raise ConfigError("a closed loop's users send each request when the one before it ends: its rate is what a run "
                          "measures, not one to scale (a capacity search counts it in users); allowed: an "
                          "arrival process or a trace (with or without conversations)", f"{key_path}.closed_loop")
    if any(s.stage >= 0 for s in specs):
        raise ConfigError("load stages send at their own rates, one after another: no one rate to scale; allowed: an "
                          "arrival process or a trace (a stage's rate as arrival.rate)", f"{key_path}.load_stages")
    arrivals = [s.arrival_s for s in specs if s.after < 0]
    if len(arrivals) < 2:
        raise ConfigError("the workload has fewer than 2 requests: no rate to search", key_path)
    if arrivals[-1] - arrivals[0] <= 0:
        raise ConfigError(f"all {len(arrivals)} requests arrive at one instant: no rate to scale them to; allowed: "
                          "arrivals spread over time (an arrival process, or a trace of distinct times)", key_path)
    if len(specs) < MIN_PROBE_REQUESTS:
        raise ConfigError(f"probes of {len(specs)} requests are too few to judge whether a deployment keeps up with "
                          f"their rate; allowed: {MIN_PROBE_REQUESTS} or more", count_key or key_path)


def users_probe(workload, base_dir, users: int, max_requests: int) -> list[RequestSpec]:
    """A closed loop's probe at `users` users: the workload's first `max_requests` requests (its own draws, capped;
    a trace's first rows) dealt to that many users, so every count of users sees the same requests and think
    times."""
    loop = workload.closed_loop.model_copy(update={"users": users})
    if workload.trace is not None:
        cap = min(workload.trace.max_requests or max_requests, max_requests)
        update = {"trace": workload.trace.model_copy(update={"max_requests": cap})}
    else:
        update = {"num_requests": min(workload.num_requests, max_requests)}
    return generate_requests(workload.model_copy(update={**update, "closed_loop": loop}), base_dir)


def check_has_slo(slo, key_path: str = "slo") -> None:
    """A capacity is the highest rate that meets an SLO: it needs a TTFT, TPOT or E2E bound to meet."""
    if slo.ttft_s is None and slo.tpot_s is None and slo.e2e_s is None:
        raise ConfigError("a capacity needs an SLO to meet: give it a ttft_s, tpot_s or e2e_s", key_path)


def offered_rate(arrivals) -> float:
    """Requests per second the arrivals offer (gaps between the first and the last)."""
    arrivals = np.asarray(arrivals, float)
    return (len(arrivals) - 1) / max(float(arrivals.max() - arrivals.min()), 1e-9) if len(arrivals) else 0.0


def passes(metrics: dict, records, specs: list[RequestSpec]) -> bool:
    """The capacity verdict on a finished run of `specs`: its metrics (sim.report.metrics.compute_metrics under the
    SLO) and its records (sim.report.metrics.RequestRecords: the arrivals as they came in that run, since a
    conversation's later turns arrive when the turns before them end, and only the SLOs tell a slow deployment)."""
    return not why_failed(metrics, records, specs)


def warm_up(specs: list[RequestSpec]) -> set[int]:
    """A closed loop's first wave: the ids of its first unit per user (a request, or a conversation's turns). With no
    think time they all arrive at t = 0, a burst no steady load of that many users sees again."""
    units = [s for s in specs if s.users]
    first = units[:units[0].users] if units else []
    conversations = {s.conversation for s in first if s.conversation >= 0}
    return {s.id for s in first} | {s.id for s in specs if s.conversation in conversations}


def judged_metrics(metrics: dict, records, specs: list[RequestSpec], users: int | None = None) -> dict:
    """The metrics a capacity verdict judges: a closed loop of `users` long enough to judge (STEADY_ROUNDS), its run
    without the first wave (warm_up) under the same SLO (metrics["slo"]); else the run's as they are."""
    warm = warm_up(specs) if users is not None and len(specs) >= STEADY_ROUNDS * users else set()
    if not warm:
        return metrics
    keep = ~np.isin(records.id, np.fromiter(warm, np.int64, len(warm)))
    if not keep.any():
        return metrics
    cut = {f.name: getattr(records, f.name)[keep] for f in fields(records)
           if isinstance(getattr(records, f.name), np.ndarray)}
    cut["reject_reason"] = [r for r, k in zip(records.reject_reason, keep) if k]
    slo = SLOConfig(**{k: metrics["slo"][k] for k in ("ttft_s", "tpot_s", "e2e_s", "quantile")})
    return compute_metrics(replace(records, **cut), slo)


def why_failed(metrics: dict, records, specs: list[RequestSpec], users: int | None = None) -> str:
    """What failed a run (see passes): "slo", "keep_up", "short" (fell behind, but the probe too short for its
    requests' latency to tell: falls_behind), "unsteady" (conversations, or a closed loop of `users`: the probe too
    short), or "". `metrics`: as judged_metrics gives them (a closed loop without its first wave)."""
    if not metrics["slo"]["met_counting_rejected"]:
        return "slo"
    if users is not None:  # a closed loop cannot fall behind its own arrivals: it needs enough rounds of them
        return "" if len(specs) >= STEADY_ROUNDS * users else "unsteady"
    behind = falls_behind(records)
    if behind:
        return behind
    return "" if steady(records, specs) else "unsteady"


def falls_behind(records) -> str:
    """"" where a run kept pace with its arrivals (pace ≥ KEEP_UP); else "keep_up", or "short" where its first
    requests took longer than RAMP_SHARE of its arrival window to end (`ramp_s`): a probe too short for its
    requests' latency, whose pace says nothing of the deployment (a search shows its capacity as "≥ C")."""
    if pace(records) >= KEEP_UP:
        return ""
    _, meant = _meant_arrivals(records)
    return "short" if ramp_s(records) > RAMP_SHARE * float(meant.max() - meant.min()) else "keep_up"


def _meant_arrivals(records):
    """(the records without warm-up requests, when each was meant to arrive): a request that waited for a slot
    (max_concurrency) arrived when it was meant to be sent."""
    rec = measured(records)
    return rec, rec.arrival_s if rec.client_wait_s is None else rec.arrival_s - rec.client_wait_s


def ramp_s(records) -> float:
    """The median E2E of the first tenth (5 at least) of the requests a run served, in order of arrival: their
    latency before a backlog could build, beside which the keep-up rule's window must be long (0 where none)."""
    rec, meant = _meant_arrivals(records)
    served = rec.completed
    if not served.any():
        return 0.0
    order = np.argsort(meant[served], kind="stable")
    e2e = (rec.finish_s[served] - rec.arrival_s[served])[order]
    return float(np.median(e2e[:max(5, len(e2e) // 10)]))


def pace(records) -> float:
    """How a run kept pace with its arrivals: of the requests it served, those that completed in the second half of
    its arrival window [t_mid, t_last] (t_mid halfway between the first and the last arrival) over those that arrived
    in it. Keeping up, both counts are the rate times half the window, the completions shifted by a request's latency
    L (1 while L < half the window, above KEEP_UP while L < 0.6 of it); overloaded, the completions run at the
    service rate. Arrivals are those the client meant (a request that waited for a slot, max_concurrency, arrived
    when it was meant to be sent), as they came in the run (a conversation's later turns after their answers);
    warm-up requests are left out, and so are rejected ones (no backlog: the SLO counts them as misses already).
    For a run that went to its end."""
    rec, meant = _meant_arrivals(records)
    if not len(meant):
        return 0.0
    last = float(meant.max())
    mid = (float(meant.min()) + last) / 2
    served = rec.completed
    arrived = int((served & (meant >= mid)).sum())  # closed: a burst at one instant arrives in a window of 0 s
    done = int((served & (rec.finish_s >= mid) & (rec.finish_s <= last)).sum())
    return done / arrived if arrived else 1.0


def steady(records, specs: list[RequestSpec]) -> bool:
    """Whether a run's conversations (if any) overlapped as a sustained stream: their first turns span STEADY_SPANS
    times their mean lifetime in the run (first turn's arrival to last turn's end) or more."""
    owner = {s.id: s.conversation for s in specs if s.conversation >= 0}
    if not owner:
        return True
    conv = np.array([owner.get(int(i), -1) for i in records.id])
    mine = conv >= 0
    conv, arrival = conv[mine], records.arrival_s[mine]
    end = np.where(np.isnan(records.finish_s[mine]), arrival, records.finish_s[mine])
    first, last = np.full(conv.max() + 1, np.inf), np.full(conv.max() + 1, -np.inf)
    np.minimum.at(first, conv, arrival)
    np.maximum.at(last, conv, end)
    held = np.isfinite(first)
    span = first[held].max() - first[held].min()
    return bool(span >= STEADY_SPANS * (last[held] - first[held]).mean())


@dataclass
class Grid:
    """What a capacity counts and how a probe at a grid point is made: requests/s scaling the workload's arrival gaps,
    or (a closed loop) users, the grid's points rounded to whole users. One grid for the simulator's search
    (`infersim search`) and the executor's measurement (`validate --capacity`)."""

    probe: Callable[[float], list[RequestSpec]]
    target: float
    unit: str  # "req/s" or "users"

    def point(self, x: float) -> float:
        """The grid point `x` as it is run: itself, or a whole number of users."""
        return float(max(1, round(x))) if self.unit == "users" else x

    def users(self, x: float) -> int | None:
        """The users a probe at `x` has (None: not a closed loop): what why_failed judges its length by."""
        return int(self.point(x)) if self.unit == "users" else None

    def judge(self, metrics: dict, records, specs: list[RequestSpec], x: float) -> tuple[dict, bool]:
        """A finished probe at `x` (its metrics under the SLO): (the metrics its verdict judged, whether it passes)."""
        judged = judged_metrics(metrics, records, specs, self.users(x))
        return judged, not why_failed(judged, records, specs, self.users(x))

    def search(self, meets: Callable[[float], bool], precision: float, min_rate: float = 0.01,
               max_rate: float = 1e5) -> "Capacity":
        """grid_capacity over `meets(point)`, each point run once (users from 1), the result in points."""
        memo: dict[float, bool] = {}

        def once(x: float) -> bool:
            if self.point(x) not in memo:
                memo[self.point(x)] = meets(self.point(x))
            return memo[self.point(x)]

        found = grid_capacity(once, self.target, precision, lowest(self.unit, min_rate), max_rate)
        return Capacity(self.point(found.rate) if found.rate else 0.0,
                        None if found.missed_at is None else self.point(found.missed_at),
                        [(self.point(x), ok) for x, ok in found.tried])


def lowest(unit: str, min_rate: float) -> float:
    """The grid's lowest point: `min_rate`, or for users at least one."""
    return max(min_rate, 1.0) if unit == "users" else min_rate


def rates_grid(rows: tuple, target: float) -> Grid:
    """An open workload's grid: its requests (probe_rows) with their arrival gaps scaled to each rate."""
    return Grid(lambda x: scaled(rows, x), target, "req/s")


def users_grid(workload, base_dir, max_requests: int, target: float) -> Grid:
    """A closed loop's grid: probes of its first `max_requests` requests dealt to each count of users."""
    return Grid(lambda x: users_probe(workload, base_dir, int(x), max_requests), target, "users")


@dataclass
class Capacity:
    """What a grid search found: `rate` the highest passing rate tried (0: none passed), `missed_at` the lowest
    failing one above it (None: none failed), and every rate tried with its verdict, in order."""

    rate: float
    missed_at: float | None
    tried: list[tuple[float, bool]] = field(default_factory=list)


def grid_capacity(meets: Callable[[float], bool], target_rate: float, precision: float = 0.05,
                  min_rate: float = 0.01, max_rate: float = 1e5) -> Capacity:
    """Search the rate grid with `meets(rate) -> bool` (each rate is asked once)."""
    step = math.log1p(precision)
    low = min_rate / target_rate  # underflows to 0 for a min_rate of 5e-324: then a log of each (log(0) raises)
    bottom = math.ceil((math.log(low) if low > 0 else math.log(min_rate) - math.log(target_rate)) / step)
    top = math.floor(math.log(max_rate / target_rate) / step)
    rate = lambda k: target_rate * math.exp(k * step)  # noqa: E731
    memo: dict[int, bool] = {}
    tried: list[tuple[float, bool]] = []

    def ok(k: int) -> bool:
        if k not in memo:
            memo[k] = bool(meets(rate(k)))
            tried.append((rate(k), memo[k]))
        return memo[k]

    k0 = min(top, max(bottom, 0))
    jump = max(1, int(round(math.log(2) / step)))
    if ok(k0):
        lo, hi = k0, None
        while hi is None:
            k = min(top, lo + jump)
            if k == lo:
                break
            if ok(k):
                lo, jump = k, jump * 2
            else:
                hi = k
    else:
        lo, hi = None, k0
        while lo is None:
            k = max(bottom, hi - jump)
            if k == hi:
                break
            if ok(k):
                lo = k
            else:
                hi, jump = k, jump * 2
    if lo is not None and hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return Capacity(rate(lo) if lo is not None else 0.0, rate(hi) if hi is not None else None, tried)

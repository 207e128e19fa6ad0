"""Serving metrics as vLLM's benchmark defines them, shared by the simulator and the executor.

TTFT: arrival → first token. E2E: arrival → last token. TPOT: (E2E − TTFT) / (output tokens − 1).
ITL: every gap between consecutive token arrivals of a request; tokens one step emits together (speculative
decoding's accepted drafts) arrive as one streamed chunk, one gap, as vLLM's benchmark times them, not a gap of 0.
Throughput: over first arrival → last finish.
Goodput: completed requests per second that meet every SLO target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from sim.policy.request import Request, Status
from sim.report.definitions import per_request, run_end, summaries

MAX_CDF_POINTS = 4000  # points kept of the inter-token gaps' CDF, for plots


@dataclass(eq=False, repr=False)
class GapSummary:
    """The inter-token gaps of a run, summarized once (a simulated day has ~1e8 of them): count, mean, numpy's
    linear percentiles, and their CDF at no more than MAX_CDF_POINTS points."""

    count: int
    stats: dict  # mean, p50, p90, p99 (None when there are no gaps)
    cdf_s: np.ndarray
    cdf_fraction: np.ndarray


def spread_indices(n: int, most: int) -> np.ndarray:
    """At most `most` indices spread evenly over 0..n-1, ascending, each once: linspace's, cut to integers, kept where
    they differ from the one before (what np.unique of them gives, without its import of numpy.ma, ~6 ms)."""
    picks = np.linspace(0, n - 1, min(n, most)).astype(np.int64)
    keep = np.ones(len(picks), bool)
    keep[1:] = picks[1:] != picks[:-1]
    return picks[keep]


def summarize_gaps(sample: list[np.ndarray]) -> GapSummary:
    """GapSummary of [values, weights], the sample in which values[k] occurs weights[k] times (every weight > 0).
    It empties the list, so each array is freed as its sorted copy replaces it (a simulated day: ~1e7 of each)."""
    values, weights = sample.pop(0), sample.pop(0)
    order = np.argsort(values, kind="stable")  # ties in the sample's order: the same last bits on any machine
    x = values[order]
    del values
    w = weights[order]
    del weights, order
    cw = np.cumsum(w, dtype=np.int64)
    del w
    stats = summarize(x, sorted_cumulative=cw)
    pick = spread_indices(len(x), MAX_CDF_POINTS)
    n = int(cw[-1]) if len(cw) else 0
    return GapSummary(n, stats, x[pick].copy(), (cw[pick] / max(n, 1)).astype(float))


@dataclass(eq=False, repr=False)
class RequestRecords:
    """Per-request outcomes, and the inter-token gaps of the completed ones, summarized."""

    id: np.ndarray
    replica: np.ndarray
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    completed: np.ndarray
    reject_reason: list[str]
    num_preemptions: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    itl: GapSummary
    # speculative decoding, per request: drafts verified, accepted, verify steps, steps ending at a rejection
    speculation: np.ndarray | None = None
    # workload.conversation: the conversation each request is a turn of (-1: none)
    conversation: np.ndarray | None = None
    # workload.max_concurrency: how long each request waited at the client before it was sent (its arrival_s)
    client_wait_s: np.ndarray | None = None
    # workload.client: warm-up requests (left out of the metrics), when each stream closed at the client, and each
    # request's way in (sending to the engine's queue) and out (a token's emission to the client)
    warmup: np.ndarray | None = None
    stream_end_s: np.ndarray | None = None
    client_in_s: np.ndarray | None = None
    client_out_s: np.ndarray | None = None


def token_gaps(requests: list[Request]) -> list[np.ndarray]:
    """Every gap between consecutive token arrivals of each completed request, from the token times kept on it
    (tokens of one step share its time: a chunk, one gap)."""
    gaps = [np.diff(r.token_times) for r in requests
            if r.status is Status.FINISHED and len(r.token_times) > 1 and not r.warmup]
    values = np.concatenate(gaps) if gaps else np.zeros(0)
    values = values[values > 0]
    return [values, np.ones(len(values), dtype=np.int64)]


def records_from_requests(requests: list[Request], itl: GapSummary | None = None) -> RequestRecords:
    """Build records on the client's clock: sent (arrival at the engine less the way in), tokens when the client got
    them (the engine's times plus the way out; workload.client); `itl`: the inter-token gaps where the token times
    are not kept on the requests (the simulator's bulk decode runs). A field at a time, each a list comprehension
    (a simulated day holds 500k requests)."""
    itl = itl if itl is not None else summarize_gaps(token_gaps(requests))
    first, finish, output_len = _token_columns(requests)
    in_s = np.array([r.client_in_s for r in requests], float)  # 0 without a transport: x + 0.0 is x, nothing moves
    out_s = np.array([r.client_out_s for r in requests], float)
    finish, finished = finish + out_s, Status.FINISHED  # an enum member's lookup costs more than the test
    spec = np.array([[r.num_drafted for r in requests], [r.num_accepted for r in requests],
                     [r.num_verify_steps for r in requests], [r.num_rejections for r in requests]], np.int64)
    return RequestRecords(
        id=np.array([r.id for r in requests], dtype=np.int64),
        replica=np.array([r.replica for r in requests], dtype=np.int64),
        arrival_s=np.array([r.arrival_s for r in requests], dtype=float) - in_s,
        prompt_len=np.array([r.prompt_len for r in requests], dtype=np.int64),
        output_len=output_len,
        completed=np.array([r.status is finished for r in requests], dtype=bool),
        reject_reason=[r.reject_reason or "" for r in requests],
        num_preemptions=np.array([r.num_preemptions for r in requests], dtype=np.int64),
        first_token_s=first + out_s,
        finish_s=finish,
        itl=itl,
        speculation=spec.T.copy(),  # (drafted, accepted, verify steps, rejections) per request
        conversation=np.array([r.conversation for r in requests], dtype=np.int64),
        client_wait_s=np.array([r.client_wait_s for r in requests], dtype=float),
        warmup=np.array([r.warmup for r in requests], dtype=bool),
        stream_end_s=finish + np.array([r.client_close_s for r in requests], float),
        client_in_s=in_s,
        client_out_s=out_s,
    )


def _token_columns(requests: list[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each request's first and last token's time (NaN: none) and its output tokens: from the token times where it
    keeps them (the executor; speculative decoding), else from its first_token_s, finish_s and num_generated."""
    if not any(r.token_times for r in requests):  # None -> NaN
        return (np.array([r.first_token_s for r in requests], float), np.array([r.finish_s for r in requests], float),
                np.array([r.num_generated for r in requests], np.int64))

    def times(attr: str, k: int) -> np.ndarray:  # token k's time where the request keeps them, else `attr`
        return np.fromiter((r.token_times[k] if r.token_times else np.nan if getattr(r, attr) is None
                            else getattr(r, attr) for r in requests), float, len(requests))

    return times("first_token_s", 0), times("finish_s", -1), np.array(
        [len(r.token_times) if r.token_times else r.num_generated for r in requests], dtype=np.int64)


def measured(rec: RequestRecords) -> RequestRecords:
    """The records without the warm-up requests (workload.client.warmup_requests), which no report counts."""
    if rec.warmup is None or not rec.warmup.any():
        return rec
    keep = ~rec.warmup
    cut = {f.name: getattr(rec, f.name)[keep] for f in fields(rec)
           if isinstance(getattr(rec, f.name), np.ndarray) and len(getattr(rec, f.name)) == len(keep)}
    return replace(rec, **cut, reject_reason=[r for r, k in zip(rec.reject_reason, keep.tolist()) if k])


def summarize(x: np.ndarray, sorted_cumulative: np.ndarray | None = None) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy's linear percentiles, as vLLM's benchmark); None when empty. With
    `sorted_cumulative`, x is sorted and x[k] occurs sorted_cumulative[k] - sorted_cumulative[k - 1] times: the
    same numbers as that sample written out."""
    if sorted_cumulative is None:
        x = x[~np.isnan(x)]
        if not len(x):
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        p50, p90, p99 = linear_quantiles(x, (0.5, 0.9, 0.99))
        return {"mean": float(x.mean()), "p50": p50, "p90": p90, "p99": p99}
    cw = sorted_cumulative
    if not len(cw):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    n = int(cw[-1])

    def at(i: int) -> float:  # the i-th smallest of the written-out sample
        return float(x[np.searchsorted(cw, i, side="right")])

    # numpy's own pairwise sum, not a BLAS dot: that splits the sum over threads, and the last bits with them
    out = {"mean": float(np.sum(x * np.diff(cw, prepend=0)) / n)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        h = (n - 1) * q
        lo = int(np.floor(h))
        a, b = at(lo), at(min(lo + 1, n - 1))
        out[name] = a + (b - a) * (h - lo)
    return out


def mean_p50_p99(a: np.ndarray) -> dict[str, float]:
    """The mean, p50 and p99 of `a` (zeros where it is empty): the kv_transfer section's times, simulated and served."""
    if not len(a):
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    p50, p99 = linear_quantiles(a, (0.5, 0.99))
    return {"mean": float(a.mean()), "p50": p50, "p99": p99}


def linear_quantiles(x: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """np.quantile(x, qs) (its default, linear method) step by step as numpy computes it, so the same bits, without
    its np.unique (which imports numpy.ma, ~6 ms of a run). x: not empty, no NaN."""
    n = len(x)
    at = [(n - 1) * q for q in qs]
    lower = [-1 if h >= n - 1 else math.floor(h) for h in at]  # numpy's index before each (-1: the largest)
    upper = [lo + 1 if lo >= 0 else -1 for lo in lower]
    part = np.partition(x, sorted({0, -1, *lower, *upper}))  # numpy's own partition: ties (0.0, -0.0) fall alike
    out = []
    for h, lo, hi in zip(at, lower, upper):
        a, b = float(part[lo]), float(part[hi])
        t = h - lo
        # numpy's _lerp: from the nearer end
        out.append(float(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t))
    return out


def per_request_latency(rec: RequestRecords) -> dict[str, np.ndarray]:
    """ttft, e2e, tpot per request (nan where undefined: rejected, or tpot with one output token)."""
    ttft = rec.first_token_s - rec.arrival_s
    e2e = rec.finish_s - rec.arrival_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(rec.output_len > 1, (e2e - ttft) / (rec.output_len - 1), np.nan)
    done = rec.completed
    return {"ttft": np.where(done, ttft, np.nan), "e2e": np.where(done, e2e, np.nan),
            "tpot": np.where(done, tpot, np.nan)}


SLO_TARGETS = (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"))  # per-request latency, the SLO's key


def slo_targets(slo) -> list[tuple[str, str, float]]:
    """The SLO's targets that are set: (per-request latency name, key, bound). `slo`: an SLOConfig or None."""
    if slo is None:
        return []
    return [(name, key, getattr(slo, key)) for name, key in SLO_TARGETS if getattr(slo, key) is not None]


def slo_mask(lat: dict[str, np.ndarray], slo) -> np.ndarray:
    """Per request: completed and within every target (a request with one token has no TPOT to miss)."""
    ok = ~np.isnan(lat["e2e"])
    for name, _, bound in slo_targets(slo):
        ok &= (np.isnan(lat[name]) | (lat[name] <= bound)) if name == "tpot" else lat[name] <= bound
    return ok


def compute_metrics(rec: RequestRecords, slo=None, client=None) -> dict:
    """The latency / throughput / SLO sections of report.json. `slo`: the scenario's (an SLOConfig: `ttft_s`,
    `tpot_s`, `e2e_s` targets on its `quantile`), or None; `client`: the plan's (sim.config.client.ResolvedClient),
    whose tool defines the latencies (sim/report/definitions.py) and whose warm-up requests are left out."""
    rec = measured(rec)
    n = len(rec.id)
    done = rec.completed
    lat = per_request(rec, client)
    finish = run_end(rec, client)
    duration = float(finish.max() - rec.arrival_s.min()) if done.any() else 0.0
    out_tokens = int(rec.output_len[done].sum())
    in_tokens = int(rec.prompt_len[done].sum())
    rate = (lambda v: v / duration if duration > 0 else 0.0)  # noqa: E731
    good = slo_mask(lat, slo)
    reasons: dict[str, int] = {}
    for reason, c in zip(rec.reject_reason, done.tolist()):
        if not c:
            key = reason or "unknown"
            reasons[key] = reasons.get(key, 0) + 1
    quantile = slo.quantile if slo is not None else 0.9

    def q(x):
        x = x[~np.isnan(x)]
        return linear_quantiles(x, (quantile,))[0] if len(x) else None

    at_q = {name: q(lat[name]) for name, _ in SLO_TARGETS}
    # TPOT is undefined for one-token requests only: none defined misses nothing; TTFT and E2E need a completion
    slo_met = bool(done.any()) and all(
        (at_q[name] is None and name == "tpot") or (at_q[name] is not None and at_q[name] <= bound)
        for name, _, bound in slo_targets(slo))
    # the same test with every rejected request counted as one that missed: quantiles over completed requests
    # alone can meet an SLO that holds only because the requests that would miss it were turned away
    rejected = int(n - done.sum())
    slo_met_all = slo_met and (rejected == 0 or all(
        linear_quantiles(np.where(done, np.nan_to_num(lat[name], nan=0.0), 1e300), (quantile,))[0] <= bound
        for name, _, bound in slo_targets(slo)))
    targets = {key: getattr(slo, key) if slo is not None else None for _, key in SLO_TARGETS}
    out = {
        "requests": {"arrived": n, "completed": int(done.sum()), "rejected": int(n - done.sum()),
                     "rejected_by_reason": reasons},
        "duration_s": duration,
        **summaries(rec, lat, client, summarize),
        "throughput": {"requests_per_s": rate(int(done.sum())), "output_tokens_per_s": rate(out_tokens),
                       "total_tokens_per_s": rate(out_tokens + in_tokens)},
        "goodput_requests_per_s": rate(int(good.sum())),
        "slo_attainment": float(good.sum() / n) if n else 0.0,
        "slo": {**targets, "quantile": quantile, "ttft_at_quantile_s": at_q["ttft"],
                "tpot_at_quantile_s": at_q["tpot"], "e2e_at_quantile_s": at_q["e2e"], "met": slo_met,
                "met_counting_rejected": bool(slo_met_all)},
    }
    if rec.speculation is not None and rec.speculation[:, 0].sum() > 0:
        out["speculative"] = speculation_summary(rec.speculation, rec.output_len)
    if rec.conversation is not None and (rec.conversation >= 0).any():
        out["conversations"] = conversation_summary(rec, lat)
    return out


def conversation_summary(rec: RequestRecords, lat: dict[str, np.ndarray]) -> dict:
    """report.json's conversations section: how many, how many had every turn answered, turns per conversation, the
    first turns' TTFT beside the later turns' (a later turn resends the whole conversation: what prefix caching
    saves shows there), and each answered conversation's length from its first arrival to its last token."""
    mine = rec.conversation >= 0
    conv, arrival, done = rec.conversation[mine], rec.arrival_s[mine], rec.completed[mine]
    ids, inverse, turns = np.unique(conv, return_inverse=True, return_counts=True)
    first_arrival = np.full(len(ids), np.inf)
    np.minimum.at(first_arrival, inverse, arrival)
    is_first = arrival == first_arrival[inverse]
    answered = np.ones(len(ids), bool)
    np.logical_and.at(answered, inverse, done)
    last = np.full(len(ids), -np.inf)
    np.maximum.at(last, inverse, np.where(done, rec.finish_s[mine], -np.inf))
    ttft = lat["ttft"][mine]
    return {"conversations": len(ids), "answered": int(answered.sum()), "turns_mean": float(turns.mean()),
            "first_turn_ttft_s": summarize(ttft[is_first]), "later_turn_ttft_s": summarize(ttft[~is_first]),
            "duration_s": summarize((last - first_arrival)[answered])}


def speculation_summary(spec: np.ndarray, output_len: np.ndarray) -> dict:
    """report.json's speculative section from per-request (drafted, accepted, verify steps, rejections) and
    output lengths: α (the simulator's acceptance_rate) and the share of decode steps that had drafts (its
    proposal_rate; prompt lookup finds no match in the others)."""
    from sim.cost.speculation import estimate_alpha  # speculative runs alone load it

    drafted, accepted, steps, rejections = (int(x) for x in spec.sum(axis=0))
    # every decode step yields one token plus its accepted drafts; the first token comes from the prefill
    decode_steps = int(np.maximum(output_len - 1 - spec[:, 1], 0).sum())
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps,
            "acceptance_rate": accepted / drafted if drafted else None,
            "alpha": estimate_alpha(accepted, rejections),
            "mean_accepted_length": accepted / steps if steps else None,
            "proposal_rate": steps / decode_steps if decode_steps else None}


def request_rates(spec: np.ndarray, output_len: np.ndarray) -> list[list[float]]:
    """[proposal_rate, α] of each request that decoded, rounded to 3 places: the scenario's
    speculative.request_rates, from per-request (drafted, accepted, verify steps, rejections) and output lengths.
    α of a request that never drafted is 0 (it is never asked)."""
    from sim.cost.speculation import estimate_alpha

    out = []
    for (_, accepted, steps, rejections), n in zip(spec.tolist(), output_len.tolist()):
        decode_steps = n - 1 - accepted
        if decode_steps > 0:
            out.append([round(steps / decode_steps, 3), round(estimate_alpha(accepted, rejections) or 0.0, 3)])
    return out

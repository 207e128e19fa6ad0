"""`infersim profile --endpoint URL`: fit the simulator's step-cost model (sim.cost.fitted) to what a running server's
streams show, from outside: no step is seen, so each sample is a step shape the sweep controls and the time the
stream gives it.

- A lone request's TTFT is a prefill step of its prompt (and the server's per-request overhead, which the fit's
  prefill terms take on: the simulator then predicts TTFT as a client sees it).
- Each gap between two tokens of a stream is one decode step; the streams batched with it are the others streaming
  across that gap (first token before it, last after it), their contexts their prompts and tokens so far. Gaps
  within which another request got its first token also ran that prompt: a mixed step. B requests sent at once
  decode at batch B, if the server batches them; a server that serves one at a time shows batch 1, and the profile
  records the most streams it ever ran together (`endpoint.max_concurrent_streams`).
- Gaps are pooled per (batch, window of tokens): the sample is their median.
- A server may deliver a stream's tokens in bursts (an event loop that got the CPU late, vLLM's `stream_interval`):
  a gap far shorter than the sweep's mean one is a token that came with the one before, whose own wait the gap
  before it holds. Such a run of gaps is one span of as many steps, each step priced at the span's mean; a stream
  that came whole in one burst shows no step. (Tiny gaps taken as steps gave samples of 20 µs among steps of 1 ms,
  and the relative-error fit broke on them: held-out MAPE 40-93% on a tiny model served over HTTP from a
  thread of the client's process, which sent some streams' last six tokens at once.)
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from calibration.endpoint import CONNECT_TIMEOUT_S, Endpoint, Outcome, Prompts, stream_one
from sim.config.errors import ConfigError
from sim.config.workload import RequestSpec
from sim.cost.fitted import fit, routed_experts
from sim.policy.batch import record_shape

WINDOW = 4  # consecutive decode gaps of a stream pooled into one sample
BURST = 0.2  # a gap under this fraction of the sweep's mean gap came in a burst with the token before it
JOIN_POLL_S = 0.0005  # how often a joiner looks at the decoding streams' tokens: well under a step of a tiny model


def sweep(quick: bool = False, max_len: int = 2048) -> list[tuple[int, list[tuple[int, int, float, int]]]]:
    """The loads, each (requests sent at once, the requests as (prompt tokens, output tokens, seconds after the load
    starts, tokens each of the load's first requests streams before it is sent)): lone prefills of many lengths; B
    requests at once decoding together at two contexts; and prompts arriving while B requests decode, a quarter and
    half way through their answers (by their tokens, not the clock: a 1 ms step's server and a 30 ms one alike).
    Prompts and outputs fit `max_len`."""
    rng = random.Random(0)

    def fits(p, o):
        return p + o <= max_len

    loads = []
    for p in [16, 64, 256, 1024] if quick else [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536]:
        if fits(p, 4):
            loads += [(1, [(p, 4, 0.0, 0)])] * (2 if quick else 3)
    for b, c in [(1, 128), (4, 128), (4, 512)] if quick else \
            [(1, 64), (1, 512), (2, 256), (4, 64), (4, 512), (8, 128), (8, 512), (16, 64), (16, 256)]:
        o = 24  # tokens enough for B streams sent at once to overlap on a ~1 ms step too
        load = [(max(8, int(c * rng.uniform(0.6, 1.4))), o, 0.0, 0) for _ in range(b)]
        loads.append((b, [r for r in load if fits(r[0], r[1])]))
    for b, p in [(4, 256)] if quick else [(4, 128), (4, 512), (8, 256)]:
        load = [(rng.randint(32, 256), 40, 0.0, 0) for _ in range(b)] + [(p, 4, 0.0, 10), (p, 4, 0.0, 20)]
        loads.append((b + 2, [r for r in load if fits(r[0], r[1])]))
    return [(b, load) for b, load in loads if load]


async def _run_load(ep: Endpoint, prompts: Prompts, load: list[tuple[int, int, float, int]], first_id: int,
                    timeout_s: float | None) -> list[Outcome]:
    """One load: its requests sent on their offsets (and, a joiner, once the load's first requests have streamed its
    number of tokens, or ended), every stream timed."""
    specs = [RequestSpec(first_id + i, t, p, o) for i, (p, o, t, _) in enumerate(load)]
    texts = [prompts.text(s.prompt_len, s.id) for s in specs]
    outs = [Outcome(s, s.arrival_s, ep) for s in specs]
    leaders = [o for o, r in zip(outs, load) if not r[3]]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as client:
        t0 = time.perf_counter()

        async def one(out: Outcome, text: str, after_tokens: int) -> None:
            await asyncio.sleep(max(0.0, out.due_s - (time.perf_counter() - t0)))
            while after_tokens and any(len(q.token_times) < after_tokens and q.end_s is None for q in leaders):
                await asyncio.sleep(JOIN_POLL_S)
            await stream_one(client, ep, out, text, t0, False, timeout_s)

        await asyncio.gather(*(one(o, t, r[3]) for o, t, r in zip(outs, texts, load)))
    return outs


def steps_of(outs: list[Outcome], floor: float = 0.0) -> list[dict]:
    """The step samples a load's streams show (see the module docstring); gaps under `floor` came in bursts."""
    done = [o for o in outs if o.finished]
    for o in outs:
        if o.error is not None:
            raise ConfigError(f"the endpoint failed a profiling request ({o.error}); profile it when it serves "
                              "requests of up to the sweep's lengths", "--endpoint")
    samples = []
    if len(outs) == 1 and done:  # a lone request: its TTFT is the prefill
        o = done[0]
        samples.append(_sample("prefill", [o.spec.prompt_len], [o.spec.prompt_len], 1, 1, [o.token_times[0] - o.sent_s]))
    firsts = [o.token_times[0] for o in done]
    for o in done:
        pooled: dict[tuple, list] = {}
        times = o.token_times
        for k, step_s in enumerate(step_gaps(times, floor)):
            a, b = times[k], times[k + 1]
            if step_s is None:
                continue
            batch = [q for q in done if q is not o and q.token_times[0] <= a and q.token_times[-1] >= b]
            if any(q.spec.id < o.spec.id for q in batch):
                continue  # the step is counted once, on its first stream
            joined = [q for q, f in zip(done, firsts) if a < f <= b and q is not o]
            # the step that streamed token k + 1 computed token k: its context is the prompt and k + 1 tokens
            ctx = [o.spec.prompt_len + k + 1] + [q.spec.prompt_len + _tokens_by(q, a) for q in batch]
            kind = "mixed" if joined else "decode"
            key = (kind, len(batch), tuple(q.spec.id for q in joined), k // WINDOW)
            pooled.setdefault(key, []).append((ctx, [q.spec.prompt_len for q in joined], step_s))
        for (kind, _, _, _), rows in pooled.items():
            ctx = [round(statistics.mean(c[i] for c, _, _ in rows)) for i in range(len(rows[0][0]))]
            prompts = rows[0][1]
            samples.append(_sample(kind, [1] * len(ctx) + prompts, ctx + prompts, len(ctx) + len(prompts),
                                   len(prompts), [t for _, _, t in rows], streams=len(ctx)))
    return samples


def step_gaps(times: list[float], floor: float) -> list[float | None]:
    """Each gap between consecutive token times as the decode step it stands for: the gap, or where tokens came in a
    burst (gaps under `floor`) the mean of the span from the last gap before the burst to the burst's end. None for
    a burst with no gap before it (the wait is in the TTFT)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    out: list[float | None] = list(gaps)
    start = None  # the gap that opened the current span
    for k, g in enumerate(gaps):
        if g >= floor and g > 0:
            start = k
        elif start is None:
            out[k] = None
        else:
            out[start:k + 1] = [sum(gaps[start:k + 1]) / (k + 1 - start)] * (k + 1 - start)
    return out


def burst_floor(outs: list[Outcome]) -> float:
    """BURST × the mean gap over the sweep's streams (a stream, even a load, delivered whole in one burst has only
    tiny gaps)."""
    gaps = [b - a for o in outs if o.finished for a, b in zip(o.token_times, o.token_times[1:])]
    return BURST * statistics.fmean(gaps) if gaps else 0.0


def _tokens_by(o: Outcome, t: float) -> int:
    return sum(1 for x in o.token_times if x <= t)


def _sample(kind: str, new: list[int], ctx: list[int], sampled: int, prefill: int, times: list[float],
            streams: int = 1) -> dict:
    return {"kind": kind, "new_tokens": new, "context_lens": ctx, "num_sampled": sampled, "num_prefill": prefill,
            "time_s": statistics.median(times), "observations": len(times), "streams": streams}


def profile_endpoint(ep: Endpoint, model_spec: dict, quick: bool = False, timeout_s: float | None = 600.0,
                     progress=None, max_len: int | None = None) -> dict:
    """Run the sweep against the endpoint and fit the step-cost model; the profile (the JSON cost_model.profile
    names), recording what it was measured from. Prompts and outputs fit `max_len` (and the endpoint's own
    max_model_len). A server that ran requests sent together one at a time is sent no more than two at once after."""
    prompts = Prompts(ep)
    max_len = min(x for x in (max_len, ep.max_model_len, model_spec.get("max_position_embeddings"), 8192) if x)
    loads = sweep(quick, max_len)
    ran, t0, next_id, serial, skipped = [], time.perf_counter(), 0, False, 0
    for n, (together, load) in enumerate(loads):
        if serial and together > 2:
            skipped += 1
            continue
        outs = asyncio.run(_run_load(ep, prompts, load, next_id, timeout_s))
        next_id += len(load)
        ran.append(outs)
        if together > 1 and max((s["streams"] for s in steps_of(outs) if s["kind"] != "prefill"), default=1) == 1:
            serial = True  # they ran one after another: more at once would only queue
        if progress is not None:
            progress(n + 1, len(loads))
    floor = burst_floor([o for outs in ran for o in outs])
    samples = [s for outs in ran for s in steps_of(outs, floor)]
    decode = [s for s in samples if s["kind"] != "prefill"]
    streams = max((s["streams"] for s in decode), default=1)
    shapes = [record_shape(s) for s in samples]
    fitted = fit(shapes, [s["time_s"] for s in samples], experts=routed_experts(model_spec))
    return {"model": model_spec, "host": {"device": "endpoint", "endpoint": ep.url, "served_model": ep.model,
                                          "engine": ep.engine},
            "endpoint": {**ep.describe(), "max_concurrent_streams": streams, "loads": len(loads) - skipped,
                         "loads_skipped_serial": skipped, "requests": next_id, "max_len": max_len},
            "sweep_s": time.perf_counter() - t0, "fit": fitted, "samples": samples}

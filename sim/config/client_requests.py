"""A workload's requests as its client sends them (workload.client, sim/config/client.py): vLLM's rate schedule, warm-up
requests, and each request's time between client and engine, drawn deterministically for the workload's seed from a
stream of its own (the other draws do not move)."""
from __future__ import annotations

import numpy as np

from sim.config.client import ResolvedClient, TransportConfig
from sim.config.workload import ArrivalConfig, RequestTable, WorkloadConfig, table_column

CLIENT_STREAM = 8  # the seed's child stream for the client's draws: generate_requests spawns streams 0-7


def with_client(cfg: WorkloadConfig, table: RequestTable, client: ResolvedClient | None) -> RequestTable:
    """`table`'s requests (sim/config/workload.py: RequestTable) as `client` (the plan's: the workload's, with its
    engine's front end) sends them (unchanged where it has none): ids 0..n-1 in arrival order, warm-up requests
    first."""
    if client is None:
        return table
    rng_schedule, rng_times = (np.random.default_rng(s) for s in
                               np.random.SeedSequence(cfg.seed, spawn_key=(CLIENT_STREAM,)).spawn(2))
    n = len(table["id"])
    if client.tool == "vllm_bench" and cfg.arrival is not None and cfg.trace is None and n:
        table = {**table, "arrival_s": vllm_schedule(n, cfg.arrival, client, rng_schedule).tolist()}
    table = _with_warmups(table, client.warmup_requests)
    if client.transport is not None:
        table = _with_transport(table, client.transport, rng_times)
    return table


def vllm_schedule(n: int, arrival: ArrivalConfig, client: ResolvedClient, rng) -> np.ndarray:
    """When `vllm bench serve` sends each of n requests (vllm/benchmarks/serve.py, get_request): gaps drawn from a gamma
    of shape `burstiness` (1: exponential; infinite: constant 1 / rate) at each request's rate, the first one too, so
    the first request leaves after a gap; without a ramp-up the times are scaled so the last is sent at n / rate."""
    burstiness = {"poisson": 1.0, "constant": np.inf}.get(arrival.process)
    if burstiness is None:  # gamma: burstiness is its shape, 1 / cv^2
        burstiness = 1.0 / arrival.cv ** 2
    ramp = client.ramp_up
    if ramp is None:
        rates = np.full(n, arrival.rate)
    else:
        progress = np.arange(n) / max(n - 1, 1)
        rates = (ramp.start_rps + (ramp.end_rps - ramp.start_rps) * progress if ramp.strategy == "linear"
                 else ramp.start_rps * (ramp.end_rps / ramp.start_rps) ** progress)
    gaps = 1.0 / rates if np.isinf(burstiness) else rng.gamma(burstiness, 1.0 / (rates * burstiness))
    t = np.cumsum(gaps)
    if ramp is None and t[-1] > 0:
        t *= (n / arrival.rate) / t[-1]
    return t


def _with_warmups(table: RequestTable, count: int) -> RequestTable:
    """`count` warm-up copies of the first request (vLLM's --num-warmups sends the first prompt again; with fixed
    lengths aiperf's dataset draws are alike) ahead of the workload, sent at once (a closed loop's users take them
    first); the workload's ids and the turns they follow move up by `count`."""
    n = len(table["id"])
    if not count or not n:
        return table
    warm = {"arrival_s": 0.0, "think_s": 0.0, "conversation": -1, "after": -1, "warmup": True}  # the copies' own
    after = [a + count if a >= 0 else -1 for a in table_column(table, "after")]
    columns = {**{name: table_column(table, name) for name in warm}, **table, "after": after}
    out = {name: [warm.get(name, values[0])] * count + values for name, values in columns.items()}
    return {**out, "id": list(range(n + count))}


def _with_transport(table: RequestTable, t: TransportConfig, rng) -> RequestTable:
    """Each request's way to the server, the server's work on it (growing with the prompt), its way out and its close:
    the means times gamma draws of mean 1 and the transport's coefficient of variation."""
    n = len(table["id"])
    if t.jitter_cv > 0:
        shape = 1.0 / t.jitter_cv ** 2
        draw = rng.gamma(shape, 1.0 / shape, size=(4, n))
    else:
        draw = np.ones((4, n))
    prompt = np.array(table["prompt_len"], float)
    ins, fronts = (t.request_s * draw[0]).tolist(), ((t.frontend_s + t.prompt_token_s * prompt) * draw[1]).tolist()
    outs, closes = (t.token_s * draw[2]).tolist(), (t.close_s * draw[3]).tolist()
    return {**table, "in_s": ins, "front_s": fronts, "out_s": outs, "close_s": closes}

"""How each benchmark client defines the latencies it reports, so that a scenario naming its tool (workload.client)
reports TTFT, TPOT, ITL, E2E and throughput as that tool would have measured them. From the tools' own code:

- none, vllm_bench: vLLM's serving benchmark (vllm/benchmarks/serve.py, calculate_metrics; lib/endpoint_request_func.py):
  TTFT sending -> first token; E2E -> last token; TPOT per request (E2E - TTFT) / (tokens - 1), averaged over requests;
  ITL every gap between streamed chunks; numpy's linear percentiles; duration from the benchmark's start to the last
  stream's end.
- genai_perf (genai-perf, profile_data_parser/llm_profile_data_parser.py) and aiperf (aiperf/metrics/types/
  inter_token_latency_metric.py, request_latency_metric.py, benchmark_duration_metric.py): their "inter token latency"
  is per request (E2E - TTFT) / (tokens - 1), the figure reported for both TPOT and ITL here; duration from the first
  request's sending to the last response.
- guidellm (src/guidellm/schemas/request_stats.py; benchmark/schemas/generative/metrics.py; schemas/statistics.py):
  inter_token_latency (last - first token) / (tokens - 1) weighted by tokens - 1; time_per_output_token (last token -
  sending) / tokens weighted by tokens; request latency to the stream's end; percentiles are the value where the
  (weighted) cumulative share first reaches q, not interpolated.
- inference_perf (inference_perf/reportgen/base.py): >= 0.5 counts tokens: TPOT (last - first token) / (tokens - 1),
  ITL every token gap, request latency to the stream's end. <= 0.4 counted server-sent events (`sse_events_per_token`
  k): every one of a token's k events and [DONE] is a "token", so TPOT is (stream end - first token) / (k tokens) and
  ITL holds k - 1 gaps of ~0 per token: the BLIS vLLM runs' TPOT reads half of vLLM's with k = 2.

Tokens are the engine's (as those with usage counts read them); tools that re-tokenize the text (genai-perf, aiperf,
inference-perf <= 0.4) can count otherwise for forced outputs, which is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VLLM_TTFT = "sending -> first token"
PER_REQUEST = "per request (E2E - TTFT) / (tokens - 1)"


@dataclass(eq=False, repr=False)
class Definitions:
    """What each report figure means for one tool, in words; `word`: the console's name for the set."""

    source: str
    ttft_s: str
    tpot_s: str
    itl_s: str
    e2e_s: str
    throughput: str
    word: str


DEFINITIONS = {
    "none": Definitions("vLLM's serving benchmark (vllm/benchmarks/serve.py), infersim's own", VLLM_TTFT,
                        PER_REQUEST + ", mean over requests", "every gap between streamed chunks",
                        "sending -> last token", "over first sending -> last token", "vLLM's"),
    "vllm_bench": Definitions("vllm bench serve (vllm/benchmarks/serve.py: calculate_metrics)", VLLM_TTFT,
                              PER_REQUEST + ", mean over requests", "every gap between streamed chunks",
                              "sending -> last token", "over first sending -> last stream's end", "vllm bench's"),
    "genai_perf": Definitions("genai-perf (genai_perf/profile_data_parser/llm_profile_data_parser.py)", VLLM_TTFT,
                              "its inter_token_latency: " + PER_REQUEST, "its inter_token_latency: " + PER_REQUEST,
                              "sending -> last response", "over first sending -> last response", "genai-perf's"),
    "aiperf": Definitions("aiperf (aiperf/metrics/types/inter_token_latency_metric.py)", VLLM_TTFT,
                          "its inter_token_latency: " + PER_REQUEST, "its inter_token_latency: " + PER_REQUEST,
                          "sending -> last response", "over first sending -> last response", "aiperf's"),
    "guidellm": Definitions("guidellm (guidellm/schemas/request_stats.py)", VLLM_TTFT,
                            "its time_per_output_token: (last token - sending) / tokens, weighted by tokens",
                            "its inter_token_latency: (last - first token) / (tokens - 1), weighted by tokens - 1",
                            "sending -> stream's end", "over first sending -> last stream's end", "guidellm's"),
    "inference_perf": Definitions("inference-perf (inference_perf/reportgen/base.py)", VLLM_TTFT,
                                  "(last - first token) / (tokens - 1)", "every gap between tokens",
                                  "sending -> stream's end", "over first sending -> last stream's end",
                                  "inference-perf's"),
}
EVENTS = Definitions("inference-perf <= 0.4 (inference_perf/reportgen/base.py, counting server-sent events)",
                     VLLM_TTFT, "(stream's end - first event) / (events - 1), events = k per token + [DONE]",
                     "every gap between server-sent events", "sending -> stream's end",
                     "over first sending -> last stream's end", "inference-perf's (events)")
E2E_TO_STREAM_END = ("guidellm", "inference_perf")  # tools whose request latency ends with the stream, not its token
RUN_TO_STREAM_END = ("vllm_bench", "guidellm", "inference_perf")  # tools whose run ends with the last stream's end


def definitions_of(client) -> Definitions:
    """The definitions a run's client reports by (None: no client, infersim's own)."""
    if client is None:
        return DEFINITIONS["none"]
    return EVENTS if client.sse_events_per_token else DEFINITIONS[client.tool]


def describe(client) -> dict:
    """report.json's latency_definitions: the tool, where its definitions come from, and each figure's."""
    d = definitions_of(client)
    return {"tool": client.tool if client is not None else "none", "source": d.source, "ttft_s": d.ttft_s,
            "tpot_s": d.tpot_s, "itl_s": d.itl_s, "e2e_s": d.e2e_s, "throughput": d.throughput, "word": d.word}


def tool_of(client) -> str:
    return client.tool if client is not None else "none"


def per_request(rec, client) -> dict[str, np.ndarray]:
    """ttft, e2e, tpot per request as the client's tool defines them (nan where undefined: rejected, or TPOT with one
    token), and for a tool whose ITL is per request, `itl` and its weights."""
    tool = tool_of(client)
    n = rec.output_len.astype(float)
    ttft = rec.first_token_s - rec.arrival_s
    to_last = rec.finish_s - rec.arrival_s
    end = rec.stream_end_s if tool in E2E_TO_STREAM_END and rec.stream_end_s is not None else rec.finish_s
    e2e = end - rec.arrival_s if tool in E2E_TO_STREAM_END else to_last
    with np.errstate(invalid="ignore", divide="ignore"):
        # (E2E - TTFT) / (n - 1) written as metrics.per_request_latency writes it: the same bits
        per_gap = np.where(rec.output_len > 1, (to_last - ttft) / (rec.output_len - 1), np.nan)
        if client is not None and client.sse_events_per_token:
            tpot = np.where(n > 0, (end - rec.first_token_s) / (client.sse_events_per_token * n), np.nan)
        elif tool == "guidellm":
            tpot = np.where(n > 0, (rec.finish_s - rec.arrival_s) / n, np.nan)
        else:
            tpot = per_gap
    done = rec.completed
    out = {"ttft": np.where(done, ttft, np.nan), "e2e": np.where(done, e2e, np.nan),
           "tpot": np.where(done, tpot, np.nan)}
    if tool in ("genai_perf", "aiperf", "guidellm"):
        out["itl"] = np.where(done, per_gap, np.nan)
        out["itl_weight"] = np.maximum(n - 1, 0) if tool == "guidellm" else np.ones(len(n))
    return out


def weighted_summary(x: np.ndarray, w: np.ndarray | None = None) -> dict[str, float | None]:
    """mean, p50, p90, p99 as guidellm computes them: the weighted mean, and the smallest value whose weighted
    cumulative share reaches q (schemas/statistics.py, Percentiles.from_pdf)."""
    keep = ~np.isnan(x) if w is None else ~np.isnan(x) & (w > 0)
    x = x[keep]
    if not len(x):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    w = np.ones(len(x)) if w is None else w[keep].astype(float)
    order = np.argsort(x, kind="stable")
    x, p = x[order], w[order] / w.sum()
    cdf = np.cumsum(p)
    at = {q: float(x[min(int(np.searchsorted(cdf, q, side="left")), len(x) - 1)]) for q in (0.5, 0.9, 0.99)}
    return {"mean": float(np.sum(x * p)), "p50": at[0.5], "p90": at[0.9], "p99": at[0.99]}


def event_gaps(rec, events_per_token: int) -> dict[str, float | None]:
    """inference-perf <= 0.4's ITL: every gap between server-sent events: the engine's gaps between tokens, k - 1 gaps
    of ~0 per token (a token's other events, read together), and each stream's last gap, its last token to [DONE]
    (numpy's linear percentiles of the mixture, read off the gaps' CDF)."""
    done = rec.completed
    n = int(rec.output_len[done].sum())
    close = (rec.stream_end_s - rec.finish_s)[done] if rec.stream_end_s is not None else np.zeros(int(done.sum()))
    zeros = (events_per_token - 1) * n
    count = rec.itl.count + zeros + len(close)
    if not count:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    grid = np.unique(np.concatenate(([0.0], rec.itl.cdf_s, close)))
    below = np.interp(grid, rec.itl.cdf_s, rec.itl.cdf_fraction, left=0.0, right=1.0) if rec.itl.count else 0 * grid
    share = (zeros + rec.itl.count * below + np.searchsorted(np.sort(close), grid, side="right")) / count
    itl_sum = (rec.itl.stats["mean"] or 0.0) * rec.itl.count
    out = {"mean": float((itl_sum + close.sum()) / count)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        out[name] = float(grid[min(int(np.searchsorted(share, q, side="left")), len(grid) - 1)])
    return out


def summaries(rec, lat: dict[str, np.ndarray], client, linear) -> dict[str, dict]:
    """ttft_s, tpot_s, itl_s, e2e_s as the client's tool summarizes them; `linear`: numpy's linear-percentile summary
    (metrics.summarize) for the tools that use it."""
    tool = tool_of(client)
    if tool == "guidellm":
        n = rec.output_len.astype(float)
        return {"ttft_s": weighted_summary(lat["ttft"]), "tpot_s": weighted_summary(lat["tpot"], n),
                "itl_s": weighted_summary(lat["itl"], lat["itl_weight"]), "e2e_s": weighted_summary(lat["e2e"])}
    if "itl" in lat:
        itl = linear(lat["itl"])
    elif client is not None and client.sse_events_per_token:
        itl = event_gaps(rec, client.sse_events_per_token)
    else:
        itl = dict(rec.itl.stats)
    return {"ttft_s": linear(lat["ttft"]), "tpot_s": linear(lat["tpot"]), "itl_s": itl, "e2e_s": linear(lat["e2e"])}


def run_end(rec, client) -> np.ndarray:
    """Per completed request, when the client's clock for the run's duration counts it done."""
    done = rec.completed
    if tool_of(client) in RUN_TO_STREAM_END and rec.stream_end_s is not None:
        return rec.stream_end_s[done]
    return rec.finish_s[done]

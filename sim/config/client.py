"""The scenario's `workload.client:` section: which benchmark client sends the workload (genai-perf, aiperf, vLLM's
`vllm bench serve`, guidellm, inference-perf, or none named) and the time a request spends between that client and
the engine, on its way in (HTTP, parsing, tokenization) and out (detokenization, server-sent events, the stream's
close).

A named tool sets how requests are sent where tools differ (vLLM's rate schedule and ramp-up, aiperf's schedule under
a concurrency limit, warm-up requests) and how the report's latencies are defined (sim/report/definitions.py); the
transport moves each request's arrival at the engine after its sending and each token's arrival at the client after
the engine emitted it, with seeded per-request jitter, so that a closed loop's users do not send in lock-step
(sim/config/client_requests.py draws it; sim/policy/arrivals.py keeps it).

`resolve_client` says what a workload's client is, written or not: a closed loop with no think time is a fixed-
concurrency benchmark, and gets the measured transport unless it says otherwise.
"""

from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from sim.config.schema_base import ON_USE, StrictModel

TOOLS = ("none", "genai_perf", "aiperf", "vllm_bench", "guidellm", "inference_perf")
MAX_WARMUP_REQUESTS = 100_000


class TransportConfig(StrictModel):
    """The time between client and engine, per request (mean values; each request draws its own, see jitter_cv).

    request_s: sending to the server's handler (the client's own work, the connection, HTTP), requests in parallel.
    frontend_s + prompt_token_s per prompt token: the server's work before the engine sees the request (parsing the
    body, tokenizing the prompt), one request at a time in each server process (vLLM's API server tokenizes on one
    thread; `infersim serve --http` in its event loop), one such front end per replica, a request taking the first
    free. token_s: a token's emission by the engine to its arrival at the client (detokenization, the server-sent
    event, the client's parsing). close_s: the last token's arrival to the stream's close (the finish and usage
    events, [DONE]); a closed loop's user sends its next request after it. jitter_cv: each request's times are the
    means times gamma draws of mean 1 and this coefficient of variation (0: every request alike)."""

    request_s: float = Field(ge=0, le=60)
    frontend_s: float = Field(0.0, ge=0, le=60)
    prompt_token_s: float = Field(0.0, ge=0, le=0.01)
    token_s: float = Field(ge=0, le=60)
    close_s: float = Field(0.0, ge=0, le=60)
    jitter_cv: float = Field(0.0, ge=0, le=10)


# Measured by bench/client_time.py (2026-12-05, docs/endpoints.md): Starlette on uvicorn (infersim serve --http's
# stack; vLLM's API server runs FastAPI on it) and the project's httpx replay client, one user, on a 2-core AMD EPYC VM
# over loopback with the machine's 1-minute load at 8-10; SmolLM2's fast BPE tokenizer (HF tokenizers). request_s,
# token_s, close_s: wall-clock medians; frontend_s: the server's CPU per request beyond tokenizing and its events. A
# client across a network adds its round trip to request_s and token_s; a faster host's cores shrink them all.
MEASURED_TRANSPORT = TransportConfig(request_s=1.0e-3, frontend_s=5.0e-4, prompt_token_s=2.7e-6, token_s=4.5e-4,
                                     close_s=4.5e-4, jitter_cv=0.65)


class RampUpConfig(StrictModel):
    """vLLM's `--ramp-up-strategy`, `--ramp-up-start-rps`, `--ramp-up-end-rps`: request i is sent at the rate
    start + (end - start) i / (n - 1) (linear) or start (end / start)^(i / (n - 1)) (exponential)."""

    model_config = ON_USE

    strategy: Literal["linear", "exponential"]
    start_rps: float = Field(gt=0, le=1e6)
    end_rps: float = Field(gt=0, le=1e6)


class ClientConfig(StrictModel):
    """Who sends the workload, and how long a request takes to reach the engine and its tokens to come back."""

    model_config = ON_USE

    tool: Literal["none", "genai_perf", "aiperf", "vllm_bench", "guidellm", "inference_perf"] = Field(
        "none", description="the benchmark client: how it sends and how it defines the report's latencies (none: "
        "vLLM's serving benchmark's definitions, infersim's own)")
    transport: Union[Literal["engine", "measured", "none"], TransportConfig] = Field(
        "engine", description="the time between client and engine: engine (the serving engine's front end as "
        "calibrated end to end: vLLM's API server on published runs; else measured), measured (bench/client_time.py's "
        "figures: infersim serve --http and its client on loopback), none (requests reach the engine as sent, tokens "
        "the client as emitted), or its own figures")
    warmup_requests: int = Field(0, ge=0, le=MAX_WARMUP_REQUESTS, description=(
        "requests sent before the measured ones and left out of the report, which start once every warm-up request "
        "ended (aiperf's and genai-perf's --warmup-request-count, vLLM's --num-warmups: copies of the first request)"))
    ramp_up: Optional[RampUpConfig] = Field(None, description="vllm_bench: the rate ramps from start to end")
    sse_events_per_token: Optional[int] = Field(None, ge=1, le=16, description=(
        "inference_perf: the tool counts server-sent events, not tokens (inference-perf <= 0.4), and the server sent "
        "this many per token (the BLIS vLLM runs: 2); unset, it counts tokens (inference-perf >= 0.5)"))

    @model_validator(mode="after")
    def _keys_of_the_tool(self) -> "ClientConfig":
        if self.ramp_up is not None and self.tool != "vllm_bench":
            raise ValueError(f"'ramp_up' is vllm bench serve's (tool: vllm_bench), not {self.tool}'s")
        if self.sse_events_per_token is not None and self.tool != "inference_perf":
            raise ValueError(f"'sse_events_per_token' is inference-perf's (tool: inference_perf), not {self.tool}'s")
        if self.warmup_requests and self.tool in ("guidellm", "inference_perf"):
            raise ValueError(f"{self.tool} leaves out a warm-up window of a running load, not warm-up requests sent "
                             "before it; allowed: warmup_requests 0")
        return self


@dataclass(eq=False, repr=False)
class ResolvedClient:
    """A workload's client as the run uses it. transport None: requests reach the engine as sent. `assumed`: not
    written in the scenario (a closed loop with no think time)."""

    tool: str
    transport: TransportConfig | None
    warmup_requests: int = 0
    ramp_up: RampUpConfig | None = None
    sse_events_per_token: int | None = None
    assumed: bool = False

    def describe(self) -> dict:
        """report.json's client section (the transport's means, or None)."""
        return {"tool": self.tool, "assumed": self.assumed, "warmup_requests": self.warmup_requests,
                "transport": self.transport.model_dump() if self.transport is not None else None,
                **({"ramp_up": self.ramp_up.model_dump()} if self.ramp_up is not None else {}),
                **({"sse_events_per_token": self.sse_events_per_token} if self.sse_events_per_token else {})}


def slides(client: ResolvedClient | None) -> bool:
    """Whether a request waiting for a slot holds the schedule back (aiperf: its rate loop takes a slot, sends, then
    sleeps the next gap), rather than the requests after it keeping their times (vLLM, genai-perf)."""
    return client is not None and client.tool == "aiperf"


def resolve_client(workload, front_end: TransportConfig | None = None) -> ResolvedClient | None:
    """The workload's client (None: none, requests reach the engine as sent, infersim's definitions). `front_end`: the
    serving engine's own time between client and engine, where calibrated (sim/config/engines.py): a workload naming
    no client is still served through it, and a client's default transport is it. A closed loop with no think time
    and no `client` is a fixed-concurrency benchmark's: that transport (the measured one where the engine has none),
    no tool."""
    c: ClientConfig | None = workload.client
    engine = front_end or MEASURED_TRANSPORT
    if c is None:
        loop = workload.closed_loop
        if front_end is not None or (loop is not None and loop.think_time_s == 0):
            return ResolvedClient("none", engine, assumed=True)
        return None
    transport = {"engine": engine, "measured": MEASURED_TRANSPORT, "none": None}.get(c.transport, c.transport) \
        if isinstance(c.transport, str) else c.transport
    return ResolvedClient(c.tool, transport, c.warmup_requests, c.ramp_up, c.sse_events_per_token)


def check_client_fits(w) -> None:
    """What a named client cannot go with in the workload, as the validator's one-line reasons."""
    c: ClientConfig | None = w.client
    if c is None:
        return
    if c.tool != "none" and w.bursts:
        raise ValueError(f"with client.tool {c.tool}, drop 'bursts': the tool sends every request itself")
    if c.warmup_requests and w.conversation is not None:
        raise ValueError("client.warmup_requests with 'conversation': warm-up requests are single requests; drop one")
    if c.tool == "vllm_bench":
        if w.duration_s is not None:
            raise ValueError("with client.tool vllm_bench, give 'num_requests' (its --num-prompts), not 'duration_s'")
        if w.conversation is not None:
            raise ValueError("with client.tool vllm_bench, drop 'conversation': vllm bench serve sends single requests")
    if c.ramp_up is not None and (w.arrival is None or w.trace is not None):
        raise ValueError("client.ramp_up ramps a synthetic 'arrival' (its process's burstiness): give 'arrival', not "
                         "a closed loop or a trace")

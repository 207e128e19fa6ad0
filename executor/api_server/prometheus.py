"""The online server's metrics in Prometheus' text format, under vLLM's names where the meaning is the same, so a
Grafana board made for vLLM reads them (vllm:num_requests_running, vllm:time_to_first_token_seconds, ...)."""
from __future__ import annotations

import bisect
import threading

# vLLM's bucket bounds (vllm/engine/metrics.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's iteration_tokens
DECODE_ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are exposed."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        return out + [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {total}"]


class ServerMetrics:
    """What the server counts (any thread may record; `text` renders the exposition). `gauges()` returns the
    engine's state now: (running, waiting, KV blocks used / blocks)."""

    def __init__(self, model_name: str, gauges):
        self.labels = f'model_name="{_escape(model_name)}"'
        self.gauges = gauges
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.decode_rows = Histogram(DECODE_ROWS_BUCKETS)
        self.refused: dict[int, int] = {}  # requests the HTTP front turned away before the engine, by status
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.arrived = 0
        self.finished: dict[str, int] = {}  # by finish reason: stop, length
        self.rejected: dict[str, int] = {}  # by reason

    def request_arrived(self) -> None:
        with self.lock:
            self.arrived += 1

    def request_refused(self, status: int) -> None:
        with self.lock:
            self.refused[status] = self.refused.get(status, 0) + 1

    def step_observed(self, tokens: int, decode_rows: int) -> None:
        """One engine step: the tokens it computed and the requests it decoded."""
        with self.lock:
            self.iteration_tokens.observe(tokens)
            if decode_rows:
                self.decode_rows.observe(decode_rows)

    def request_ended(self, prompt_tokens: int, token_times: list[float], arrival_s: float,
                      finish_reason: str | None, reject_reason: str | None) -> None:
        """One request's end: its latencies into the histograms (a finished one), its outcome counted."""
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += len(token_times)
            if token_times:
                self.ttft.observe(token_times[0] - arrival_s)
                for a, b in zip(token_times, token_times[1:]):
                    if b > a:  # tokens of one step arrive as one chunk
                        self.itl.observe(b - a)
            if reject_reason is None:
                self.e2e.observe(token_times[-1] - arrival_s if token_times else 0.0)
                self.finished[finish_reason or "stop"] = self.finished.get(finish_reason or "stop", 0) + 1
            else:
                self.rejected[reject_reason] = self.rejected.get(reject_reason, 0) + 1

    def text(self) -> str:
        running, waiting, kv_usage = self.gauges()
        lab = self.labels
        out = []

        def metric(name: str, kind: str, help_: str, lines: list[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

        with self.lock:
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [f"vllm:num_requests_running{{{lab}}} {running}"])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [f"vllm:num_requests_waiting{{{lab}}} {waiting}"])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [f"vllm:kv_cache_usage_perc{{{lab}}} {kv_usage!r}"])
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   [f"vllm:prompt_tokens_total{{{lab}}} {self.prompt_tokens}"])
            metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   [f"vllm:generation_tokens_total{{{lab}}} {self.generation_tokens}"])
            metric("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                   self.ttft.lines("vllm:time_to_first_token_seconds", lab))
            metric("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
                   self.itl.lines("vllm:inter_token_latency_seconds", lab))
            metric("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
                   self.e2e.lines("vllm:e2e_request_latency_seconds", lab))
            metric("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
                   self.iteration_tokens.lines("vllm:iteration_tokens_total", lab))
            metric("infersim:decode_rows_per_step", "histogram", "Requests decoded per engine step that decoded any.",
                   self.decode_rows.lines("infersim:decode_rows_per_step", lab))
            metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   [f'vllm:request_success_total{{{lab},finished_reason="{k}"}} {v}'
                    for k, v in sorted(self.finished.items())])
            # infersim's own: every request that arrived ends completed or rejected with a reason
            metric("infersim:requests_arrived_total", "counter", "Requests received.",
                   [f"infersim:requests_arrived_total{{{lab}}} {self.arrived}"])
            metric("infersim:requests_rejected_total", "counter", "Requests rejected, by reason.",
                   [f'infersim:requests_rejected_total{{{lab},reason="{_escape(k)}"}} {v}'
                    for k, v in sorted(self.rejected.items())])
            metric("infersim:requests_refused_total", "counter", "Requests the HTTP front turned away before the "
                   "engine (bad input, too large, not authorized, shutting down), by status.",
                   [f'infersim:requests_refused_total{{{lab},status="{k}"}} {v}' for k, v in sorted(self.refused.items())])
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

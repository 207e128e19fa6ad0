"""What a serving engine does with the kernels, as the cost models price it (sim/config/engines.py says what each
engine release does; this turns it into seconds):

- CUDA graphs: a step run from a captured graph computes its padded size (the next captured one) in every kernel
  inside the graph — the decoder layers' GEMMs, passes and all-reduces — while the LM head runs on the rows sampled;
- all-reduce: the engine's own peer-to-peer one- or two-shot all-reduce over NVLink below its message limit, NCCL
  above it and on PCIe (sim/cost/nccl.py: `CustomAllReduce`);
- host work: scheduling, input preparation and sampling take `step_s` + `per_seq_s` a sequence (+ `prefill_s` in a
  step with a prompt); with async scheduling (vLLM from 0.14, SGLang's and TensorRT-LLM's overlap schedulers) the
  host prepares the next step while the device runs this one, so only what exceeds the device's work shows
  (`HostCost`).
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.config.engines import EngineProfile


@dataclass(eq=False, repr=False)
class HostCost:
    """The host's seconds of a step, and how much of them the step's time shows."""

    step_s: float
    per_seq_s: float
    prefill_s: float = 0.0
    async_scheduling: bool = False

    def host_s(self, seqs: float, prefill: bool) -> float:
        """The host's work for a step of `seqs` sequences (a prompt among them: `prefill`)."""
        return self.step_s + seqs * self.per_seq_s + (self.prefill_s if prefill else 0.0)

    def visible_s(self, seqs: float, prefill: bool, device_s: float) -> float:
        """What the step's time shows of the host's work beside `device_s` of the device's (async scheduling: only
        what exceeds it)."""
        host = self.host_s(seqs, prefill)
        if not self.async_scheduling:
            return host
        return host - device_s if host > device_s else 0.0


# The host's time per kernel of a step run outside a CUDA graph: Python module calls, PyTorch's dispatch and
# cudaLaunchKernel. An eager step takes at least its launches one after another, which a graph replays at once.
# Estimate, not fitted: gpt-fast's eager Llama-2-7B decodes ~25 tokens/s on an A100 against ~100 with graphs (~30 µs
# an op of its unfused code); vLLM's fused custom ops launch fewer, cheaper kernels (docs/cost-model.md)
EAGER_LAUNCH_S = 20e-6


def launch_floor_s(engine: EngineProfile | None, tokens: int, decode_only: bool, kernels: int) -> float:
    """The least time an eager step's `kernels` launches take one after another (0 for a graph's replay, and for a
    cost model given no engine)."""
    if engine is None or engine.in_graph(tokens, decode_only):
        return 0.0
    return kernels * EAGER_LAUNCH_S


def with_launches(step_s: float, launches_s: float, host_s: float) -> float:
    """A step of `step_s` seconds, `host_s` of them the host's own, run no faster than its launches: the device's
    share of it waits for them where they take longer."""
    device = step_s - host_s
    return step_s + (launches_s - device) if launches_s > device else step_s


def padded_tokens(engine: EngineProfile | None, tokens: int, decode_only: bool) -> int:
    """The tokens a step's graphed kernels compute: a CUDA graph's padded size, or the step's own."""
    return tokens if engine is None else engine.graph_tokens(tokens, decode_only)

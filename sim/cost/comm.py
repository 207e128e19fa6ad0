"""Collectives between a replica's devices: the seconds an all-reduce, a gather or a send takes, from the bytes each
device contributes and the number of devices.

Two sources answer the same calls (`Collectives`): `Interconnect`, the link's numbers from the hardware catalog
(bandwidth, latency, topology: what the roofline prices with), and `MeasuredCollectives`, the per-operation fits a
profile measured on the machine (executor/distributed/comm_bench.py). `TensorParallelComm` is a Megatron step's
communication over an interconnect: two all-reduces a layer of the tokens' hidden states and the sampled rows' logits
gathered from the vocabulary-parallel LM head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sim.config.hardware import HardwareSpec
from sim.config.models import ModelSpec


class Collectives(Protocol):
    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        """One all-reduce of `nbytes` on each of `devices` devices."""

    def gather_s(self, nbytes: float, devices: int) -> float:
        """One gather of `nbytes` in all, each of `devices` devices holding a share of them."""

    def send_s(self, nbytes: float) -> float:
        """One point-to-point send of `nbytes`."""

    def all_to_all_s(self, nbytes: float, devices: int) -> float:
        """One all-to-all in which each of `devices` devices holds `nbytes` for all of them (its own share stays)."""


@dataclass(eq=False, repr=False, slots=True)
class Interconnect:
    """A link between devices as the hardware catalog gives it. Over a `ring` (NCCL on PCIe cards) a collective
    passes its messages one after another; through a `switch` (NVSwitch) every peer is one hop away, so an all-reduce
    (reduce-scatter + all-gather, vLLM's custom one-shot or two-shot) waits two latencies and a gather one."""

    bandwidth: float  # bytes/s each device sends and receives
    latency_s: float  # one message's
    topology: str = "ring"  # "ring" or "switch"

    @classmethod
    def of(cls, hw: HardwareSpec) -> Interconnect:
        """The hardware entry's device-to-device link."""
        return cls(hw.interconnect_bandwidth, hw.interconnect_latency_s, hw.interconnect_topology)

    def all_reduce_hops(self, devices: int) -> int:
        """Latencies one all-reduce waits."""
        return 2 if self.topology == "switch" else 2 * (devices - 1)

    def gather_hops(self, devices: int) -> int:
        """Latencies one gather waits."""
        return 1 if self.topology == "switch" else devices - 1

    def all_reduce_bytes_s(self, nbytes: float, devices: int, count: int = 1) -> float:
        """The bandwidth part of `count` all-reduces of `nbytes` each: a ring's reduce-scatter and all-gather move
        2(n−1)/n of the bytes through each device's link."""
        ring = 2 * (devices - 1) / devices
        return count * ring * nbytes / self.bandwidth

    def gather_bytes_s(self, nbytes: float, devices: int) -> float:
        """The bandwidth part of a gather: each device receives the (n−1)/n of the bytes it does not hold."""
        return (devices - 1) / devices * nbytes / self.bandwidth

    def send_bytes_s(self, nbytes: float) -> float:
        """The bandwidth part of a send."""
        return nbytes / self.bandwidth

    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        return self.all_reduce_bytes_s(nbytes, devices) + self.all_reduce_hops(devices) * self.latency_s

    def gather_s(self, nbytes: float, devices: int) -> float:
        return self.gather_bytes_s(nbytes, devices) + self.gather_hops(devices) * self.latency_s

    def send_s(self, nbytes: float) -> float:
        return self.send_bytes_s(nbytes) + self.latency_s

    def all_to_all_s(self, nbytes: float, devices: int) -> float:
        """Each device sends the (n−1)/n of its bytes bound elsewhere at once: through a switch one latency, over a
        ring the messages pass n−1 hops."""
        return self.gather_s(nbytes, devices)


@dataclass(eq=False, repr=False, slots=True)
class TensorParallelComm:
    """A tensor-parallel step's communication over `devices` devices, affine in its tokens: two all-reduces a layer
    of each new token's hidden state (sequence parallelism's reduce-scatter + all-gather move the same bytes), and
    each sampled row's fp32 logits gathered from the vocabulary-parallel LM head."""

    per_token_s: float
    per_step_s: float  # the collectives' latencies
    per_logit_row_s: float

    @classmethod
    def of(cls, model: ModelSpec, link: Interconnect, devices: int) -> TensorParallelComm:
        """Model and link sizes to the step's coefficients."""
        all_reduces = 2 * model.num_layers
        return cls(link.all_reduce_bytes_s(model.hidden_size * model.act_bytes, devices, all_reduces),
                   (all_reduces * link.all_reduce_hops(devices) + link.gather_hops(devices)) * link.latency_s,
                   link.gather_bytes_s(model.vocab_size * 4, devices))

    def time(self, tokens: int, sampled: int) -> float:
        """Seconds of communication in a step of `tokens` new tokens, `sampled` of them sampling."""
        return tokens * self.per_token_s + self.per_step_s + sampled * self.per_logit_row_s


class MeasuredCollectives:
    """Collectives as a profile measured them (`comm.fit`: per operation a latency and seconds per byte, fitted at
    the profile's world size, which is the device count they price): the CPU engine's shared-memory all-reduce and
    gather, gloo's point-to-point send and the driver's step message."""

    def __init__(self, fits: dict[str, dict[str, float]]):
        self.fits = fits

    def _time(self, op: str, nbytes: float) -> float:
        fit = self.fits[op]
        return fit["latency_s"] + fit["s_per_byte"] * nbytes

    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        return self._time("all_reduce_shm", nbytes)

    def gather_s(self, nbytes: float, devices: int) -> float:
        return self._time("gather_shm", nbytes)

    def send_s(self, nbytes: float) -> float:
        return self._time("send_gloo", nbytes)

    def message_s(self, nbytes: float) -> float:
        """The driver's broadcast of a step's message to the workers."""
        return self._time("message_gloo", nbytes)

    def scaled(self, factor: float) -> MeasuredCollectives:
        """Every collective `factor` times as long (the machine slower or faster than profiled)."""
        return MeasuredCollectives({op: {k: v * factor for k, v in fit.items()} for op, fit in self.fits.items()})

"""Collectives priced from NCCL measurements (sim/cost/comm.py's `Collectives`): per system (a DGX's NVSwitch, PCIe
boards, InfiniBand between nodes), collective and device count, time = (latency^p + (bytes / bandwidth)^p)^(1/p),
fitted by calibration/kernel_fit.py to Vidur's measurements (calibration/data/gpu/collectives.csv). What the system
did not measure falls back to the hardware's link (`Interconnect`)."""
from __future__ import annotations

from dataclasses import dataclass

from sim.cost.comm import Interconnect


@dataclass(frozen=True)
class CollectiveFit:
    latency_s: float
    bandwidth: float  # algorithm bandwidth: message bytes per second
    sharpness: float

    def time(self, nbytes: float) -> float:
        p = self.sharpness
        return (self.latency_s ** p + (nbytes / self.bandwidth) ** p) ** (1.0 / p)

    def for_devices(self, measured: int, n: int) -> CollectiveFit:
        """An all-reduce fit of `measured` devices carried to n: a ring moves 2(n−1)/n of the message over each link,
        so the bus bandwidth stays and the message rate scales by that factor."""
        scale = (2 * (measured - 1) / measured) / (2 * (n - 1) / n)
        return CollectiveFit(self.latency_s, self.bandwidth * scale, self.sharpness)


def pick(fits: dict, n: int) -> CollectiveFit | None:
    """From fits keyed "<workers>x<devices per node>": n devices in one node, else n across nodes as measured, else
    the nearest count in one node carried to n; None if nothing was measured."""
    shapes = {tuple(map(int, k.split("x"))): v for k, v in fits.items()}
    for key in ((n, n), *sorted((w, d) for w, d in shapes if w == n)):
        if key in shapes:
            return CollectiveFit(**shapes[key])
    one_node = sorted(w for w, d in shapes if w == d)
    if not one_node:
        return None
    near = min(one_node, key=lambda w: (abs(w - n), w))
    return CollectiveFit(**shapes[(near, near)]).for_devices(near, n)


class NcclCollectives:
    """One system's measured all-reduces (by device count) and sends between two devices of a node; the link's
    formula for what it did not measure."""

    def __init__(self, system: str, fits: dict, link: Interconnect):
        self.system, self.link = system, link
        self._all_reduce = fits.get("all_reduce", {})
        self._picked: dict[int, CollectiveFit | None] = {}
        self._send = CollectiveFit(**fits["send_recv"]["2x2"]) if "2x2" in fits.get("send_recv", {}) else None

    def _fit(self, devices: int) -> CollectiveFit | None:
        if devices not in self._picked:
            self._picked[devices] = pick(self._all_reduce, devices)
        return self._picked[devices]

    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        fit = self._fit(devices)
        return fit.time(nbytes) if fit is not None else self.link.all_reduce_s(nbytes, devices)

    def gather_s(self, nbytes: float, devices: int) -> float:
        """Gathering `nbytes` in all: a ring all-reduce is a reduce-scatter then an all-gather, each moving half its
        traffic, so half an all-reduce of the same bytes."""
        fit = self._fit(devices)
        return fit.time(nbytes / 2) if fit is not None else self.link.gather_s(nbytes, devices)

    def send_s(self, nbytes: float) -> float:
        return self._send.time(nbytes) if self._send is not None else self.link.send_s(nbytes)

    def all_to_all_s(self, nbytes: float, devices: int) -> float:
        """No all-to-all was measured: a device's (n−1)/n of the bytes leaving at once, at the measured
        point-to-point rate (every peer is one NVSwitch hop away)."""
        if self._send is None:
            return self.link.all_to_all_s(nbytes, devices)
        return self._send.time((devices - 1) / devices * nbytes)

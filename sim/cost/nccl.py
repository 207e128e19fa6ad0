"""Collectives priced from NCCL measurements: per system (a DGX's NVSwitch, PCIe boards, InfiniBand between nodes),
collective and device count, time = (latency^p + (bytes / bandwidth)^p)^(1/p), fitted by calibration/kernel_fit.py to
Vidur's measurements (calibration/data/gpu/collectives.csv)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveFit:
    latency_s: float
    bandwidth: float  # algorithm bandwidth: message bytes per second
    sharpness: float

    def time(self, nbytes: float) -> float:
        p = self.sharpness
        return (self.latency_s ** p + (nbytes / self.bandwidth) ** p) ** (1.0 / p)

    def for_devices(self, measured: int, n: int) -> "CollectiveFit":
        """An all-reduce fit of `measured` devices carried to n: a ring moves 2(n−1)/n of the message over each link,
        so the bus bandwidth stays and the message rate scales by that factor."""
        scale = (2 * (measured - 1) / measured) / (2 * (n - 1) / n)
        return CollectiveFit(self.latency_s, self.bandwidth * scale, self.sharpness)


class MeasuredCollectives:
    """The collectives of `n` devices of one node (more than a node holds: across nodes, as measured) from one system's
    fits ({collective: {"<workers>x<devices per node>": {latency_s, bandwidth, sharpness}}})."""

    def __init__(self, fits: dict, n: int, system: str):
        self.system, self.n = system, n
        self._all_reduce = self._pick(fits.get("all_reduce", {}), n) if n > 1 else None
        sends = fits.get("send_recv", {})
        self._send = CollectiveFit(**sends["2x2"]) if "2x2" in sends else None

    @staticmethod
    def _pick(fits: dict, n: int) -> CollectiveFit | None:
        """The fit of n devices in one node, else n across nodes, else the nearest count in one node carried to n."""
        shapes = {tuple(map(int, k.split("x"))): v for k, v in fits.items()}
        for key in ((n, n), *sorted((w, d) for w, d in shapes if w == n)):
            if key in shapes:
                return CollectiveFit(**shapes[key])
        one_node = sorted(w for w, d in shapes if w == d)
        if not one_node:
            return None
        near = min(one_node, key=lambda w: (abs(w - n), w))
        return CollectiveFit(**shapes[(near, near)]).for_devices(near, n)

    @property
    def has_all_reduce(self) -> bool:
        return self._all_reduce is not None

    @property
    def has_send(self) -> bool:
        return self._send is not None

    def all_reduce(self, nbytes: float) -> float:
        return self._all_reduce.time(nbytes)

    def all_gather(self, nbytes: float) -> float:
        """Gathering `nbytes` in all: a ring all-reduce is a reduce-scatter then an all-gather, each moving half its
        traffic, so half an all-reduce of the same bytes (one latency)."""
        return self._all_reduce.time(nbytes / 2)

    def send(self, nbytes: float) -> float:
        return self._send.time(nbytes)

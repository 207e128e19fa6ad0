"""Collectives priced from NCCL measurements (sim/cost/comm.py's `Collectives`): per system (a DGX's NVSwitch, PCIe
boards, InfiniBand between nodes), collective and device count, time = (latency^p + (bytes / bandwidth)^p)^(1/p),
fitted by calibration/kernel_fit.py to Vidur's measurements (calibration/data/gpu/collectives.csv) and by
calibration/aic_fit.py to AIConfigurator's nccl-tests runs (systems "aic_<device>", with all-gather and all-to-all
measured too). What the system did not measure falls back to the hardware's link (`Interconnect`).

`CustomAllReduce` is a serving engine's own all-reduce (vLLM's and SGLang's one-shot / two-shot kernels over
NVLink, TensorRT-LLM's): below the largest message it takes, its fit; above, the collectives it wraps (NCCL)."""
from __future__ import annotations

from dataclasses import dataclass

from sim.cost.comm import Interconnect


@dataclass(eq=False, repr=False)
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
    """One system's measured all-reduces (by device count) and sends between two devices of a node, and where it
    measured them its all-gathers and all-to-alls; the link's formula for what it did not measure."""

    def __init__(self, system: str, fits: dict, link: Interconnect):
        self.system, self.link = system, link
        self._fits = fits
        self._picked: dict[tuple[str, int], CollectiveFit | None] = {}
        self._send = CollectiveFit(**fits["send_recv"]["2x2"]) if "2x2" in fits.get("send_recv", {}) else None

    def _fit(self, devices: int, collective: str = "all_reduce") -> CollectiveFit | None:
        key = (collective, devices)
        if key not in self._picked:
            self._picked[key] = pick(self._fits.get(collective, {}), devices)
        return self._picked[key]

    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        fit = self._fit(devices)
        return fit.time(nbytes) if fit is not None else self.link.all_reduce_s(nbytes, devices)

    def gather_s(self, nbytes: float, devices: int) -> float:
        """Gathering `nbytes` in all: the all-gather as measured, else half an all-reduce of the same bytes (a ring
        all-reduce is a reduce-scatter then an all-gather, each moving half its traffic)."""
        if "all_gather" in self._fits and (fit := self._fit(devices, "all_gather")) is not None:
            return fit.time(nbytes)
        fit = self._fit(devices)
        return fit.time(nbytes / 2) if fit is not None else self.link.gather_s(nbytes, devices)

    def send_s(self, nbytes: float) -> float:
        return self._send.time(nbytes) if self._send is not None else self.link.send_s(nbytes)

    def all_to_all_s(self, nbytes: float, devices: int) -> float:
        """The all-to-all as measured; else a device's (n−1)/n of the bytes leaving at once, at the measured
        point-to-point rate (every peer is one NVSwitch hop away)."""
        if "alltoall" in self._fits and (fit := self._fit(devices, "alltoall")) is not None:
            return fit.time(nbytes)
        if self._send is None:
            return self.link.all_to_all_s(nbytes, devices)
        return self._send.time((devices - 1) / devices * nbytes)


@dataclass(eq=False, repr=False)
class CustomAllReduceFit:
    """An engine's own all-reduce over one device count: its time below the largest message it takes."""

    latency_s: float
    bandwidth: float
    sharpness: float
    max_bytes: float  # past this the engine falls back to NCCL

    def time(self, nbytes: float) -> float:
        return CollectiveFit(self.latency_s, self.bandwidth, self.sharpness).time(nbytes)


class CustomAllReduce:
    """A serving engine's collectives: its own all-reduce kernel for messages up to that kernel's limit on the
    device counts it was measured at, everything else (larger messages, gathers, sends) by the collectives it
    wraps."""

    def __init__(self, base, fits: dict):
        self.base = base
        self.fits = {int(n): CustomAllReduceFit(**f) for n, f in fits.items()}

    def all_reduce_s(self, nbytes: float, devices: int) -> float:
        fit = self.fits.get(devices)
        if fit is not None and nbytes <= fit.max_bytes:
            return fit.time(nbytes)
        return self.base.all_reduce_s(nbytes, devices)

    def gather_s(self, nbytes: float, devices: int) -> float:
        return self.base.gather_s(nbytes, devices)

    def send_s(self, nbytes: float) -> float:
        return self.base.send_s(nbytes)

    def all_to_all_s(self, nbytes: float, devices: int) -> float:
        return self.base.all_to_all_s(nbytes, devices)


def engine_collectives(kernels, collective_fits: dict, link: Interconnect, graph: bool = True):
    """The collectives an engine's kernels (`DeviceKernels` of `engine_kernels`) run: the NCCL system they name
    (`collective_fits`: gpu_kernels.json's "collectives", as `load_kernels` returns them), else the link; with the
    engine's custom all-reduce in CUDA-graph (`graph`) or eager mode where it was measured (an engine timed under
    CUDA graphs only, TensorRT-LLM, runs that kernel eagerly too: its launch hides behind the GPU's queue)."""
    system = kernels.collectives
    base = NcclCollectives(system, collective_fits[system], link) if system in collective_fits else link
    fits = kernels.custom_all_reduce or {}
    custom = fits.get("graph" if graph else "eager") or fits.get("graph")
    return CustomAllReduce(base, custom) if custom else base

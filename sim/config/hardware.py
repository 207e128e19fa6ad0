"""Accelerators: the catalog and explicit specs (peak rates, memory, links, price)."""

import json
from collections.abc import Mapping
from functools import lru_cache, partial
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, NonNegativeFloat, PositiveFloat

from sim.config.errors import LazyCatalog, catalog_entry
from sim.config.schema_base import StrictModel

GiB = 1024**3


class HardwareSpec(StrictModel):
    """One device: dense peak FLOP/s per dtype, memory, and the links around it."""

    # built when a spec is first validated: the catalog's entries are built unvalidated (tests/test_catalogs.py)
    model_config = ConfigDict(defer_build=True)
    name: str = "custom"
    peak_flops: dict[Literal["fp32", "fp16", "bf16", "int8", "fp8", "int4", "fp4"],
                     Annotated[float, Field(ge=1e6)]] = Field(
        min_length=1, description="dense FLOP/s by dtype: fp32, fp16, bf16, int8, fp8, int4, fp4")
    memory_bandwidth: float = Field(ge=1e6, description="bytes/s")
    # past ~1e6 GiB the byte counts overflow to inf and the block count to NaN
    memory_gib: PositiveFloat = Field(le=1e6)
    # the links' bounds keep one transfer's time finite and meaningful (1e-300 B/s priced steps at 1e300 s)
    interconnect_bandwidth: float = Field(64e9, ge=1e6, description="device-to-device bytes/s (NVLink or PCIe)")
    interconnect_latency_s: NonNegativeFloat = Field(5e-6, le=60)
    interconnect_topology: Literal["switch", "ring"] = Field(
        "ring", description="switch: every device one hop from every other (NVSwitch), so an all-reduce waits on two "
        "link latencies whatever the device count (vLLM's one-/two-shot custom all-reduce); ring: 2(n-1) of them "
        "(NCCL's ring over PCIe)")
    host_bandwidth: float = Field(25e9, ge=1e6, description="device-to-host bytes/s (PCIe), used by KV swap")
    price_per_hour: float = Field(0.0, ge=0, le=1e6, description="USD per device-hour")
    sparse_tensor_cores: bool = Field(False, description="2:4 structured sparsity runs at twice the dense rate "
                                      "(NVIDIA Ampere and later)")

    def flops(self, dtype: str) -> float:
        """Peak rate for a matmul dtype, falling back to the 16-bit rate."""
        return self.peak_flops.get(dtype) or self.peak_flops.get("fp16") or max(self.peak_flops.values())

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB


def _gpu(name, mem_gib, bw, bf16, fp8_int8, fp32, link, price, link_latency=3e-6, host_bw=25e9, fp8=True,
         topology="switch", fp4=None, int8=None):
    rates = {"fp32": fp32, "fp16": bf16, "bf16": bf16, "int8": int8 or fp8_int8} | ({"fp8": fp8_int8} if fp8 else {}) \
        | ({"fp4": fp4} if fp4 else {})
    return name, partial(
        HardwareSpec.model_construct, name=name, memory_gib=mem_gib, memory_bandwidth=bw, peak_flops=rates,
        interconnect_bandwidth=link, interconnect_latency_s=link_latency, interconnect_topology=topology,
        host_bandwidth=host_bw, price_per_hour=price, sparse_tensor_cores=True)


# Rates: vendor datasheets, dense (no 2:4 sparsity). Memory: what the driver reports (nvidia-smi). Links: achieved
# and per direction, as NCCL measured them (Vidur's data/profiling, calibration/data/gpu): send/recv between two GPUs
# of a DGX A100 (263 GB/s, 14.5 µs) and DGX H100 (355 GB/s, 7.5 µs) through NVSwitch — not the datasheet's
# bidirectional 600 / 900 GB/s; PCIe boards: the bus bandwidth of an all-reduce of 4 A100s over PCIe Gen4 (22.5 GB/s).
# Prices: rough 2024-25 on-demand USD per GPU-hour at GPU clouds; they vary by provider, set your own.
# Blackwell parts (rates as NVIDIA's datasheets give them and AIConfigurator's systems/*.yaml quote them; FP32 from
# the HGX / GB200 NVL72 datasheets per GPU): memory as nvidia-smi reports it (B200 183359 MiB; the others as
# AIConfigurator's system files record it); links per direction and achieved, the H100's 355 GB/s / 7.5 µs scaled by
# NCCL's all-gather between two GPUs (bus bandwidth at 512 MiB, time at 512 B) against the H100's in AIConfigurator's
# nccl-tests runs; the RTX PRO 6000 (PCIe Gen5) the bus bandwidth of its 4-GPU all-reduce there. Prices, 2026
# on-demand: B200 Ornn's GPU-rental benchmark (neocloud), B300 the middle of its $5.00-7.25 range, GB200 Spheron's
# $9.08 a 2-GPU superchip, RTX PRO 6000 RunPod's on-demand rate; GB300: no public per-GPU rate found, the B300's.
HARDWARE_CATALOG: Mapping[str, HardwareSpec] = LazyCatalog(dict([
    _gpu("A100-40GB", 40.0, 1.555e12, 312e12, 624e12, 19.5e12, 263e9, 1.29, link_latency=14.5e-6, fp8=False),
    _gpu("A100-80GB", 80.0, 2.039e12, 312e12, 624e12, 19.5e12, 263e9, 1.79, link_latency=14.5e-6, fp8=False),
    _gpu("H100-SXM", 79.6, 3.35e12, 989e12, 1979e12, 67e12, 355e9, 2.99, link_latency=7.5e-6, host_bw=50e9),
    _gpu("H200", 140.4, 4.8e12, 989e12, 1979e12, 67e12, 355e9, 3.79, link_latency=7.5e-6, host_bw=50e9),
    # PCIe cards: NCCL's ring over PCIe Gen4
    _gpu("A40", 45.0, 696e9, 149.7e12, 299.3e12, 37.4e12, 22.5e9, 0.60, link_latency=10e-6, fp8=False,
         topology="ring"),
    _gpu("L4", 22.5, 300e9, 121e12, 242e12, 30.3e12, 22.5e9, 0.80, link_latency=10e-6, topology="ring"),
    _gpu("L40S", 45.0, 864e9, 362e12, 733e12, 91.6e12, 22.5e9, 1.49, link_latency=10e-6, topology="ring"),
    _gpu("B200", 179.06, 8.0e12, 2250e12, 4500e12, 75e12, 603e9, 4.50, link_latency=12.5e-6, host_bw=50e9,
         fp4=9000e12),
    _gpu("GB200", 185.03, 8.0e12, 2500e12, 5000e12, 80e12, 601e9, 4.54, link_latency=13.2e-6, host_bw=450e9,
         fp4=10000e12),  # Grace over NVLink-C2C: 450 GB/s each way
    _gpu("B300", 268.59, 7.75e12, 2250e12, 4500e12, 75e12, 611e9, 6.10, link_latency=11.3e-6, host_bw=50e9,
         fp4=14000e12, int8=153.5e12),  # Blackwell Ultra trades INT8 tensor cores for FP4
    _gpu("GB300", 277.55, 8.0e12, 2500e12, 5000e12, 80e12, 616e9, 6.10, link_latency=11.6e-6, host_bw=450e9,
         fp4=15000e12, int8=165e12),
    _gpu("RTX-PRO-6000", 95.59, 1.792e12, 467.8e12, 935.6e12, 120e12, 26e9, 1.57, link_latency=10e-6,
         host_bw=50e9, topology="ring", fp4=1871.2e12),  # Blackwell Server Edition
    # A 2-core AMD EPYC VM (these CI machines), rough numpy figures of 2026-11-29; the matmul rate and
    # bandwidth in calibration/profiles/cpu.json (`infersim profile`) replace them when present (read on the entry's
    # first lookup: a run on another device never parses that 270 KB file).
    ("cpu", lambda: _measured_cpu(HardwareSpec.model_construct(
        name="cpu", memory_gib=24.0, memory_bandwidth=9e9, peak_flops={"fp32": 115e9, "fp16": 30e9, "bf16": 30e9},
        interconnect_bandwidth=9e9, host_bandwidth=9e9, price_per_hour=0.1))),
]))


def _measured_cpu(spec: HardwareSpec) -> HardwareSpec:
    """The `cpu` entry with the matmul rate and bandwidth `infersim profile` measured, if a profile exists."""
    path = Path(__file__).resolve().parents[2] / "calibration" / "profiles" / "cpu.json"
    try:
        measured = json.loads(path.read_text())["measured"]
    except (OSError, ValueError, KeyError):
        return spec
    flops = dict(spec.peak_flops, fp32=measured["matmul_flops"])
    return spec.model_copy(update={"peak_flops": flops, "memory_bandwidth": measured["memory_bandwidth"]})


def catalog_hardware(name: str, key_path: str = "hardware") -> HardwareSpec:
    """Look a device up by name, case-insensitively."""
    return catalog_entry(HARDWARE_CATALOG, name, "hardware",
                         ", or an explicit spec (peak_flops, memory_bandwidth, memory_gib, ...)", key_path)


KERNELS_FILE = Path(__file__).resolve().parents[1] / "data" / "gpu_kernels.json"
SPEED_FIELDS = ("peak_flops", "memory_bandwidth", "sparse_tensor_cores")
LINK_FIELDS = ("interconnect_bandwidth", "interconnect_latency_s", "interconnect_topology")


@lru_cache(maxsize=4)
def kernels_file(path: Path = KERNELS_FILE) -> dict:
    """A kernel-fits file (default sim/data/gpu_kernels.json, the GPU kernel model's) parsed once for every reader.
    Read-only: its readers share it."""
    return json.loads(Path(path).read_text())


@lru_cache(maxsize=1)
def measured_devices() -> tuple[str, ...]:
    """Catalog devices whose kernels were measured (sim/data/gpu_kernels.json, the GPU kernel model's fits)."""
    return tuple(kernels_file(KERNELS_FILE)["devices"])  # given, not defaulted: one cache key with load_kernels


def as_in_catalog(hw: HardwareSpec, fields: tuple[str, ...]) -> bool:
    """Whether `hw` is a catalog device with these fields as the catalog has them (a spec with a changed price
    still runs the catalog device's kernels; one with a changed bandwidth does not)."""
    known = HARDWARE_CATALOG.get(hw.name)
    return known is not None and all(getattr(hw, f) == getattr(known, f) for f in fields)


def has_kernels(hw: HardwareSpec) -> bool:
    """The GPU kernel model can price this device: it is a measured catalog device at the catalog's speeds."""
    return hw.name in measured_devices() and as_in_catalog(hw, SPEED_FIELDS)

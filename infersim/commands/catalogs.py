"""`infersim models` and `infersim hardware`: the catalogs, by name."""
from __future__ import annotations

from rich.table import Column, Table

from infersim.tables import wide_console
from sim.config.hardware import HARDWARE_CATALOG
from sim.config.layers import describe
from sim.config.models import MODEL_CATALOG


def model_catalog() -> dict:
    """The model catalog, by name."""

    return dict(MODEL_CATALOG)


def hardware_catalog() -> dict:
    """The hardware catalog, by name."""

    return dict(HARDWARE_CATALOG)


def print_models() -> None:
    """The model catalog as a table (layers: their attention kinds; KV/token: every layer that caches per token)."""
    t = Table("params", "active", "experts", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
              "vocab", "max_len", "dtype", "KV/token")
    t.columns.insert(0, Column("name", no_wrap=True))
    for m in model_catalog().values():
        experts = f"{m.num_experts_per_tok}/{m.num_experts}" if m.num_experts else "-"
        dtype = m.weight_dtype + (f" ({m.expert_weight_dtype} experts)" if m.expert_weight_dtype else "")
        t.add_row(m.name, f"{m.num_params / 1e9:.2f}B", f"{m.active_params / 1e9:.2f}B", experts, describe(m),
                  str(m.hidden_size), str(m.num_heads), str(m.num_kv_heads), str(m.head_size),
                  str(m.intermediate_size), str(m.vocab_size), str(m.max_position_embeddings), dtype,
                  f"{m.kv_bytes_per_token / 1024:.0f} KiB")
    wide_console().print(t)


def print_hardware() -> None:
    """The hardware catalog as a table."""
    t = Table(Column("name", no_wrap=True), "memory", "bandwidth", "bf16 dense", "fp8 dense", "fp4 dense", "int8",
              "interconnect", "$/hour")
    for h in hardware_catalog().values():
        rates = [_flops(h.peak_flops[d]) if d in h.peak_flops else "-" for d in ("fp8", "fp4", "int8")]
        t.add_row(h.name, f"{h.memory_gib:.1f} GiB", f"{h.memory_bandwidth / 1e9:,.0f} GB/s",
                  _flops(h.flops("bf16")), *rates, f"{h.interconnect_bandwidth / 1e9:,.0f} GB/s",
                  f"{h.price_per_hour:.2f}")
    wide_console().print(t)


def _flops(x: float) -> str:
    return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.0f} GFLOP/s"

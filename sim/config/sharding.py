"""How a model's layers split over a tensor-parallel group (Megatron-style), the one rule the plan, every cost model,
calibration and the executor's tensor parallel read: query heads and the MLP's columns split evenly; KV heads split
evenly too, or, with more devices than KV heads (as vLLM does), each device holds a copy of one; the LM head splits
by vocabulary rows; a pipeline's stages take the layers in even runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol


class LayerShape(NamedTuple):
    """The counts sharding reads, for callers that have no model object (kernel tables, measured rows)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int


class _Shaped(Protocol):
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass(eq=False, repr=False, slots=True)
class Sharding:
    """One device's share of each decoder layer at tensor_parallel_size `tp`."""

    tp: int
    heads: int  # query heads per device
    kv_heads: int  # KV heads per device (1, a copy, where there are fewer KV heads than devices)
    kv_replicas: int  # devices holding a copy of each KV head (1 unless tp > num_kv_heads)
    intermediate: int  # MLP columns per device (of the gate and of the up projection each)
    num_kv_heads: int  # the model's

    def kv_head_of(self, rank: int) -> int:
        """The first of the model's KV heads that device `rank` holds."""
        return rank * self.num_kv_heads // self.tp

    def kv_bytes(self, model_bytes: float) -> float:
        """One device's share of K/V bytes the whole model keeps (per token, say): its KV heads' fraction."""
        return model_bytes * self.kv_heads / self.num_kv_heads


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage: an even split, the later stages taking the extra ones (stage 0 also schedules,
    samples and runs the LM head). The executor splits its stages with this."""
    per, extra = divmod(num_layers, pp)
    return [per + (1 if s >= pp - extra else 0) for s in range(pp)]


def vocab_shard(vocab_size: int, tp: int) -> int:
    """Rows of each device's slice of a vocab-parallel LM head (the last one zero-padded)."""
    return -(-vocab_size // tp)


def shard(model: _Shaped, tp: int) -> Sharding:
    """How `model` (anything with num_heads, num_kv_heads, intermediate_size) splits over `tp` devices; ValueError
    (one line, saying what is allowed) when its heads cannot."""
    heads, kv_heads = model.num_heads, model.num_kv_heads
    of = f" of {model.name}" if getattr(model, "name", None) else ""
    if heads % tp:
        ok = [d for d in range(1, min(heads, 64) + 1) if heads % d == 0]
        raise ValueError(f"{tp} does not divide the {heads} attention heads{of}; allowed: {', '.join(map(str, ok))}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{tp} neither divides nor is a multiple of the {kv_heads} KV heads{of}")
    return Sharding(tp, heads // tp, max(1, kv_heads // tp), max(1, tp // kv_heads), model.intermediate_size // tp,
                    kv_heads)

"""MXFP4 expert weights (OCP microscaling, as gpt-oss ships its experts), dequantized on the CPU.

A block of 32 consecutive weights along a row shares one E8M0 scale (a byte: the exponent + 127, so the block's
values are 2^(byte − 127) times their codes) and holds 32 FP4 E2M1 codes, two a byte, the lower nibble first:
4.25 bits a weight. gpt-oss's checkpoint keeps, per expert projection, `<name>_blocks` [E, rows, cols/32, 16] (uint8)
and `<name>_scales` [E, rows, cols/32] (uint8), its gate_up rows interleaving gate and up.

`Mxfp4Experts` keeps the packed bytes and dequantizes, each step, only the experts the step's tokens touch, to the
activations' dtype, then runs the same grouped matmuls (executor/model/moe.py): the expert weights take 4.25/32 of
their fp32 bytes in memory, at the price of a dequantization per touched expert per step. `dequantize_experts`
instead expands them once at load (what transformers does on a CPU). Both give exactly the dequantized weights' values
(every code times a power of two is exact in fp32 and bf16); the choice is memory against step time
(bench/mxfp4.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from executor.model.moe import Experts

BLOCK = 32
# E2M1 codes 0..15: sign bit 3, then exponent (2 bits) and mantissa (1 bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = torch.tensor(E2M1[:8])


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) as MXFP4: (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]). A block's
    scale is 2^(floor(log2 max|w|) − 2), so its largest weight lands in [4, 8) and rounds to at most 6 (E2M1's
    largest); each weight goes to the nearest code."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} weights, not {w.shape[-1]}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scaled = (x / torch.exp2(exp)).clamp(-6.0, 6.0)
    code = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(-1).to(torch.uint8)  # nearest magnitude
    code |= (scaled < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)


# each byte's two values, lower nibble first: one lookup a byte (a lookup a code took 1.7x as long)
_PAIRS = torch.tensor([[E2M1[b & 15], E2M1[b >> 4]] for b in range(256)])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (blocks [..., G, 16], scales [..., G]) back to weights [..., G · 32] in `dtype`."""
    pairs = _PAIRS.to(device=blocks.device, dtype=dtype)
    values = torch.index_select(pairs, 0, blocks.flatten().int()).view(*blocks.shape[:-1], 2 * blocks.shape[-1])
    powers = torch.ldexp(torch.ones(scales.shape, dtype=dtype, device=blocks.device), scales.to(torch.int32) - 127)
    return values.mul_(powers[..., None]).flatten(-2)


class Mxfp4Experts(Experts):
    """Routed experts held as MXFP4 bytes (gate rows before up rows, as Experts keeps them), dequantized per step for
    the experts a step touches; the biases stay in the activations' dtype."""

    def __init__(self, experts: Experts):
        nn.Module.__init__(self)
        self.act = experts.act
        self.dtype = experts.gate_up_proj.dtype
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = quantize(getattr(experts, name).detach())
            self.register_buffer(name + "_blocks", blocks)
            self.register_buffer(name + "_scales", scales)
        self.gate_up_proj_bias, self.down_proj_bias = experts.gate_up_proj_bias, experts.down_proj_bias

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj_blocks.shape[0]

    def weights(self, experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pick = slice(None) if experts is None else experts
        return (dequantize(self.gate_up_proj_blocks[pick], self.gate_up_proj_scales[pick], self.dtype),
                dequantize(self.down_proj_blocks[pick], self.down_proj_scales[pick], self.dtype))

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The FFN of rows grouped by expert, each touched expert dequantized for this call only."""
        from executor.model.moe import grouped_swiglu

        touched = [e for e, n in enumerate(counts) if n]
        if not touched:
            return x.new_empty(0, self.down_proj_blocks.shape[1])
        biases = None
        if self.gate_up_proj_bias is not None:
            biases = (self.gate_up_proj_bias[touched], self.down_proj_bias[touched])
        return grouped_swiglu(x, [counts[e] for e in touched], *self.weights(touched), self.act, biases)

    def load_packed(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Take a checkpoint's (blocks, scales) of gate_up (rows in our order) and down as they are."""
        for name, (blocks, scales) in (("gate_up_proj", gate_up), ("down_proj", down)):
            getattr(self, name + "_blocks").copy_(blocks)
            getattr(self, name + "_scales").copy_(scales)


def pack_experts(model: nn.Module) -> int:
    """Replace every mixture-of-experts block's experts by MXFP4 ones (their weights rounded to MXFP4); how many."""
    blocks = [m for m in model.modules() if hasattr(m, "experts") and type(m.experts) is Experts]
    for m in blocks:
        m.experts = Mxfp4Experts(m.experts)
    return len(blocks)


def dequantize_experts(model: nn.Module) -> int:
    """Replace every MXFP4 experts module by plain experts holding its dequantized weights (expanded at load)."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), Mxfp4Experts)]
    for m in blocks:
        q = m.experts
        gate_up, down = q.weights()
        plain = Experts(q.num_experts, down.shape[1], down.shape[2], q.gate_up_proj_bias is not None, q.act)
        with torch.no_grad():
            plain.gate_up_proj.copy_(gate_up)
            plain.down_proj.copy_(down)
            if q.gate_up_proj_bias is not None:
                plain.gate_up_proj_bias.copy_(q.gate_up_proj_bias)
                plain.down_proj_bias.copy_(q.down_proj_bias)
        m.experts = plain
    return len(blocks)


def checkpoint_is_mxfp4(directory: Path) -> bool:
    """Whether a checkpoint's config.json says its experts are MXFP4 (gpt-oss's quantization_config)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def load_packed_experts(model: nn.Module, directory: Path) -> int:
    """Read a gpt-oss checkpoint's MXFP4 expert tensors (safetensors, `*_blocks` / `*_scales`) into the model's
    Mxfp4Experts as they are (gate_up's interleaved rows reordered to gate rows first); how many blocks."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys() if k.endswith(("_blocks", "_scales"))})
    done = 0
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        p = f"model.layers.{i}.mlp.experts."
        if isinstance(experts, Mxfp4Experts) and p + "gate_up_proj_blocks" in tensors:
            blocks, scales = tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"]
            order = torch.cat([torch.arange(0, blocks.shape[1], 2), torch.arange(1, blocks.shape[1], 2)])
            experts.load_packed((blocks[:, order], scales[:, order]),
                                (tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"]))
            done += 1
    return done

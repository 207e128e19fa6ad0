"""2:4 structured sparsity: every group of 4 consecutive input weights of a decoder projection keeps its 2 largest
magnitudes (the pattern NVIDIA's sparse tensor cores run at twice the dense rate). On CUDA the pruned weights are
stored compressed (torch's semi-structured sparse tensors) and multiplied by its sparse kernels; on the CPU there
are no such kernels, so the pruned weights stay dense: the model is as slow as before and only its quality changes
(the simulator's `cpu` entry has no sparse tensor cores either)."""
from __future__ import annotations

import torch
from torch import nn


def prune_2_4_(weight: torch.Tensor) -> torch.Tensor:
    """Zero the 2 smallest-magnitude of every 4 consecutive weights along the input dimension, in place."""
    out_features, in_features = weight.shape
    if in_features % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, not {in_features}")
    groups = weight.view(out_features, in_features // 4, 4)
    drop = groups.abs().argsort(dim=-1)[..., :2]  # ties: the earlier index is dropped, deterministically
    groups.scatter_(-1, drop, 0.0)
    return weight


def decoder_linears(model) -> list[tuple[str, nn.Linear]]:
    """The projections 2:4 sparsity prunes: every linear layer of the decoder layers (not embedding or LM head,
    as SparseGPT and NVIDIA's recipes leave them)."""
    return [(f"layers.{i}.{name}", m) for i, layer in enumerate(model.layers) for name, m in layer.named_modules()
            if isinstance(m, nn.Linear)]


@torch.no_grad()
def prune_model_2_4(model):
    """Prune the model's decoder projections to 2:4 in place (dense storage; in-place updates make the executor's
    packed weight copies be rebuilt); on CUDA in fp16/bf16, then compress them for torch's sparse kernels."""
    for _, linear in decoder_linears(model):
        prune_2_4_(linear.weight.data)
    if next(model.parameters()).device.type == "cuda":
        _to_semi_structured(model)
    return model


def sparsity(model) -> float:
    """The share of zeros among the decoder projections' weights (0.5 after 2:4 pruning)."""
    zeros = total = 0
    for _, linear in decoder_linears(model):
        w = linear.weight
        if w.layout != torch.strided:
            return 0.5  # compressed semi-structured: exactly 2 of 4 by construction
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / total if total else 0.0


def _to_semi_structured(model) -> None:
    """Each pruned projection's weight (or each of its split parts) as a SparseSemiStructuredTensor, which F.linear
    multiplies with cuSPARSELt/CUTLASS kernels; a clear error where torch or the shapes do not allow it."""
    from torch.sparse import to_sparse_semi_structured

    for name, linear in decoder_linears(model):
        w = linear.weight
        if w.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name}: torch's 2:4 sparse kernels take fp16/bf16 weights, not {w.dtype}")
        parts = list(w.data.split(linear.splits)) if getattr(linear, "splits", None) else [w.data]
        try:
            sparse = [to_sparse_semi_structured(p.contiguous()) for p in parts]
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{name}: torch cannot run {tuple(w.shape)} as 2:4 sparse here ({e})") from None
        linear.forward = _sparse_forward(linear, sparse)


def _sparse_forward(linear, parts: list):
    splits = getattr(linear, "splits", None)

    def forward(x: torch.Tensor):
        flat = x.reshape(-1, x.shape[-1])
        outs = [torch.nn.functional.linear(flat, p).reshape(*x.shape[:-1], -1) for p in parts]
        return tuple(outs) if splits else outs[0]
    return forward


"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, the
routed experts run as grouped matmuls, and shared experts (Qwen2-MoE) run on every token.

Routing is Hugging Face's: router logits, softmax in fp32, the top-k probabilities, renormalized to sum to 1 where
`norm_topk_prob` (Mixtral always, Qwen as configured). The routed experts are SwiGLU MLPs whose weights are kept
as transformers ≥ 5 keeps them, one 3-D tensor per projection (`gate_up_proj` [E, 2I, H], gate rows first, and
`down_proj` [E, H, I]). A step's (token, expert) pairs are sorted by expert, so each expert's rows are contiguous,
and the two projections run as one `torch._grouped_mm` each over those groups (a loop over the experts that got
tokens where this torch or the shapes do not allow it); each pair's output, scaled by its routing weight, is
added back to its token. Every block counts the tokens each expert computed (`take_counts`): the engine's step
trace records them.

Not modelled here: DeepSeek's grouped top-k routing (expert groups, a correction bias) and its multi-head latent
attention; the block is built from the MoE fields of LlamaConfig (executor/model/llama.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.layers import MLP, Linear

# Switch off to run the routed experts as a loop over experts (for comparisons).
USE_GROUPED_MM = hasattr(torch, "_grouped_mm")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k] in the logits' dtype, expert ids [T, k]) from router logits [T, E]."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def _grouped_mm_fits(x: torch.Tensor, down: torch.Tensor) -> bool:
    # the grouped kernel wants every row and weight stride (hidden, intermediate) a multiple of 16 bytes
    align = 16 // x.element_size()
    return USE_GROUPED_MM and down.shape[1] % align == 0 and down.shape[2] % align == 0


def grouped_swiglu(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of rows `x` [N, H] grouped by expert (`counts[e]` consecutive rows for expert e) through expert
    weights `gate_up` [E, 2I, H] and `down` [E, H, I]: [N, H]."""
    if not _grouped_mm_fits(x, down):
        return _looped_swiglu(x, counts, gate_up, down)
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)


def _looped_swiglu(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """grouped_swiglu as one pair of matmuls per expert that got rows."""
    out = x.new_empty(x.shape[0], down.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(x[start:start + n], gate_up[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, down[e])
            start += n
    return out


class Experts(nn.Module):
    """The routed experts' weights, as transformers ≥ 5 stores them (one tensor per projection)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's choices of weight · expert(x): x [T, H], weights and expert ids [T, k]."""
        order, counts = sort_by_expert(experts, self.num_experts)
        y = grouped_swiglu(x[order // experts.shape[1]], counts, self.gate_up_proj, self.down_proj)
        return torch.zeros_like(x).index_add_(0, order // experts.shape[1], y * weights.flatten()[order, None])


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, choice) pairs of expert ids [T, k] sorted by expert: (their positions in the flattened choices,
    so token = position // k; pairs per expert)."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


class SparseMoeBlock(nn.Module):
    """The MoE MLP of a decoder layer: router (`gate`), routed `experts`, and optionally a `shared_expert` (a
    SwiGLU MLP every token runs) scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE). Names are Hugging Face's
    (Qwen2-MoE; Mixtral's `block_sparse_moe` loads into the same)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool = True, shared_intermediate_size: int = 0, shared_expert_gate: bool = False,
                 local_experts: int | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be 1 to num_experts ({num_experts})")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts if local_experts is None else local_experts, hidden_size,
                               intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        self.register_buffer("counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The block's output for hidden states x [T, H] (`fused`: the dense MLP's native elementwise switch,
        taken by the shared expert)."""
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        self.counts += torch.bincount(experts.flatten(), minlength=self.num_experts)
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, fused=fused)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out.add_(shared)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for every token (a parallel block dispatches instead)."""
        return self.experts(x, weights, experts)

    def take_counts(self) -> torch.Tensor:
        """Tokens each expert was routed since the last call, [num_experts] int64; the count starts again."""
        counts = self.counts.clone()
        self.counts.zero_()
        return counts

    def load_hf(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy the block's weights from a transformers state_dict: `prefix` is the layer's ("model.layers.3."); the
        experts as transformers ≥ 5 holds them (mlp.experts.gate_up_proj) or one module each, Mixtral's
        (block_sparse_moe.experts.N.w1/w3/w2) or Qwen-MoE's (mlp.experts.N.gate_proj/up_proj/down_proj)."""
        block = prefix + ("block_sparse_moe." if prefix + "block_sparse_moe.gate.weight" in sd else "mlp.")
        gate_up, down = expert_weights(sd, block + "experts.", self.num_experts)
        with torch.no_grad():
            self.gate.weight.copy_(sd[block + "gate.weight"])
            self.experts.gate_up_proj.copy_(gate_up)
            self.experts.down_proj.copy_(down)
            if self.shared_expert is not None:
                s = block + "shared_expert."
                self.shared_expert.gate_up_proj.weight.copy_(torch.cat([sd[s + "gate_proj.weight"],
                                                                        sd[s + "up_proj.weight"]]))
                self.shared_expert.down_proj.weight.copy_(sd[s + "down_proj.weight"])
            if self.shared_expert_gate is not None:
                self.shared_expert_gate.weight.copy_(sd[block + "shared_expert_gate.weight"])

    def hf_state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The block's weights under transformers ≥ 5's Qwen2-MoE names below `prefix` (the layer's "...mlp.")."""
        sd = {prefix + "gate.weight": self.gate.weight, prefix + "experts.gate_up_proj": self.experts.gate_up_proj,
              prefix + "experts.down_proj": self.experts.down_proj}
        if self.shared_expert is not None:
            gate, up = self.shared_expert.gate_up_proj.weight.chunk(2)
            sd.update({prefix + "shared_expert.gate_proj.weight": gate, prefix + "shared_expert.up_proj.weight": up,
                       prefix + "shared_expert.down_proj.weight": self.shared_expert.down_proj.weight})
        if self.shared_expert_gate is not None:
            sd[prefix + "shared_expert_gate.weight"] = self.shared_expert_gate.weight
        return sd


# per-expert module names: (gate, up, down) of Mixtral and of Qwen-MoE
_PER_EXPERT = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def expert_weights(sd: dict[str, torch.Tensor], prefix: str, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) of the experts under `prefix` ("...experts."), stored fused (transformers
    ≥ 5) or one module per expert (checkpoints on disk, transformers 4)."""
    if prefix + "gate_up_proj" in sd:
        return sd[prefix + "gate_up_proj"], sd[prefix + "down_proj"]
    for gate, up, down in _PER_EXPERT:
        if prefix + f"0.{gate}.weight" in sd:
            name = lambda e, n: f"{prefix}{e}.{n}.weight"  # noqa: E731
            return (torch.stack([torch.cat([sd[name(e, gate)], sd[name(e, up)]]) for e in range(num_experts)]),
                    torch.stack([sd[name(e, down)] for e in range(num_experts)]))
    raise KeyError(f"no expert weights under {prefix!r}")

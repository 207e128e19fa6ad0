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

Routers (`router`): "softmax" as above; "topk_softmax" (gpt-oss): the top-k router logits (the router has a bias)
and a softmax over those k alone; "deepseek" (DeepSeek-V2): softmax in fp32, the top-k probabilities (`topk_method`
"greedy", or "group_limited_greedy": only experts of the `topk_group` expert groups with the highest best expert)
scaled by `routed_scaling_factor`, not renormalized. Expert activations: SwiGLU, or gpt-oss's clamped SwiGLU
("clamped_swiglu": gate clamped above at `swiglu_limit`, up to ±limit, (up + 1) · gate · sigmoid(alpha · gate)), with a
bias per expert on both projections where `bias`. DeepSeek's sigmoid scoring with a correction bias (V3) is not
modelled; the block is built from the MoE fields of LlamaConfig (executor/model/llama.py) or of a HybridConfig
(executor/model/hybrid.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.layers import MLP, Linear, linear

# Switch off to run the routed experts as a loop over experts (for comparisons).
USE_GROUPED_MM = hasattr(torch, "_grouped_mm")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k] in the logits' dtype, expert ids [T, k]) from router logits [T, E]."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k logits, then a softmax over those k (weights in the logits' dtype)."""
    values, experts = torch.topk(logits, top_k, dim=-1)
    return F.softmax(values, dim=1, dtype=values.dtype), experts


def route_deepseek(logits: torch.Tensor, top_k: int, scaling: float, method: str = "greedy", n_group: int = 1,
                   topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing: fp32 softmax, the top-k probabilities (group-limited: among the `topk_group` groups whose
    best expert scores highest) times `scaling`."""
    scores = logits.float().softmax(dim=-1)
    if method == "group_limited_greedy":
        groups = scores.view(scores.shape[0], n_group, -1)
        keep = torch.zeros_like(groups[..., 0]).scatter_(1, groups.amax(-1).topk(topk_group, dim=-1).indices, 1.0)
        scores = (groups * keep[..., None]).flatten(1)
    weights, experts = torch.topk(scores, top_k, dim=-1, sorted=False)
    return weights * scaling, experts


def _grouped_mm_fits(x: torch.Tensor, down: torch.Tensor) -> bool:
    # the grouped kernel wants every row and weight stride (hidden, intermediate) a multiple of 16 bytes
    align = 16 // x.element_size()
    return USE_GROUPED_MM and down.shape[1] % align == 0 and down.shape[2] % align == 0


@dataclass(frozen=True)
class Activation:
    """An expert's gated activation: SwiGLU ("silu"), or gpt-oss's clamped SwiGLU with its alpha and limit."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = Activation()


def grouped_swiglu(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                   act: Activation = SWIGLU, biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The gated FFN of rows `x` [N, H] grouped by expert (`counts[e]` consecutive rows for expert e) through expert
    weights `gate_up` [E, 2I, H] and `down` [E, H, I] (and per expert `biases` [E, 2I], [E, H]): [N, H]."""
    if not _grouped_mm_fits(x, down):
        return _looped_swiglu(x, counts, gate_up, down, act, biases)
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)
    ids = None
    if biases is not None:  # each row's expert's bias
        ids = torch.repeat_interleave(torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device))
        h = h + biases[0][ids]
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(act(gate, up), down.transpose(1, 2), offs=offs)
    return out if ids is None else out + biases[1][ids]


def _looped_swiglu(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                   act: Activation = SWIGLU, biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """grouped_swiglu as one pair of matmuls per expert that got rows."""
    out = x.new_empty(x.shape[0], down.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            b_up, b_down = (None, None) if biases is None else (biases[0][e], biases[1][e])
            gate, up = F.linear(x[start:start + n], gate_up[e], b_up).chunk(2, dim=-1)
            out[start:start + n] = F.linear(act(gate, up), down[e], b_down)
            start += n
    return out


class Experts(nn.Module):
    """The routed experts' weights, as transformers ≥ 5 stores them (one tensor per projection, gate rows before up
    rows), with per-expert biases where `bias` (gpt-oss)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 act: Activation = SWIGLU):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.act = act

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def weights(self, experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of the experts (all of them, or those listed): an MXFP4 block dequantizes them here."""
        if experts is None:
            return self.gate_up_proj, self.down_proj
        return self.gate_up_proj[experts], self.down_proj[experts]

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts' FFN of rows x [N, H] grouped by expert (`counts[e]` consecutive rows for expert e)."""
        biases = None if self.gate_up_proj_bias is None else (self.gate_up_proj_bias, self.down_proj_bias)
        return grouped_swiglu(x, counts, *self.weights(), self.act, biases)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's choices of weight · expert(x): x [T, H], weights and expert ids [T, k]."""
        order, counts = sort_by_expert(experts, self.num_experts)
        y = self.grouped(x[order // experts.shape[1]], counts)
        return torch.zeros_like(x).index_add_(0, order // experts.shape[1], y * weights.flatten()[order, None])


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, choice) pairs of expert ids [T, k] sorted by expert: (their positions in the flattened choices,
    so token = position // k; pairs per expert)."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


@dataclass(frozen=True)
class Routing:
    """A router's rule: "softmax" (Mixtral, Qwen; renormalized where the block's norm_topk_prob), "topk_softmax"
    (gpt-oss) or "deepseek" (`method` greedy or group_limited_greedy over `n_group` groups, `topk_group` kept, the
    weights times `scaling`)."""

    kind: str = "softmax"
    scaling: float = 1.0
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1


class SparseMoeBlock(nn.Module):
    """The MoE MLP of a decoder layer: router (`gate`), routed `experts`, and optionally a `shared_expert` (a
    SwiGLU MLP every token runs) scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE). Names are Hugging Face's
    (Qwen2-MoE; Mixtral's `block_sparse_moe` loads into the same)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool = True, shared_intermediate_size: int = 0, shared_expert_gate: bool = False,
                 local_experts: int | None = None, *, routing: Routing | None = None, bias: bool = False,
                 act: Activation = SWIGLU):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be 1 to num_experts ({num_experts})")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.routing = routing or Routing()
        self.gate = linear(hidden_size, num_experts, bias)
        self.experts = Experts(num_experts if local_experts is None else local_experts, hidden_size,
                               intermediate_size, bias, act)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        self.register_buffer("counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k]) of hidden states x [T, H], by the block's router."""
        return self.route_logits(self.gate(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k]) of router logits [T, E], by the block's routing rule."""
        r = self.routing
        if r.kind == "softmax":
            return route(logits, self.top_k, self.norm_topk_prob)
        if r.kind == "topk_softmax":
            return route_topk_softmax(logits, self.top_k)
        return route_deepseek(logits, self.top_k, r.scaling, r.method, r.n_group, r.topk_group)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The block's output for hidden states x [T, H] (`fused`: the dense MLP's native elementwise switch,
        taken by the shared expert)."""
        out = self.routed_output(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, fused=fused)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out.add_(shared)
        return out

    def routed_output(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for hidden states x [T, H]: routed, counted, run (a data-parallel block
        gathers the ranks' tokens around this)."""
        weights, experts = self.route(x)
        self.counts += torch.bincount(experts.flatten(), minlength=self.num_experts)
        return self.routed(x, weights, experts)

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


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in module order (every data-parallel rank's the same)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


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

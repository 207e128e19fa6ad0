"""Gated DeltaNet (Qwen3-Next's linear attention): no per-token cache, a fixed state per sequence.

A layer projects each token to q, k (key heads × key dim), v (value heads × value dim), an output gate z and, per value
head, beta (the write strength, sigmoid) and a decay g = −exp(A_log) · softplus(a + dt_bias). q, k and v pass a
causal depthwise convolution of `kernel` taps (SiLU after it); q and k are L2-normed per head, q scaled by
1/√key dim, and each key head serves value heads / key heads value heads. Per value head the recurrent state S
[key dim, value dim] follows the delta rule with decay: S ← exp(g)·S; S ← S + k ⊗ β(v − Sᵀk); the output is Sᵀq, then
an RMSNorm per head gated by SiLU(z), and the output projection.

The state a sequence carries between steps is the convolution's last kernel − 1 input columns and S: one page of the
hybrid KV cache (executor/model/hybrid_cache.py), read at the step's start and written at its end. A decode row steps
the recurrence once (all decode rows as one batch); a prompt chunk runs the chunked form (blocks of CHUNK tokens: the
delta rule's updates within a block solved as one triangular system, the WY form of Yang et al.'s Gated DeltaNet),
starting from the state its sequence left.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.model.layers import Linear

CHUNK = 64  # tokens the chunked form solves at once


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(q, k, v, g, beta, state):
    """One token of every row: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv] -> (out [B, H, dv],
    the new state)."""
    state = state * g.exp()[..., None, None]
    memory = (state * k[..., None]).sum(dim=-2)  # what the state recalls for k
    delta = (v - memory) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """A sequence's tokens, q, k [H, L, dk], v [H, L, dv], g, beta [H, L], from `state` [H, dk, dv]: (out [H, L, dv],
    the final state). Within a block of `chunk` tokens with cumulative decay γ, the corrected values W solve
    (I + T) W = β·V − β·exp(γ)·K S₀, T strictly lower with T_ij = β_i exp(γ_i − γ_j) k_i·k_j; the outputs are
    exp(γ)·Q S₀ + (causal exp(γ_i − γ_j) q_i·k_j) W and the state exp(γ_L)·S₀ + (exp(γ_L − γ)·K)ᵀ W."""
    length = q.shape[1]
    out = v.new_empty(v.shape)
    for s in range(0, length, chunk):
        e = min(length, s + chunk)
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e, None]
        gamma = g[:, s:e].cumsum(dim=-1)
        decay = (gamma[:, :, None] - gamma[:, None, :])
        lower = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        pair = torch.where(lower, decay, float("-inf")).exp()  # exp(γ_i − γ_j), i ≥ j
        system = (bc * kc) @ kc.transpose(-1, -2) * pair
        system = system.tril(-1) + torch.eye(e - s, dtype=q.dtype, device=q.device)
        rhs = torch.cat([bc * vc, (bc * gamma[..., None].exp()) * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w = solved[..., :vc.shape[-1]] - solved[..., vc.shape[-1]:] @ state
        out[:, s:e] = (qc * gamma[..., None].exp()) @ state + ((qc @ kc.transpose(-1, -2)) * pair) @ w
        last = gamma[:, -1:]
        state = state * last[..., None].exp() + (kc * (last - gamma)[..., None].exp()).transpose(-1, -2) @ w
    return out, state


class GatedRMSNorm(nn.Module):
    """RMSNorm over a value head, times its weight, times SiLU of the gate z (Qwen3-Next's RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight
        return (x * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer with Hugging Face's parameter names (Qwen3NextGatedDeltaNet)."""

    def __init__(self, hidden_size: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, kernel: int,
                 layer_idx: int, eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv, self.dk, self.dv, self.kernel = key_heads, value_heads, key_dim, value_dim, kernel
        self.key_size, self.value_size = key_heads * key_dim, value_heads * value_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_size + 2 * self.value_size, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, bias=False, groups=self.conv_dim,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.zeros(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = Linear(self.value_size, hidden_size, bias=False)

    @property
    def state_elements(self) -> int:
        """A sequence's state: kernel − 1 convolution columns, then the recurrent matrix of every value head."""
        return (self.kernel - 1) * self.conv_dim + self.hv * self.dk * self.dv

    def _split(self, x: torch.Tensor):
        """(conv input [T, conv_dim] = q|k|v, z [T, hv, dv], b, a [T, hv]) from the projections, whose columns are
        grouped per key head (q, k, then that head's value heads' v and z; b then a)."""
        t, per = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, -1)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, -1).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _heads(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """(q, k, v [T, hv, d], g, beta [T, hv]) from the convolution's output."""
        t, per = mixed.shape[0], self.hv // self.hk
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = l2norm(q.reshape(t, self.hk, self.dk).float()).repeat_interleave(per, dim=1) * self.dk ** -0.5
        k = l2norm(k.reshape(t, self.hk, self.dk).float()).repeat_interleave(per, dim=1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v.reshape(t, self.hv, self.dv).float(), g, b.sigmoid().float()

    def forward(self, x: torch.Tensor, meta, cache, kind: int, group: int) -> torch.Tensor:
        """The layer's output for the step's tokens x [T, hidden]; each row's state read from and written to the
        cache's pages (`meta.states(kind, group)`)."""
        mixed, z, b, a = self._split(x)
        mixed = mixed.float()  # the convolution and the recurrence run in fp32 (the state too), as transformers' do
        slots = meta.states(kind, group)
        pages = cache.page(self.layer_idx)
        n_conv = (self.kernel - 1) * self.conv_dim
        read = torch.tensor([max(r, 0) for r in slots.read], dtype=torch.long, device=x.device)
        states = pages[read, :self.state_elements].to(torch.float32, copy=True)
        states[torch.tensor([r < 0 for r in slots.read], device=x.device)] = 0.0  # a sequence's first step
        conv = states[:, :n_conv].view(-1, self.kernel - 1, self.conv_dim)
        rec = states[:, n_conv:].view(-1, self.hv, self.dk, self.dv)
        out = x.new_empty(x.shape[0], self.hv, self.dv, dtype=torch.float32)
        weight = self.conv1d.weight[:, 0].float()  # [conv_dim, kernel]
        starts = meta.cu_query_lens
        ones = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if ones:  # one token a row: the whole batch steps at once
            rows, toks = torch.tensor(ones, device=x.device), torch.tensor([starts[i] for i in ones], device=x.device)
            cols = torch.cat([conv[rows], mixed[toks, None]], dim=1)  # [B, kernel, conv_dim]
            conv[rows] = cols[:, 1:]
            q, k, v, g, beta = self._heads(F.silu((cols * weight.T).sum(dim=1)), a[toks], b[toks])
            o, rec[rows] = delta_rule_step(q, k, v, g, beta, rec[rows])
            out[toks] = o
        for i in (i for i, n in enumerate(meta.query_lens) if n > 1):
            s, e = starts[i], starts[i + 1]
            cols = torch.cat([conv[i], mixed[s:e]])  # the kernel − 1 inputs before the chunk, then its own
            h = F.silu(F.conv1d(cols.T[None], weight[:, None], groups=self.conv_dim)[0].T)
            conv[i] = cols[-(self.kernel - 1):]
            q, k, v, g, beta = self._heads(h, a[s:e], b[s:e])
            o, rec[i] = delta_rule_chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T,
                                           rec[i])
            out[s:e] = o.transpose(0, 1)
        write = torch.tensor(slots.write, dtype=torch.long, device=x.device)
        pages[:, :self.state_elements].index_copy_(0, write, states.to(pages.dtype))
        o = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(x.shape[0], -1)
        return self.out_proj(o.to(x.dtype))

"""Multi-head latent attention (DeepSeek-V2/V3), with the latent KV cache vLLM keeps.

A token's keys and values are made from one compressed latent c (kv_lora_rank, RMS-normed) and one rotary key
k_pe (qk_rope_head_dim) shared by every head; the cache holds [c | k_pe] per token (executor/model/hybrid_cache.py:
`latent_pool`). Per head, kv_b_proj expands c to a key part k_nope (qk_nope_head_dim) and a value (v_head_dim); the
query is q_nope | q_pe, q_pe and k_pe rotated (interleaved pairs, as DeepSeek's complex form).

As vLLM does, a prompt chunk attends *decompressed*: its context's latents expanded to every head's keys and
values, then causal attention (compute-bound: the expansion is shared by the chunk's queries). A decode row attends
*absorbed*: kv_b_proj's key half folded into the query (q_nope · W_UK, a latent-sized query per head) and its value
half applied after (softmax · c, then · W_UV), so a step reads only the latents — multi-query attention over the
cache. Both are the same attention; tests/test_twins.py checks each against transformers' expanded form.
"""
from __future__ import annotations

import torch
from torch import nn

from executor.model.attention import AttentionMetadata
from executor.model.layers import Linear, RMSNorm, linear, yarn_mscale
from executor.model.window_attention import softmax_with_sinks

LATENT_NORM_EPS = 1e-6  # DeepSeek's kv_a_layernorm and q_a_layernorm keep their own epsilon


class LatentAttention(nn.Module):
    """One MLA layer with Hugging Face's parameter names (DeepseekV2Attention); `rope` rotates [T, heads, rope dim]."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int, nope: int,
                 rope_dim: int, v_dim: int, layer_idx: int, bias: bool = False, rope_scaling: dict | None = None):
        super().__init__()
        self.layer_idx, self.num_heads = layer_idx, num_heads
        self.rank, self.nope, self.rope_dim, self.v_dim = kv_lora_rank, nope, rope_dim, v_dim
        qk = nope + rope_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_a_proj = linear(hidden_size, q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = linear(hidden_size, kv_lora_rank + rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (nope + v_dim), bias=False)
        self.o_proj = linear(num_heads * v_dim, hidden_size, bias)
        self.scale = qk ** -0.5
        scaling = rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):  # YaRN's scale on every dim
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2

    @property
    def latent_width(self) -> int:
        return self.rank + self.rope_dim

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, latents: torch.Tensor) -> torch.Tensor:
        """The layer's output for the step's tokens x [T, hidden]; their latents written to `latents` [blocks,
        block_size, width] at the step's slots, every row's context read from there."""
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q_pe, k_pe = rope(q_pe), rope(k_pe[:, None])[:, 0]
        latents.view(-1, self.latent_width).index_copy_(0, meta.slot_mapping, torch.cat([self.kv_a_layernorm(c), k_pe],
                                                                                         dim=-1))
        out = x.new_empty(t, self.num_heads, self.v_dim)
        if meta.decode_seqs:
            rows = meta.decode_token_index
            out[rows] = self.absorbed(q_nope[rows], q_pe[rows], latents, meta, meta.decode_seqs)
        for i in meta.prefill_seqs:
            s, e = meta.cu_query_lens[i], meta.cu_query_lens[i + 1]
            out[s:e] = self.decompressed(q_nope[s:e], q_pe[s:e], latents, meta, i)
        return self.o_proj(out.view(t, -1))

    def _halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key and value halves per head: W_UK [heads, nope, rank], W_UV [heads, v, rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def absorbed(self, q_nope, q_pe, latents, meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
        """Decode rows: attention over the latents themselves, W_UK folded into the query and W_UV applied after."""
        w_uk, w_uv = self._halves()
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        lens = [meta.context_lens[i] for i in seqs]
        width = -(-max(lens) // meta.block_size)
        tables = torch.tensor([(meta.block_tables[i] + [0] * width)[:width] for i in seqs], dtype=torch.long,
                              device=q_nope.device)
        ctx = latents[tables.reshape(-1)].view(len(seqs), width * meta.block_size, self.latent_width)
        c, k_pe = ctx.split([self.rank, self.rope_dim], dim=-1)
        scores = (torch.einsum("bhr,blr->bhl", q_latent, c) + torch.einsum("bhp,blp->bhl", q_pe, k_pe)) * self.scale
        keys = torch.arange(ctx.shape[1], device=ctx.device)[None]
        scores.masked_fill_((keys >= torch.tensor(lens, device=ctx.device)[:, None])[:, None], float("-inf"))
        return torch.einsum("bhr,hvr->bhv", torch.einsum("bhl,blr->bhr", scores.softmax(-1), c), w_uv)

    def decompressed(self, q_nope, q_pe, latents, meta: AttentionMetadata, i: int) -> torch.Tensor:
        """A prompt chunk: its context's latents expanded to every head's keys and values, then causal attention."""
        n, ctx_len = q_nope.shape[0], meta.context_lens[i]
        ctx = latents.view(-1, self.latent_width)[meta.context_slots(i)]
        c, k_pe = ctx.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(ctx_len, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        scores = (torch.einsum("qhn,khn->hqk", q_nope, k_nope)
                  + torch.einsum("qhp,kp->hqk", q_pe, k_pe)) * self.scale
        visible = torch.arange(ctx_len, device=c.device)[None] <= torch.arange(ctx_len - n, ctx_len,
                                                                              device=c.device)[:, None]
        scores.masked_fill_(~visible, float("-inf"))
        return torch.einsum("hqk,khv->qhv", softmax_with_sinks(scores, None), v)

"""What one device of a replica computes for each block of a model's layers (sim/config/layers.py: `ModelSpec.layers`,
attention kind × FFN kind): the one composition every cost source prices a step through. The roofline prices its
FLOPs and bytes (sim/cost/roofline.py), the GPU kernel model its kernels (sim/cost/gpu.py); the fitted profile reads a
step's keys by kind from here (`kv_reads`).

Per distinct block, on one device of its tensor-parallel group (`Sharding`):
- GEMMs (N, K) but the routed experts: GQA's qkv (a second q for an output gate) and o; MLA's q_a, q_b (or q), kv_a,
  kv_b and o, q_a and kv_a whole on every rank as vLLM replicates them; Gated DeltaNet's in_proj_qkvz, in_proj_ba and
  out_proj; a dense layer's gate/up and down; a MoE layer's shared experts (and their gate) and the router, whole;
- elementwise passes, as bytes a token moves: the two RMSNorms, rotary, the gated activation, a residual add (inside
  the norms where the engine fuses it), and by kind q/k norms, the output gate, MLA's latent norms, Gated DeltaNet's
  causal convolution and gated norm, Gemma's extra norms. Attention sinks add nothing: their one logit a head is
  folded into the attention kernel's softmax.
Per attention kind, on one device (`AttentionGroup`): the layers, heads, K/V bytes a token (one layer), FLOPs of a
(query, key) pair in prefill and of a key in decode, and a linear layer's state and recurrence FLOPs. Routed experts:
their layer count, one device's expert GEMMs and the load a step puts on the busiest device (sim/cost/routing.py).

A step's keys by kind (`kv_reads`, `prompt_pairs`): a decode row of a sliding-window layer reads at most W keys and a
chunked-local layer's at most C, so the step's decode rows read min(their context, rows × W); a prompt chunk's
queries attend at most W keys each. The step's shape holds sums, not rows: the bound is exact when every row is past
its window (any row past 128 tokens of gpt-oss's windows) or every row within it, above the truth for a mix; a
chunked-local row past its first chunk reads (context − 1) mod C + 1 keys, C/2 on average, priced at C.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.config import layers as kinds
from sim.config.expert_parallel import ExpertLayout
from sim.config.layers import Attention, LayerSpec
from sim.config.moe import expert_width, qk_head_dim, shared_width, v_head_dim
from sim.config.sharding import Sharding
from sim.cost.routing import ExpertLoad, ranks_touched
from sim.policy.batch import BatchShape

# the elementwise passes measured, and which of their fits prices each kind of pass
PASS_FITS = {"input_norm": "input_norm", "post_norm": "post_norm", "rope": "rope", "act": "act", "add": "add",
             "qk_norm": "input_norm", "latent_norm": "input_norm", "extra_norms": "input_norm", "gate": "act",
             "conv": "act", "gated_norm": "post_norm"}
# Gated DeltaNet's chunked prefill (flash-linear-attention's chunk_gated_delta_rule): chunks of 64 tokens
DELTA_RULE_CHUNK = 64
MOE_KERNELS = 4  # a MoE layer's launches besides its elementwise passes: top-k, permute, two grouped GEMMs


@dataclass(eq=False, repr=False)
class AttentionGroup:
    """The layers of one attention kind (and window) on one device."""

    kind: str  # full | sliding_window | chunked_local | linear | mla
    window: int  # sliding_window: W; chunked_local: C; else 0
    layers: int
    heads: int  # query heads on the device (linear: value heads)
    kv_heads: int  # KV heads on the device (MLA: 1, the latent; linear: value heads)
    head_dim: int
    kv_bytes_per_token: float  # one layer's K/V of one token on the device (linear: 0)
    prefill_flops_per_pair: float  # one layer's FLOPs of a (query, key) pair in a prompt chunk
    decode_flops_per_key: float  # one layer's FLOPs of a decode row's key (MLA: absorbed)
    state_bytes: float = 0.0  # linear: one sequence's state in one layer on the device
    state_flops_per_token: float = 0.0  # linear: the recurrence's FLOPs a token in one layer on the device

    @property
    def windowed(self) -> bool:
        return self.kind in kinds.WINDOWED


@dataclass(eq=False, repr=False)
class BlockWork:
    """One distinct decoder block on one device, and how many of the model's layers run it."""

    layer: LayerSpec
    count: int
    gemms: tuple[tuple[int, int], ...]  # (N, K) of each GEMM but the routed experts
    passes: tuple[tuple[str, int], ...]  # (pass, bytes a token moves), in the order they run


def attention_gemms(m, a: Attention, s: Sharding) -> list[tuple[int, int]]:
    """(N, K) of one layer's attention projections on one device."""
    h = m.hidden_size
    if a.kind == "mla":
        qk, heads = qk_head_dim(m), m.num_heads // s.tp
        q = [(m.q_lora_rank, h), (heads * qk, m.q_lora_rank)] if m.q_lora_rank else [(heads * qk, h)]
        return [*q, (m.kv_lora_rank + m.qk_rope_head_dim, h), (heads * (m.qk_nope_head_dim + v_head_dim(m)),
                                                                m.kv_lora_rank), (h, heads * v_head_dim(m))]
    if a.kind == "linear":
        key, value, heads = linear_dims(m, s.tp)
        return [(2 * key + 2 * value, h), (2 * heads, h), (h, value)]
    q, kv = s.heads * m.head_size, s.kv_heads * m.head_size
    return [((2 if a.output_gate else 1) * q + 2 * kv, h), (h, q)]


def ffn_gemms(m, layer: LayerSpec, s: Sharding) -> list[tuple[int, int]]:
    """(N, K) of one layer's FFN GEMMs on one device but the routed experts (a MoE layer's shared experts and router,
    whole on every rank)."""
    h = m.hidden_size
    if layer.ffn.kind == "dense":
        inter = layer.ffn.width // s.tp
        return [(2 * inter, h), (h, inter)]
    shared = shared_width(m) // s.tp
    out = [(2 * shared, h), (h, shared)] if shared else []
    if shared and m.shared_expert_gate:
        out.append((1, h))
    return [*out, (m.num_experts, h)]


def linear_dims(m, tp: int) -> tuple[int, int, int]:
    """A Gated DeltaNet layer's key and value channels and value heads on one of `tp` devices."""
    heads = m.linear_num_value_heads // tp
    return m.linear_num_key_heads // tp * m.linear_key_head_dim, heads * m.linear_value_head_dim, heads


def layer_passes(m, layer: LayerSpec, s: Sharding, act_bytes: int, fused_add: bool) -> tuple[tuple[str, int], ...]:
    """(pass, bytes a token moves) of one layer's elementwise passes on one device, the residual add inside each
    norm's kernel where the engine fuses it (each norm then moving the residual too)."""
    a, h = layer.attention, m.hidden_size
    q, kv = s.heads * m.head_size, s.kv_heads * m.head_size
    p = {"input_norm": 2 * h * act_bytes, "post_norm": 2 * h * act_bytes}
    if a.kind == "mla":
        p["rope"] = 2 * (m.num_heads // s.tp + 1) * m.qk_rope_head_dim * act_bytes
    elif a.kind != "linear":
        p["rope"] = 2 * (q + kv) * act_bytes
    width = layer.ffn.width // s.tp if layer.ffn.kind == "dense" else \
        expert_width(m) * m.num_experts_per_tok // s.tp + shared_width(m) // s.tp
    p["act"] = 3 * width * act_bytes
    p["add"] = 3 * h * act_bytes
    if fused_add:
        add = p.pop("add")
        p["input_norm"] += add // 3 * 2
        p["post_norm"] += add // 3 * 2
    return tuple(p.items()) + kind_passes(m, a, s, act_bytes)


def kind_passes(m, a: Attention, s: Sharding, act_bytes: int) -> tuple[tuple[str, int], ...]:
    """The elementwise passes an attention kind adds to a layer: q/k norms, the output gate, MLA's latent norms, Gated
    DeltaNet's convolution and gated norm; Gemma's third and fourth norms."""
    q, kv = s.heads * m.head_size, s.kv_heads * m.head_size
    out = []
    if a.qk_norm:
        out.append(("qk_norm", 2 * (q + kv) * act_bytes))
    if a.output_gate:
        out.append(("gate", 3 * q * act_bytes))
    if a.kind == "mla":
        out.append(("latent_norm", 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank) * act_bytes))
    if a.kind == "linear":
        key, value, _ = linear_dims(m, s.tp)
        out += [("conv", 2 * (2 * key + value) * act_bytes), ("gated_norm", 3 * value * act_bytes)]
    if m.layer_norms > 2:
        out.append(("extra_norms", 2 * (m.layer_norms - 2) * m.hidden_size * act_bytes))
    return tuple(out)


def distinct_blocks(m) -> list[tuple[LayerSpec, int]]:
    """The model's distinct blocks with how many layers run each, in the order they first appear."""
    counts: dict[LayerSpec, int] = {}
    for layer in m.layers:
        counts[layer] = counts.get(layer, 0) + 1
    return list(counts.items())


def attention_group(m, a: Attention, layers: int, s: Sharding, kv_bytes_per_token: float) -> AttentionGroup:
    """The layers of attention block `a` on one device; `kv_bytes_per_token`: one layer's K/V a token there."""
    if a.kind == "mla":  # decompressed in prefill; absorbed in decode, each head meeting the latent and rotary key
        heads = m.num_heads
        return AttentionGroup("mla", 0, layers, heads // s.tp, 1, qk_head_dim(m), kv_bytes_per_token,
                              2 * heads * (qk_head_dim(m) + v_head_dim(m)) / s.tp,
                              2 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) / s.tp)
    if a.kind == "linear":
        dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
        _, _, heads = linear_dims(m, s.tp)
        # per value head and token: the state applied to q and updated by k, v (2·dk·dv each); the chunk's own
        # attention (q·kᵀ and its product with v) over DELTA_RULE_CHUNK tokens
        flops = heads * (4 * dk * dv + 4 * DELTA_RULE_CHUNK * (dk + dv))
        return AttentionGroup("linear", 0, layers, heads, heads, dv, 0.0, 0.0, 0.0,
                              kinds.state_bytes(m, a) / s.tp, flops)
    flops = 4 * s.heads * m.head_size
    return AttentionGroup(a.kind, a.window, layers, s.heads, s.kv_heads, m.head_size, kv_bytes_per_token, flops, flops)


def attention_groups(m, s: Sharding, kv_bytes_per_token_layer: float) -> tuple[AttentionGroup, ...]:
    """The model's attention layers by kind on one device, full attention (or MLA) first."""
    found: dict[tuple[str, int], list] = {}
    for layer in m.layers:
        a = layer.attention
        found.setdefault((a.kind, a.window), [a, 0])[1] += 1
    groups = [attention_group(m, a, n, s, kv_bytes_per_token_layer) for a, n in found.values()]
    return tuple(sorted(groups, key=lambda g: g.kind not in ("full", "mla")))


@dataclass(eq=False, repr=False)
class StepBlocks:
    """A replica's model as one device of one data-parallel rank computes it: its distinct blocks' GEMMs and passes,
    its attention groups, its routed experts and the layout that splits them."""

    model: object  # ModelSpec
    sharding: Sharding
    expert_layout: ExpertLayout
    blocks: tuple[BlockWork, ...]
    groups: tuple[AttentionGroup, ...]
    moe_layers: int
    expert_gemms: tuple[tuple[int, int], ...]  # one routed expert's gate/up and down (N, K) on a device holding it
    experts: ExpertLoad

    @property
    def full(self) -> AttentionGroup | None:
        """The full-attention (or MLA) layers: the group every decode row reads its whole context in."""
        g = self.groups[0]
        return g if g.kind in ("full", "mla") else None

    @property
    def bounded(self) -> tuple[AttentionGroup, ...]:
        """The groups a step prices apart from full attention: windowed and linear layers."""
        return tuple(g for g in self.groups if g.kind not in ("full", "mla"))

    @property
    def dispatches(self) -> bool:
        """Whether a MoE layer's tokens cross data-parallel ranks (every MoE layout with DP > 1 in vLLM) and back."""
        return bool(self.moe_layers) and self.expert_layout.data_parallel_size > 1

    def dispatch_s(self, collectives, tokens: float) -> float:
        """A step's dispatch and combine across the data-parallel ranks, a MoE layer each: an all-gather and a
        reduce-scatter of every token's hidden state (`gather_combine_s`) without expert parallelism or with it on the
        allgather_reducescatter backend (vLLM's default), else two all-to-alls of the routed rows: a row per expert a
        token chose, or with DeepEP's normal kernels one per rank those experts are on.
        (Within one rank every device already holds every token: each runs its own experts or slices, and the
        layer's all-reduce combines them.)"""
        if not (self.dispatches and tokens):
            return 0.0
        if self.expert_layout.gathers:
            return self.moe_layers * self.gather_combine_s(collectives, tokens)
        m, layout = self.model, self.expert_layout
        ep, rows = layout.ep_size, m.num_experts_per_tok
        if layout.one_copy_per_rank:
            rows = ranks_touched(m.num_experts, rows, ep)
        routed = tokens * rows / ep * self.experts.imbalance * (m.hidden_size * m.act_bytes)
        return 2 * self.moe_layers * collectives.all_to_all_s(routed, ep)

    def gather_combine_s(self, collectives, tokens: float) -> float:
        """One MoE layer's exchange with experts sliced over the DP ranks (vLLM's naive dispatch / combine, its
        allgather_reducescatter backend): the replica's `tokens` hidden states and router logits gathered over each
        TP rank's DP peers, the experts' partial outputs reduce-scattered back (a reduce-scatter moves an all-gather's
        bytes); the TP all-reduce after the layer completes them."""
        m, dp = self.model, self.expert_layout.data_parallel_size
        hidden = tokens * m.hidden_size * m.act_bytes
        return collectives.gather_s(hidden + tokens * m.num_experts * m.act_bytes, dp) + \
            collectives.gather_s(hidden, dp)

    def kernels_per_layer(self, block: BlockWork) -> int:
        """Kernels one layer of `block` launches: its GEMMs and passes, attention, the experts' and the tensor-parallel
        all-reduces."""
        tp = self.sharding.tp
        return len(block.gemms) + len(block.passes) + 1 + (2 if tp > 1 else 0) + \
            (MOE_KERNELS if block.layer.ffn.kind == "moe" else 0)


def step_blocks(model, sharding: Sharding, expert_layout: ExpertLayout, kv_bytes_per_token_layer: float,
                act_bytes: int, fused_add: bool = False, load_imbalance: float = 1.0) -> StepBlocks:
    """The composition of a plan's model on one device (the plan's sharding and expert layout; one attention layer's
    K/V a token on the device)."""
    blocks = tuple(BlockWork(layer, n, tuple(attention_gemms(model, layer.attention, sharding)
                                             + ffn_gemms(model, layer, sharding)),
                             layer_passes(model, layer, sharding, act_bytes, fused_add))
                   for layer, n in distinct_blocks(model))
    moe_layers = sum(b.count for b in blocks if b.layer.ffn.kind == "moe")
    width = expert_width(model) // expert_layout.expert_slices
    experts = ExpertLoad(model.num_experts if moe_layers else 0, model.num_experts_per_tok,
                         expert_layout.enable_expert_parallel, expert_layout.ep_size, load_imbalance)
    return StepBlocks(model, sharding, expert_layout, blocks,
                      attention_groups(model, sharding, kv_bytes_per_token_layer), moe_layers,
                      ((2 * width, model.hidden_size), (model.hidden_size, width)), experts)


# -- a step's keys by attention kind ------------------------------------------------------------------------------------
def window_reads(group: AttentionGroup, context: int, rows: int) -> int:
    """Keys `rows` decode rows of `context` tokens in all read in one layer of `group`: all of them, or at most the
    window each."""
    cap = rows * group.window
    return context if context < cap else cap


def prompt_pairs(group: AttentionGroup, pairs: int, queries: int) -> int:
    """(query, key) pairs a step's `queries` prompt (and draft) queries of `pairs` causal pairs in all attend in one
    layer of a windowed group: at most the window each."""
    cap = queries * group.window
    return pairs if pairs < cap else cap


def prompt_keys(group: AttentionGroup, context: int, chunks: int, tokens: int) -> int:
    """Keys `chunks` prompt chunks of `tokens` new tokens and `context` in all walk in one layer of a windowed group:
    their own tokens and at most the window before each."""
    cap = tokens + chunks * group.window
    return context if context < cap else cap


def kv_reads(group: AttentionGroup, shape: BatchShape) -> int:
    """K/V tokens one layer of `group` reads in a step of `shape`: every row's context, or at most each row's window
    (decode rows) and its chunk and window (prompt chunks); 0 for linear attention."""
    if group.kind == "linear":
        return 0
    if not group.windowed:
        return shape.sum_context
    rows = shape.num_seqs - shape.num_prefill
    return window_reads(group, shape.sum_context - shape.prefill_context, rows) + \
        prompt_keys(group, shape.prefill_context, shape.num_prefill, shape.prefill_tokens)

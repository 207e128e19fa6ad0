"""A llama-family decoder in plain torch with a serving-engine forward (nano-vllm style), built from the
layers of executor/model/layers.py.

`forward` takes the flat packed tokens of a step (prefill chunks and decodes mixed), writes
their K/V into the paged cache and attends through it; `compute_logits` runs the LM head only
on the rows the caller needs (a prefill needs just its last position).
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs per layer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import nn

from executor.model import attention, layers, native, quantize
from executor.model.attention import AttentionMetadata, get_backend
from executor.model.cache_engine import KVCache
from executor.model.layers import MLP, Attention, Embedding, Linear, RMSNorm, RotaryEmbedding
from executor.model.moe import SparseMoeBlock
from sim.config.moe import is_moe_layer

# Switch off to run decode steps layer by layer in Python even where the native decode loop applies (comparisons).
USE_NATIVE_DECODE_LOOP = True


@dataclass
class LlamaConfig:
    """Shape and numerics of a llama-family model (names follow the serving literature)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or HF's {"rope_type": "linear" | "llama3", "factor": ..., ...}
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    # mixture of experts (Hugging Face's names; 0 experts: dense): which layers are MoE is is_moe(layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # one routed expert's width; None: intermediate_size
    shared_expert_intermediate_size: int = 0  # the shared experts' width in all (0: none)
    shared_expert_gate: bool = False  # sigmoid gate on the shared experts' output (Qwen2-MoE)
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    local_experts: int | None = None  # experts this copy holds (an expert-parallel rank's share); None: all
    # sharded over ranks (executor.distributed): experts whole on each rank (vLLM's enable_expert_parallel), not sliced
    expert_parallel: bool = False

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a MoE block instead of the dense MLP."""
        return is_moe_layer(self, layer)  # the simulator's rule: this config has ModelSpec's names

    @classmethod
    def from_hf(cls, hf) -> LlamaConfig:
        """Read a transformers LlamaConfig (v4 rope_theta/rope_scaling or v5 rope_parameters), or a Mixtral,
        Qwen2-MoE or Qwen3-MoE one (their experts; Qwen3's q/k norms); NotImplementedError for what the layers do
        not compute (biases, DeepSeek's latent attention and grouped routing, sliding windows, other activations)."""
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False) or getattr(hf, "qkv_bias", False):
            raise NotImplementedError("projection biases are not supported")
        if getattr(hf, "kv_lora_rank", None) or getattr(hf, "n_routed_experts", None):
            raise NotImplementedError("DeepSeek's latent attention and grouped expert routing are not supported")
        if getattr(hf, "use_sliding_window", True) and getattr(hf, "sliding_window", None):
            raise NotImplementedError("sliding-window attention is not supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {hf.hidden_act!r} is not supported")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        heads = hf.num_attention_heads
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_id=getattr(hf, "eos_token_id", None),
            qk_norm=getattr(hf, "model_type", None) in ("qwen3", "qwen3_moe"),
            **_moe_from_hf(hf),
        )

    def to_hf(self):
        """The equivalent transformers LlamaConfig (for reference comparisons; a dense model's)."""
        if self.num_experts or self.qk_norm:
            raise NotImplementedError("a MoE or Qwen3 model has no transformers LlamaConfig; build the twin from its "
                                      "own family's config (executor.model.tiny.moe_config)")
        from transformers import LlamaConfig as HFLlamaConfig

        return HFLlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )


def _moe_from_hf(hf) -> dict:
    """The MoE fields of LlamaConfig from a transformers Mixtral (num_local_experts) or Qwen2/3-MoE (num_experts,
    moe_intermediate_size, shared expert, decoder_sparse_step, mlp_only_layers) config; {} for a dense one."""
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
    if not experts:
        return {}
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    return {"num_experts": experts, "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": getattr(hf, "moe_intermediate_size", None),  # Mixtral's: intermediate_size
            "shared_expert_intermediate_size": shared, "shared_expert_gate": bool(shared),  # Qwen2-MoE gates it
            "norm_topk_prob": bool(getattr(hf, "norm_topk_prob", True)),  # Mixtral always renormalizes
            "decoder_sparse_step": getattr(hf, "decoder_sparse_step", None) or 1,
            "mlp_only_layers": tuple(getattr(hf, "mlp_only_layers", None) or ())}


def moe_block(config: LlamaConfig, cls=SparseMoeBlock, **kwargs) -> SparseMoeBlock:
    """A MoE block (`cls`: SparseMoeBlock or a parallel one, with its own `kwargs`) of the config's shapes."""
    c = config
    return cls(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size or c.intermediate_size,
               c.norm_topk_prob, c.shared_expert_intermediate_size, c.shared_expert_gate, c.local_experts, **kwargs)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(x)); the mlp a MoE block where config.is_moe."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, layer_idx,
                                   c.rms_norm_eps if c.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = moe_block(c) if c.is_moe(layer_idx) else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, rope, meta, kv_cache, backend, rows=None, delta=None):
        """(residual stream, pending output). `x` is the model's own residual stream: updated in place under
        FUSED_OPS. With `rows` (see Attention.forward) only those rows go on past attention and come back.

        Native path (rope.native): `delta`, the previous layer's output, is added to `x` here, fused with this
        layer's first norm, and this layer's output comes back as the pending one for the next layer to add;
        on the torch paths it is added here and the pending output is None."""
        if rope.native:
            h = self.input_layernorm.fused_add(x, delta)
            a = self.self_attn(h, rope, meta, kv_cache, backend, rows)
            if rows is not None:
                x = x[rows[0]]
            return x, self.mlp(self.post_attention_layernorm.fused_add(x, a), fused=True)
        if rows is not None:
            x = x[rows[0]] + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend, rows)
            return x.add_(self.mlp(self.post_attention_layernorm(x))), None
        if layers.FUSED_OPS and not torch.is_grad_enabled():
            x.add_(self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend))
            return x.add_(self.mlp(self.post_attention_layernorm(x))), None
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x)), None


class LlamaModel(nn.Module):
    """Decoder + LM head. `attn_backend` is a name from executor.model.attention ("naive", "sdpa",
    "flash", "paged") or a backend callable; change it any time via the attribute."""

    def __init__(self, config: LlamaConfig, attn_backend="sdpa"):
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # the decode plan and what says when to remake it: see _decode_plan
    _decode_cache: dict | None = None

    def __getstate__(self):  # the plan holds addresses of this object's tensors: never pickled or deep-copied
        state = dict(self.__dict__)
        state.pop("_decode_cache", None)
        state.pop("_pools", None)
        return state

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCache, last_of: list[int] | None = None, attention=None,
                hidden: torch.Tensor | None = None, final: bool = True) -> torch.Tensor:
        """Run one step over T packed tokens; returns the final-normed hidden states [T, hidden].

        `last_of`: indices of sequences whose last new token is all the caller needs (the rows that
        sample); then the result is [len(last_of), hidden], and the last layer computes attention, MLP
        and norm for those rows only — every other row's last-layer output only ever fed its own logits
        (its K/V, which later tokens read, are still written). `attention`: a backend for this call instead of
        the model's (a CUDA graph's static-shape decode attention).

        A pipeline stage runs some of the layers: `hidden`, the residual stream [T, hidden] an earlier stage
        returned, replaces the embedding of `input_ids` (and is updated in place); `final=False` returns the
        residual stream after this model's layers instead of the final-normed hidden states."""
        backend = attention or (get_backend(self.attn_backend) if isinstance(self.attn_backend, str)
                                else self.attn_backend)
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        rope = self.rotary.angles(positions, x, kv_caches.layer(0)[0], meta.slot_mapping)
        if not final:
            if last_of is not None:
                raise ValueError("last_of picks the rows of the final hidden states: not with final=False")
            delta = None
            for layer in self.layers:
                x, delta = layer(x, rope, meta, kv_caches, backend, delta=delta)
            return x if delta is None else x.add_(delta)  # the next stage starts from the whole residual stream
        if hidden is None and attention is None and rope.native:
            out = self._native_decode(x, rope, meta, kv_caches, last_of, backend)
            if out is not None:
                return out
        rows, idx = None, None
        if last_of is not None:
            idx = [meta.cu_query_lens[i + 1] - 1 for i in last_of]
            if idx != sorted(set(idx)):
                raise ValueError("last_of must list distinct sequences in batch order")
            if idx and len(idx) < x.shape[0]:
                index = torch.tensor(idx, dtype=torch.long, device=x.device)
                rows = (index, AttentionMetadata([1] * len(idx), [meta.context_lens[i] for i in last_of],
                                                 [meta.block_tables[i] for i in last_of],
                                                 meta.slot_mapping[index], meta.block_size))
        delta = None
        for layer in self.layers[:-1]:
            x, delta = layer(x, rope, meta, kv_caches, backend, delta=delta)
        x, delta = self.layers[-1](x, rope, meta, kv_caches, backend, rows, delta)
        if idx is not None and rows is None and len(idx) < x.shape[0]:  # no row samples: none returned
            x, delta = x[:0], None if delta is None else delta[:0]
        return self.norm.fused_add(x, delta) if rope.native else self.norm(x)

    def _native_decode(self, x, rope, meta: AttentionMetadata, kv_caches: KVCache, last_of, backend):
        """The final-normed hidden states of a step whose rows are all one-token decodes, every layer in one native
        call (native.decode_layers), or None where that would not be exactly the layer-by-layer native path: a row
        of several tokens, trees, some rows not sampling, another attention backend, a projection that is not a
        plain fp32 / int8 / int4 one (tensor-parallel, outlier columns) or too many rows for its native kernel."""
        t = x.shape[0]
        if not (USE_NATIVE_DECODE_LOOP and t == len(meta.query_lens) and not meta.trees
                and backend is attention.sdpa_attention and attention.USE_NATIVE_ATTENTION
                and (last_of is None or list(last_of) == list(range(t)))):
            return None
        plan = self._decode_plan()
        if plan is None or t > plan["max_rows"] or (plan["fp32"] and not layers.USE_NATIVE_LINEAR) \
                or (plan["quantized"] and not quantize.USE_NATIVE_QUANT):
            return None
        pools = self._pool_addresses(kv_caches)
        if pools is None:
            return None
        c = self.config
        delta = torch.empty_like(x)
        native.decode_layers(plan["desc"], len(self.layers), x, delta,
                             (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size), plan["eps"],
                             rope.rotary.cos, rope.rotary.sin, rope.positions, meta.slot_mapping, pools[0], pools[1],
                             meta.block_size, meta.decode_block_tables, meta.decode_context_lens, plan["scale"])
        return self.norm.fused_add(x, delta)

    _pools: tuple | None = None  # (key, pools' addresses, int8 KV) of the last KVCache: see _pool_addresses

    def _pool_addresses(self, kv_caches: KVCache) -> tuple[torch.Tensor, bool] | None:
        """(int64 [2 · layers]: every layer's k and v pool address, whether they hold int8 rows), or None where a
        pool is not one the native kernels read. Kept for the next step of the same cache: a KVCache's pools are
        fixed views of its one tensor, so its address and shape identify them."""
        first = kv_caches.layer(0)[0]
        key = (id(kv_caches), first.data_ptr(), first.shape, first.dtype) if type(kv_caches) is KVCache else None
        if key is None or self._pools is None or self._pools[0] != key:
            pools = [p for i in range(len(self.layers)) for p in kv_caches.layer(i)]
            if not all(map(native.kv_pool_usable, pools)) or len({(p.dtype, p.shape) for p in pools}) != 1:
                return None
            self._pools = (key, torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64),
                           first.dtype == torch.int8)
        return self._pools[1:]

    def _decode_plan(self) -> dict | None:
        """The native decode loop's descriptor of this model's layers (native.decode_descriptor) and what it needs
        per step, made once and remade when the model changes; None where a layer is not one the loop runs exactly,
        or where a forward hook watches one (the loop would not call it).

        A step checks little, since walking every module and weight of 30 layers costs ~0.5 ms once the step's
        weight stream has pushed them out of the caches: a module, parameter or buffer assigned anywhere (replaced
        layers, quantize_weights, sharding) bumps _REGISTRATIONS, `.to()` on the model drops the plan (_apply), and
        of the weights only fp32 projections' are checked (version and address), since the loop reads their panel
        copies; norms and quantized weights it reads in place, so in-place updates reach it as they are. (`.to()` on
        one layer rather than the model goes unseen, but the plan holds the storages it points into, so nothing it
        reads is freed.)"""
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return None
        cache = self._decode_cache
        if cache is None or cache["registrations"] != _REGISTRATIONS[0] or not _unchanged(cache["copied"]):
            cache = self._decode_cache = self._make_decode_plan()
        return None if any(map(len, cache["hooks"])) else cache["plan"]

    def tune_projections(self) -> dict[tuple, int]:
        """Kernel copies of every fp32 CPU projection made now and where the native kernel hands over to the GEMM
        measured per shape (layers.tune_native_rows); the decode plan is remade with the new row limits."""
        found = layers.tune_native_rows(self)
        if found:
            self._decode_cache = None
        return found

    def _apply(self, fn, *args, **kwargs):  # .to() / .float() / share_memory_() may move every weight
        self._decode_cache = self._pools = None
        return super()._apply(fn, *args, **kwargs)

    def _make_decode_plan(self) -> dict:
        """_decode_plan's cache: the plan (None where the loop does not apply) and what says when to remake it."""
        registrations = _REGISTRATIONS[0]
        plan = self._plan_layers()
        copied = [m.weight for layer in self.layers for m in layer.modules() if type(m) is Linear]
        called = [] if plan is None else [m for layer in self.layers for m in (
            layer, *layer.children(), *layer.self_attn.children(), *layer.mlp.children())]
        return {"registrations": registrations, "plan": plan,
                "copied": (copied, tuple(map(torch.Tensor.data_ptr, copied)), tuple(map(_VERSION, copied))),
                "hooks": [d for m in called for d in (m._forward_hooks, m._forward_pre_hooks)]}

    def _plan_layers(self) -> dict | None:
        """The plan of _decode_plan, made from the model as it is now."""
        c = self.config
        if not native.available() or c.num_heads % c.num_kv_heads:
            return None
        hidden, q_size, inter = c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size
        shapes = [(hidden, q_size + 2 * c.num_kv_heads * c.head_dim, None), (q_size, hidden, None),
                  (hidden, 2 * inter, [inter, inter]), (inter, hidden, None)]  # (in, out, splits): the loop's buffers
        layer_specs, kinds, max_rows, norms = [], set(), 1 << 30, []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            kinds_of = (type(layer), type(attn), type(mlp), type(layer.input_layernorm),
                        type(layer.post_attention_layernorm))
            if kinds_of != (DecoderLayer, Attention, MLP, RMSNorm, RMSNorm) or attn.q_norm is not None \
                    or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (c.num_heads, c.num_kv_heads, c.head_dim):
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            projections = []
            mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            for m, outputs, shape in zip(mods, (1, 1, 2, 1), shapes):
                parts = _decode_parts(m)
                if parts is None or (m.in_features, m.out_features, m.splits) != shape:
                    return None
                kind, rows, parts = parts
                if sum(2 if p[6] else 1 for p in parts) != outputs:
                    return None
                kinds.add(kind)
                max_rows = min(max_rows, rows)
                projections.append(parts)
            layer_specs.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                *projections))
        eps = {n.eps for n in norms}
        scale = {layer.self_attn.scale for layer in self.layers}
        weights_ok = all(n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"
                         and n.weight.is_contiguous() and n.weight.shape == (hidden,) for n in norms)
        if len(eps) != 1 or len(scale) != 1 or not weights_ok or not layer_specs:
            return None
        # "tensors": what desc points into (detached: a parameter's data swapped later still leaves these alive)
        return {"desc": native.decode_descriptor(layer_specs), "tensors": layer_specs, "eps": eps.pop(),
                "scale": scale.pop(), "max_rows": max_rows, "fp32": "fp32" in kinds,
                "quantized": bool(kinds - {"fp32"})}

    def take_expert_counts(self) -> list[int] | None:
        """Tokens each expert computed, summed over the MoE layers, since the last call (None: a dense model)."""
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return sum(b.take_counts() for b in blocks).tolist() if blocks else None

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the given hidden rows only."""
        return self.lm_head(hidden_rows)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy a transformers LlamaForCausalLM state_dict in (fusing q/k/v and gate/up); a MoE layer's block from
        Mixtral's or Qwen-MoE's names (SparseMoeBlock.load_hf)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.weight.copy_(sd["model.norm.weight"])
            if not self.config.tie_word_embeddings:
                self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                layer.self_attn.qkv_proj.weight.copy_(torch.cat(attn))
                layer.self_attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
                if layer.self_attn.q_norm is not None:
                    layer.self_attn.q_norm.weight.copy_(sd[p + "self_attn.q_norm.weight"])
                    layer.self_attn.k_norm.weight.copy_(sd[p + "self_attn.k_norm.weight"])
                if isinstance(layer.mlp, SparseMoeBlock):
                    layer.mlp.load_hf(sd, p)
                else:
                    mlp = [sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
                    layer.mlp.gate_up_proj.weight.copy_(torch.cat(mlp))
                    layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under transformers' LlamaForCausalLM names (q/k/v and gate/up split; a MoE block's
        under transformers ≥ 5's Qwen2-MoE names)."""
        c = self.config
        sd = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight,
              "lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            sizes = [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
            q, k, v = layer.self_attn.qkv_proj.weight.split(sizes)
            if layer.self_attn.q_norm is not None:
                sd.update({p + "self_attn.q_norm.weight": layer.self_attn.q_norm.weight,
                           p + "self_attn.k_norm.weight": layer.self_attn.k_norm.weight})
            if isinstance(layer.mlp, SparseMoeBlock):
                sd.update(layer.mlp.hf_state(p + "mlp."))
            else:
                gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
                sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                           p + "mlp.down_proj.weight": layer.mlp.down_proj.weight})
            sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                       p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                       p + "input_layernorm.weight": layer.input_layernorm.weight,
                       p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
        return {k: v.detach().clone() for k, v in sd.items()}


_VERSION = operator.attrgetter("_version")


def _unchanged(copied: tuple) -> bool:
    """Whether the fp32 projection weights a decode plan holds panel copies of are the same tensors as then."""
    weights, ptrs, versions = copied
    return tuple(map(torch.Tensor.data_ptr, weights)) == ptrs and tuple(map(_VERSION, weights)) == versions


# Module, parameter and buffer assignments so far, anywhere: a decode plan is remade when the count moves.
_REGISTRATIONS = [0]


def _count_registration(*args) -> None:
    _REGISTRATIONS[0] += 1


for _register in (nn.modules.module.register_module_module_registration_hook,
                  nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook):
    _register(_count_registration)


def _decode_parts(m: nn.Module) -> tuple[str, int, list] | None:
    """(kind, most rows, decode_layers parts) of a projection: a plain fp32 Linear (its native panels) or an int8 /
    int4 QuantizedLinear without outlier columns; None for anything else (a tensor-parallel subclass, fp8, ...)."""
    if type(m) is Linear:
        if not m.fp32_cpu_weight():
            return None
        panels = m._copies("_panels", native.pack_weight)
        return "fp32", m.native_rows(), [(native.PART_FP32, p.data, None, p.n, p.k, 0, 0) for p in panels]
    if type(m) is not quantize.QuantizedLinear or m.weight_dtype not in ("int8", "int4"):
        return None
    lib, parts = native.library(), []
    for qw in m.parts:
        if (type(qw) is not quantize.QuantizedWeight or qw.outlier_index is not None or qw.panels.device.type != "cpu"
                or qw.width != lib.panel_columns or qw.scales.dtype not in (torch.float32, torch.int16)):
            return None
        kind = native.PART_INT8 if qw.bits == 8 else native.PART_INT4
        parts.append((kind, qw.panels.detach(), qw.scales.detach(), qw.n, qw.k, qw.group_size, qw.split or 0))
    rows = quantize.QUANT_MAX_ROWS_BY_PANEL.get(lib.panel_columns, 32)
    return "quantized", rows, parts

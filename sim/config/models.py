"""Model architectures: the catalog, explicit specs, Hugging Face config.json loading, sizes."""

from collections.abc import Callable, Mapping
from functools import cached_property, partial
from typing import Literal

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sim.config import layers, moe
from sim.config.errors import LazyCatalog, catalog_entry
from sim.config.schema_base import StrictModel

WeightDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8", "int4", "mxfp4", "nvfp4"]
LayerType = Literal[tuple(layers.LAYER_TYPES)]

# Bytes per weight; int8/int4 carry one fp16 scale and zero point per group of 128 (GPTQ/AWQ style); fp8 (e4m3) one
# scale per output channel (negligible); the OCP microscaling MXFP4 one 8-bit power-of-two scale (E8M0) per block of
# 32 FP4 (E2M1) values: 4.25 bits; NVIDIA's NVFP4 one FP8 (E4M3) scale per block of 16: 4.5 bits (and one fp32 scale a
# tensor, negligible).
BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 128,
                   "mxfp4": (4 + 8 / 32) / 8, "nvfp4": (4 + 8 / 16) / 8}
FP4 = ("mxfp4", "nvfp4")  # served with bf16 activations
# 2:4 structured sparsity stored compressed (sparse kernels): the 2 kept values of every 4, plus a 2-bit index each
SPARSE_METADATA_BYTES = 2 * 2 / 8 / 4


class ModelSpec(StrictModel):
    """A llama-family decoder, described by the numbers in its config.json."""

    # its validator is built when a spec is first validated: a run naming a catalog model (whose entries are built
    # unvalidated, tests/test_catalogs.py validates them) never builds it
    model_config = ConfigDict(defer_build=True)
    name: str = "custom"
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt | None = None
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    max_position_embeddings: PositiveInt = 4096
    weight_dtype: WeightDtype = "fp16"
    kv_dtype: Literal["fp32", "fp16", "bf16", "fp8", "int8"] | None = Field(
        default=None, description="KV cache element type; default: the activation dtype (int8: a scale per token "
                                  "and head)")
    sparsity: Literal["none", "2:4"] = Field("none", description="2:4: decoder weights pruned to 2 of every 4 "
                                             "(magnitude); compressed and computed at twice the rate on hardware "
                                             "with sparse tensor cores, stored and computed dense elsewhere")
    tie_word_embeddings: bool = False
    rope_theta: float = Field(10000.0, gt=0)
    # mixture-of-experts, names as in Hugging Face configs (0 routed experts: a dense model)
    num_experts: NonNegativeInt = Field(0, description="routed experts in each MoE layer (0: dense)")
    num_experts_per_tok: NonNegativeInt = Field(0, description="routed experts each token runs (top-k)")
    moe_intermediate_size: PositiveInt | None = Field(None, description="one routed expert's FFN width; default "
                                                                        "intermediate_size")
    num_shared_experts: NonNegativeInt = Field(0, description="experts every token runs besides its top-k")
    shared_expert_intermediate_size: PositiveInt | None = Field(None, description="the shared experts' FFN width "
                                                                                  "in all; default num_shared_experts "
                                                                                  "× moe_intermediate_size")
    shared_expert_gate: bool = Field(False, description="a sigmoid gate scales the shared experts' output "
                                                        "(Qwen2-MoE)")
    norm_topk_prob: bool = Field(True, description="the top-k routing weights renormalized to sum to 1")
    first_k_dense_replace: NonNegativeInt = Field(0, description="the first k layers keep a dense MLP (DeepSeek)")
    decoder_sparse_step: PositiveInt = Field(1, description="every n-th layer is MoE (Qwen-MoE)")
    mlp_only_layers: list[NonNegativeInt] = Field(default_factory=list, description="layers that keep a dense MLP "
                                                                                    "(Qwen-MoE)")
    # multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank set caches one latent and a rotary key per token
    kv_lora_rank: PositiveInt | None = None
    q_lora_rank: PositiveInt | None = None
    qk_rope_head_dim: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt | None = None
    v_head_dim: PositiveInt | None = None
    # per-layer attention kinds (sim/config/layers.py), names as in Hugging Face configs
    layer_types: list[LayerType] | None = Field(None, description="each layer's attention: full_attention, "
                                                "sliding_attention (sliding_window), chunked_attention "
                                                "(attention_chunk_size), linear_attention (the linear_* keys); "
                                                "default: every layer full, or sliding where sliding_window is set")
    sliding_window: PositiveInt | None = Field(None, description="tokens a sliding-window layer's query attends, "
                                                                 "itself included")
    attention_chunk_size: PositiveInt | None = Field(None, description="a chunked-local layer's chunk: a query "
                                                                       "attends its own chunk up to itself (Llama-4)")
    linear_num_key_heads: PositiveInt | None = Field(None, description="Gated DeltaNet (linear attention) key heads")
    linear_num_value_heads: PositiveInt | None = Field(None, description="Gated DeltaNet value heads")
    linear_key_head_dim: PositiveInt | None = None
    linear_value_head_dim: PositiveInt | None = None
    linear_conv_kernel_dim: PositiveInt | None = Field(None, description="the causal convolution's kernel; its state "
                                                                         "keeps kernel - 1 columns")
    attention_sinks: bool = Field(False, description="a learned sink logit per head (gpt-oss)")
    attn_output_gate: bool = Field(False, description="a sigmoid gate on the attention output from a second query "
                                                      "projection (Qwen3-Next's gated attention)")
    qk_norm: bool = Field(False, description="an RMSNorm on every query and key head (Qwen3, Gemma-3)")
    attention_bias: bool = Field(False, description="biases on q, k, v and o (Llama's attention_bias, gpt-oss)")
    qkv_bias: bool = Field(False, description="biases on q, k and v (Qwen2)")
    mlp_bias: bool = Field(False, description="biases on the MLP's and experts' projections and the router (gpt-oss)")
    layer_norms: int = Field(2, ge=1, le=8, description="RMSNorms a decoder layer holds (Gemma-2/3: 4)")
    expert_weight_dtype: WeightDtype | None = Field(None, description="the routed experts' dtype where it differs "
                                                                      "from weight_dtype (gpt-oss: mxfp4)")

    @field_validator("num_kv_heads")
    @classmethod
    def _check_heads(cls, kv_heads: int, info: ValidationInfo) -> int:
        heads = info.data.get("num_heads")
        if heads and heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({heads})")
        return kv_heads

    @model_validator(mode="after")
    def _check_head_size(self) -> "ModelSpec":
        # without head_dim a head is hidden_size / num_heads: a remainder would silently shrink every head
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size}), or give "
                             "head_dim")
        return self

    @model_validator(mode="after")
    def _check_experts(self) -> "ModelSpec":
        moe.check(self)
        layers.check(self)
        return self

    @cached_property
    def layers(self) -> tuple[layers.LayerSpec, ...]:
        """The decoder layers as typed blocks (attention kind, FFN kind), first to last."""
        return layers.layer_specs(self)

    @property
    def hybrid(self) -> bool:
        """Whether any layer's cache is bounded or fixed (sliding window, chunked local, linear attention): vLLM's
        hybrid KV cache manager gives each kind its own block group."""
        return bool(set(layers.kind_counts(self)) - {"full", "mla"})

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def act_dtype(self) -> str:
        """Activations run in this dtype (int8/int4 are weight-only quantization; fp8 weights keep 16-bit
        activations between layers; FP4 weights, bf16)."""
        if self.weight_dtype in FP4:
            return "bf16"
        return "fp32" if self.weight_dtype == "fp32" else ("bf16" if self.weight_dtype == "bf16" else "fp16")

    def matmul_dtype(self, hw_dtypes) -> str:
        """The dtype the linear layers multiply in on hardware with peak rates for `hw_dtypes`: fp8 weights with fp8
        activations where the hardware has fp8 tensor cores (W8A8), NVFP4 weights with FP4 activations where it has
        FP4 tensor cores (Blackwell: W4A4), else the activation dtype (weight-only quantization: weights dequantized
        on the fly)."""
        if self.weight_dtype == "fp8" and "fp8" in hw_dtypes:
            return "fp8"
        return "fp4" if self.weight_dtype == "nvfp4" and "fp4" in hw_dtypes else self.act_dtype

    def dequantizes(self, hw_dtypes) -> bool:
        """Whether its linear layers dequantize weights to a wider dtype before multiplying."""
        return self.weight_dtype in ("int8", "int4", "fp8", *FP4) and \
            self.matmul_dtype(hw_dtypes) not in (self.weight_dtype, "fp4")

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element."""
        return 4 if self.act_dtype == "fp32" else 2

    @property
    def kv_bytes_per_element(self) -> float:
        if self.kv_dtype == "int8":  # plus a 4-byte scale per token and head, as the executor stores it
            return 1 + 4 / self.head_size
        return {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}[self.kv_dtype or self.act_dtype]

    @property
    def kv_bytes_per_token(self) -> float:
        """K/V bytes one token adds over the layers that cache per token: 2 (K and V) · layers · kv_heads · head_dim ·
        bytes per element; MLA: layers · (kv_lora_rank + qk_rope_head_dim) · bytes per element. Linear-attention layers
        cache nothing per token (their fixed state: sim/config/layers.py). What a step reads of it, by kind of layer
        (at most a window a row in sliding and chunked layers): sim/cost/blocks.py."""
        if moe.uses_mla(self):
            return moe.latent_kv_bytes_per_token(self)
        return 2 * layers.cached_layers(self) * self.num_kv_heads * self.head_size * self.kv_bytes_per_element

    @cached_property
    def decoder_parts(self) -> moe.DecoderParams:
        """The decoder layers' parameters by part (attention, dense MLPs, experts, router, norms), summed over the
        layers' blocks."""
        return moe.decoder_params(self)

    @property
    def params_per_layer(self) -> int:
        """A decoder layer's parameters (the mean over its layers where they differ, every expert counted)."""
        return self.linear_params // self.num_layers

    @property
    def linear_params(self) -> int:
        """The decoder layers' parameters (not embeddings or lm_head): what every token multiplies through in a dense
        model; every expert of a MoE (active_linear_params: a token's share)."""
        return self.decoder_parts.total

    @property
    def active_linear_params(self) -> int:
        """Decoder parameters one token multiplies through (a MoE's top-k experts, not all)."""
        return self.decoder_parts.active

    @property
    def active_params(self) -> int:
        """Parameters one token runs through, embedding and LM head included (num_params for a dense model)."""
        return moe.active_params(self)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.linear_params + self.embedding_params + lm_head + self.hidden_size

    def bytes_per_linear_param(self, sparse_kernels: bool = False) -> float:
        """Bytes a decoder weight takes: its dtype's, or 2:4-compressed where `sparse_kernels` run it."""
        b = BYTES_PER_PARAM[self.weight_dtype]
        return b / 2 + SPARSE_METADATA_BYTES if self.sparsity == "2:4" and sparse_kernels else b

    def bytes_per_expert_param(self, sparse_kernels: bool = False) -> float:
        """Bytes a routed expert's weight takes: expert_weight_dtype's where set (gpt-oss's MXFP4 experts beside bf16
        attention and router), else bytes_per_linear_param."""
        if self.expert_weight_dtype is None:
            return self.bytes_per_linear_param(sparse_kernels)
        b = BYTES_PER_PARAM[self.expert_weight_dtype]
        return b / 2 + SPARSE_METADATA_BYTES if self.sparsity == "2:4" and sparse_kernels else b

    @property
    def weight_bytes(self) -> float:
        """Decoder layers at weight_dtype (routed experts at expert_weight_dtype; 2:4 sparse weights stored dense);
        embeddings and lm_head stay in the activation dtype."""
        return self.weight_bytes_on(False)

    def weight_bytes_on(self, sparse_kernels: bool) -> float:
        """weight_bytes on hardware with (True) or without 2:4 sparse kernels."""
        act = BYTES_PER_PARAM[self.act_dtype]
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        embeddings = (self.embedding_params + lm_head) * act
        if self.expert_weight_dtype is not None:
            routed = self.decoder_parts.routed
            return (self.linear_params - routed) * self.bytes_per_linear_param(sparse_kernels) + \
                routed * self.bytes_per_expert_param(sparse_kernels) + embeddings
        return self.linear_params * self.bytes_per_linear_param(sparse_kernels) + embeddings


def _spec(name, layers, hidden, heads, kv_heads, inter, vocab, max_pos, **kw) -> tuple[str, Callable[[], ModelSpec]]:
    """(name, what builds its catalog entry): built on the first lookup, unvalidated (tests/test_catalogs.py)."""
    # mlp_only_layers given: model_construct reads a default factory's signature, inspect.signature(list) ~0.4 ms
    return name, partial(ModelSpec.model_construct, name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                         num_kv_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=max_pos, **{"mlp_only_layers": [], **kw})


# Numbers from each model's public config.json.
MODEL_CATALOG: Mapping[str, ModelSpec] = LazyCatalog(dict([
    _spec("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, 4096),
    _spec("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000, 4096),
    _spec("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000, 4096),
    _spec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0, weight_dtype="bf16"),
    _spec("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0, weight_dtype="bf16"),
    _spec("Mistral-7B", 32, 4096, 32, 8, 14336, 32000, 32768, weight_dtype="bf16"),
    _spec("CodeLlama-34B", 48, 8192, 64, 8, 22016, 32000, 16384, rope_theta=1e6, weight_dtype="bf16"),
    _spec("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, rope_theta=100000.0,
          tie_word_embeddings=True, weight_dtype="bf16"),
    # smaller models distilled or pruned from a bigger one: plan "the 70B in int4" against "a distilled 8B in fp16"
    _spec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072, rope_theta=500000.0, weight_dtype="bf16"),
    _spec("Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, 131072, rope_theta=500000.0, tie_word_embeddings=True,
          weight_dtype="bf16"),
    _spec("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 131072, rope_theta=500000.0, tie_word_embeddings=True,
          weight_dtype="bf16"),
    _spec("Llama-3.1-Minitron-4B-Width", 32, 3072, 32, 8, 9216, 128256, 131072, rope_theta=500000.0,
          weight_dtype="bf16"),
    # mixtures of experts (sim/config/moe.py); DeepSeek-V3 with latent attention, served in its fp8 checkpoint
    _spec("Mixtral-8x7B", 32, 4096, 32, 8, 14336, 32000, 32768, rope_theta=1e6, weight_dtype="bf16",
          num_experts=8, num_experts_per_tok=2),
    _spec("Mixtral-8x22B", 56, 6144, 48, 8, 16384, 32768, 65536, rope_theta=1e6, weight_dtype="bf16",
          num_experts=8, num_experts_per_tok=2),
    _spec("Qwen3-30B-A3B", 48, 2048, 32, 4, 6144, 151936, 40960, head_dim=128, rope_theta=1e6,
          weight_dtype="bf16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True),
    _spec("Qwen3-235B-A22B", 94, 4096, 64, 4, 12288, 151936, 40960, head_dim=128, rope_theta=1e6,
          weight_dtype="bf16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, qk_norm=True),
    _spec("DeepSeek-V3", 61, 7168, 128, 128, 18432, 129280, 163840, head_dim=192, weight_dtype="fp8",
          num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
          first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
          v_head_dim=128),
    # what fleets serve in 2026 (each config.json on huggingface.co: Qwen/Qwen3-8B, Qwen/Qwen3-32B,
    # openai/gpt-oss-120b, openai/gpt-oss-20b, Qwen/Qwen3-Next-80B-A3B-Instruct, meta-llama/Llama-4-Scout-17B-16E,
    # meta-llama/Llama-4-Maverick-17B-128E (their text_config), moonshotai/Kimi-K2-Instruct; sim/config/layers.py)
    _spec("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, 40960, head_dim=128, rope_theta=1e6, weight_dtype="bf16",
          qk_norm=True),
    _spec("Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, 40960, head_dim=128, rope_theta=1e6, weight_dtype="bf16",
          qk_norm=True),
    *[_spec(f"gpt-oss-{size}", layers, 2880, 64, 8, 2880, 201088, 131072, head_dim=64, rope_theta=150000.0,
            weight_dtype="bf16", expert_weight_dtype="mxfp4", num_experts=experts, num_experts_per_tok=4,
            moe_intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            sliding_window=128, attention_sinks=True, attention_bias=True, mlp_bias=True)
      for size, layers, experts in (("120b", 36, 128), ("20b", 24, 32))],
    _spec("Qwen3-Next-80B-A3B", 48, 2048, 16, 2, 5120, 151936, 262144, head_dim=256, rope_theta=1e7,
          weight_dtype="bf16", num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
          shared_expert_intermediate_size=512, shared_expert_gate=True,
          layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
          linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
          linear_conv_kernel_dim=4, qk_norm=True, attn_output_gate=True),
    *[_spec(name, 48, 5120, 40, 8, 16384, 202048, max_pos, head_dim=128, rope_theta=500000.0, weight_dtype="bf16",
            num_experts=experts, num_experts_per_tok=1, moe_intermediate_size=8192, num_shared_experts=1,
            norm_topk_prob=False, decoder_sparse_step=step, attention_chunk_size=8192,
            layer_types=(["chunked_attention"] * 3 + ["full_attention"]) * 12)
      for name, experts, step, max_pos in (("Llama-4-Scout", 16, 1, 10485760), ("Llama-4-Maverick", 128, 2, 1048576))],
    _spec("Kimi-K2", 61, 7168, 64, 64, 18432, 163840, 131072, head_dim=192, rope_theta=50000.0, weight_dtype="fp8",
          num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
          first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
          v_head_dim=128),
]))


def catalog_model(name: str, key_path: str = "model") -> ModelSpec:
    """Look a model up by name, case-insensitively."""
    return catalog_entry(MODEL_CATALOG, name, "model", ", an explicit architecture, or {hf_config: path/to/config.json}",
                         key_path)

"""Model architectures: the catalog, explicit specs, Hugging Face config.json loading, sizes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sim.config import moe
from sim.config.errors import ConfigError
from sim.config.schema_base import StrictModel

WeightDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8", "int4"]

# Bytes per weight; int8/int4 carry one fp16 scale and zero point per group of 128 (GPTQ/AWQ style); fp8 (e4m3) one
# scale per output channel (negligible).
BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 128}
# 2:4 structured sparsity stored compressed (sparse kernels): the 2 kept values of every 4, plus a 2-bit index each
SPARSE_METADATA_BYTES = 2 * 2 / 8 / 4


class ModelSpec(StrictModel):
    """A llama-family decoder, described by the numbers in its config.json."""

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
        return self

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def act_dtype(self) -> str:
        """Activations run in this dtype (int8/int4 are weight-only quantization; fp8 weights keep 16-bit
        activations between layers)."""
        return "fp32" if self.weight_dtype == "fp32" else ("bf16" if self.weight_dtype == "bf16" else "fp16")

    def matmul_dtype(self, hw_dtypes) -> str:
        """The dtype the linear layers multiply in on hardware with peak rates for `hw_dtypes`: fp8 weights with fp8
        activations where the hardware has fp8 tensor cores (W8A8), else the activation dtype (weight-only
        quantization: weights dequantized on the fly)."""
        return "fp8" if self.weight_dtype == "fp8" and "fp8" in hw_dtypes else self.act_dtype

    def dequantizes(self, hw_dtypes) -> bool:
        """Whether its linear layers dequantize weights to a wider dtype before multiplying."""
        return self.weight_dtype in ("int8", "int4", "fp8") and self.matmul_dtype(hw_dtypes) != self.weight_dtype

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
        """2 (K and V) · layers · kv_heads · head_dim · bytes per element; MLA: layers · (kv_lora_rank +
        qk_rope_head_dim) · bytes per element."""
        if moe.is_mla(self):
            return moe.kv_bytes_per_token(self)
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.kv_bytes_per_element

    @property
    def params_per_layer(self) -> int:
        """A decoder layer's parameters (a MoE or MLA model's: the mean over its layers, every expert counted)."""
        if moe.is_sparse(self):
            return self.linear_params // self.num_layers
        h, d = self.hidden_size, self.head_size
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, k, v
        return attn + 3 * h * self.intermediate_size + 2 * h  # SwiGLU gate/up/down + two RMSNorms

    @property
    def linear_params(self) -> int:
        """The decoder layers' parameters (not embeddings or lm_head): what every token multiplies through in a dense
        model; every expert of a MoE (active_linear_params: a token's share)."""
        if moe.is_sparse(self):
            return moe.decoder_params(self).total
        return self.num_layers * self.params_per_layer

    @property
    def active_linear_params(self) -> int:
        """Decoder parameters one token multiplies through (a MoE's top-k experts, not all)."""
        return moe.decoder_params(self).active if moe.is_sparse(self) else self.linear_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through, embedding and LM head included (num_params for a dense model)."""
        return moe.active_params(self) if moe.is_sparse(self) else self.num_params

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

    @property
    def weight_bytes(self) -> float:
        """Decoder layers at weight_dtype (2:4 sparse weights stored dense); embeddings and lm_head stay in the
        activation dtype."""
        return self.weight_bytes_on(False)

    def weight_bytes_on(self, sparse_kernels: bool) -> float:
        """weight_bytes on hardware with (True) or without 2:4 sparse kernels."""
        act = BYTES_PER_PARAM[self.act_dtype]
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.linear_params * self.bytes_per_linear_param(sparse_kernels) + \
            (self.embedding_params + lm_head) * act


def _spec(name, layers, hidden, heads, kv_heads, inter, vocab, max_pos, **kw) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max_pos, **kw)


# Numbers from each model's public config.json.
MODEL_CATALOG: dict[str, ModelSpec] = {m.name: m for m in [
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
          weight_dtype="bf16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    _spec("Qwen3-235B-A22B", 94, 4096, 64, 4, 12288, 151936, 40960, head_dim=128, rope_theta=1e6,
          weight_dtype="bf16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    _spec("DeepSeek-V3", 61, 7168, 128, 128, 18432, 129280, 163840, head_dim=192, weight_dtype="fp8",
          num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
          first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
          v_head_dim=128),
]}


def catalog_model(name: str, key_path: str = "model") -> ModelSpec:
    """Look a model up by name, case-insensitively."""
    for known, spec in MODEL_CATALOG.items():
        if known.lower() == name.lower():
            return spec
    raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(MODEL_CATALOG)}, an explicit "
                      "architecture, or {hf_config: path/to/config.json}", key_path)


MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KB
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}


# config.json key -> ModelSpec field, for the keys read from it (errors name the file's key, not the spec's)
HF_KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
           "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
           "tie_word_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta"}
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# the decoders the simulator prices: llama-shaped (Mistral-7B is in the catalog), and the mixtures of experts and
# latent attention below; others differ in layers (biases, other activations) or keys, and would be priced as
# something they are not
DENSE_MODEL_TYPES = ("llama", "mistral")
# a mixture of experts' config.json key -> ModelSpec field, by model_type
_MOE_KEYS = {"num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
             "norm_topk_prob": "norm_topk_prob"}
_QWEN_MOE = {**_MOE_KEYS, "num_experts": "num_experts", "decoder_sparse_step": "decoder_sparse_step",
             "mlp_only_layers": "mlp_only_layers", "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
_DEEPSEEK = {**_MOE_KEYS, "n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
             "first_k_dense_replace": "first_k_dense_replace", "kv_lora_rank": "kv_lora_rank",
             "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim",
             "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim"}
MOE_HF_KEYS = {"mixtral": {**_MOE_KEYS, "num_local_experts": "num_experts"}, "qwen2_moe": _QWEN_MOE,
               "qwen3_moe": _QWEN_MOE, "deepseek_v2": _DEEPSEEK, "deepseek_v3": _DEEPSEEK}
HF_MODEL_TYPES = DENSE_MODEL_TYPES + tuple(MOE_HF_KEYS)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_BOOL_KEYS = ("tie_word_embeddings", "norm_topk_prob")
# a quantized checkpoint's bits -> the weight_dtype that serves it
_QUANT_DTYPES = {4: "int4", 8: "int8"}


class UnsupportedModel(ValueError):
    """A config.json of a model the simulator does not model; its message says what is allowed."""


def _check_supported(config: dict, weight_dtype: str | None) -> None:
    """Refuse what would be priced as something it is not: experts in a config whose model_type has none, another
    model_type, DeepSeek's MoE layers at another frequency, and quantized weights whose serving dtype the scenario
    does not say (fp8 checkpoints serve as fp8)."""
    model_type = config.get("model_type")
    if model_type is not None and model_type not in HF_MODEL_TYPES:
        raise UnsupportedModel(f"model_type {repr(model_type)[:40]} is not modelled; allowed: "
                               f"{', '.join(HF_MODEL_TYPES)}")
    if model_type not in MOE_HF_KEYS:
        for key in _EXPERT_KEYS:
            experts = config.get(key)
            if experts is not None and not (type(experts) is int and experts <= 1):
                raise UnsupportedModel(f"{key} {repr(experts)[:40]}: mixture-of-experts in a "
                                       f"{model_type or 'llama'} config; allowed: model_type "
                                       f"{', '.join(MOE_HF_KEYS)}")
    freq = config.get("moe_layer_freq", 1)
    if model_type in ("deepseek_v2", "deepseek_v3") and freq != 1:
        raise UnsupportedModel(f"moe_layer_freq {repr(freq)[:20]}: MoE layers at another frequency are not "
                               "modelled; allowed: 1")
    quant = config.get("quantization_config")
    if quant is not None and weight_dtype is None and _served(quant) != "fp8":
        raise UnsupportedModel(f"quantized checkpoint ({_quantization(quant)}); allowed: model.weight_dtype "
                               f"{_served(quant)} (how it is served) beside hf_config, not its torch_dtype")


def _quantization(quant) -> str:
    """A quantization_config in a few words: its method and bits."""
    if not isinstance(quant, dict):
        return f"quantization_config {repr(quant)[:30]}"
    bits = quant.get("bits", quant.get("w_bit"))
    return f"{str(quant.get('quant_method', 'unknown method'))[:30]}" + (f", {str(bits)[:10]} bits" if bits else "")


def _served(quant) -> str:
    """The weight_dtype that most likely serves a quantized checkpoint."""
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return "fp8"
    bits = quant.get("bits", quant.get("w_bit")) if isinstance(quant, dict) else None
    return _QUANT_DTYPES.get(bits, "int4 or int8") if type(bits) is int else "int4 or int8"


def _hf_value(config: dict, key: str):
    """A config.json value as the file types it: whole numbers for counts, a number for rope_theta, true/false for
    tie_word_embeddings and norm_topk_prob, a list of layer numbers for mlp_only_layers (transformers loads nothing
    else; "64" or "false" used to pass here and fail there)."""
    v = config[key]
    whole = isinstance(v, int) and not isinstance(v, bool)
    if key in _BOOL_KEYS:
        ok, what = isinstance(v, bool), "true or false"
    elif key == "rope_theta":
        ok, what = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
    elif key == "mlp_only_layers":
        ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        what = "a list of layer numbers"
    else:
        ok, what = whole, "a whole number"
    if not ok:
        raise ValueError(f"{key} {repr(v)[:40]}: {what}")
    return v


def _moe_fields(config: dict) -> dict:
    """The MoE and latent-attention fields of a mixture of experts' config.json (none for a dense model_type)."""
    keys = MOE_HF_KEYS.get(config.get("model_type"), {})
    fields = {f: _hf_value(config, k) for k, f in keys.items() if config.get(k) is not None}
    if fields.get("shared_expert_intermediate_size") and config.get("model_type") == "qwen2_moe":
        fields["shared_expert_gate"] = True  # Qwen2-MoE's shared_expert_gate: hidden -> 1, a sigmoid
    if fields.get("kv_lora_rank") and config.get("head_dim") is None:  # a query head meets a key in nope + rope
        fields["head_dim"] = fields.get("qk_nope_head_dim", 0) + fields.get("qk_rope_head_dim", 0) or None
    return fields


def model_from_hf_config(config: dict, name: str = "hf-model", weight_dtype: str | None = None) -> ModelSpec:
    """Build a ModelSpec from the dict of a Hugging Face config.json (llama family, Mixtral, Qwen2/3-MoE,
    DeepSeek-V2/V3); ValueError naming the file's key for a value missing, mistyped or out of the spec's bounds.
    `weight_dtype`: how it is served, instead of the file's torch_dtype (an fp8 checkpoint: fp8)."""
    if not isinstance(config, dict):
        raise ValueError(f"a JSON object, not a {type(config).__name__}")
    _check_supported(config, weight_dtype)
    missing = [k for k in _HF_REQUIRED if config.get(k) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    rope = config.get("rope_parameters")  # transformers >= 5 keeps rope_theta there
    if config.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        config = {**config, "rope_theta": rope["rope_theta"]}
    if config.get("num_key_value_heads") is None:
        config = {**config, "num_key_value_heads": config["num_attention_heads"]}
    fields = {HF_KEYS[k]: _hf_value(config, k) for k in HF_KEYS if config.get(k) is not None}
    fields = {**fields, **_moe_fields(config)}
    dtype = config.get("torch_dtype") or config.get("dtype") or "float16"
    if weight_dtype is None and config.get("quantization_config") is not None:
        weight_dtype = "fp8"  # _check_supported let only fp8 checkpoints through without a weight_dtype
    if weight_dtype is None and (not isinstance(dtype, str) or dtype not in _DTYPES):  # read as fp16, it priced other weights' bytes unannounced
        raise ValueError(f"torch_dtype {repr(dtype)[:40]}: one of {', '.join(_DTYPES)}, or the model's "
                         "weight_dtype set beside hf_config")
    try:
        return ModelSpec(name=name, weight_dtype=weight_dtype or _DTYPES[dtype], **fields)
    except ValidationError as e:
        err = e.errors()[0]
        field = err["loc"][0] if err["loc"] else None
        keys = {**HF_KEYS, **MOE_HF_KEYS.get(config.get("model_type"), {})}
        key = next((k for k, f in keys.items() if f == field), None)
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"{key} {err.get('input')!r}: {msg}" if key else msg) from None


def load_hf_config(path: Path, key_path: str = "model.hf_config", weight_dtype: str | None = None) -> ModelSpec:
    """Read a config.json file (or a folder holding one) into a ModelSpec."""
    path = path / "config.json" if path.is_dir() else path
    try:
        if path.exists() and (not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES):  # /dev/zero never ends
            raise ConfigError(f"{path} is not a Hugging Face config.json (not a regular file of at most "
                              f"{MAX_CONFIG_BYTES // 2**20} MiB)", key_path)
        config = json.loads(path.read_text())
        return model_from_hf_config(config, name=path.parent.name or "hf-model", weight_dtype=weight_dtype)
    except FileNotFoundError:
        raise ConfigError(f"file not found: {path}; expected a Hugging Face config.json", key_path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path} ({type(e).__name__})", key_path) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{path} is not a usable llama-family config.json ({type(e).__name__}: {e}); "
                          "needs num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, "
                          "vocab_size", key_path) from None
    except UnsupportedModel as e:
        raise ConfigError(f"{path}: {e}", key_path) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}; allowed: a llama-family, Mixtral, Qwen-MoE or DeepSeek config.json (whole num_hidden_layers, hidden_size, "
                          "num_attention_heads, intermediate_size, vocab_size)", key_path) from None

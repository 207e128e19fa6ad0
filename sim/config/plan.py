"""The resolved plan: a scenario with names looked up, every default filled in and the memory budget worked
out. Every layer reads its knobs from here, never from the raw scenario again."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from sim.config.client import ResolvedClient, resolve_client
from sim.config.engines import (
    INFERSIM_DEFAULTS,
    INFERSIM_STEP_TOKENS,
    EngineConfig,
    EngineProfile,
    cuda_graph_sizes,
    default_engine_name,
    front_end,
    release,
    serving_defaults,
)
from sim.config.errors import ConfigError
from sim.config.expert_parallel import ExpertLayout, expert_layout
from sim.config.hardware import HARDWARE_CATALOG, HardwareSpec, catalog_hardware, has_kernels, measured_devices
from sim.config.memory import Layout, memory_budget
from sim.config.models import ModelSpec, WeightDtype, catalog_model
from sim.config.scenario import (
    CostModelConfig,
    ExecutorConfig,
    KVCacheConfig,
    Scenario,
    ServingConfig,
    SLOConfig,
    SpeculativeConfig,
    parse_scenario,
    validation_error,
)
from sim.config.sharding import Sharding, shard
from sim.config.workload import WorkloadConfig
from sim.config.yaml_file import read_yaml

if TYPE_CHECKING:
    from sim.config.kv_groups import KVGroups
    from sim.config.profile import ProfileFile


@dataclass(frozen=True, repr=False)
class SchedulerConfig:
    """The serving knobs the scheduler reads, resolved (`make_plan` derives the step budget and lengths)."""

    batching: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    prefill_chunk_size: int
    waiting_served_ratio: float | None
    max_waiting_tokens: int | None
    max_model_len: int
    preemption: str
    batch_size: int
    num_speculative_tokens: int  # most drafts a row verifies per step (0: no speculative decoding)
    speculative_disable_by_batch_size: int | None  # vLLM: no drafts while more requests decode
    max_queue_len: int | None  # admission bound: waiting requests past which an arrival is rejected
    max_queue_delay_s: float | None  # admission bound: a request not started this long after arriving is rejected
    mixed_batches: bool = True  # prompts run in the decodes' steps; False: a step that prefills runs prompts alone
    reserve_output: bool = False  # admit only what fits to its last output token (TRT-LLM's GUARANTEED_NO_EVICT)


# vLLM turns chunked prefill on by default past this context (engine args, V0; V1 always): a step budget of a whole
# 128k-token prompt reserves ~11 GiB of activations for Llama-3.1-8B
LONG_CONTEXT = 32768
DEFAULT_STEP_TOKENS = INFERSIM_STEP_TOKENS
INFERSIM_MAX_NUM_SEQS = INFERSIM_DEFAULTS["serving"]["max_num_seqs"]


def _default(cls, name: str):
    return cls.model_fields[name].default


def scheduler_config(max_model_len: int, step_tokens: int = DEFAULT_STEP_TOKENS, **knobs: Any) -> SchedulerConfig:
    """The scheduler's knobs resolved: those not given take the scenario schema's defaults (ServingConfig,
    KVCacheConfig; infersim's where the schema leaves them to the engine; no speculative decoding), and the step
    budget (`step_tokens` with chunked prefill, else at least max_model_len) and prompt chunk follow the same rules as
    a scenario's (the one place they are written). For plans and for offline engines (profile sweeps, benches)."""
    unknown = set(knobs) - set(SchedulerConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown scheduler knobs {sorted(unknown)}")
    k = {name: knobs.get(name, _default(ServingConfig, name)) for name in
         ("batching", "max_num_seqs", "enable_chunked_prefill", "waiting_served_ratio", "max_waiting_tokens",
          "batch_size", "max_queue_len", "max_queue_delay_s", "mixed_batches", "reserve_output")}
    if k["max_num_seqs"] is None:
        k["max_num_seqs"] = INFERSIM_MAX_NUM_SEQS
    if k["enable_chunked_prefill"] is None:
        k["enable_chunked_prefill"] = k["batching"] == "continuous" and max_model_len > LONG_CONTEXT
    if k["mixed_batches"] is None:  # infersim, and vLLM V0 before it: a whole prompt runs alone
        k["mixed_batches"] = k["enable_chunked_prefill"]
    k["reserve_output"] = bool(k["reserve_output"])
    budget = knobs.get("max_num_batched_tokens") or \
        (step_tokens if k["enable_chunked_prefill"] else max(max_model_len, step_tokens))
    chunk = min(knobs.get("prefill_chunk_size") or budget, budget)
    return SchedulerConfig(**k, max_num_batched_tokens=budget, prefill_chunk_size=chunk, max_model_len=max_model_len,
                           preemption=knobs.get("preemption", _default(KVCacheConfig, "preemption")),
                           num_speculative_tokens=knobs.get("num_speculative_tokens", 0),
                           speculative_disable_by_batch_size=knobs.get("speculative_disable_by_batch_size"))


@dataclass(frozen=True, repr=False)
class CostPlan:
    """The step-cost model: its source ("profile", "kernels": the GPU kernel model, "roofline"), the roofline's
    parameters, the host overheads the scenario set (None: the source's own), or a fitted profile (read and checked)."""

    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float | None
    per_seq_overhead_s: float | None
    profile: ProfileFile | None
    profile_scale: float
    source: str = "roofline"
    refinement: dict | None = None  # the profile's refinement of the GPU kernel model, where it prices the steps
    expert_load_imbalance: float = 1.0  # a MoE's busiest expert (or expert-parallel rank) over the mean


@dataclass(eq=False, repr=False)
class Plan:
    """A scenario with names resolved, defaults filled in and the memory budget worked out."""

    name: str
    model: ModelSpec
    model_checkpoint: Path | None  # `model: {hf_config: ...}`: the folder of its weights, for the executor
    hardware: HardwareSpec
    base_dir: Path
    replicas: int
    router: str
    scheduler: SchedulerConfig
    sharding: Sharding  # one device's share of each layer in its tensor-parallel group
    # DP ranks of tensor_parallel_size devices each, experts whole over EP ranks or sliced (sim/config/expert_parallel.py)
    expert_layout: ExpertLayout
    sequence_parallel: bool
    pipeline_parallel_size: int  # stages; a replica has tensor_parallel_size x pipeline_parallel_size devices
    virtual_engines: int  # batches a pipelined replica keeps in flight, each its own scheduler and num_blocks
    kv_bytes_per_token: float  # on one device of a replica (its share of the KV heads)
    kv_allocator: str  # paged | contiguous
    enable_prefix_caching: bool
    kv_watermark: float
    weight_bytes: float
    activation_bytes: float
    kv_cache_bytes: float
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    workload: WorkloadConfig
    slo: SLOConfig
    cost: CostPlan
    executor: ExecutorConfig
    speculative: SpeculativeConfig | None
    source: dict[str, Any]  # the scenario as validated (JSON form): echoed in reports, the base of `replan`
    # disaggregated: the prefill and decode pools, each resolved as a plan of its own; the plan's own replica fields
    # are the decode pool's
    pools: Pools | None = None
    engine: EngineProfile | None = None  # the serving engine the plan runs on, resolved
    # a hybrid model's KV cache groups by attention kind (sim/config/kv_groups.py); None: one group of every layer
    kv_groups: KVGroups | None = None
    client: ResolvedClient | None = None  # workload.client, resolved (_client_of)

    @property
    def devices_per_replica(self) -> int:
        return self.sharding.tp * self.pipeline_parallel_size * self.expert_layout.data_parallel_size

    @property
    def largest_stage_layers(self) -> int:
        """The largest pipeline stage's share of the layers (the one `kv_bytes_per_token` covers)."""
        return largest_stage(self.model.num_layers, self.pipeline_parallel_size)

    @property
    def block_bytes(self) -> float:
        """One KV block on one device: block_size tokens of its layers' K/V, or a hybrid model's group of pages."""
        return self.kv_groups.block_bytes if self.kv_groups is not None else self.block_size * self.kv_bytes_per_token

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """K/V bytes per token and layer on one device (its share of the KV heads)."""
        return self.kv_bytes_per_token / self.largest_stage_layers


@dataclass(eq=False, repr=False)
class Pools:
    """A disaggregated cluster: each pool as a plan of its own, and the KV-transfer link between them."""

    prefill: Plan
    decode: Plan
    kv_bandwidth: float  # bytes/s between one device of a prefill replica and its counterpart in a decode replica
    kv_latency_s: float

    @property
    def kv_links(self) -> int:
        """Device pairs a transfer spreads over: each device of the smaller replica sends or takes its shard."""
        return min(p.sharding.tp * p.pipeline_parallel_size for p in (self.prefill, self.decode))

    def transfer_s(self, num_tokens: int) -> float:
        """Time to move `num_tokens` tokens of KV from a prefill replica to a decode replica."""
        kv_bytes = num_tokens * self.prefill.model.kv_bytes_per_token
        return kv_bytes / (self.kv_bandwidth * self.kv_links) + self.kv_latency_s


POOL_KEYS = ("replicas", "hardware", "router", "parallel", "serving", "kv_cache", "cost_model")


def _pool_scenario(scenario: Scenario, name: str) -> Scenario:
    """The scenario one pool runs: the pool's keys over the scenario's (serving and kv_cache key by key)."""
    pool = getattr(scenario.pools, name)
    kv = scenario.kv_cache if pool.kv_cache is None else KVCacheConfig.model_validate(
        {**scenario.kv_cache.model_dump(), **pool.kv_cache.model_dump(exclude_unset=True)})
    cost = scenario.cost_model if pool.cost_model is None else CostModelConfig.model_validate(
        {**scenario.cost_model.model_dump(), **pool.cost_model.model_dump(exclude_unset=True)})
    return scenario.model_copy(update={
        "replicas": pool.replicas, "hardware": pool.hardware if pool.hardware is not None else scenario.hardware,
        "router": pool.router or scenario.router, "parallel": pool.parallel or scenario.parallel,
        "serving": scenario.pools_serving(name), "kv_cache": kv, "cost_model": cost, "pools": None})


def _make_pools(scenario: Scenario, base_dir: Path) -> Plan:
    """The plan of a disaggregated scenario: each pool resolved as a plan, errors located in the pool."""
    plans = {}
    for name in ("prefill", "decode"):
        try:
            plans[name] = make_plan(_pool_scenario(scenario, name), base_dir)
        except ConfigError as e:
            where = e.key_path
            if where.split(".")[0].split("[")[0] in POOL_KEYS:
                where = f"pools.{name}.{where}"
            raise ConfigError(e.message, where, e.file) from None
    p, d = plans["prefill"], plans["decode"]
    if d.scheduler.max_model_len < p.scheduler.max_model_len:
        raise ConfigError(f"{d.scheduler.max_model_len} is less than the prefill pool's {p.scheduler.max_model_len}: a "
                          "request the prefill pool admits must fit a decode instance",
                          "pools.decode.serving.max_model_len")
    link = scenario.pools.kv_transfer
    bandwidth = link.bandwidth or min(p.hardware.interconnect_bandwidth, d.hardware.interconnect_bandwidth)
    latency = link.latency_s if link.latency_s is not None else \
        max(p.hardware.interconnect_latency_s, d.hardware.interconnect_latency_s)
    # a pool's sections keep only the keys it set: resolved again (replan) they still override key by key
    source = {**scenario.model_dump(mode="json"), "pools": scenario.pools.model_dump(mode="json", exclude_unset=True)}
    return replace(d, name=scenario.name, source=source, pools=Pools(p, d, bandwidth, latency))


def _cost_source(c: CostModelConfig, hw: HardwareSpec, profile: ProfileFile | None) -> str:
    """What prices the plan's steps: the profile (its linear fit, or on the GPU it was measured on its refinement of
    the GPU kernel model where that was closer on the held-out steps), the GPU kernel model where the device's kernels
    were measured, or the roofline (cost_model.type: auto, kernels or roofline)."""
    if profile is not None:
        refined = profile.kernels if profile.kernels and profile.kernels["device"] == hw.name and has_kernels(hw) \
            else None
        if c.type == "kernels" and refined is None:
            raise ConfigError(f"{profile.path} refines no kernel model of {hw.name}; allowed: a profile measured on "
                              "that GPU (`infersim profile --device cuda`), or type auto", "cost_model.type")
        if c.type == "roofline":
            raise ConfigError("a profile names its own step costs; allowed: type auto or kernels with a profile, or "
                              "no profile for the roofline", "cost_model.type")
        better = refined is not None and refined["heldout"]["mape"] < profile.data["fit"]["heldout"]["mape"]
        return "kernels" if c.type == "kernels" or (c.type == "auto" and better) else "profile"
    if c.type == "roofline":
        return "roofline"
    if has_kernels(hw):
        return "kernels"
    if c.type == "kernels":
        raise ConfigError(f"no measured kernels for {hw.name!r}; allowed: a catalog device among "
                          f"{', '.join(measured_devices())} (at the catalog's rates), or type auto / roofline",
                          "cost_model.type")
    return "roofline"


def _resolve(raw: str | dict, kind: str, lookup, spec_cls):
    if isinstance(raw, str):
        return lookup(raw, kind)
    raw = dict(raw)
    base = raw.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"a catalog name, not {type(base).__name__} {str(base)[:40]!r}", f"{kind}.base")
    merged = {**(lookup(base, f"{kind}.base").model_dump() if base else {}), **raw}
    try:
        return spec_cls.model_validate(merged)
    except ValidationError as e:
        raise validation_error(e, spec_cls, kind) from None


def resolve_hardware(raw: str | dict) -> HardwareSpec:
    """The device a scenario names: a catalog entry, an explicit spec, or a catalog entry with overrides."""
    return _resolve(raw, "hardware", catalog_hardware, HardwareSpec)


CHECKPOINT_OVERRIDES = ("weight_dtype", "kv_dtype", "sparsity")  # keys a checkpoint's model may set beside hf_config


def resolve_model(raw: str | dict, base_dir: Path) -> tuple[ModelSpec, Path | None]:
    """The model's architecture, and the folder of its checkpoint where the scenario names one."""
    if isinstance(raw, dict) and "hf_config" in raw:
        from sim.config.hf_config import load_hf_config  # a checkpoint's config.json: most scenarios name none

        extra = set(raw) - {"hf_config", *CHECKPOINT_OVERRIDES}
        if extra:
            raise ConfigError(f"unknown key {sorted(extra)[0]!r} beside hf_config; allowed: hf_config, "
                              f"{', '.join(CHECKPOINT_OVERRIDES)}", "model")
        path = base_dir / str(raw["hf_config"])
        served = raw.get("weight_dtype")  # replaces the file's torch_dtype (checked with the other overrides below)
        spec = load_hf_config(path, weight_dtype=served if served in get_args(WeightDtype) else None)
        overrides = {k: raw[k] for k in CHECKPOINT_OVERRIDES if k in raw}
        if overrides:  # how the checkpoint is served compressed: validated as the catalog's entries are
            try:
                spec = ModelSpec.model_validate({**spec.model_dump(), **overrides})
            except ValidationError as e:
                raise validation_error(e, ModelSpec, "model") from None
        return spec, path.parent if path.suffix == ".json" else path
    return _resolve(raw, "model", catalog_model, ModelSpec), None


def make_plan(scenario: Scenario, base_dir: Path = Path(".")) -> Plan:
    """Resolve names and check the deployment is possible (the model fits, the KV cache holds a request)."""
    if scenario.pools is not None:
        return _make_pools(scenario, base_dir)
    model, checkpoint = resolve_model(scenario.model, base_dir)
    hw = resolve_hardware(scenario.hardware)
    given = _engine_config(scenario, hw)
    r = release(given.name, given.version)
    scenario, assumed = _with_engine_defaults(scenario, r, hw)
    kv = scenario.kv_cache
    scheduler = _scheduler_of(scenario, model, _step_tokens(scenario, r, hw))
    layout = _layout_of(scenario, model, r.all2all_backend)
    if layout.expert.exchanges and model.num_experts and scenario.parallel.all2all_backend is None:
        assumed = {**assumed, "parallel.all2all_backend": layout.expert.all2all_backend}
    memory = memory_budget(model, hw, kv, layout, scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
                           scheduler.max_model_len, of_free=r.memory_of_free)
    if memory.kv_groups is not None:
        _check_hybrid(scenario, model, memory.kv_groups, scheduler)
    engine = _engine_profile(scenario, given, r, hw, scheduler, layout.sharding.tp, assumed)
    cost = _cost_plan(scenario.cost_model, base_dir, model, hw, layout)
    # a replica's data-parallel ranks run as one engine over DP times a rank's batch and blocks
    scheduler, num_blocks, swap_blocks = layout.expert.replica_engine(scheduler, memory.num_blocks,
                                                                      memory.num_swap_blocks)
    return Plan(name=scenario.name, model=model, model_checkpoint=checkpoint, hardware=hw, base_dir=base_dir,
                replicas=scenario.replicas, router=scenario.router, scheduler=scheduler,
                sharding=layout.sharding, sequence_parallel=layout.sequence_parallel,
                pipeline_parallel_size=layout.pipeline_parallel_size, virtual_engines=layout.virtual_engines,
                kv_bytes_per_token=memory.kv_bytes_per_token, kv_allocator=kv.allocator,
                enable_prefix_caching=kv.enable_prefix_caching,
                kv_watermark=kv.watermark, weight_bytes=memory.weight_bytes, activation_bytes=memory.activation_bytes,
                kv_cache_bytes=memory.kv_cache_bytes, block_size=memory.block_size, num_blocks=num_blocks,
                num_swap_blocks=swap_blocks, workload=scenario.workload, slo=scenario.slo, cost=cost,
                executor=scenario.executor, speculative=scenario.speculative, source=scenario.model_dump(mode="json"),
                expert_layout=layout.expert, engine=engine, kv_groups=memory.kv_groups,
                client=_client_of(scenario, engine))


def _client_of(scenario: Scenario, engine: EngineProfile) -> ResolvedClient | None:
    """Who sends the workload and the time between it and the engine (sim/config/client.py): workload.client, or a
    closed loop's with no think time (a fixed-concurrency benchmark's), through the engine's front end where it has
    one calibrated; else none."""
    return resolve_client(scenario.workload, engine.front_end)


def _check_hybrid(scenario: Scenario, model: ModelSpec, groups: KVGroups, scheduler: SchedulerConfig) -> None:
    """What a hybrid model's groups are not simulated with: static batching (each row reserves its whole length in
    every group, which no window frees), and with linear-attention layers speculative decoding (its states per
    draft); and what vLLM's prefix caching of linear-attention states needs (its mamba "align" mode: chunked
    prefill, chunks of at least a block)."""
    kinds = ", ".join(k.kind for k in groups.kinds if k.kind != "full")
    if scenario.serving.batching == "static":
        raise ConfigError(f"{model.name} has {kinds} layers, whose KV groups (vLLM's hybrid KV cache manager) free "
                          "blocks as windows move, which static batching's whole-length reservations do not; "
                          "allowed: continuous", "serving.batching")
    if not any(k.kind == "linear" for k in groups.kinds):
        return
    if scenario.speculative is not None:
        raise ConfigError(f"{model.name}'s linear-attention state per draft token is not modelled; allowed: no "
                          "speculative section", "speculative")
    if scenario.kv_cache.enable_prefix_caching and not scheduler.enable_chunked_prefill:
        raise ConfigError(f"prefix caching of {model.name}'s linear-attention states cuts prompt chunks at block "
                          "boundaries (vLLM's mamba 'align' mode requires chunked prefill); allowed: true",
                          "serving.enable_chunked_prefill")
    if scenario.kv_cache.enable_prefix_caching and scheduler.prefill_chunk_size < groups.block_size:
        raise ConfigError(f"{scheduler.prefill_chunk_size} tokens is less than a block of {groups.block_size} (raised "
                          f"to hold {model.name}'s linear-attention state): prefix caching cuts prompt chunks to whole "
                          "blocks; allowed: at least that", "serving.prefill_chunk_size")


def _engine_config(scenario: Scenario, hw: HardwareSpec) -> EngineConfig:
    """The engine the scenario names (a name is its newest release), or the default for its device and costs."""
    if scenario.engine is not None:
        return scenario.engine
    return EngineConfig(name=default_engine_name(hw.name, scenario.cost_model.profile is not None))


def _with_engine_defaults(scenario: Scenario, r, hw: HardwareSpec) -> tuple[Scenario, dict]:
    """The scenario with the serving and KV-cache keys it left out taken from the engine release, and which those
    were ({"section.key": value}). Static batching (no engine's policy) keeps infersim's; a contiguous cache shares
    no blocks."""
    sv, kv = scenario.serving, scenario.kv_cache
    defaults = serving_defaults(r, hw.memory_gib, hw.name) if sv.batching == "continuous" else INFERSIM_DEFAULTS
    skip = {"max_num_batched_tokens"}  # a step budget: the scheduler's rule (_step_tokens)
    if kv.allocator == "contiguous":
        skip |= {"enable_prefix_caching", "block_size"}
    assumed, updates = {}, {}
    for section, config in (("serving", sv), ("kv_cache", kv)):
        fill = {k: v for k, v in defaults.get(section, {}).items() if k not in skip and getattr(config, k) is None}
        if section == "kv_cache":  # infersim's where the engine has none to give (a contiguous cache)
            fill |= {k: v for k, v in INFERSIM_DEFAULTS["kv_cache"].items() if getattr(config, k) is None and
                     k not in fill}
        if section == "serving" and sv.mixed_batches is None and r.engine != "infersim":
            fill["mixed_batches"] = r.mixed_batches
        assumed |= {f"{section}.{k}": v for k, v in fill.items()}
        updates[section] = config.model_copy(update=fill)
    if scenario.router == "cache_aware" and not updates["kv_cache"].enable_prefix_caching:
        raise ConfigError("cache_aware routes by what each replica's prefix cache holds, and "
                          "kv_cache.enable_prefix_caching is off; allowed: turn it on, or another router", "router")
    return scenario.model_copy(update=updates), assumed


def _step_tokens(scenario: Scenario, r, hw: HardwareSpec) -> int:
    """The step budget the engine takes with chunked prefill when the scenario sets none (without it, at least
    max_model_len)."""
    if scenario.serving.batching != "continuous":
        return INFERSIM_STEP_TOKENS
    return serving_defaults(r, hw.memory_gib, hw.name).get("serving", {}).get("max_num_batched_tokens",
                                                                              INFERSIM_STEP_TOKENS)


def _engine_profile(scenario: Scenario, given: EngineConfig, r, hw: HardwareSpec, scheduler: SchedulerConfig,
                    tp: int, assumed: dict) -> EngineProfile:
    """The engine as the plan runs it: its CUDA graph sizes (none on the CPU, or eager), all-reduce and scheduling."""
    graphs = given.cuda_graphs if given.cuda_graphs is not None else \
        (scenario.executor.cuda_graphs if r.engine == "infersim" else True)
    sizes = cuda_graph_sizes(r, scheduler.max_num_seqs, scheduler.max_num_batched_tokens, tp,
                             given.max_cuda_graph_batch) if graphs and hw.name != "cpu" else ()
    budget = scheduler.max_num_batched_tokens
    if scheduler.batching == "continuous" and "serving.max_num_batched_tokens" not in assumed \
            and scenario.serving.max_num_batched_tokens is None:
        assumed = {**assumed, "serving.max_num_batched_tokens": budget}
    custom = given.custom_all_reduce if given.custom_all_reduce is not None else r.custom_all_reduce
    asynchronous = given.async_scheduling if given.async_scheduling is not None else r.async_scheduling
    return EngineProfile(r, sizes, custom, asynchronous, assumed, front_end(r.engine) if hw.name != "cpu" else None)


def _scheduler_of(scenario: Scenario, model: ModelSpec, step_tokens: int = DEFAULT_STEP_TOKENS) -> SchedulerConfig:
    """The scheduler's knobs, checked against the model's positions and each other."""
    sv, spec = scenario.serving, scenario.speculative
    max_model_len = sv.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:  # vLLM refuses it too: positions past those are untrained
        raise ConfigError(f"max_model_len {max_model_len} exceeds {model.name}'s max_position_embeddings "
                          f"({model.max_position_embeddings}); allowed: at most that, or a model spec with more "
                          "positions", "serving.max_model_len")
    scheduler = scheduler_config(
        max_model_len, step_tokens, **sv.model_dump(exclude={"max_model_len"}), preemption=scenario.kv_cache.preemption,
        num_speculative_tokens=spec.num_draft_tokens if spec else 0,
        speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else None)
    budget = scheduler.max_num_batched_tokens
    if sv.prefill_chunk_size is not None and not scheduler.enable_chunked_prefill:
        why = "static batching" if sv.batching == "static" else \
            f"max_model_len {max_model_len} (on by default past {LONG_CONTEXT})"
        raise ConfigError(f"applies with chunked prefill, which is off under {why}; a whole prompt runs in one step "
                          "without it", "serving.prefill_chunk_size")
    if sv.batching == "continuous" and not scheduler.enable_chunked_prefill and budget < max_model_len:
        raise ConfigError(f"{budget} is smaller than max_model_len ({max_model_len}); without chunked prefill "
                          "a whole prompt must fit one step: raise it or set enable_chunked_prefill: true",
                          "serving.max_num_batched_tokens")
    if sv.batching == "continuous" and budget < scheduler.max_num_seqs and scheduler.enable_chunked_prefill:
        raise ConfigError(f"{budget} is smaller than max_num_seqs ({scheduler.max_num_seqs}); every running "
                          "sequence must be able to decode in one step", "serving.max_num_batched_tokens")
    return scheduler


def _layout_of(scenario: Scenario, model: ModelSpec, all2all_backend: str) -> Layout:
    """How a replica splits the model: tensor-parallel sharding, pipeline stages and batches in flight, checked."""
    par = scenario.parallel
    try:
        sharding = shard(model, par.tensor_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e), "parallel.tensor_parallel_size") from None
    pp = par.pipeline_parallel_size
    engines = par.virtual_engines or pp
    if pp > model.num_layers:
        raise ConfigError(f"{pp} stages for the {model.num_layers} layers of {model.name}; allowed: at most "
                          f"{model.num_layers}", "parallel.pipeline_parallel_size")
    if engines > pp:
        raise ConfigError(f"{engines} batches in flight through {pp} stages; allowed: 1..{pp} (one per stage fills "
                          "the pipeline)", "parallel.virtual_engines")
    return Layout(sharding, par.sequence_parallel, pp, engines, largest_stage(model.num_layers, pp), scenario.replicas,
                  expert_layout(model, par, all2all_backend))


def largest_stage(num_layers: int, pp: int) -> int:
    """The largest pipeline stage's share of the layers, which sizes every device."""
    return -(-num_layers // pp)


def _cost_plan(c: CostModelConfig, base_dir: Path, model: ModelSpec, hw: HardwareSpec, layout: Layout) -> CostPlan:
    """What prices the steps; a profile is read now, so that a bad one is reported against the scenario naming it."""
    profile = None
    if c.profile:
        from sim.config.profile import read_profile  # a fitted profile's reader: most scenarios name none

        profile = read_profile(base_dir / c.profile, model)
        _check_profile_layout(profile, layout.sharding.tp, layout.pipeline_parallel_size,
                              layout.expert.enable_expert_parallel)
    source = _cost_source(c, hw, profile)
    refined = profile.kernels["refinement"] if source == "kernels" and profile is not None else None
    return CostPlan(c.compute_efficiency, c.memory_efficiency, c.step_overhead_s, c.per_seq_overhead_s, profile,
                    c.profile_scale, source, refined, c.expert_load_imbalance)


def _check_profile_layout(profile: ProfileFile, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """A profile prices this layout: it was measured through it, or on one device with what composing needs (a
    mixture of experts' only through its layout)."""
    key = "parallel.tensor_parallel_size" if tp > 1 else "parallel.pipeline_parallel_size"
    if profile.parallel != (1, 1) and profile.parallel != (tp, pp):
        raise ConfigError(f"{profile.path} was measured through tensor x pipeline parallel {profile.parallel[0]} x "
                          f"{profile.parallel[1]}, not {tp} x {pp}; allowed: a profile of that layout or of one "
                          "device", key)
    if profile.expert_parallel != expert_parallel and profile.parallel == (tp, pp) and tp * pp > 1:
        said = "with" if profile.expert_parallel else "without"
        raise ConfigError(f"{profile.path} was measured {said} expert parallelism; allowed: a profile measured "
                          f"through this layout (`infersim profile --scenario`)", "parallel.enable_expert_parallel")
    if tp * pp > 1 and profile.parallel == (1, 1) and profile.data.get("model", {}).get("num_experts"):
        raise ConfigError(f"{profile.path} was measured on one device; a mixture of experts' parallel steps are priced "
                          "by a profile measured through their layout (`infersim profile --scenario`), or without "
                          "a profile", key)
    if tp * pp > 1 and profile.parallel == (1, 1):  # composed (sim/cost/parallel.py)
        if tp > 1 and pp > 1:
            raise ConfigError("a fitted profile prices tensor or pipeline parallelism, not both; allowed: the roofline "
                              "(no cost_model.profile) for both", key)
        if profile.forward is None or profile.comm is None:
            raise ConfigError(f"{profile.path} has no forward fit or communication measurements, which pricing "
                              "parallel steps needs; profile again (`infersim profile`), or use the roofline", key)
        need = ("message_gloo", "all_reduce_shm", "gather_shm") if tp > 1 else ("send_gloo",)
        missing = [op for op in need if op not in profile.comm]
        if missing:
            raise ConfigError(f"{profile.path} has no {', '.join(missing)} measurement (comm.fit), which pricing "
                              "this layout's steps needs; profile again (`infersim profile`), or use the roofline", key)


def check_profile_device(plan: Plan) -> None:
    """For a simulation: a profile measured on the CPU does not price a GPU's steps, nor a GPU's the CPU's (a CPU
    profile on an H100 priced every step at the CPU's speed and the H100's price, without a word). Not in make_plan:
    validation predicts an executor run on whatever device it ran on, with the scenario's hardware only its label."""
    for name, p in [("prefill", plan.pools.prefill), ("decode", plan.pools.decode)] if plan.pools else [("", plan)]:
        profile, hw = p.cost.profile, p.hardware
        host = profile.data.get("host") if profile is not None else None
        measured = str(host.get("device", "")) if isinstance(host, dict) else ""
        gpu = hw.name in HARDWARE_CATALOG and hw.name != "cpu"
        if (measured == "cpu" and gpu) or (measured.startswith("cuda") and hw.name == "cpu"):
            where = host.get("gpu") or host.get("cpu") or measured
            raise ConfigError(f"{profile.path} was measured on {measured} ({str(where)[:40]}), and hardware is "
                              f"{hw.name}; allowed: a profile measured on that device (`infersim profile`), or none "
                              "(the roofline)", f"pools.{name}.cost_model.profile" if name else "cost_model.profile")


def plan_of(data: dict, base_dir: Path = Path(".")) -> Plan:
    """A plan from a scenario mapping (as a YAML file would hold it)."""
    return make_plan(parse_scenario(data), base_dir)


def replan(plan: Plan, **sections: Any) -> Plan:
    """The same scenario with whole top-level sections replaced (e.g. `speculative=None`), resolved again."""
    return plan_of({**plan.source, **sections}, plan.base_dir)


def load_scenario(path: str | Path) -> tuple[Scenario, Plan]:
    """Read, validate and resolve a scenario YAML file; every problem is a one-line ConfigError."""
    path = Path(path)
    data = read_yaml(path)
    try:
        scenario = parse_scenario(data)
        return scenario, make_plan(scenario, path.parent)
    except ConfigError as e:
        raise e.with_file(str(path)) from None

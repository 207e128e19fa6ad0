"""The scenario a user writes (YAML, pydantic v2, unknown keys are errors) and its resolution."""

from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from sim.config.engines import All2AllBackend, EngineConfig
from sim.config.errors import ConfigError
from sim.config.limits import MAX_REPLICAS
from sim.config.schema_base import ON_USE, OnUse, StrictModel
from sim.config.workload import WorkloadConfig

RouterName = Literal["round_robin", "least_outstanding", "cache_aware", "session"]  # sim.policy.router's routers


class ServingConfig(StrictModel):
    """Scheduler knobs, named as vLLM and TGI name them."""

    batching: Literal["continuous", "static"] = "continuous"
    batch_size: PositiveInt = Field(8, description="static batching: requests per batch")
    max_num_seqs: PositiveInt | None = Field(None, description="most sequences running at once; default: the "
                                             "engine's (vLLM: 1024 on a GPU of 70 GiB or more but an A100, else 256; "
                                             "SGLang 1024; TensorRT-LLM 2048; infersim 256)")
    max_num_batched_tokens: PositiveInt | None = Field(
        None, description="token budget of one step; default: the engine's (vLLM 8192 on a GPU of 70 GiB or more but "
        "an A100, else 2048; SGLang's chunked_prefill_size; TensorRT-LLM 8192; infersim 2048), at least "
        "max_model_len without chunked prefill")
    enable_chunked_prefill: bool | None = Field(
        None, description="split prompts across steps; default: the engine's (vLLM and SGLang on, TensorRT-LLM off; "
        "infersim: on under continuous batching when max_model_len is over 32,768, else off)")
    reserve_output: bool | None = Field(
        None, description="admit a request only if the KV blocks of its whole length (prompt and max_tokens) fit "
        "beside the running requests' whole lengths, so none is ever preempted (TensorRT-LLM's GUARANTEED_NO_EVICT "
        "capacity scheduler); false: admit on the prompt's blocks and preempt when decodes outgrow the cache (vLLM, "
        "SGLang). Default: the engine's (TensorRT-LLM on, the others off)")
    mixed_batches: bool | None = Field(None, description="prompts (or their chunks) run in the same step as the "
                                       "decodes; false: a step that prefills runs prompts alone and the decodes wait "
                                       "(SGLang, vLLM V0). Default: the engine's (vLLM and TensorRT-LLM on, SGLang "
                                       "off; infersim: on with chunked prefill)")
    prefill_chunk_size: PositiveInt | None = Field(
        None, description="most prompt tokens of one request per step (default: the step budget)")
    waiting_served_ratio: NonNegativeFloat | None = Field(
        None, description="TGI: admit waiting requests into a running batch only when at least "
                          "ratio x running of them can be admitted; null admits whenever one fits (vLLM)")
    max_waiting_tokens: PositiveInt | None = Field(
        None, description="TGI: after this many decode steps the waiting requests are admitted regardless")
    max_model_len: PositiveInt | None = Field(None, description="default: the model's max_position_embeddings")
    max_queue_len: PositiveInt | None = Field(
        None, description="admission bound: a request that arrives while this many wait is rejected ('queue full'), "
                          "as a server answers 429; null: the queue is unbounded")
    max_queue_delay_s: PositiveFloat | None = Field(
        None, description="admission bound: a request still waiting to start this long after it arrived is "
                          "rejected ('queue timeout'); null: requests wait as long as it takes")


class KVCacheConfig(StrictModel):
    """KV cache allocator and its memory budget, named as vLLM names them."""

    allocator: Literal["paged", "contiguous"] = "paged"
    block_size: PositiveInt | None = Field(None, description="tokens a KV block holds; default: the engine's "
                                          "(vLLM 16, SGLang 16: its one-token pages in blocks, TensorRT-LLM 32, "
                                          "infersim 16)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="share of the device's memory the "
                                                 "engine may use (TensorRT-LLM: of what weights and activations "
                                                 "leave); default: the engine's (vLLM 0.9, 0.92 from 0.22; SGLang "
                                                 "0.88; TensorRT-LLM 0.9; infersim 0.9)")
    watermark: float = Field(0.01, ge=0, lt=1, description="fraction of blocks kept free at admission")
    preemption: Literal["recompute", "swap"] = "recompute"
    swap_space_gib: NonNegativeFloat = Field(4.0, le=1e6)  # past it the swap block count overflows to NaN
    num_blocks: PositiveInt | None = Field(None, description="override the computed block count")
    enable_prefix_caching: bool | None = Field(None, description="vLLM's automatic prefix caching: full prompt "
                                               "blocks stay in the cache, and a prompt that begins alike reuses them "
                                               "instead of computing them (paged blocks, continuous batching); "
                                               "default: the engine's (vLLM, SGLang, TensorRT-LLM on; infersim off)")



class SLOConfig(StrictModel):
    ttft_s: PositiveFloat | None = None
    tpot_s: PositiveFloat | None = None
    e2e_s: PositiveFloat | None = Field(None, description="end-to-end latency, arrival to last token (vLLM's e2el)")
    quantile: float = Field(0.9, gt=0, le=1, description="the SLO holds if this quantile meets each target")


class CostModelConfig(StrictModel):
    """Step-cost model. With `profile`, a model fitted to measured steps (`infersim profile`); else, on a GPU whose
    kernels were measured, the GPU kernel model (measured GEMMs, attention, elementwise passes and NCCL collectives);
    else the roofline: max(compute, memory) per operator group at the datasheet's rates times the efficiencies."""

    type: Literal["auto", "kernels", "roofline"] = Field(
        "auto", description="auto: the profile if given, else the GPU kernel model where the device's kernels were "
        "measured, else the roofline; kernels: require the kernel model; roofline: the roofline even where kernels "
        "were measured")
    compute_efficiency: float = Field(0.6, ge=0.001, le=1, description="roofline: achieved / peak FLOP/s in matmuls")
    memory_efficiency: float = Field(0.8, ge=0.001, le=1, description="roofline: achieved / peak memory bandwidth")
    step_overhead_s: float | None = Field(None, ge=0, le=60, description="fixed host cost of one engine step "
                                          "(scheduling, launch); default: the roofline's 2 ms, the kernel model's "
                                          "126 µs (vLLM, as BLIS fitted it)")
    per_seq_overhead_s: float | None = Field(None, ge=0, le=60, description="host cost per sequence in the step (input "
                                             "prep, sampling); default: the roofline's 20 µs, the kernel model's 4.4 µs")
    profile: str | None = Field(None, min_length=1, description="a calibration profile JSON (relative to the "
                                "scenario file)")
    profile_scale: float = Field(1.0, ge=1e-3, le=1e3, description="multiply the profile's step times (a slower or faster "
                                 "machine of the same kind)")
    expert_load_imbalance: float = Field(1.0, ge=1, le=64, description="mixture of experts: the busiest expert's "
                                         "tokens over the mean of the experts a step touches (and with expert "
                                         "parallelism the busiest rank's over the mean rank's); 1: uniform routing")


class ExecutorConfig(StrictModel):
    """How `infersim serve` runs the scenario on real hardware (the simulator ignores it)."""

    attention: Literal["naive", "sdpa", "flash", "paged"] = "sdpa"
    threads: PositiveInt | None = Field(None, le=4096, description="torch CPU threads (per process with tensor or pipeline "
                                                          "parallelism); default: all cores, shared among the processes")
    temperature: NonNegativeFloat = Field(0.0, description="0 is greedy (so is anything below 1e-5, as in vLLM)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, le=2**63 - 1, description="torch's sampling generator takes a 64-bit seed")
    ignore_eos: bool = Field(True, description="generate exactly each request's output length")
    max_kv_cache_gib: PositiveFloat = Field(4.0, le=1e6, description="refuse to allocate a bigger KV cache")
    cuda_graphs: bool = Field(True, description="on a GPU, replay plain decode steps from captured CUDA graphs "
                                                "(vLLM's default; false: every step eager, vLLM's enforce_eager)")
    random_weights: bool = Field(False, description="serve the scenario's model architecture with seeded random "
                                 "weights (executor.seed) instead of real ones: for timing a shape no checkpoint here "
                                 "has; the outputs are noise, so keep ignore_eos")
    keep_warm: bool = Field(True, description="on a CPU, keep torch's threads busy through the idle gaps of an online "
                            "serve while no other process needs the cores (a serving engine's busy-poll: threads "
                            "left to sleep wake slowly for the next step); false: sleep until the next arrival")


MEDUSA_TOPK = 10  # candidates per Medusa head and per EAGLE tree node (executor.speculative.medusa.TOPK)


def check_tree(tree: list[tuple[int, ...]], num_heads: int, topk: int) -> None:
    """A Medusa candidate tree: non-empty paths of candidate ranks, each one's parent listed before it."""
    seen: set = {()}
    for p in tree:
        if not p or len(p) > num_heads or any(not 0 <= r < topk for r in p):
            raise ValueError(f"tree node {list(p)}: a path of 1..{num_heads} ranks, each in 0..{topk - 1}")
        if p[:-1] not in seen or p in seen:
            raise ValueError(f"tree node {list(p)}: its parent must come before it, and each node once")
        seen.add(p)


HEAD_METHODS = ("eagle", "mtp")  # drafters of one decoder layer over the target's hidden states
CandidateTree = list[list[NonNegativeInt]]  # each node the path of candidate ranks from the root, parents first
RankProbs = list[list[NonNegativeFloat]]  # per depth, the chance of each candidate rank, the last entry none of them


def _drafter_folder(methods: str, command: str, shipped: str) -> Any:
    """The Field of a trained drafter's folder key (medusa_heads, eagle_head)."""
    return Field(None, min_length=1, description=f"{methods}: folder written by `infersim {command}` (relative to "
                 f"the scenario; default: the {shipped} shipped for SmolLM2-135M)")


def _candidate_tree(methods: str, default: str) -> Any:
    """The Field of a tree drafter's candidate tree key (medusa_tree, eagle_tree)."""
    return Field(None, description=f"{methods}: the candidate tree, each node the path of candidate ranks from the "
                 f"root, parents first, e.g. [[0], [1], [0, 0]]; {default}")


def _rank_probs(methods: str, per: str, chain: str) -> Any:
    """The Field of a tree drafter's measured rank probabilities key (medusa_rank_probs, eagle_rank_probs)."""
    return Field(None, description=f"simulator, {methods}: per {per}, the chance the token that follows has each "
                 f"candidate rank, the last entry none of them{chain} (`infersim serve` measures it); required to "
                 "simulate")


def _draft_seconds(what: str) -> Any:
    """The Field of a drafter's measured time key (draft_s_per_step, _per_seq, _per_token): at most a minute."""
    return Field(0.0, le=60, description=f"simulator: the drafter's time {what}; `infersim serve` measures it")


class SpeculativeConfig(StrictModel):
    """Speculative decoding (vLLM's speculative_config): each step a drafter proposes up to
    num_speculative_tokens tokens for every decoding request and the target model checks them all in
    that step, keeping the accepted prefix plus one token of its own."""

    model_config = ON_USE

    method: Literal["ngram", "draft_model", "medusa", "eagle", "mtp"] = Field(
        "ngram", description="ngram: prompt lookup, drafts copied from the prompt and the text so far; "
                             "draft_model: a small model distilled from the target (`infersim distill`); "
                             "medusa: heads on the target's last hidden state, a candidate tree verified with "
                             "tree attention (`infersim train-medusa`); eagle: one decoder layer over the target's "
                             "hidden states and its own last token, chained a step per draft (`infersim "
                             "train-eagle`); mtp: a checkpoint's multi-token-prediction layers, the same drafter "
                             "(on the executor the trained EAGLE head stands in: no model it runs carries them)")
    num_speculative_tokens: PositiveInt = Field(5, le=64, description="γ: most drafts verified per request per step")
    prompt_lookup_max: PositiveInt = Field(3, description="ngram: longest n-gram matched")
    prompt_lookup_min: PositiveInt = Field(1, description="ngram: shortest n-gram matched")
    draft_model: str | None = Field(None, min_length=1, description="draft_model: folder written by `infersim distill` (relative "
                                    "to the scenario; default ~/.cache/infersim/drafts/smollm2-135m)")
    medusa_heads: str | None = _drafter_folder("medusa", "train-medusa", "heads")
    medusa_tree: CandidateTree | None = _candidate_tree("medusa", "required; verify rows have 1 + its nodes tokens")
    medusa_rank_probs: RankProbs | None = _rank_probs("medusa", "depth", "")
    eagle_head: str | None = _drafter_folder("eagle, mtp", "train-eagle", "head")
    eagle_tree: CandidateTree | None = _candidate_tree("eagle, mtp", "default: the chain of num_speculative_tokens")
    eagle_rank_probs: RankProbs | None = _rank_probs("eagle and mtp", "draft position (tree depth)",
                                                     "; a row's first entry is that position's acceptance in a chain")
    disable_by_batch_size: PositiveInt | None = Field(None, description="no drafts while more than this many "
                                                      "requests decode (vLLM's speculative_disable_by_batch_size): "
                                                      "a big batch is compute-bound, drafts cost more than they save")
    acceptance_rate: float | None = Field(None, ge=0, le=1, description="simulator: α, the chance each draft is "
                                          "accepted (`infersim serve` measures it); required to simulate")
    proposal_rate: float = Field(1.0, ge=0, le=1, description="simulator: fraction of steps a request gets "
                                 "drafts (prompt lookup finds no match in the rest)")
    request_rates: list[tuple[Annotated[float, Field(ge=0, le=1)], Annotated[float, Field(ge=0, le=1)]]] | None = \
        Field(None, description="simulator, ngram and draft_model: [proposal_rate, acceptance_rate] of each request "
                                "of a calibration serve (`infersim serve` writes them: report.json "
                                "speculative.request_rates); each simulated request takes one pair for its life, so "
                                "requests differ as on the executor (prompt lookup: one that copies its prompt "
                                "drafts often and keeps most, one that does not rarely); instead of the two rates")
    draft_s_per_step: NonNegativeFloat = _draft_seconds("in a step it runs for, whatever its batch and whether it "
                                                        "finds drafts (ngram: the search; draft_model: its γ forward "
                                                        "passes)")
    draft_s_per_seq: NonNegativeFloat = _draft_seconds("per drafting request per step (ngram: a search in the "
                                                       "request's tokens; draft_model: its share of the γ forward "
                                                       "passes)")
    draft_s_per_token: NonNegativeFloat = _draft_seconds("per token its model catches up on (draft_model: a "
                                                         "request's whole context at its first draft, then the "
                                                         "tokens decoded since its last)")
    draft_s_reference_step: NonNegativeFloat = Field(0.0, le=60, description="simulator: the draft_s_* times are at the "
                                                     "speed of a profile whose one-row decode step at context 256 "
                                                     "takes this long (`infersim serve --profile` writes it: the "
                                                     "times divided by the serve's own speed against that "
                                                     "profile); the simulator scales them by its own cost model's "
                                                     "time for that step, so the drafter follows the profile's "
                                                     "speed as the target's steps do. 0: the times as given")
    verify_cost_ratio: float = Field(1.0, ge=1e-3, le=1e3, description="simulator: a verify step's forward over the cost "
                                             "model's prediction for its shape (`infersim serve --profile` "
                                             "measures it, scaled by how fast the serve's plain decode steps ran; "
                                             "a candidate tree's masked attention costs more than chain rows)")

    @model_validator(mode="after")
    def _check_ngram(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        for key, methods in (("medusa_tree", ("medusa",)), ("medusa_rank_probs", ("medusa",)),
                             ("medusa_heads", ("medusa",)), ("draft_model", ("draft_model",)),
                             ("eagle_head", HEAD_METHODS), ("eagle_tree", HEAD_METHODS),
                             ("eagle_rank_probs", HEAD_METHODS)):
            if getattr(self, key) is not None and self.method not in methods:  # it would be ignored without a word
                raise ValueError(f"{key} applies to method {' or '.join(methods)}, not {self.method}")
        if self.request_rates and self.acceptance_rate is not None:
            raise ValueError("request_rates replace acceptance_rate and proposal_rate; allowed: one or the other")
        if 0 < self.draft_s_reference_step < 1e-6:  # the draft times are scaled by step / reference: it would explode
            raise ValueError(f"draft_s_reference_step {self.draft_s_reference_step} s; allowed: 0 (the times as "
                             "given) or a step time of at least 1e-6 s")
        if self.method == "medusa":
            if not self.medusa_tree:
                raise ValueError("method medusa needs medusa_tree (e.g. [[0], [1], [0, 0]])")
            _check_rank_probs("medusa", self.medusa_tree, self.medusa_rank_probs)
        if self.method in HEAD_METHODS:
            if self.eagle_tree is not None and "num_speculative_tokens" in self.model_fields_set \
                    and self.num_speculative_tokens != len(self.eagle_tree):
                raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens} but eagle_tree has "
                                 f"{len(self.eagle_tree)} nodes; allowed: one of the two (a tree's drafts are its nodes)")
            _check_rank_probs("eagle", self.candidate_tree, self.eagle_rank_probs)
        if self.request_rates and self.method not in ("ngram", "draft_model"):
            raise ValueError(f"request_rates is for ngram and draft_model ({self.method}: {self.rank_probs_key})")
        return self

    @property
    def candidate_tree(self) -> list[tuple[int, ...]] | None:
        """The drafts' tree as paths of candidate ranks: Medusa's tree, EAGLE's (default: the chain of γ, each
        position its head's first candidate); None for drafters whose drafts are a plain sequence."""
        if self.method == "medusa":
            return [tuple(p) for p in self.medusa_tree]
        if self.method in HEAD_METHODS:
            if self.eagle_tree is not None:
                return [tuple(p) for p in self.eagle_tree]
            return [(0,) * d for d in range(1, self.num_speculative_tokens + 1)]
        return None

    @property
    def rank_probs_key(self) -> str | None:
        """The key of the measured per-depth rank probabilities a tree drafter is simulated with."""
        return {"medusa": "medusa_rank_probs", "eagle": "eagle_rank_probs", "mtp": "eagle_rank_probs"}.get(self.method)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens a verify row carries at most: γ, or a candidate tree's nodes."""
        tree = self.candidate_tree
        return self.num_speculative_tokens if tree is None else len(tree)


def _check_rank_probs(name: str, tree: list | None, rank_probs: list[list[float]] | None) -> None:
    """A candidate tree (name_tree) and its per-depth rank probabilities (name_rank_probs), if given: a row per depth,
    each a distribution over MEDUSA_TOPK ranks and a miss."""
    depth = max(len(p) for p in tree)
    check_tree([tuple(p) for p in tree], depth, MEDUSA_TOPK)
    if rank_probs is None:
        return
    if len(rank_probs) < depth:
        raise ValueError(f"{name}_rank_probs needs a row per tree depth ({depth}), got {len(rank_probs)}")
    for row in rank_probs:
        if not row or len(row) > MEDUSA_TOPK + 1 or max(row) > 1 or not 0 < sum(row) <= 1.01:
            raise ValueError(f"each {name}_rank_probs row is a probability distribution over at most "
                             f"{MEDUSA_TOPK} ranks and a miss (values in 0..1, summing to 1)")


class ParallelConfig(StrictModel):
    """How one replica spreads over devices (vLLM's names)."""

    tensor_parallel_size: PositiveInt = Field(1, le=64, description="devices a replica's layers are split across "
                                              "(Megatron-style: heads and MLP columns/rows); two all-reduces a layer")
    sequence_parallel: bool = Field(False, description="with tensor parallelism: the norm and residual regions "
                                    "split by tokens too (reduce-scatter + all-gather instead of all-reduce)")
    pipeline_parallel_size: PositiveInt = Field(1, le=64, description="stages a replica's layers are split into, "
                                                "each on its own tensor-parallel group of devices")
    data_parallel_size: PositiveInt = Field(1, le=64, description="attention data-parallel ranks in a replica "
                                                                  "(vLLM's --data-parallel-size); their tokens meet "
                                                                  "in a mixture of experts' MoE layers")
    enable_expert_parallel: bool = Field(False, description="experts sharded whole over the replica's tensor × "
                                                            "data parallel devices (all-to-all dispatch), instead of "
                                                            "each expert sliced over them (all-gather and "
                                                            "reduce-scatter across data-parallel ranks)")
    all2all_backend: All2AllBackend | None = Field(None, description="with expert parallelism across data-parallel "
                                                   "ranks: the MoE layers' dispatch/combine (vLLM's "
                                                   "--all2all-backend): allgather_reducescatter (every token's "
                                                   "hidden state gathered, outputs reduce-scattered), or an "
                                                   "all-to-all of the routed rows, one per expert (all_to_all, "
                                                   "deepep_low_latency) or per rank (deepep_high_throughput); "
                                                   "default: the engine's")
    virtual_engines: PositiveInt | None = Field(None, le=64, description="with pipeline parallelism: batches in "
                                                "flight (vLLM: one per stage; fewer leave stages idle: the bubble); "
                                                "each has its own scheduler and share of the KV blocks")

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> "ParallelConfig":
        if self.sequence_parallel and self.tensor_parallel_size == 1:  # it would change nothing, without a word
            raise ValueError("sequence_parallel splits a tensor-parallel group's norms; allowed: with "
                             "tensor_parallel_size of 2 or more")
        if self.all2all_backend not in (None, "allgather_reducescatter") and not self.enable_expert_parallel:
            raise ValueError(f"all2all_backend {self.all2all_backend} sends routed rows to experts held whole; "
                             "allowed: with enable_expert_parallel true, or allgather_reducescatter")
        return self


class PoolConfig(StrictModel):
    """One pool of a disaggregated cluster (DistServe, Splitwise): its own devices, count, parallelism, serving knobs
    and router. Keys left out take the scenario's; `serving` and `kv_cache` override only the keys they set."""

    model_config = ON_USE

    replicas: PositiveInt = Field(1, le=MAX_REPLICAS, description="instances in the pool")
    hardware: str | dict[str, Any] | None = Field(None, description="default: the scenario's hardware")
    router: RouterName | None = Field(None, description="which instance of the pool "
                                                                       "takes a request; default: the scenario's")
    parallel: ParallelConfig | None = Field(None, description="default: the scenario's parallel")
    serving: ServingConfig | None = Field(None, description="keys set here override the scenario's serving")
    kv_cache: KVCacheConfig | None = Field(None, description="keys set here override the scenario's kv_cache")
    cost_model: CostModelConfig | None = Field(None, description="keys set here override the scenario's cost_model "
                                               "(a pool on other hardware prices its steps with its own profile)")


class KVTransferConfig(StrictModel):
    """The link a finished prefill's KV crosses to its decode instance (one per device pair of the two replicas)."""

    model_config = ON_USE  # only a disaggregated scenario makes one: built then, not at import

    bandwidth: float | None = Field(None, ge=1e6, le=1e15, description="bytes/s per device pair; default: the slower "
                                    "pool hardware's interconnect_bandwidth")
    latency_s: NonNegativeFloat | None = Field(None, le=60, description="per transfer; default: the pools' "
                                               "interconnect_latency_s")


class PoolsConfig(StrictModel):
    """Disaggregated serving: prompts run on the prefill pool, which hands each request with its KV to a decode
    instance once that has memory for it; the decode pool generates the rest of the output."""

    model_config = ON_USE

    prefill: PoolConfig
    decode: PoolConfig
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)  # no instance at import


DEFAULT_SECTIONS = ("parallel", "serving", "kv_cache", "slo", "cost_model", "executor")


class Scenario(StrictModel):
    """One deployment and its traffic: everything `infersim run` needs."""

    name: str = "scenario"
    description: str = ""
    model: str | dict[str, Any] = Field(description="catalog name, explicit architecture, {base: NAME, ...} "
                                                    "overrides, or {hf_config: path}")
    hardware: str | dict[str, Any] = Field(description="catalog name, explicit spec, or {base: NAME, ...}")
    replicas: PositiveInt = Field(1, le=MAX_REPLICAS)
    engine: EngineConfig | None = Field(
        None, description="the serving engine: vllm, sglang, trtllm or infersim (the project's executor), or "
        "{name, version, cuda_graphs, max_cuda_graph_batch, custom_all_reduce, async_scheduling}; the serving and "
        "kv_cache keys left out take its defaults. Default: infersim where a profile prices the steps or on the "
        "cpu, else vllm")
    router: RouterName = Field(
        "round_robin", description="which replica an arrival goes to: in turn, the least loaded, cache_aware "
        "(the replica caching the longest prefix of its prompt; SGLang's and vLLM's router's policy), or session "
        "(a conversation's turns to one replica, by consistent hashing; the vLLM production stack's)")
    parallel: ParallelConfig = ParallelConfig()
    serving: ServingConfig = ServingConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    workload: WorkloadConfig
    slo: SLOConfig = SLOConfig()
    cost_model: CostModelConfig = CostModelConfig()
    executor: ExecutorConfig = ExecutorConfig()
    speculative: Annotated[SpeculativeConfig | None, OnUse()] = None
    pools: Annotated[PoolsConfig | None, OnUse()] = Field(None, description="disaggregated prefill and decode pools instead of one "
                                      "replica set (then replicas is set per pool)")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_by_name(cls, value: Any) -> Any:
        """`engine: vllm` is `engine: {name: vllm}` (its newest release)."""
        if isinstance(value, str):
            return {"name": value}
        if value is not None and not isinstance(value, dict):
            raise ValueError("expected an engine name (vllm, sglang, trtllm, infersim) or a mapping of keys")
        return value

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """A section written with every key commented out (`serving:` alone: null in YAML) is the section's
        defaults, as `speculative:` and `pools:` alone are none."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in DEFAULT_SECTIONS)}
        return data

    @model_validator(mode="after")
    def _check_static(self) -> "Scenario":
        _check_serving_keys(self.serving, "serving")
        if self.serving.batching == "static" and self.serving.enable_chunked_prefill:
            raise ValueError("serving.enable_chunked_prefill needs batching: continuous")
        for where, kv in [("kv_cache", self.kv_cache)] + [(f"pools.{n}.kv_cache", self.pools_kv(n)) for n in
                                                          (("prefill", "decode") if self.pools else ())]:
            if kv.enable_prefix_caching and kv.allocator == "contiguous":
                raise ValueError(f"{where}.enable_prefix_caching shares paged blocks; allowed with allocator: paged")
        routers = [("router", self.router, self.kv_cache)] + [
            (f"pools.{n}.router", getattr(self.pools, n).router or self.router, self.pools_kv(n))
            for n in (("prefill", "decode") if self.pools else ())]
        for where, router, kv in routers:
            if router == "cache_aware" and kv.enable_prefix_caching is False:  # unset: the engine's (make_plan)
                raise ValueError(f"{where}: cache_aware routes by what each replica's prefix cache holds, and "
                                 "kv_cache.enable_prefix_caching is off; allowed: turn it on, or another router")
        if self.serving.batching == "static" and self.kv_cache.enable_prefix_caching:
            raise ValueError("kv_cache.enable_prefix_caching needs batching: continuous")
        if self.serving.batching == "static" and self.speculative:
            raise ValueError("speculative decoding needs batching: continuous")
        spec = self.speculative
        if spec is not None and spec.method in HEAD_METHODS and self.kv_cache.enable_prefix_caching:
            raise ValueError(f"speculative.method {spec.method}: its head keeps no prefix cache of its own, so a "
                             "prompt served from kv_cache's prefix cache has no hidden states to draft from; allowed: "
                             "one of the two")
        # Medusa's drafts always go through tree attention; EAGLE's only where its tree branches (else a chain)
        branches = spec is not None and (spec.method == "medusa" or spec.method in HEAD_METHODS
                                         and any(p != (0,) * len(p) for p in spec.candidate_tree))
        if branches and self.executor.attention not in ("sdpa", "naive"):
            raise ValueError(f"{'Medusa' if spec.method == 'medusa' else 'a candidate tree'}'s tree attention runs on "
                             "executor.attention sdpa or naive")
        if self.pools is not None:
            if self.replicas != 1:
                raise ValueError("with pools, replicas is set per pool (pools.prefill.replicas, pools.decode.replicas)")
            for name in ("prefill", "decode"):
                sv = self.pools_serving(name)
                _check_serving_keys(sv, f"pools.{name}.serving")
                if sv.batching == "static":
                    raise ValueError(f"pools.{name}: disaggregated pools need batching: continuous")
            if self.speculative is not None:
                raise ValueError("speculative decoding with pools is not supported yet; allowed: one of the two")
        return self

    def pools_kv(self, name: str) -> KVCacheConfig:
        """The KV cache of pool `name`: the scenario's, with the keys the pool sets overriding them."""
        return self._pool_section(name, "kv_cache")

    def pools_serving(self, name: str) -> ServingConfig:
        """The serving knobs of pool `name`: the scenario's, with the keys the pool sets overriding them."""
        return self._pool_section(name, "serving")

    def _pool_section(self, name: str, section: str):
        ours, own = getattr(self, section), getattr(getattr(self.pools, name), section)
        if own is None:
            return ours
        return type(ours).model_validate({**ours.model_dump(), **own.model_dump(exclude_unset=True)})


# serving keys that only one batching mode, or only another key, reads: set where nothing reads them, the run would
# silently be the run without them
CONTINUOUS_ONLY = ("max_num_seqs", "max_num_batched_tokens", "waiting_served_ratio", "max_waiting_tokens")


def _check_serving_keys(sv: ServingConfig, where: str) -> None:
    # a key at its default changes nothing either way (and dumped scenarios carry every default)
    given = {k for k, f in ServingConfig.model_fields.items() if getattr(sv, k) != f.default}
    if sv.batching == "static":
        ignored = [k for k in CONTINUOUS_ONLY if k in given]
        if ignored:
            raise ValueError(f"{where}.{ignored[0]} applies to batching: continuous; static batching reads batch_size")
    elif "batch_size" in given:
        raise ValueError(f"{where}.batch_size applies to batching: static; continuous batching reads max_num_seqs")
    # unset, chunked prefill is the plan's to decide (on past a long context)
    if "prefill_chunk_size" in given and sv.enable_chunked_prefill is False:
        raise ValueError(f"{where}.prefill_chunk_size applies with enable_chunked_prefill: true (a whole prompt "
                         "runs in one step without it)")
    if "max_waiting_tokens" in given and sv.waiting_served_ratio is None:
        raise ValueError(f"{where}.max_waiting_tokens applies with waiting_served_ratio (TGI's admission gate), "
                         "which is not set")


def _loc_to_path(loc: list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _members(ann) -> list | None:
    """The alternatives of a union annotation (Annotated and Optional unwrapped), else None."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) not in (Union, UnionType):
        return None
    out = []
    for a in get_args(ann):
        if a is not type(None):
            out.extend(_members(a) or [a])
    return out


def _tag_member(members: list, part: str):
    """The union member a pydantic location part names: a discriminator value or a type name."""
    for m in members:
        if isinstance(m, type) and issubclass(m, BaseModel):
            for f in m.model_fields.values():
                if get_origin(f.annotation) is Literal and part in get_args(f.annotation):
                    return m
    return None


def _walk(cls: type[BaseModel], loc: tuple) -> tuple[list, object]:
    """Follow a pydantic error location through the schema: the user's key path (union member names
    and discriminator tags dropped) and the type found at its end."""
    path: list = []
    cur: object = cls
    for part in loc:
        members = _members(cur)
        models = [m for m in members or () if isinstance(m, type) and issubclass(m, BaseModel)]
        if len(models) == 1 and part in models[0].model_fields:  # a key, though a tag may share its name
            cur, members = models[0], None
        if members is not None:
            tagged = _tag_member(members, part) if isinstance(part, str) else None
            if tagged is not None or (isinstance(part, str) and not part.isidentifier()) or part in (
                    "str", "int", "float", "bool", "list", "dict"):
                cur = tagged
                continue
            models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
            cur = models[0] if len(models) == 1 else None  # an optional section: its model
        if isinstance(part, int):
            path.append(part)
            args = get_args(cur)
            cur = args[0] if args else None
        elif isinstance(cur, type) and issubclass(cur, BaseModel) and part in cur.model_fields:
            path.append(part)
            cur = cur.model_fields[part].annotation
        else:
            path.append(part)
            cur = None
    return path, cur


def _short(value, limit: int = 60) -> str:
    """A value as the error shows it: its repr, cut (an expanded alias can be megabytes)."""
    text = repr(value) if not isinstance(value, (list, tuple)) or len(value) < 20 else \
        f"a list of {len(value)} items"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def validation_error(e: ValidationError, cls: type[BaseModel], prefix: str = "") -> ConfigError:
    """Turn pydantic's report into one line: key path, what is wrong, what is allowed."""
    err = e.errors()[0]
    path, _ = _walk(cls, err["loc"])
    where = ".".join(p for p in (prefix, _loc_to_path(path)) if p)
    if err["type"] == "extra_forbidden":
        _, parent = _walk(cls, err["loc"][:-1])
        members = _members(parent)
        if members:
            parent = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
        allowed = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        if prefix in ("model", "hardware") and not path[:-1]:
            allowed.append("base")
        return ConfigError(f"unknown key; allowed: {', '.join(allowed)}", where)
    if err["type"] == "missing":
        return ConfigError("required key is missing", where)
    if err["type"] in ("string_type", "dict_type") and path in (["model"], ["hardware"]):
        return ConfigError("expected a catalog name or a mapping of keys", where)
    got = err.get("input")
    got_txt = "" if isinstance(got, dict) or got is None else f" (got {_short(got)})"
    msg = err["msg"].removeprefix("Value error, ")
    return ConfigError(msg + got_txt, where)


def parse_scenario(data: Any) -> Scenario:
    """Validate a scenario dict (already parsed from YAML)."""
    if data is None:
        raise ConfigError("the scenario is empty; it needs at least model, hardware and workload")
    if not isinstance(data, dict):
        raise ConfigError(f"a scenario is a mapping of keys; got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, Scenario) from None

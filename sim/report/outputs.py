"""The report contract: report.json, requests.csv, plots and a console table, for sim and executor alike."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sim.config.errors import ConfigError
from sim.config.plan import Plan
from sim.cost.build import describe_cost
from sim.report.definitions import describe as describe_definitions
from sim.report.metrics import RequestRecords, compute_metrics, measured, per_request_latency, summarize
from sim.report.stages import stage_sections, stages_table
from sim.report.text_table import text_table

GiB = 2**30


def kv_usage(samples: np.ndarray, num_blocks: int, block_size: int) -> dict[str, float]:
    """Time-weighted KV use of one replica from its (time, running, used blocks, stored tokens, waiting)
    samples, taken at engine events (a run of identical decode steps is one event);
    `reserved_unused` is the reserved-but-unused share (what paging removes)."""
    if len(samples) < 2:
        return {"mean": 0.0, "reserved_unused": 0.0}
    a = samples
    dt = np.diff(a[:, 0])
    used = a[:-1, 2]
    total = dt.sum()
    if total <= 0:
        return {"mean": 0.0, "reserved_unused": 0.0}
    reserved = used * block_size
    unused = np.where(reserved > 0, 1 - a[:-1, 3] / np.maximum(reserved, 1), 0.0)
    busy = dt * (used > 0)
    return {"mean": float((used / num_blocks * dt).sum() / total),
            "reserved_unused": float((unused * busy).sum() / busy.sum()) if busy.sum() > 0 else 0.0}


def client_section(limit: int, records: RequestRecords, duration: float) -> dict:
    """report.json's max_concurrency section: how many requests waited at the client for a slot, how long (over every
    arrived request, 0 for those sent on time), and the requests in flight on average (Little's law)."""
    wait = records.client_wait_s if records.client_wait_s is not None else np.zeros(len(records.id))
    return {"limit": limit, "requests_waited": int((wait > 0).sum()), "client_wait_s": summarize(wait),
            "mean_in_flight": mean_in_flight(records, duration)}


def transport_section(client, records: RequestRecords) -> dict:
    """report.json's client section: the tool, its transport's means, the warm-up requests (left out of every other
    figure) and the time each measured request spent between client and engine, in and out (the engine's TTFT is
    the report's less both)."""
    measured = ~records.warmup if records.warmup is not None else np.ones(len(records.id), bool)
    warm = ~measured
    done = records.completed & measured
    return {**client.describe(), "warmup_completed": int((records.completed & warm).sum()),
            "warmup_rejected": int((~records.completed & warm).sum()),
            "in_s": summarize(records.client_in_s[measured]), "out_s": summarize(records.client_out_s[done]),
            "close_s": summarize((records.stream_end_s - records.finish_s)[done])}


def mean_in_flight(records: RequestRecords, duration: float) -> float:
    """Requests in flight on average (Little's law: the completed requests' E2E times over the run's duration)."""
    e2e = np.where(records.completed, records.finish_s - records.arrival_s, 0.0)
    return float(e2e.sum() / duration) if duration else 0.0


def build_report(plan: Plan, records: RequestRecords, replicas: list, wall_time_s: float, engine: str = "sim",
                 extra: dict | None = None) -> dict:
    """Assemble report.json. `replicas`: objects with samples, num_blocks, block_size, peak_blocks,
    num_preemptions and step_end (the simulator's ReplicaTrace; the executor fills the same)."""
    m = compute_metrics(records, plan.slo, plan.client)
    all_replicas = replicas
    if plan.pools is not None:  # the decode pool holds the long-lived KV: the kv_cache section is its
        replicas = [r for r in replicas if r.pool == "decode"]
    report = {
        "scenario": scenario_section(plan),
        "engine": engine,
        **m,
        "latency_definitions": describe_definitions(plan.client),
        "kv_cache": kv_cache_section(plan, replicas),
        "memory_gib": memory_section(plan),
        "cost": cost_section(plan, m["throughput"]["output_tokens_per_s"]),
        "engine_steps": int(sum(len(r.step_end) for r in all_replicas)),
        "wall_time_s": wall_time_s,
    }
    if engine == "sim":  # what priced the simulated steps, and how far that source was off where it was measured
        report["cost_model"] = describe_cost(plan) if plan.pools is None else \
            {name: describe_cost(p) for name, p in (("prefill", plan.pools.prefill), ("decode", plan.pools.decode))}
    if plan.pools is not None:
        report["scenario"]["replicas"] = plan.pools.prefill.replicas + plan.pools.decode.replicas
        report["pools"] = {name: pool_section(p, [r for r in all_replicas if r.pool == name], report["duration_s"])
                           for name, p in (("prefill", plan.pools.prefill), ("decode", plan.pools.decode))}
    report.update(workload_sections(plan, records, report["duration_s"]))
    if plan.pipeline_parallel_size > 1:
        report["pipeline"] = pipeline_section(plan, replicas, report["duration_s"])
    if plan.workload.load_stages is not None:
        report["stages"] = stage_sections(plan, records)
    if extra:
        report.update(extra)
    return report


def scenario_section(plan: Plan) -> dict:
    """report.json's scenario section: what was run, on what, laid out how."""
    return {"name": plan.name, "model": plan.model.name, "hardware": plan.hardware.name,
            "replicas": plan.replicas, "tensor_parallel_size": plan.sharding.tp,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "router": plan.router, "batching": plan.scheduler.batching,
            "kv_allocator": plan.kv_allocator, "config": plan.source}


def kv_cache_section(plan: Plan, replicas: list) -> dict:
    """report.json's kv_cache section: the replicas' peak and time-weighted KV use, preemptions and capacity."""
    usage = [kv_usage(r.samples, r.num_blocks, r.block_size) for r in replicas]
    engines = (plan.pools.decode if plan.pools is not None else plan).virtual_engines
    return {
        "peak_utilization": max(r.peak_blocks / r.num_blocks for r in replicas),
        "mean_utilization": float(np.mean([u["mean"] for u in usage])),
        "reserved_unused_fraction": float(np.mean([u["reserved_unused"] for u in usage])),
        "preemptions": int(sum(r.num_preemptions for r in replicas)),
        "num_blocks": replicas[0].num_blocks, "block_size": replicas[0].block_size,
        "bytes_per_token": plan.kv_bytes_per_token,
        # a pipeline's virtual engines each hold num_blocks (kv_cache.num_blocks is per engine): the replica's
        # room is their sum, as memory_gib.kv_cache counts it
        "engines_per_replica": engines,
        "capacity_tokens": replicas[0].num_blocks * replicas[0].block_size * engines,
        **(prefix_cache_section(replicas) if plan.enable_prefix_caching else {}),
        **(kv_groups_section(plan, replicas) if plan.kv_groups is not None else {}),
    }


def memory_section(plan: Plan) -> dict:
    """report.json's memory_gib section: one device's weights, activations and KV cache, and its memory."""
    return {"weights": plan.weight_bytes / GiB, "activations": plan.activation_bytes / GiB,
            # one device's: a replica's data-parallel ranks each hold 1 / DP of its blocks
            "kv_cache": (plan.num_blocks * plan.virtual_engines * plan.block_size * plan.kv_bytes_per_token
                         if plan.kv_groups is None else plan.num_blocks * plan.virtual_engines *
                         plan.block_bytes) / GiB / plan.expert_layout.data_parallel_size,
            "device": plan.hardware.memory_gib}


def cost_section(plan: Plan, out_tok_s: float) -> dict:
    """report.json's cost section: the devices' price per hour (both pools' when disaggregated) and per million
    output tokens at the run's throughput."""
    pool_plans = [plan.pools.prefill, plan.pools.decode] if plan.pools is not None else [plan]
    usd_per_hour = sum(p.hardware.price_per_hour * p.replicas * p.devices_per_replica for p in pool_plans)
    return {"usd_per_hour": usd_per_hour,
            "usd_per_million_output_tokens": usd_per_hour / 3600 / out_tok_s * 1e6 if out_tok_s else None}


def workload_sections(plan: Plan, records: RequestRecords, duration_s: float) -> dict:
    """report.json's sections of how the workload's client sent: closed_loop, max_concurrency and client, where
    the workload has them."""
    loop, shown = plan.workload.closed_loop, measured(records)  # a client's warm-ups are in no figure
    out = {}
    if loop is not None:
        # the users waiting on the deployment, on average (the rest were thinking)
        out["closed_loop"] = {"users": loop.users, "think_time_s": loop.think_time_s,
                              "mean_in_flight": mean_in_flight(shown, duration_s)}
    if plan.workload.max_concurrency is not None:
        out["max_concurrency"] = client_section(plan.workload.max_concurrency, shown, duration_s)
    if plan.client is not None:
        out["client"] = transport_section(plan.client, records)
    return out


def pipeline_section(plan: Plan, replicas: list, duration_s: float) -> dict:
    """report.json's pipeline section: the stages, virtual engines, and the share of the stages' time spent
    computing."""
    busy = {id(r.pipeline_busy_s): r.pipeline_busy_s for r in replicas if r.pipeline_busy_s}.values()
    return {"stages": plan.pipeline_parallel_size, "virtual_engines": plan.virtual_engines,
            # share of the stages' time spent computing: 1 - the bubble (and the idle time between requests)
            "stage_utilization": float(np.mean([sum(b) / (len(b) * duration_s) for b in busy])) if duration_s else 0.0}


def prefix_cache_section(replicas: list) -> dict:
    """Prefix caching's share of the admitted prompts' tokens found cached (vLLM's prefix cache hit rate), and the
    tokens it saved computing."""
    queried = sum(r.prefix_queried_tokens for r in replicas)
    hits = sum(r.prefix_hit_tokens for r in replicas)
    return {"prefix_cache_hit_rate": hits / queried if queried else 0.0, "prefix_cache_hit_tokens": int(hits)}


def kv_groups_section(plan: Plan, replicas: list) -> dict:
    """A hybrid model's KV cache (vLLM's hybrid KV cache manager), one device's: the bytes a token adds over each
    attention kind's layers, the fixed state a sequence holds over its linear-attention layers, and per kind its
    groups (`layers_per_group` layers each, a block `block_bytes` in every group) and the most blocks they held."""
    g = plan.kv_groups
    peaks = [r.peak_blocks_by_kind or {} for r in replicas]
    linear = sum(k.layers for k in g.kinds if k.kind == "linear")
    return {"bytes_per_token_by_layer_type": g.bytes_per_token_by_kind(),
            "state_bytes_per_sequence": g.state_bytes * linear, "block_bytes": g.block_bytes,
            "layers_per_group": g.group_size,
            "groups": {k.kind: {"window": k.window, "layers": k.layers, "groups": k.groups,
                                "peak_blocks": max(p.get(k.kind, 0) for p in peaks)} for k in g.kinds}}


def pool_section(plan: Plan, replicas: list, duration_s: float) -> dict:
    """One pool of a disaggregated cluster: its layout, how busy its engines were, its KV use and cost."""
    usage = [kv_usage(r.samples, r.num_blocks, r.block_size) for r in replicas]
    devices = plan.replicas * plan.devices_per_replica
    return {"replicas": plan.replicas, "hardware": plan.hardware.name,
            "tensor_parallel_size": plan.sharding.tp, "pipeline_parallel_size": plan.pipeline_parallel_size,
            "devices": devices, "router": plan.router,
            # share of the run each engine spent in steps, averaged over the pool's engines
            "utilization": float(np.mean([r.busy_s for r in replicas]) / duration_s) if duration_s else 0.0,
            "kv_peak_utilization": max(r.peak_blocks / r.num_blocks for r in replicas),
            "kv_mean_utilization": float(np.mean([u["mean"] for u in usage])),
            "preemptions": int(sum(r.num_preemptions for r in replicas)),
            **(prefix_cache_section(replicas) if plan.enable_prefix_caching else {}),
            "engine_steps": int(sum(len(r.step_end) for r in replicas)),
            "usd_per_hour": plan.hardware.price_per_hour * devices}


_WORDS = np.array(["rejected", "completed"], dtype=object)  # requests.csv's status, by completed
HEADER = ["id", "replica", "arrival_s", "prompt_tokens", "output_tokens", "status", "reject_reason", "first_token_s",
          "finish_s", "ttft_s", "tpot_s", "e2e_s", "preemptions", "drafted", "accepted", "conversation"]


def write_requests_csv(path: Path, rec: RequestRecords, extra: dict[str, list] | None = None) -> None:
    """One row per request; `extra`: more columns, a value per request each (str, a number or None: an endpoint
    replay's ITLs, errors). Written as the csv module's default dialect writes it, each column formatted whole and
    the rows joined at once (its writer, a field at a time, took most of a 10,000-request run's writing)."""
    lat = per_request_latency(rec)
    extra = extra or {}
    if rec.warmup is not None and rec.warmup.any():  # workload.client's warm-up requests, in no other figure
        extra = {**extra, "warmup": rec.warmup.astype(int).tolist()}
    n = len(rec.id)
    spec = rec.speculation if rec.speculation is not None else np.zeros((n, 4), np.int64)
    conv = rec.conversation if rec.conversation is not None else np.full(n, -1)
    columns = [_ints(rec.id), _ints(rec.replica), _decimals(rec.arrival_s), _ints(rec.prompt_len),
               _ints(rec.output_len), _WORDS[rec.completed.astype(np.intp)].tolist(),
               _fields(rec.reject_reason), *(_decimals(a, blank_nan=True) for a in (rec.first_token_s, rec.finish_s,
                                                                                    lat["ttft"], lat["tpot"], lat["e2e"])),
               _ints(rec.num_preemptions), _ints(spec[:, 0]), _ints(spec[:, 1]), _ints(conv, blank_negative=True),
               *map(_fields, extra.values())]
    lines = [",".join(_fields([*HEADER, *extra])), *map(",".join, zip(*columns)), ""]
    path.write_text("\r\n".join(lines), newline="")


def _ints(a: np.ndarray, blank_negative: bool = False) -> list[str]:
    """Integers as text; with `blank_negative`, a negative one (none: a request in no conversation) as an empty field.
    A column of few values (a replica, a length, zeros) takes each value's text from a table of them."""
    a = a.astype(np.int64)
    lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, -1)
    if hi - lo >= len(a):
        return ["" if blank_negative and v < 0 else str(v) for v in a.tolist()]
    table = np.array(["" if blank_negative and v < 0 else str(v) for v in range(lo, hi + 1)], dtype=object)
    return table[a - lo].tolist()


def _decimals(a: np.ndarray, blank_nan: bool = False) -> list[str]:
    """Each value with 6 decimals (one % for the column); with `blank_nan`, NaN (undefined: rejected, one token) as
    an empty field."""
    if not len(a):
        return []
    text = ("%.6f," * len(a) % tuple(a.tolist()))[:-1].split(",")
    if blank_nan:
        for i in np.flatnonzero(np.isnan(a)).tolist():
            text[i] = ""
    return text


def _fields(values: list) -> list[str]:
    """Values as the csv module's writer puts them (QUOTE_MINIMAL): None empty, str() of the rest, quoted (quotes
    doubled) where they hold a comma, a quote or a line break."""
    texts = [v if type(v) is str else "" if v is None else str(v) for v in values]
    joined = "\0".join(texts)
    if not any(c in joined for c in ',"\r\n'):  # the usual column: nothing to quote
        return texts
    return ['"' + t.replace('"', '""') + '"' if any(c in t for c in ',"\r\n') else t for t in texts]


def check_finite(report: dict) -> None:
    """A run whose own figures came out infinite or NaN is an error, not a report (report.json is strict JSON):
    raise ConfigError naming the first such figure."""
    stack = [("", report)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(x))))
        elif isinstance(x, float) and not math.isfinite(x):
            raise ConfigError(f"the run's {where} came out {x}: its step times overflow or vanish; check the "
                              "cost_model and hardware numbers")


def write_outputs(out_dir: Path, report: dict, records: RequestRecords, replicas: list, plots: bool = True) -> None:
    """Write report.json, requests.csv and the PNG plots into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    write_requests_csv(out_dir / "requests.csv", records)
    if plots:
        from sim.report.plots import write_plots  # Pillow: only when plotting
        write_plots(out_dir, records, replicas)


def _fmt(x) -> str:
    return "-" if x is None else (f"{x * 1000:.1f}" if isinstance(x, float) else str(x))


def _seconds(x) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _slo_verdict(slo: dict, requests: dict) -> str:
    """met / MISSED, and when it is met only because rejected requests are left out of the quantiles, says so."""
    if not slo["met"]:
        return "MISSED"
    if slo.get("met_counting_rejected", True):
        return "met"
    share = requests["rejected"] / max(1, requests["arrived"])
    return (f"met over completed requests only: with the {requests['rejected']} rejected ({share:.1%}) counted as "
            "misses it is MISSED")


def cost_line(c: dict) -> str:
    """One cost source and its measured error, for the summary."""
    err = c.get("error") or {}
    off = ""
    if err.get("median_pct") is not None:
        off = f" (held out: median |error| {err['median_pct']}%, p90 {err['p90_pct']}% on {err['what']})"
    elif err.get("mape_pct") is not None:
        off = f" (held out: mean |error| {err['mape_pct']}% on {err['what']})"
    if c["source"] == "gpu_kernels" and c.get("kernels"):
        k = c["kernels"]
        return f"GPU kernel model, {k['engine']} {k['version']}'s own kernels on {c['device']} (AIConfigurator){off}"
    if c["source"] == "gpu_kernels":
        return f"GPU kernel model, {c['device']} kernels measured on {c['measured_on']}{off}"
    if c["source"] == "profile":
        return f"profile {c['profile']} ({c['device']}, x{c['scale']:g}){off}"
    return f"datasheet roofline, no measured kernels for this device{off.replace('held out: ', '')}"


def _cost_model_lines(priced: dict | None) -> list[str]:
    """What priced the steps (per pool for disaggregated runs) and the engine they ran on."""
    if not priced:
        return []
    sources = priced.values() if "source" not in priced else [priced]
    engines = [c["engine"] for c in sources if "engine" in c]
    return ["priced by: " + "; ".join(dict.fromkeys(cost_line(c) for c in sources)),
            *(["engine: " + "; ".join(dict.fromkeys(engine_line(e) for e in engines))] if engines else [])]


def engine_line(e: dict) -> str:
    """The serving engine a plan runs on, how far its simulation was off published real runs, and the defaults it
    supplied, for the summary."""
    assumed = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in e["assumed"].items())
    errors = e.get("end_to_end_error") or {}
    measured = "; ".join(f"end to end on {gpu}: TPOT {err['tpot_abs_err_median_pct']}%, TTFT "
                         f"{err['ttft_abs_err_median_pct']}% median |error| (leave one experiment out)"
                         for gpu, err in errors.items())
    if e["name"] != "infersim" and not errors:
        measured = "not yet judged end to end against published runs"
    notes = "; ".join(x for x in (measured, f"its defaults: {assumed}" if assumed else "") if x)
    return f"{e['name']} {e['version']}" + (f" ({notes})" if notes else "")


def client_line(c: dict) -> str:
    """The client section in one line: the tool, its transport, the warm-ups left out."""
    tool = "no tool named" if c["tool"] == "none" else c["tool"]
    way = "no transport time" if c["transport"] is None else (
        f"transport in p50 {_fmt(c['in_s']['p50'])} ms, out p50 {_fmt(c['out_s']['p50'])} ms"
        + (" (assumed: the engine's front end, or a closed loop's)" if c["assumed"] else ""))
    warm = f"; {c['warmup_requests']} warm-up requests left out" if c["warmup_requests"] else ""
    return f"client: {tool}, {way}{warm}"


def latency_table(report: dict, defined_by: str = "") -> str:
    """The latency quantiles in ms as a text table; `defined_by`: whose definitions, in a word."""
    rows = [[label, *(_fmt(report[key][q]) for q in ("mean", "p50", "p90", "p99"))]
            for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))]
    return text_table(["latency (ms)" + defined_by, "mean", "p50", "p90", "p99"], rows)


def summary_text(report: dict) -> str:
    """The console summary: latency quantiles in ms, throughput, SLOs, memory and cost."""
    rq = report["requests"]
    client = report.get("client")
    th = report["throughput"]
    cost = report["cost"]
    per_m = cost["usd_per_million_output_tokens"]
    lines = [scenario_line(report),
             f"requests: {rq['arrived']} arrived, {rq['completed']} completed, {rq['rejected']} rejected"
             + "".join(f"\n  rejected: {n} × {why}" for why, n in rq["rejected_by_reason"].items()),
             latency_table(report, f", {report['latency_definitions']['word']}" if client else ""),
             stages_table(report),
             f"throughput: {th['requests_per_s']:.2f} req/s, {th['output_tokens_per_s']:.1f} output tok/s, "
             f"{th['total_tokens_per_s']:.1f} total tok/s; goodput {report['goodput_requests_per_s']:.2f} req/s",
             slo_line(report), kv_line(report["kv_cache"]),
             *_section_lines(report, (("max_concurrency", concurrency_line), ("client", client_line),
                                      ("closed_loop", closed_loop_line), ("conversations", conversations_line))),
             *(pool_line(name, pool) for name, pool in report.get("pools", {}).items()),
             *_section_lines(report, (("kv_transfer", kv_transfer_line), ("speculative", speculative_line))),
             *_cost_model_lines(report.get("cost_model")),
             f"cost: ${cost['usd_per_hour']:.2f}/h" + (f", ${per_m:.3f} per 1M output tokens" if per_m else "")
             + f"; {'simulated' if report['engine'] == 'sim' else 'served'} in {report['wall_time_s']:.2f} s"]
    return "\n".join(x for x in lines if x)


def _section_lines(report: dict, lines: tuple) -> list[str]:
    """Each (key, line) of `lines` whose section the report has (and is not empty): that section's line."""
    return [line(report[key]) for key, line in lines if report.get(key)]


def _layout(tp: int, pp: int) -> str:
    """ × TPn × PPm, each where it is over 1."""
    return (f" × TP{tp}" if tp > 1 else "") + (f" × PP{pp}" if pp > 1 else "")


def scenario_line(report: dict) -> str:
    """The summary's first line: the scenario, its model on what, and how it was run."""
    s = report["scenario"]
    return (f"{s['name']}  {s['model']} on {s['replicas']}× {s['hardware']}"
            + _layout(s.get("tensor_parallel_size", 1), s.get("pipeline_parallel_size", 1)) + "  "
            f"({report['engine']}, {s['batching']} batching, {s['kv_allocator']} KV)")


def slo_line(report: dict) -> str:
    """The SLO, whether it was met, and the share of requests within it."""
    slo = report["slo"]
    e2e = f", E2E ≤ {_fmt(slo['e2e_s'])} ms" if slo.get("e2e_s") is not None else ""
    return (f"SLO (p{slo['quantile'] * 100:g} TTFT ≤ {_fmt(slo['ttft_s'])} ms, TPOT ≤ {_fmt(slo['tpot_s'])} ms"
            f"{e2e}): {_slo_verdict(slo, report['requests'])}; attainment {report['slo_attainment'] * 100:.1f}%")


def kv_line(kv: dict) -> str:
    """The kv_cache section in one line."""
    hits = f", prefix cache hits {kv['prefix_cache_hit_rate'] * 100:.1f}%" if "prefix_cache_hit_rate" in kv else ""
    return (f"KV cache: peak {kv['peak_utilization'] * 100:.1f}%, mean {kv['mean_utilization'] * 100:.1f}%, "
            f"reserved-unused {kv['reserved_unused_fraction'] * 100:.1f}%, {kv['preemptions']} preemptions, "
            f"{kv['capacity_tokens']} tokens{hits}")


def concurrency_line(gate: dict) -> str:
    """The max_concurrency section in one line."""
    w = gate["client_wait_s"]
    return (f"max concurrency {gate['limit']}: {gate['requests_waited']} requests waited at the client for "
            f"a slot (mean {w['mean']:.3g} s, p90 {w['p90']:.3g} s), latencies count from sending; "
            f"{gate['mean_in_flight']:.1f} in flight on average")


def closed_loop_line(loop: dict) -> str:
    """The closed_loop section in one line."""
    return (f"closed loop: {loop['users']} users, think time {loop['think_time_s']:g} s; "
            f"{loop['mean_in_flight']:.1f} requests in flight on average")


def conversations_line(conv: dict) -> str:
    """The conversations section in one line."""
    first, later = conv["first_turn_ttft_s"]["p50"], conv["later_turn_ttft_s"]["p50"]
    return (f"conversations: {conv['conversations']}, {conv['answered']} with every turn answered, "
            f"{conv['turns_mean']:.2f} turns on average; TTFT p50 first turns {_fmt(first)} ms, later turns "
            f"{_fmt(later)} ms; first arrival to last token p50 {_seconds(conv['duration_s']['p50'])}")


def pool_line(name: str, pool: dict) -> str:
    """One pool of a disaggregated cluster in one line."""
    return (f"{name} pool: {pool['replicas']}× {pool['hardware']}"
            + _layout(pool["tensor_parallel_size"], pool["pipeline_parallel_size"])
            + f", busy {pool['utilization'] * 100:.1f}%, KV peak {pool['kv_peak_utilization'] * 100:.1f}%, "
            f"{pool['preemptions']} preemptions")


def kv_transfer_line(kvt: dict) -> str:
    """The kv_transfer section (disaggregated serving) in one line."""
    link, wait = kvt["transfer_s"], kvt["wait_s"]
    return (f"KV transfer: {kvt['transfers']} transfers, {kvt['bytes'] / 2**30:.2f} GiB; on the link "
            f"p50 {_fmt(link['p50'])} ms, p99 {_fmt(link['p99'])} ms; hand-off to transfer (decode instance's next "
            f"step, its memory, the link) p50 {_fmt(wait['p50'])} ms, p99 {_fmt(wait['p99'])} ms")


def speculative_line(spec: dict) -> str:
    """The speculative section in one line: acceptance, and the drafter's measured cost where there is one."""
    costs = (f"; drafting {spec['draft_s_per_step'] * 1e3:.2f} ms per step + "
                f"{spec['draft_s_per_seq'] * 1e3:.2f} ms per request" if "draft_s_per_step" in spec else "")
    if "draft_s_per_token" in spec:
        costs += f" + {spec['draft_s_per_token'] * 1e6:.1f} µs per token caught up"
    if "verify_cost_ratio" in spec:
        costs += f"; verify steps {spec['verify_cost_ratio']:.3f}x the profile"
    return (f"speculative: {spec['accepted']}/{spec['drafted']} drafts accepted, α {spec['alpha']:.3f}, "
            f"{spec['mean_accepted_length']:.2f} accepted per verify step, drafts on "
            f"{(spec['proposal_rate'] or 0) * 100:.0f}% of decode steps{costs}")

"""The application API: run / serve / validate / profile / distill / train-medusa / train-eagle, and the catalogs.

The only place that wires the layers together; the CLI, the dashboard and the benches call it. Every function
raises ConfigError (one line: file, key path, what is allowed) for bad input.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from rich.console import Console

from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.config.plan import Plan, check_profile_device, load_scenario, plan_of
from sim.report.metrics import RequestRecords
from sim.report.outputs import build_report, check_finite, print_summary, write_outputs
from sim.report.trace import ReplicaTrace

DEFAULT_SCENARIO = "default.yaml"


def default_scenario_path() -> Path:
    """The scenario `infersim run` uses when given none (shipped inside the package)."""
    return Path(str(files("sim") / "data" / DEFAULT_SCENARIO))


def load_plan(path: str | Path) -> Plan:
    """A scenario file read, validated and resolved."""
    return load_scenario(path)[1]


def check_checkpoint(plan: Plan, path: Path) -> None:
    """The checkpoint a scenario's `model: {hf_config: DIR}` names holds what transformers loads (a config.json with
    its model_type, and weights), checked before anything runs: transformers' own error is a traceback."""
    folder = plan.model_checkpoint
    if folder is None or plan.executor.random_weights:
        return
    config = folder / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{config} names no model_type (e.g. \"llama\"), which loading the checkpoint needs; "
                          "allowed: a Hugging Face checkpoint's config.json, or executor.random_weights: true",
                          "model.hf_config", str(path))
    if not any(f.suffix in (".safetensors", ".bin") for f in folder.iterdir()):
        raise ConfigError(f"{folder} holds no weights (*.safetensors or *.bin) for the executor; allowed: a "
                          "checkpoint folder, or executor.random_weights: true", "model.hf_config", str(path))


def prepare_out(out: Path | None) -> None:
    """Make sure `out` is a folder this process can write, before a run that may take minutes (an error after
    the run would lose it)."""
    if out is None:
        return
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a folder", "--out")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".infersim-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to {out} ({type(e).__name__}: {e.strerror or e})", "--out") from None


def prepare_out_file(path: Path | None, key_path: str) -> None:
    """Make sure `path` can be written as a file (its folder made), before minutes of measuring that end in it."""
    if path is None:
        return
    try:
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} exists and is not a file", key_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(f"cannot write to {path} (permission denied)", key_path)
        # os.access says yes to root even where nothing can be written (/sys, a read-only mount): try it
        probe = path.parent / f".{path.name}.infersim-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to {path} ({type(e).__name__}: {e.strerror or e})", key_path) from None


@dataclass
class Outcome:
    """One simulated scenario: the resolved plan, report.json's content, the per-request records and the replicas'
    traces (each pool's replicas, with pools)."""

    plan: Plan
    report: dict
    records: RequestRecords
    traces: list[ReplicaTrace]


def simulate_data(data: dict, base_dir: Path = Path("."), *,
                  progress: Callable[[int, int], None] | None = None) -> Outcome:
    """Validate, resolve and simulate a scenario mapping (as a YAML file holds it; paths relative to `base_dir`).
    `progress(done, total)` is called as requests finish (about 100 times); an exception it raises aborts the run."""
    from sim.simulator.cluster import sim_records, simulate

    plan = plan_of(data, base_dir)
    check_profile_device(plan)
    specs = plan_requests(plan)
    n, step = len(specs), max(1, len(specs) // 100)
    result = simulate(plan, specs, progress=progress and (lambda done: done % step == 0 and progress(done, n)))
    records = sim_records(result)
    report = build_report(plan, records, result.replicas, result.wall_time_s, engine="sim", extra=result.extra)
    check_finite(report)
    return Outcome(plan, report, records, result.replicas)


def run_scenario(path: Path, out: Path | None, quiet: bool = False, plots: bool = True) -> dict:
    """Load, simulate, report. Returns report.json's content."""
    from sim.simulator.cluster import sim_records, simulate

    plan = load_plan(path)
    try:
        check_profile_device(plan)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    _check_drafters([(path, plan)], named_only=True)
    prepare_out(out)
    try:
        specs = plan_requests(plan)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    n, step = len(specs), max(1, len(specs) // 100)
    try:
        with progress_bar(Console(stderr=True), quiet or n < 2000, "simulating", n) as bar:
            result = simulate(plan, specs, progress=bar and (lambda done: done % step == 0 and bar(done, n)))
    except ConfigError as e:  # e.g. a setting only the simulator needs
        raise e.with_file(str(path)) from None
    del specs  # the requests hold what the report needs
    records = sim_records(result)
    report = build_report(plan, records, result.replicas, result.wall_time_s, engine="sim", extra=result.extra)
    try:
        check_finite(report)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    if out is not None:
        write_outputs(out, report, records, result.replicas, plots=plots)
    if not quiet:
        print_summary(report, Console())
        if out is not None:
            Console().print(f"wrote {out}/report.json, requests.csv" + (", *.png" if plots else ""))
    return report


def serve_scenario(path: Path, out: Path | None, device: str = "cpu", threads: int | None = None,
                   quiet: bool = False, plots: bool = True, profile: Path | None = None) -> dict:
    """Load, run on the executor, report. Returns report.json's content. `profile` (default: the scenario's
    cost_model.profile, if any): the fitted step costs the speculative overhead is measured against."""
    import torch

    from calibration.speculative import draft_cost, write_speculative_yaml
    from executor.distributed.launch import WorkerError
    from executor.serving.disaggregated import serve_pools
    from executor.serving.serve import check_device, serve, write_traces
    from sim.cost.build import make_cost_model
    from sim.cost.fitted import load_profile
    from sim.report.metrics import records_from_requests, request_rates

    check_device(device)
    plan = load_plan(path)
    check_checkpoint(plan, path)
    prepare_out(out)
    cost = None  # checked before the run, which takes minutes
    if profile is not None:
        cost = load_profile(profile, plan.model, "--profile")
    elif plan.cost.profile is not None:
        cost = make_cost_model(plan)
    _check_drafters([(path, plan)])
    warn_threads(plan, threads)
    err = Console(stderr=True)
    stage = (lambda text: None) if quiet else (lambda text: err.print(f"{plan.name}: {text}", highlight=False))
    try:
        specs = plan_requests(plan)
        with progress_bar(err, quiet, "serving", len(specs)) as progress:
            run = serve if plan.pools is None else serve_pools  # disaggregated: a process per instance
            records, traces, engine, requests, wall, load = run(plan, specs, device, threads, stage=stage,
                                                                progress=progress)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    except WorkerError as e:  # a worker process died: what completed before it, and one line
        if getattr(e, "requests", None) is None:  # it died starting up (a model load, a spawn): nothing was served
            raise WorkerError(f"{e}, before any request was served", e.rank) from None
        done = sum(r.status.value == "finished" for r in e.requests)
        if out is not None:
            write_traces(out, e.engine, e.requests)
            if plan.pools is not None:  # disaggregated: the report of what completed, and the KV transfers
                partial = records_from_requests(e.requests)
                write_outputs(out, build_report(plan, partial, e.engine.traces, e.engine.wall_s, engine="executor",
                                                extra=e.engine.sections), partial, e.engine.traces, plots=False)
                e.engine.write_transfers(out)
        where = f" (their traces in {out})" if out is not None else ""
        raise WorkerError(f"{e}; {done} of {len(e.requests)} requests completed before it{where}", e.rank) from None
    warning = load.warning("this serve")
    if warning and not quiet:
        err.print(warning, style="yellow", highlight=False)
    report = build_report(plan, records, traces, wall, engine="executor",
                          extra={"executor": {"device": device, "threads": torch.get_num_threads(),
                                              "attention": plan.executor.attention,
                                              "torch": torch.__version__,
                                              "other_processes_cores": round(load.mean_others, 2),
                                              "other_processes_busy_share": round(load.busy_share, 2)},
                                 **(engine.sections if plan.pools is not None else {})})
    if "speculative" in report:
        report["speculative"].update(draft_cost(engine.records, cost))
        report["speculative"]["request_rates"] = request_rates(records.speculation, records.output_len)
        if hasattr(engine.drafter, "rank_probs"):  # Medusa's heads, an EAGLE head: measured per depth
            report["speculative"][plan.speculative.rank_probs_key] = engine.drafter.rank_probs()
    if out is not None:
        write_outputs(out, report, records, traces, plots=plots)
        write_traces(out, engine, requests)
        if plan.pools is not None:
            engine.write_transfers(out)
        if "speculative" in report:
            write_speculative_yaml(out / "speculative.yaml", plan, report["speculative"])
    if not quiet:
        print_summary(report, Console())
        if out is not None:
            Console().print(f"wrote {out}/report.json, requests.csv, steps.jsonl, requests.jsonl"
                            + (", transfers.jsonl" if plan.pools is not None else "")
                            + (", speculative.yaml (the measured drafter, for the scenario's speculative: section)"
                               if "speculative" in report else ""))
    return report


def require_executor(what: str) -> None:
    """The executor's heavy dependencies (torch, transformers, ...: the `executor` extra) are installed, else a
    one-line error saying how to get them: planning needs none of them."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "gguf", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"`infersim {what}` runs the PyTorch executor, which needs {', '.join(missing)}: pip "
                          "install 'infersim[executor]' (torch first, pinned: see the README)")


def http_server(path: Path, device: str = "cpu", threads: int | None = None, served_model: str | None = None,
                keep_trace: bool = False, limits=None):
    """(plan, the OpenAI-compatible server of a scenario's model: executor.api_server.server.OpenAIServer, its
    engine process started, the model loaded and warmed up there, not yet listening). The scenario's scheduler, KV
    cache and limits serve whatever clients send; its workload is not replayed. `keep_trace`: every step and request
    kept for a report. `limits`: the HTTP front's bounds (executor.api_server.limits.ServerLimits; default: its
    defaults, the API key from INFERSIM_API_KEY)."""
    require_executor("serve")
    from executor.api_server.engine_client import EngineClient
    from executor.api_server.server import OpenAIServer, Served

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; allowed: cpu, cuda", "--device")
    plan = load_plan(path)
    check_checkpoint(plan, path)
    if plan.pools is not None or plan.replicas != 1 or plan.tensor_parallel_size * plan.pipeline_parallel_size > 1:
        raise ConfigError("serve --http runs one replica on one device: allowed: no pools, replicas: 1, no tensor "
                          "or pipeline parallelism", "replicas", str(path))
    if plan.speculative is not None:
        raise ConfigError("serve --http does not run speculative decoding; drop the speculative section",
                          "speculative", str(path))
    warn_threads(plan, threads)
    keep_warm_s = KEEP_WARM_S if plan.executor.keep_warm and device == "cpu" else 0.0
    try:
        client = EngineClient(plan, device, threads, keep_trace, keep_warm_s)
    except ConfigError as e:
        raise e.with_file(str(path)) from None
    info = client.info
    served = Served(client, info["tokenizer"], served_model or plan.model.name, info["vocab_size"], plan.max_model_len,
                    info["eos_token_id"])
    return plan, OpenAIServer(served, limits or server_limits())


def server_limits(**given):
    """The HTTP front's bounds (executor.api_server.limits.ServerLimits): the values given, defaults for those None;
    the API key, when none is given, from INFERSIM_API_KEY."""
    from executor.api_server.limits import ServerLimits
    from sim.config.environment import api_key

    given = {k: v for k, v in given.items() if v is not None}
    key, where = (given["api_key"], "--api-key") if "api_key" in given else (api_key(), "INFERSIM_API_KEY")
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ConfigError("an API key is printable ASCII without spaces (it travels in a header); allowed: such a "
                          "non-empty string", where)
    return ServerLimits(**{**given, "api_key": key})


def serve_http(path: Path, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu",
               threads: int | None = None, out: Path | None = None, quiet: bool = False,
               served_model: str | None = None, limits=None) -> dict | None:
    """Serve a scenario's model as an OpenAI-compatible HTTP server (http_server) until SIGTERM or Ctrl-C, which
    drain it. With `out`, the report of every request served is written there when it stops (and returned). The
    engine process dying raises executor.api_server.engine_client.EngineDied once the server has stopped."""
    require_executor("serve")
    from executor.api_server.engine_client import EngineDied
    from executor.api_server.server import HTTPServer, bind
    from sim.report.metrics import records_from_requests

    prepare_out(out)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{port}: allowed: a port number in 0..65535", "--port")
    try:
        sock = bind(host, port)
    except (OSError, OverflowError) as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e})", "--port") from None
    plan, server = http_server(path, device, threads, served_model, keep_trace=out is not None, limits=limits)
    url = f"http://{host}:{sock.getsockname()[1]}"
    if not quiet:
        key = "; clients send Authorization: Bearer KEY" if server.limits.api_key else ""
        Console(stderr=True).print(f"{plan.name}: serving {server.served.model_name} at {url}/v1 (OpenAI API; "
                                   f"/metrics, /health){key}; engine process {server.served.client.info['pid']}; "
                                   "Ctrl-C or SIGTERM stops", highlight=False)
    HTTPServer(server).run(sockets=[sock])
    sock.close()
    client = server.served.client
    if client.error is not None:
        raise EngineDied(f"{client.error}: the server stopped")
    if out is None or client.trace is None:
        return None
    from executor.serving.serve import write_traces

    trace = client.trace
    records = records_from_requests(trace.requests)
    report = build_report(plan, records, trace.traces, trace.wall_s, engine="executor",
                          extra={"executor": {"device": device, "threads": client.info["threads"], "http": url}})
    write_outputs(out, report, records, trace.traces, plots=False)
    write_traces(out, trace, trace.requests)
    if not quiet:
        print_summary(report, Console())
        Console().print(f"wrote {out}/report.json, requests.csv, steps.jsonl, requests.jsonl")
    return report


KEEP_WARM_S = 1.0  # a CPU server keeps torch's threads busy this long into an idle spell (executor.keep_warm)


class progress_bar:
    """A progress bar on a terminal (a callback taking (done, total)); nothing when quiet or piped."""

    def __init__(self, console: Console, quiet: bool, what: str, total: int):
        self.show = not quiet and console.is_terminal
        self.console, self.what, self.total = console, what, total

    def __enter__(self):
        if not self.show:
            return None
        from rich.progress import Progress

        self.bar = Progress(console=self.console, transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(self.what, total=self.total)
        return lambda done, total: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.show:
            self.bar.__exit__(*exc)
        return False


def scenario_files(paths: list[Path]) -> list[Path]:
    """The YAML files named, with each folder expanded to its *.yaml (sorted)."""
    found_all = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.yaml"))
            if not found:
                raise ConfigError(f"{p} holds no *.yaml scenarios", "SCENARIO")
            found_all += found
        else:
            found_all.append(p)
    check_distinct(found_all)
    return found_all


def check_distinct(paths: list[Path]) -> None:
    """Each scenario file named once (twice, one's outputs replaced the other's and the medians counted it twice)."""
    seen: dict[Path, Path] = {}
    for p in paths:
        key = p.resolve() if p.exists() else p
        if key in seen:
            raise ConfigError(f"{seen[key]} and {p} are one file; allowed: each scenario once", "SCENARIO")
        seen[key] = p


def validate(scenarios: list[Path], out: Path | None = None, device: str = "cpu", profile: Path | None = None,
             threads: int | None = None, repeat: int = 1, real_from: Path | None = None,
             alongside: Path | None = None) -> tuple[list[dict], Path, dict | None]:
    """Run scenarios on the executor and in the simulator: (each scenario's validation.json content, the profile
    predicted with, the summary over scenarios or None for one). Writes summary.json and table.md under `out`."""
    from calibration.validate import markdown_table, model_loader, summarize, validate_many
    from executor.serving.serve import check_device

    check_device(device, present=real_from is None)  # re-scoring recorded runs needs no device
    paths = scenario_files(scenarios)
    plans = [(path, load_plan(path)) for path in paths]
    prepare_out(out)
    _check_before_runs(plans, drafters=real_from is None)
    prof = _validation_profile(profile, alongside, device, plans)
    _check_profile(prof, alongside, plans)
    if real_from is None:
        for plan in {plan.executor.threads: plan for _, plan in plans}.values():
            warn_threads(plan, threads)
    for path, plan in plans if real_from is None else ():
        check_checkpoint(plan, path)
    folders = [None if out is None else (out if len(plans) == 1 else out / path.stem) for path, _ in plans]
    recorded = None
    if real_from is not None:
        recorded = [real_from if len(plans) == 1 else real_from / path.stem for path, _ in plans]
    shared = model_loader(device)

    def load(plan):  # a model that will not load is reported against its scenario file
        try:
            return shared(plan)
        except ConfigError as e:
            raise e.with_file(str(next((p for p, pl in plans if pl is plan), plans[0][0]))) from None

    results = validate_many([(plan, f) for (_, plan), f in zip(plans, folders)], prof, device, threads,
                            repeat, load, real_from=recorded, alongside=alongside)
    prof = alongside or prof
    summary = summarize(results) if len(results) > 1 else None
    if summary is not None and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"profile": str(prof), "device": device,
                                                      "summary": summary, "scenarios": results}, indent=2) + "\n")
        (out / "table.md").write_text(markdown_table(results))
    return results, prof, summary


def validate_endpoint(scenario: Path, endpoint: str, served_model: str | None = None, profile: Path | None = None,
                      out: Path | None = None, tokenizer: str | None = None, chat: bool = False,
                      timeout_s: float | None = None, quiet: bool = False) -> dict:
    """Replay a scenario's workload against a running OpenAI-compatible server and compare with the simulation
    (`profile`, else the scenario's own cost model): validation.json's content, written under `out` with
    requests.csv, requests.jsonl and the CDF plot. Needs no torch."""
    from calibration.endpoint import connect
    from calibration.endpoint_validate import validate_endpoint as run

    plan = load_plan(scenario)
    if plan.pools is not None:
        raise ConfigError("an endpoint is one server: a scenario with pools cannot be compared with it; allowed: "
                          "one replica set", "pools", str(scenario))
    if profile is not None:
        from sim.config.profile import read_profile

        read_profile(profile, plan.model, "--profile")
    prepare_out(out)
    ep = connect(endpoint, served_model, tokenizer)
    err = Console(stderr=True)
    if not quiet:
        err.print(f"{plan.name}: replaying {plan.workload.num_requests or 'the'} requests against {ep.url} "
                  f"({ep.model}, {ep.engine})", highlight=False)
    try:
        n = len(plan_requests(plan))
        with progress_bar(err, quiet, "replaying", n) as progress:
            return run(plan, ep, profile, out, chat, timeout_s, progress)
    except ConfigError as e:
        raise e.with_file(str(scenario)) from None
    finally:
        ep.close()


def validate_published(scenario: Path, published: Path, out: Path | None = None) -> dict:
    """Simulate a scenario and score it, stage by stage, against a real run's published figures (a
    infersim-published-run/1 file: scenarios/gpu_validation/published/): validation.json's content, written under
    `out`. Needs no torch."""
    from calibration.published import validate_published as run

    plan = load_plan(scenario)
    if plan.pools is not None:
        raise ConfigError("a published run is one server: a scenario with pools cannot be compared with it; allowed: "
                          "one replica set", "pools", str(scenario))
    prepare_out(out)
    try:
        check_profile_device(plan)
        return run(plan, published, out)
    except ConfigError as e:
        raise e.with_file(str(scenario)) from None


def profile_endpoint(endpoint: str, out: Path, served_model: str | None = None, model: str = "SmolLM2-135M",
                     scenario: Path | None = None, quick: bool = False, tokenizer: str | None = None,
                     quiet: bool = False) -> dict:
    """Fit the step-cost model to a running server's streams (calibration.endpoint_profile) and write the profile
    `cost_model: {profile: OUT}` reads. The model it records: the scenario's, else `model` (a catalog name or a
    local config). Needs no torch."""
    from calibration.endpoint import connect
    from calibration.endpoint_profile import profile_endpoint as run
    from sim.config.hf_config import load_hf_config
    from sim.config.models import catalog_model
    from sim.config.profile import check_profile

    _check_replaces_a_profile(out)
    prepare_out_file(out, "--out")
    max_len = None
    if scenario is not None:
        plan = load_plan(scenario)
        spec, max_len = plan.model, plan.max_model_len
    elif Path(model).exists():
        spec = load_hf_config(Path(model), "--model")
    else:
        try:
            spec = catalog_model(model)
        except (KeyError, ConfigError):
            raise ConfigError(f"{model!r} is neither a catalog model (infersim models) nor a local config",
                              "--model") from None
    ep = connect(endpoint, served_model, tokenizer)
    err = Console(stderr=True)
    if not quiet:
        err.print(f"profiling {ep.url} ({ep.model}, {ep.engine}) as {spec.name}", highlight=False)
    try:
        from calibration.endpoint_profile import sweep

        with progress_bar(err, quiet, "profile loads", len(sweep(quick))) as progress:
            prof = run(ep, spec.model_dump(), quick, progress=progress, max_len=max_len)
    finally:
        ep.close()
    try:
        check_profile(prof, out)
    except ConfigError as e:
        raise ConfigError(f"the fit of the endpoint's streams is no profile `infersim run` takes ({e.message})",
                          "--endpoint") from None
    out.write_text(json.dumps(prof, indent=1) + "\n")
    if not quiet:
        f, streams = prof["fit"], prof["endpoint"]["max_concurrent_streams"]
        Console().print(f"profiled {len(prof['samples'])} step shapes in {prof['sweep_s']:.0f} s; held-out MAPE "
                        f"{f['heldout']['mape'] * 100:.1f}%, R² {f['heldout']['r2']:.4f}; the endpoint ran at most "
                        f"{streams} stream{'s' if streams > 1 else ''} at once"
                        + (" (plan with serving.max_num_seqs: 1)" if streams == 1 else "") + f"; wrote {out}")
    return prof


def validate_capacity(scenarios: list[Path], out: Path | None = None, device: str = "cpu",
                      profile: Path | None = None, threads: int | None = None, alongside: Path | None = None,
                      precision: float = 0.05, requests: int | None = None) -> tuple[list[dict], Path]:
    """Each scenario's capacity (the highest rate meeting its SLOs; a closed loop's: the most users) measured on the
    executor by a search of real serves and predicted by the simulator on the same grid: (each scenario's
    capacity.json content, the profile predicted with). `alongside`: profile meanwhile (a sweep slice before each
    probe) and predict with it. `requests`: the probes' workload has this many requests (the scenario's
    distributions and seed)."""
    from calibration.capacity import validate_capacity as measure
    from calibration.profile import write_profile
    from calibration.validate import alongside_sweep, check_graphs, model_loader
    from executor.serving.serve import check_device, set_threads
    from sim.report.capacity import STEADY_ROUNDS, check_has_slo, check_scalable

    check_device(device)
    paths = scenario_files(scenarios)
    plans = [(path, load_plan(path)) for path in paths]
    if requests is not None:
        plans = [(path, _with_requests(plan, requests, path)) for path, plan in plans]
    for path, plan in plans:
        try:
            check_has_slo(plan.slo)
            specs = plan_requests(plan)
            if plan.workload.closed_loop is None:  # a closed loop's capacity is in users: nothing to scale
                check_scalable(specs)
            elif len(specs) < STEADY_ROUNDS:
                raise ConfigError(f"probes of {len(specs)} requests cannot judge even one user (a closed loop's probe "
                                  f"needs {STEADY_ROUNDS} requests per user or more)",
                                  "--requests" if requests is not None else "workload.num_requests")
        except ConfigError as e:
            raise e.with_file(str(path)) from None
    prepare_out(out)
    _check_before_runs(plans, drafters=True)
    prof = _validation_profile(profile, alongside, device, plans)
    _check_profile(prof, alongside, plans)
    for path, plan in plans:
        check_checkpoint(plan, path)
    check_graphs([plan for _, plan in plans], None if alongside else prof, device)
    load = model_loader(device)
    results = []
    for path, plan in plans:
        folder = None if out is None else (out if len(plans) == 1 else out / path.stem)
        try:
            loaded = load(plan)
        except ConfigError as e:
            raise e.with_file(str(path)) from None
        set_threads(plan, threads)
        sweep = alongside_sweep([plan], load, device, False) if alongside is not None else None
        own = None if alongside is None else (alongside if len(plans) == 1 else
                                               alongside.with_name(f"{alongside.stem}-{path.stem}{alongside.suffix}"))

        def finish(sweep=sweep, own=own, plan=plan):
            write_profile(own, sweep.profile(plan.model.model_dump()))
            return own

        results.append(measure(plan, prof if sweep is None else None, device, threads, loaded, sweep,
                               finish if sweep is not None else None, folder, precision))
    return results, alongside or prof


def _with_requests(plan, requests: int, path: Path):
    """The plan with `requests` requests in its workload (a trace's workload is a one-line error)."""
    from sim.config.plan import replan

    workload = dict(plan.source.get("workload") or {})
    if workload.get("trace") is not None:
        raise ConfigError(f"{path}: --requests sizes a generated workload; this one replays a trace", "--requests")
    workload.pop("duration_s", None)  # a workload is sized by one of the two
    try:
        return replan(plan, workload={**workload, "num_requests": requests})
    except ConfigError as e:  # e.g. past the request limit: the flag's fault, in this scenario
        raise ConfigError(e.message, "--requests", str(path)) from None


def _validation_profile(profile: Path | None, alongside: Path | None, device: str, plans: list = ()) -> Path:
    """The profile a validation predicts with: `profile`, else the one every scenario's cost_model.profile names
    (a model other than SmolLM2 ships its own), else the device's shipped one (checked to exist unless
    `--profile-alongside` measures its own, which excludes `--profile`)."""
    from calibration.validate import PROFILES

    if alongside is not None and profile is not None:
        raise ConfigError("--profile-alongside measures the profile to predict with: not with --profile", "--profile")
    prepare_out_file(alongside, "--profile-alongside")
    named = {plan.cost.profile.path.resolve() if plan.cost.profile else None for _, plan in plans}
    own = named.pop() if len(named) == 1 else None
    prof = profile or own or PROFILES / f"{device}.json"
    if alongside is None and not prof.exists():
        raise ConfigError(f"no profile at {prof}; make one with `infersim profile --device {device}`", "--profile")
    if alongside is None and not prof.is_file():  # a folder: reported later against cost_model.profile, wrongly
        raise ConfigError(f"{prof} is not a profile file", "--profile")
    return prof


def _check_profile(prof: Path, alongside: Path | None, plans: list) -> None:
    """The profile predicted with read for each plan's model before any executor run (a broken one, or one of
    another model, surfaced after the runs); a plan's own cost_model.profile was read with it."""
    from sim.config.profile import read_profile

    for _, plan in plans if alongside is None else ():
        if plan.cost.profile is None or plan.cost.profile.path.resolve() != prof.resolve():
            read_profile(prof, plan.model, "--profile")


def _check_before_runs(plans: list, drafters: bool) -> None:
    """What the simulator (and, with `drafters`, a draft-model or Medusa drafter) needs, per (path, plan), checked
    before any executor run, which takes minutes; errors name the scenario file."""
    from sim.cost.build import speculation_model

    for path, plan in plans:
        try:
            speculation_model(plan, 0)
        except ConfigError as e:
            raise e.with_file(str(path)) from None
    if drafters:
        _check_drafters(plans)


def _check_drafters(plans: list, named_only: bool = False) -> None:
    """Each (path, plan)'s draft model or Medusa heads are there, and a Medusa tree fits its heads, checked before
    the target model loads; errors name the scenario file. `named_only`: a simulation may plan with heads or a draft
    not made yet, so only a folder the scenario names that holds them is checked against it."""
    import importlib.util

    if named_only and importlib.util.find_spec("torch") is None:  # planning without the executor: nothing to load
        return
    for path, plan in plans:
        if plan.speculative is not None and plan.speculative.method in ("draft_model", "medusa", "eagle", "mtp"):
            from executor.speculative.build import drafter_dir  # torch: only where a drafter is named

            try:
                drafter_dir(plan, named_only)
            except ConfigError as e:
                raise e.with_file(str(path)) from None


def warn_threads(plan: Plan, threads: int | None) -> None:
    """One line on stderr when the torch threads asked for (`threads`, else executor.threads) outnumber the cores
    this process may run on: each step then waits on threads that share a core, and latencies come out many times
    those of the machine."""
    want = threads or plan.executor.threads
    procs = plan.tensor_parallel_size * plan.pipeline_parallel_size  # each process of a parallel serve takes as many
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if want and want * procs > cores:
        where = ("--threads" if threads else "executor.threads") + f" {want}" + (f" x {procs} processes"
                                                                              if procs > 1 else "")
        print(f"infersim: warning: {where} on {cores} cores here: the threads share cores and every step slows "
              f"down; allowed, but the latencies measured are not this machine's at {cores} threads", file=sys.stderr)


def profile(device: str, model: str, out: Path, threads: int | None, quick: bool, repeats: int,
            refit: bool = False, scenario: Path | None = None) -> dict:
    """Time engine steps of many shapes on the executor and fit the step-cost model (or, with `refit`, fit
    the samples stored in `out` again); writes the profile JSON. `scenario`: as that scenario runs the executor."""
    from calibration.profile import profile_command, refit_command

    if not refit:
        _check_replaces_a_profile(out)
        prepare_out_file(out, "--out")
    return refit_command(out) if refit else profile_command(device, model, out, threads, quick, repeats, scenario)


def _check_replaces_a_profile(out: Path) -> None:
    """`--out` is a new path or a profile to measure again: any other file there would be overwritten after a sweep
    of minutes (a scenario or a report named by mistake)."""
    if not out.is_file():
        return
    try:
        data = json.loads(out.read_text(encoding="utf-8"))
        ok = isinstance(data, dict) and "samples" in data and "fit" in data
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise ConfigError(f"{out} exists and is not an infersim profile; allowed: a new path, or a profile to "
                          "measure again", "--out")


def distill(out: Path | None, layers: list[int], vocab_size: int, minutes: float, max_new: int,
            threads: int | None) -> None:
    """Distill SmolLM2-135M into a small draft model (speculative method draft_model)."""
    from executor.training.speculative import distill_command

    try:
        distill_command(out, layers, vocab_size, minutes, max_new, threads)
    except ValueError as e:
        raise ConfigError(str(e), "--layers") from None


def train_medusa(out: Path | None, num_heads: int, vocab_size: int, minutes: float, max_new: int,
                 threads: int | None, profile: Path | None, retree: bool = False) -> None:
    """Train Medusa-1 heads on SmolLM2-135M's generations and pick their tree (`retree`: only pick the tree)."""
    from calibration.validate import PROFILES
    from executor.training.speculative import retree_command, train_medusa_command

    profile = profile or PROFILES / "cpu.json"
    if retree:
        try:
            retree_command(out, profile)
        except FileNotFoundError as e:
            raise ConfigError(str(e), "--out") from None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # a medusa.json not as trained
            raise ConfigError(f"medusa.json there is not what `infersim train-medusa` writes ({type(e).__name__}: "
                              f"{str(e)[:80]})", "--out", None if out is None else str(out)) from None
        return
    train_medusa_command(out, num_heads, vocab_size, minutes, max_new, threads, profile)


def train_eagle(out: Path | None, vocab_size: int, minutes: float, max_new: int, threads: int | None,
                profile: Path | None, steps: int) -> None:
    """Train an EAGLE head on SmolLM2-135M's generations and pick its chain or tree (speculative method eagle)."""
    from calibration.validate import PROFILES
    from executor.training.eagle import train_eagle_command

    train_eagle_command(out, vocab_size, minutes, max_new, threads, profile or PROFILES / "cpu.json", steps)


def dashboard(port: int) -> None:
    """Serve the Streamlit dashboard (dashboard/app.py) on `port`: this process becomes the Streamlit server."""
    import importlib.util
    import os
    import sys

    missing = [m for m in ("streamlit", "plotly") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"the dashboard needs {' and '.join(missing)}: pip install 'infersim[dashboard]'",
                          "dashboard")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    args = [sys.executable, "-m", "streamlit", "run", str(root / "dashboard" / "app.py"), "--server.port", str(port),
            "--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
            "--browser.serverAddress", "localhost",  # no look-up of this machine's external address
            "--client.toolbarMode", "viewer"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)  # one process: stopping `infersim dashboard` stops the server


def step_time(data: dict | str | Path, new_tokens: list[int], context_lens: list[int] | None = None,
              pool: str | None = None, base_dir: Path = Path(".")) -> dict:
    """One step's time and where it goes, as the simulator prices it for a scenario (a mapping, or a YAML file): a
    dict with total_s, linear_s (the decoder layers' non-attention work: projections, norms, rotary, activation,
    residual adds; not embedding or LM head), attention_s, communication_s, lm_head_s, overhead_s, draft_s, swap_s,
    and source (what priced it: profile, gpu_kernels or roofline). `new_tokens` and `context_lens` (tokens in the
    KV cache after the step; default: each row's new tokens): one per sequence; rows of more than one token compute
    a prompt chunk. A disaggregated scenario prices prompt-only steps on its prefill pool, others on its decode pool
    (or `pool`)."""
    from infersim.step_cost import price, step_of

    plan = load_plan(data) if isinstance(data, (str, Path)) else plan_of(data, base_dir)
    return price(plan, step_of("step", list(new_tokens), list(context_lens) if context_lens else None), pool)


def step_costs(plan: Plan, steps=None, report: dict | None = None) -> list[tuple[str, dict]]:
    """(label, step_time's dict) of `steps` (infersim.step_cost.Step), default the scenario's typical ones: a prefill
    of its median prompt and decodes of 1, 8, 32 and max_num_seqs rows, or with a run's `report` of its mean decode
    batch."""
    from infersim.step_cost import decode_batch_of, price, typical_steps

    if steps is None:
        steps = typical_steps(plan, [decode_batch_of(report)] if report is not None else None)
    return [(s.label, price(plan, s)) for s in steps]


def model_catalog() -> dict:
    """The model catalog, by name."""
    from sim.config.models import MODEL_CATALOG

    return dict(MODEL_CATALOG)


def hardware_catalog() -> dict:
    """The hardware catalog, by name."""
    from sim.config.hardware import HARDWARE_CATALOG

    return dict(HARDWARE_CATALOG)

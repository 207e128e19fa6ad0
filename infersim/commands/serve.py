"""`infersim serve`: a scenario's workload replayed on the PyTorch executor (serve_scenario), or its model served as
an OpenAI-compatible HTTP server (http_server, serve_http). The executor's modules (torch) are imported inside the
functions that run it, after require_executor found them installed."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from infersim.inputs import check_checkpoint, check_drafters, load_plan, prepare_out, require_executor, warn_threads
from infersim.progress import progress_bar
from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.cost.build import make_cost_model
from sim.cost.fitted import load_profile
from sim.report.metrics import records_from_requests, request_rates
from sim.report.outputs import build_report, summary_text, write_outputs


def serve_scenario(path: Path, out: Path | None, device: str = "cpu", threads: int | None = None,
                   quiet: bool = False, plots: bool = True, profile: Path | None = None) -> dict:
    """Load, run on the executor, report. Returns report.json's content. `profile` (default: the scenario's
    cost_model.profile, if any): the fitted step costs the speculative overhead is measured against."""
    from executor.distributed.launch import WorkerError
    from executor.serving.disaggregated import serve_pools
    from executor.serving.serve import check_device, serve

    check_device(device)
    plan = load_plan(path)
    check_checkpoint(plan, path)
    prepare_out(out)
    cost = _overhead_cost(plan, profile)  # checked before the run, which takes minutes
    check_drafters([(path, plan)])
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
        raise _worker_failed(e, plan, out) from None
    warning = load.warning("this serve")
    if warning and not quiet:
        err.print(warning, style="yellow", highlight=False)
    report = _served_report(plan, records, traces, wall, engine, device, load, cost)
    if out is not None:
        _write_served(out, report, plan, records, traces, engine, requests, plots)
    if not quiet:
        print(summary_text(report))
        if out is not None:
            Console().print(f"wrote {out}/report.json, requests.csv, steps.jsonl, requests.jsonl"
                            + (", transfers.jsonl" if plan.pools is not None else "")
                            + (", speculative.yaml (the measured drafter, for the scenario's speculative: section)"
                               if "speculative" in report else ""))
    return report


def _overhead_cost(plan, profile: Path | None):
    """The fitted step costs a speculative serve's overhead is measured against: `profile`'s, else the scenario's
    cost_model.profile's, else None."""
    if profile is not None:
        return load_profile(profile, plan.model, "--profile")
    if plan.cost.profile is not None:
        return make_cost_model(plan)
    return None


def _worker_failed(e, plan, out: Path | None):
    """A worker process of the serve died (WorkerError `e`): what completed before it written to `out` (traces; a
    disaggregated run's report and transfers too), and the WorkerError to raise, saying so in one line."""
    from executor.distributed.launch import WorkerError
    from executor.serving.serve import write_traces

    if getattr(e, "requests", None) is None:  # it died starting up (a model load, a spawn): nothing was served
        return WorkerError(f"{e}, before any request was served", e.rank)
    done = sum(r.status.value == "finished" for r in e.requests)
    if out is not None:
        write_traces(out, e.engine, e.requests)
        if plan.pools is not None:  # disaggregated: the report of what completed, and the KV transfers
            partial = records_from_requests(e.requests)
            write_outputs(out, build_report(plan, partial, e.engine.traces, e.engine.wall_s, engine="executor",
                                            extra=e.engine.sections), partial, e.engine.traces, plots=False)
            e.engine.write_transfers(out)
    where = f" (their traces in {out})" if out is not None else ""
    return WorkerError(f"{e}; {done} of {len(e.requests)} requests completed before it{where}", e.rank)


def _served_report(plan, records, traces, wall: float, engine, device: str, load, cost) -> dict:
    """report.json of a serve: the simulator's report with engine "executor", the executor's settings and the
    machine's load meanwhile, and a speculative serve's measured drafter (its cost against `cost`'s steps)."""
    import torch

    from calibration.speculative import draft_cost

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
    return report


def _write_served(out: Path, report: dict, plan, records, traces, engine, requests, plots: bool) -> None:
    """A serve's files in `out`: the report, requests.csv and plots, the step and request traces, a disaggregated
    run's KV transfers, a speculative run's measured drafter (speculative.yaml)."""
    from calibration.speculative import write_speculative_yaml
    from executor.serving.serve import write_traces

    write_outputs(out, report, records, traces, plots=plots)
    write_traces(out, engine, requests)
    if plan.pools is not None:
        engine.write_transfers(out)
    if "speculative" in report:
        write_speculative_yaml(out / "speculative.yaml", plan, report["speculative"])


def check_serve_flags(http: bool, profile: Path | None, served_model: str | None, front: dict) -> None:
    """serve's flags fit its mode: --profile only replaying, the HTTP server's settings (`served_model`, the
    bounds in `front`, None where not given) only with --http."""
    if http:
        if profile is not None:
            raise ConfigError("--profile measures a replay's speculative overhead: not with --http", "--profile")
        return
    given = [k for k, v in {"served_model": served_model, **front}.items() if v is not None]
    if given:
        flag = "--" + given[0].removesuffix("_s").replace("_", "-")
        raise ConfigError(f"{flag} is a setting of an HTTP server: only with --http", flag)


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
    if plan.pools is not None or plan.replicas != 1 or plan.sharding.tp * plan.pipeline_parallel_size > 1:
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
    served = Served(client, info["tokenizer"], served_model or plan.model.name, info["vocab_size"],
                    plan.scheduler.max_model_len, info["eos_token_id"])
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
        print(summary_text(report))
        Console().print(f"wrote {out}/report.json, requests.csv, steps.jsonl, requests.jsonl")
    return report


KEEP_WARM_S = 1.0  # a CPU server keeps torch's threads busy this long into an idle spell (executor.keep_warm)


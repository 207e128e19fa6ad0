"""`infersim`: the command line. Thin: parses flags and calls the application API (infersim.api).
Bad input → one line on stderr and exit code 2."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Column, Table
from typer.core import TyperGroup

from infersim import api
from sim.config.errors import ConfigError
from sim.cost.build import describe_cost
from sim.report.outputs import cost_line

# typer >= 0.2x parses with its own copy of click, older ones with click itself
_UsageError = getattr(getattr(typer.core, "_click", None), "exceptions", None)
if _UsageError is None:
    import click.exceptions as _UsageError
_UsageError = _UsageError.UsageError


class _OneLineUsage(TyperGroup):
    """A mistake in a command's flags or arguments (a value out of range, a missing argument, an unknown option or
    command) is bad input like any other: one line and exit code 2, not a usage panel."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except _UsageError as e:
            sub = f" {e.ctx.info_name}" if e.ctx is not None and e.ctx.parent is not None else ""
            print(f"infersim: error: {' '.join(e.format_message().split())[:240]} (see infersim{sub} --help)",
                  file=sys.stderr)
            raise typer.Exit(2) from None


app = typer.Typer(cls=_OneLineUsage, add_completion=False, no_args_is_help=True,
                  help="infersim: capacity planning for LLM inference serving (simulate, then validate).")
DEFAULT_SCENARIO = "default.yaml"
MAX_THREADS = 4096  # the schema's executor.threads bound (torch overflowed on --threads 1e20)
MAX_MINUTES = 24 * 60.0  # a training budget past a day is a typo (inf trained forever)


def _path(value: str) -> Path:
    """A path flag's value; an empty one (an unset shell variable) would silently mean the current folder."""
    if isinstance(value, Path):  # a default: typer passes it through the parser too
        return value
    if not value.strip():
        raise typer.BadParameter("an empty path; give a folder or file name")
    return Path(value)


def _fail(e: ConfigError) -> None:
    print(f"infersim: error: {e.one_line()}", file=sys.stderr)
    raise typer.Exit(2)


@app.command()
def run(scenario: Optional[Path] = typer.Argument(None, help="scenario YAML (default: the embedded one)"),
        out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for report.json, requests.csv, plots"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no table, no progress bar"),
        no_plots: bool = typer.Option(False, "--no-plots", help="skip the PNG plots")) -> None:
    """Simulate a scenario and report TTFT / TPOT / ITL / E2E, throughput, goodput, KV use and cost."""
    try:
        api.run_scenario(scenario or api.default_scenario_path(), out, quiet=quiet, plots=not no_plots)
    except ConfigError as e:
        _fail(e)


@app.command()
def serve(scenario: Path = typer.Argument(..., help="scenario YAML (a model with real weights: SmolLM2-135M)"),
          out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the report and the step trace"),
          device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
          threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS,
                                                help="torch CPU threads (default: all cores)"),
          quiet: bool = typer.Option(False, "--quiet", "-q"),
          no_plots: bool = typer.Option(False, "--no-plots"),
          profile: Optional[Path] = typer.Option(None, "--profile", help="fitted profile of this device (default: the "
                                                 "scenario's cost_model.profile): a speculative scenario's overhead "
                                                 "per step is measured against its predicted verify steps"),
          http: bool = typer.Option(False, "--http", help="serve the scenario's model as an OpenAI-compatible HTTP "
                                    "server (its scheduler, KV cache and limits) until Ctrl-C, instead of replaying "
                                    "its workload; --out: the report of what it served, when it stops"),
          host: str = typer.Option("127.0.0.1", "--host", help="--http: the address to listen on"),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="--http: the port (0: any free one)"),
          served_model: Optional[str] = typer.Option(None, "--served-model", help="--http: the model's name in the "
                                                     "API (default: the scenario's model)"),
          api_key: Optional[str] = typer.Option(None, "--api-key", help="--http: clients must send Authorization: "
                                                "Bearer KEY; /health and /metrics stay open (default: "
                                                "$INFERSIM_API_KEY, else no key)"),
          max_request_bytes: Optional[int] = typer.Option(None, "--max-request-bytes", min=1024, max=1 << 30,
                                                          help="--http: larger request bodies get 413 unread "
                                                          "(default 4 MiB)"),
          max_connections: Optional[int] = typer.Option(None, "--max-connections", min=1, max=1_000_000,
                                                        help="--http: past this many open connections a request "
                                                        "gets 503 (default 1024)"),
          request_timeout: Optional[float] = typer.Option(None, "--request-timeout", min=0.1, max=3600.0,
                                                          help="--http: seconds a connection has to send a whole "
                                                          "request, headers and body (default 30)"),
          stall_timeout: Optional[float] = typer.Option(None, "--stall-timeout", min=0.1, max=3600.0,
                                                        help="--http: a response its client reads nothing of for "
                                                        "this many seconds is dropped, its KV freed (default 30)"),
          shutdown_timeout: Optional[float] = typer.Option(None, "--shutdown-timeout", min=0.0, max=3600.0,
                                                           help="--http: on SIGTERM or Ctrl-C, seconds requests in "
                                                           "flight get to finish before they are cancelled "
                                                           "(default 30)")) -> None:
    """Replay a scenario on the real PyTorch executor (online, requests arrive on their timestamps) and write
    the same report as `run`, with engine "executor", plus steps.jsonl and requests.jsonl; or, with --http, serve
    its model as an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)."""
    front = {"api_key": api_key, "max_request_bytes": max_request_bytes, "max_connections": max_connections,
             "request_timeout_s": request_timeout, "stall_timeout_s": stall_timeout,
             "shutdown_timeout_s": shutdown_timeout}
    try:
        if http:
            if profile is not None:
                raise ConfigError("--profile measures a replay's speculative overhead: not with --http", "--profile")
            _serve_http(scenario, host, port, device, threads, out, quiet, served_model, front)
            return
        given = [k for k, v in {"served_model": served_model, **front}.items() if v is not None]
        if given:
            flag = "--" + given[0].removesuffix("_s").replace("_", "-")
            raise ConfigError(f"{flag} is a setting of an HTTP server: only with --http", flag)
        api.require_executor("serve")
        from executor.distributed.launch import WorkerError
    except ConfigError as e:
        _fail(e)
    try:
        api.serve_scenario(scenario, out, device, threads, quiet=quiet, plots=not no_plots, profile=profile)
    except ConfigError as e:
        _fail(e)
    except WorkerError as e:  # a worker process of a parallel serve failed: one line, the partial traces written
        print(f"infersim: error: {scenario}: {e}", file=sys.stderr)
        raise typer.Exit(1)


def _serve_http(scenario: Path, host: str, port: int, device: str, threads: int | None, out: Path | None,
                quiet: bool, served_model: str | None, front: dict) -> None:
    """serve --http: the engine process dying is one line and exit code 1."""
    api.require_executor("serve")
    from executor.api_server.engine_client import EngineDied

    try:
        api.serve_http(scenario, host, port, device, threads, out, quiet=quiet, served_model=served_model,
                       limits=api.server_limits(**front))
    except EngineDied as e:
        print(f"infersim: error: {scenario}: {e}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command()
def profile(device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
            model: str = typer.Option("SmolLM2-135M", "--model", help="SmolLM2-135M or a local HF checkpoint folder"),
            out: Path = typer.Option(Path("calibration/profiles/cpu.json"), "--out", "-o", parser=_path),
            threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS,
                                                  help="torch CPU threads (default: all cores)"),
            quick: bool = typer.Option(False, "--quick", help="a smaller sweep (tests, smoke runs)"),
            repeats: int = typer.Option(3, "--repeats", min=1, max=100, help="runs of each workload; a step's time is "
                                        "the median over them"),
            refit: bool = typer.Option(False, "--refit", help="no sweep: fit the step-cost model again on the "
                                       "samples stored in the --out profile, in place"),
            scenario: Optional[Path] = typer.Option(None, "--scenario", help="profile the executor as this scenario "
                                                    "runs it: its model (random_weights too), its tensor- or "
                                                    "pipeline-parallel layout, its threads"),
            endpoint: Optional[str] = typer.Option(None, "--endpoint", help="profile a running OpenAI-compatible "
                                                   "server (URL, e.g. http://localhost:8000/v1) from its streams "
                                                   "instead: the model it serves is --scenario's, else --model"),
            served_model: Optional[str] = typer.Option(None, "--served-model", help="--endpoint: the model's name "
                                                       "there (default: the one it serves)"),
            tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="--endpoint: a local tokenizer (HF "
                                                    "folder or GGUF) where the server has no /tokenize")) -> None:
    """Time engine steps of many shapes on the executor (or a server's streams, --endpoint), fit the step-cost
    model, write a profile JSON."""
    try:
        if endpoint is not None:
            if refit or threads is not None or device != "cpu" or repeats != 3:
                raise ConfigError("--endpoint measures a running server: not with --refit, --threads, --device or "
                                  "--repeats", "--endpoint")
            api.profile_endpoint(endpoint, out, served_model, model, scenario, quick, tokenizer)
            return
        if served_model is not None or tokenizer is not None:
            raise ConfigError("--served-model and --tokenizer name an endpoint's: only with --endpoint",
                              "--served-model" if served_model is not None else "--tokenizer")
        api.require_executor("profile")
        api.profile(device, model, out, threads, quick, repeats, refit=refit, scenario=scenario)
    except ConfigError as e:
        _fail(e)


@app.command()
def distill(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the draft model (default: "
                                               "~/.cache/infersim/drafts/smollm2-135m)"),
            layers: str = typer.Option("0,1", "--layers", help="teacher layers the student starts from, comma-separated"),
            vocab_size: int = typer.Option(8192, "--vocab-size", min=16, help="tokens the draft can propose"),
            minutes: float = typer.Option(10.0, "--train-minutes", min=0.0, max=MAX_MINUTES,
                                          help="training time budget"),
            max_new: int = typer.Option(128, "--max-new", min=1, help="longest teacher answer generated"),
            threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS)) -> None:
    """Distill SmolLM2-135M into a small draft model for speculative decoding (method: draft_model)."""
    try:
        picked = [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        _fail(ConfigError(f"--layers takes comma-separated layer numbers, not {layers!r}", "--layers"))
    try:
        api.require_executor("distill")
    except ConfigError as e:
        _fail(e)
    teacher = api.model_catalog()["SmolLM2-135M"].num_layers  # checked here: the teacher takes seconds to load
    if not picked or any(not 0 <= n < teacher for n in picked):
        _fail(ConfigError(f"draft layers must be teacher layer numbers in 0..{teacher - 1}, got {picked}", "--layers"))
    try:
        api.prepare_out(out)  # before minutes of training that would end in the write
        api.distill(out, picked, vocab_size, minutes, max_new, threads)
    except ConfigError as e:
        _fail(e)


@app.command("train-medusa")
def train_medusa(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the heads (default: the "
                                                    "ones shipped in executor/data/medusa-smollm2-135m)"),
                 num_heads: int = typer.Option(3, "--heads", min=1, max=8, help="K: head d guesses d + 1 tokens on"),
                 vocab_size: int = typer.Option(8192, "--vocab-size", min=16, help="tokens the heads can propose"),
                 minutes: float = typer.Option(4.0, "--train-minutes", min=0.0, max=MAX_MINUTES,
                                               help="training time budget"),
                 max_new: int = typer.Option(128, "--max-new", min=1, help="longest teacher answer generated"),
                 threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS),
                 profile: Optional[Path] = typer.Option(None, "--profile", help="fitted profile that prices each "
                                                        "tree size (default: calibration/profiles/cpu.json)"),
                 retree: bool = typer.Option(False, "--retree", help="no training: pick the candidate tree of the "
                                             "heads in --out again for --profile (after re-profiling)")) -> None:
    """Train Medusa-1 heads on SmolLM2-135M's own generations and pick their candidate tree."""
    try:
        api.require_executor("train-medusa")
        if not retree:  # before minutes of training that would end in the write
            api.prepare_out(out)
        elif out is not None and out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a folder", "--out")
        api.train_medusa(out, num_heads, vocab_size, minutes, max_new, threads, profile, retree=retree)
    except ConfigError as e:
        _fail(e)


@app.command("train-eagle")
def train_eagle(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the head (default: the "
                                                   "one shipped in executor/data/eagle-smollm2-135m)"),
                steps: int = typer.Option(3, "--steps", min=1, max=8, help="chain steps unrolled in training: the "
                                          "deepest draft it is trained for"),
                vocab_size: int = typer.Option(8192, "--vocab-size", min=16, help="tokens the head can propose"),
                minutes: float = typer.Option(12.0, "--train-minutes", min=0.0, max=MAX_MINUTES,
                                              help="training time budget"),
                max_new: int = typer.Option(128, "--max-new", min=1, help="longest target answer generated"),
                threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS),
                profile: Optional[Path] = typer.Option(None, "--profile", help="fitted profile that prices each "
                                                       "chain or tree (default: calibration/profiles/cpu.json)")) -> None:
    """Train an EAGLE head (one decoder layer over SmolLM2-135M's hidden states) and pick its chain or tree."""
    try:
        api.require_executor("train-eagle")
        api.prepare_out(out)  # before minutes of training that would end in the write
        api.train_eagle(out, vocab_size, minutes, max_new, threads, profile, steps)
    except ConfigError as e:
        _fail(e)


@app.command()
def validate(scenarios: List[Path] = typer.Argument(..., help="scenario YAMLs (or folders of them) with a model "
                                                               "that has real weights"),
             out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for validation.json and the CDF plot "
                                                "(one subfolder per scenario when there are several)"),
             device: str = typer.Option("cpu", "--device"),
             profile_path: Optional[Path] = typer.Option(None, "--profile",
                                                         help="default: calibration/profiles/DEVICE.json"),
             threads: Optional[int] = typer.Option(None, "--threads", min=1, max=MAX_THREADS),
             repeat: int = typer.Option(1, "--repeat", min=1, max=100, help="executor runs per scenario: real is their "
                                        "mean, and two or more report the real-vs-real spread"),
             real_from: Optional[Path] = typer.Option(None, "--real-from", help="score the executor runs recorded "
                                                      "by an earlier `validate --out DIR` (DIR) instead of running "
                                                      "them: e.g. to compare a new profile on the same runs"),
             alongside: Optional[Path] = typer.Option(None, "--profile-alongside", help="profile the device again "
                                                      "while validating (a slice of the sweep before each executor "
                                                      "run and after the last; ~4 min more for SmolLM2 on a CPU), "
                                                      "write it here and predict with it: profile and runs then "
                                                      "see the machine in the same minutes"),
             capacity: bool = typer.Option(False, "--capacity", help="validate capacity instead: the highest "
                                           "arrival rate meeting the SLOs (a closed loop: the most users), found by "
                                           "a search of real serves (the scenario's requests, their gaps scaled) "
                                           "and predicted on the same grid; writes capacity.json"),
             precision: float = typer.Option(0.05, "--precision", min=0.01, max=1.0, help="--capacity: the rate "
                                             "grid's step (capacity is found within it)"),
             requests: Optional[int] = typer.Option(None, "--requests", min=2, help="--capacity: probe with this "
                                                    "many requests of the scenario's workload instead (a longer "
                                                    "probe judges keeping up more finely)"),
             endpoint: Optional[str] = typer.Option(None, "--endpoint", help="replay the scenario against a running "
                                                    "OpenAI-compatible server (URL) instead of the executor, and "
                                                    "compare it with the simulation (--profile, else the "
                                                    "scenario's cost model)"),
             served_model: Optional[str] = typer.Option(None, "--served-model", help="--endpoint: the model's "
                                                        "name there (default: the one it serves)"),
             tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="--endpoint: a local tokenizer (HF "
                                                     "folder or GGUF) where the server has no /tokenize"),
             chat: bool = typer.Option(False, "--chat", help="--endpoint: send /v1/chat/completions (the server's "
                                       "chat template around each prompt) instead of /v1/completions"),
             timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, help="--endpoint: a request "
                                                     "not done this many seconds after it was sent ends rejected"),
             published: Optional[Path] = typer.Option(None, "--published", parser=_path, help="score the "
                                                      "simulation per stage against a real run's published figures "
                                                      "(JSON: scenarios/gpu_validation/published/) instead")
             ) -> None:
    """Run scenarios on the executor (or a server, --endpoint) and in the simulator; print real vs sim and the %
    error per metric. With --published, score the simulation against a real run's published figures."""
    runs = [("--real-from", real_from), ("--profile-alongside", alongside), ("--threads", threads),
            ("--repeat", repeat if repeat > 1 else None), ("--capacity", capacity or None), ("--requests", requests),
            ("--device", device if device != "cpu" else None)]  # what only runs of the executor take
    if published is not None:
        return _validate_published(scenarios, published, out, [*runs, ("--endpoint", endpoint), ("--profile", profile_path)])
    if endpoint is not None:
        return _validate_endpoint(scenarios, endpoint, served_model, profile_path, out, tokenizer, chat, timeout, runs)
    try:
        if served_model is not None or tokenizer is not None or chat or timeout is not None:
            raise ConfigError("--served-model, --tokenizer, --chat and --timeout are for an endpoint: only with "
                              "--endpoint", "--endpoint")
        api.require_executor("validate")
        from executor.distributed.launch import WorkerError
    except ConfigError as e:
        _fail(e)
    try:
        if capacity:
            if real_from is not None or repeat > 1:
                raise ConfigError("--capacity runs its own probes: not with --real-from or --repeat", "--capacity")
            results, prof = api.validate_capacity(scenarios, out, device, profile_path, threads, alongside, precision,
                                                  requests)
        elif requests is not None:
            raise ConfigError("--requests sizes the capacity probes: only with --capacity", "--requests")
        else:
            results, prof, summary = api.validate(scenarios, out, device, profile_path, threads, repeat, real_from,
                                                  alongside)
    except ConfigError as e:
        _fail(e)
    except WorkerError as e:  # a worker process of a parallel or disaggregated serve failed: one line
        print(f"infersim: error: {e}", file=sys.stderr)
        raise typer.Exit(1)
    if capacity:
        _print_capacity(results, device, prof)
    else:
        _print_validations(results, device, prof, summary, out)


def _print_validations(results: list[dict], device: str, prof, summary: dict | None, out: Path | None) -> None:
    """Each scenario's real vs sim table, the machine's drift, and over several scenarios the summary table."""
    for result in results:
        _print_validation(result, device, prof, result["runs"])
    drift = _drift_line(results)
    if drift:
        Console().print(drift)
    if summary is None:
        return
    spread = any(r["runs"] > 1 for r in results)
    t = Table("metric", "max |error| %", "median |error| %", "median |error| % at run speed",
              *(["median spread %"] if spread else []))
    for name, row in summary.items():
        t.add_row(name, _num(row["max_abs_error_pct"]), _num(row["median_abs_error_pct"]),
                  _num(row["median_abs_error_at_run_speed_pct"]),
                  *([_num(row["median_spread_pct"])] if spread else []))
    Console().print(f"[bold]{len(results)} scenarios[/]")
    Console().print(t)
    if out is not None:
        Console().print(f"wrote {out}/summary.json, table.md and one folder per scenario")


def _validate_endpoint(scenarios: List[Path], endpoint: str, served_model, profile_path, out, tokenizer, chat,
                       timeout, others: list) -> None:
    """`validate --endpoint`: one scenario replayed against a server, its table printed."""
    try:
        given = [flag for flag, value in others if value is not None]
        if given:
            raise ConfigError(f"--endpoint replays against a running server: not with {', '.join(given)}",
                              "--endpoint")
        if len(scenarios) != 1 or scenarios[0].is_dir():
            raise ConfigError("--endpoint replays one scenario file", "SCENARIO")
        result = api.validate_endpoint(scenarios[0], endpoint, served_model, profile_path, out, tokenizer, chat,
                                       timeout)
    except ConfigError as e:
        _fail(e)
    ep = result["endpoint"]
    _print_validation(result, f"{ep['url']} ({ep['model']}, {ep['engine']})", result["profile"] or "its cost model",
                      1)
    rq, lengths = result["requests"], result["lengths"]
    Console().print(f"requests: {rq['arrived']} sent, {rq['completed']} completed, {rq['rejected']} rejected"
                    + "".join(f"; {n} {reason}" for reason, n in rq["rejected_by_reason"].items())
                    + f"; prompts the server counted otherwise: {lengths['prompts_off']} of "
                    f"{lengths['prompts_counted_by_server']}, outputs of another length: {lengths['outputs_off']}")
    if out is not None:
        Console().print(f"wrote {out}/validation.json, requests.csv, requests.jsonl, latency_cdf_sim_vs_real.png")


def _validate_published(scenarios: List[Path], published: Path, out, others: list) -> None:
    """`validate --published`: one scenario simulated and scored against a published run, a table per stage."""
    try:
        given = [flag for flag, value in others if value is not None]
        if given:
            raise ConfigError(f"--published scores a simulation against published figures: not with "
                              f"{', '.join(given)}", "--published")
        if len(scenarios) != 1 or scenarios[0].is_dir():
            raise ConfigError("--published scores one scenario file", "SCENARIO")
        result = api.validate_published(scenarios[0], published, out)
    except ConfigError as e:
        _fail(e)
    engine = result["engine"]
    what = f"{engine.get('name', 'the real run')} {engine.get('version') or ''}".strip()
    for stage in result["stages"]:
        t = Table("metric", "real", "sim", "error %")
        for name, row in stage["metrics"].items():
            t.add_row(name, _num(row["real"]), _num(row["sim"]), _pct(row["error_pct"]))
        up = stage["keeps_up"]
        Console().print(f"[bold]{result['scenario']}[/] stage {stage['stage']} at {stage['rate']:g} req/s: {what} "
                        f"(published) vs simulated; kept up: real {'yes' if up['real'] else 'no'}, sim "
                        f"{'yes' if up['sim'] else 'no'}", highlight=False)
        Console().print(t)
    if out is not None:
        Console().print(f"wrote {out}/validation.json")


def _print_validation(result: dict, device: str, prof: Path, repeat: int) -> None:
    spread = repeat > 1
    t = Table("metric", "real", "sim", "error %", "error % at the run's step speed",
              *(["runs", "spread %"] if spread else []))
    for name, row in result["metrics"].items():
        cells = [_num(row["real"]), _num(row["sim"]), _pct(row["error_pct"]), _pct(row.get("error_at_run_speed_pct"))]
        if spread:
            cells += [" ".join(_num(v) for v in row["real_runs"]), _num(row["spread_pct"])]
        t.add_row(name, *cells)
    spec = result.get("speculative")
    for name in ("tpot_p50_speedup", "throughput_speedup") if spec else ():
        row = spec[name]
        t.add_row(name, _num(row["real"]), _num(row["sim"]), _pct(row["error_pct"]),
                  _pct(row.get("error_at_run_speed_pct")), *(["", ""] if spread else []))
    if spec:
        t.add_row("alpha", _num(spec["alpha_real"]), _num(spec["alpha_sim"]), "", "", *(["", ""] if spread else []))
    real = "real (mean of %d executor runs)" % repeat if spread else "real"
    Console().print(f"[bold]{result['scenario']}[/] on {device}: {real} vs simulated with {prof}")
    Console().print(t)


def _print_capacity(results: list[dict], device: str, prof: Path) -> None:
    units = sorted({r.get("unit", "req/s") for r in results})
    t = Table("scenario", f"measured {' / '.join(units)}", "missed at", "predicted", "error %", "at run speed",
              "error %", "probes")
    for r in results:
        m, p, s = r["measured"], r["predicted"], r["predicted_at_run_speed"] or {}
        t.add_row(r["scenario"], _num(m["capacity_rps"]), _num(m["missed_at_rps"]), _num(p["capacity_rps"]),
                  _pct(r["error_pct"]), _num(s.get("capacity_rps")), _pct(r["error_at_run_speed_pct"]),
                  " ".join(f"{q['rate']:.3g}{'+' if q['passes'] else '-'}{'' if q['sim_passes'] == q['passes'] else '!'}"
                           for q in r["probes"]))
    Console().print(f"capacity on {device} (grid step {results[0]['precision']:.0%}) vs simulated with {prof}; "
                    "probes: rate (a closed loop: users), + met the SLOs / - missed, ! where the simulator said "
                    "otherwise")
    Console().print(t)


# Steps running this far from the profile on average mean the machine itself has changed speed since profiling.
DRIFT_WARN = 0.05


def _drift_line(results: list[dict]) -> str | None:
    """One line when the executor's steps ran, on average over every run, more than DRIFT_WARN off the profile's
    prediction for their own shapes: the latencies' errors then carry the machine's drift, not the model's."""
    ratios = [r["all"] for result in results for r in result.get("step_time_ratio", []) if r.get("all")]
    if not ratios:
        return None
    mean = sum(ratios) / len(ratios)
    if abs(mean - 1) <= DRIFT_WARN:
        return None
    way = "faster" if mean < 1 else "slower"
    return (f"steps ran {mean:.2f}x the profile's prediction for their shapes ({min(ratios):.2f}-{max(ratios):.2f} "
            f"over {len(ratios)} runs): this machine is {abs(1 / mean - 1) * 100:.0f}% {way} than when profiled, "
            "and TPOT's error carries that; `infersim profile` again, or read the 'at the run's step speed' column")


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}"


@app.command()
def search(spec: Path = typer.Argument(..., help="search spec YAML: scenario, target, space, search"),
           out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for search.json, search.md, pareto.png"),
           backend: str = typer.Option("local", "--backend", help="local (processes on this machine) or ray"),
           address: Optional[str] = typer.Option(None, "--address", help="ray: the cluster (default: a local Ray)"),
           workers: Optional[int] = typer.Option(None, "--workers", min=1, help="local: processes (default: cores)"),
           quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
    """Find each configuration's capacity within the SLOs, the Pareto front and the cheapest one for the target."""
    from infersim import search as srch

    console = Console()
    try:
        found = srch.load_search_spec(spec)
        api.prepare_out(out)
        n = len(srch.configurations(found))
        with api.progress_bar(Console(stderr=True), quiet, "configurations", n) as bar:
            result = srch.run_search(found, backend, workers, progress=bar, address=address)
    except ConfigError as e:
        _fail(e.with_file(str(spec)) if e.key_path.startswith(("space", "target", "search", "scenario")) else e)
    if out is not None:
        srch.write_outputs(out, result)
    if quiet:
        return
    keep = [0, 1, 4, 5, 6, 8, 10]  # search.md has every column; the terminal the ones that decide
    columns = srch.header(result.unit)
    t = Table(*(columns[i] for i in keep[:-1]), Column(columns[-1], overflow="fold"),
              title=f"{result.name}: {n} configurations, target {result.target_rate:.3g} {result.unit} "
              f"({result.probes} probes, {result.wall_s:.1f} s)")
    for row in srch.table_rows(result)[:30]:
        t.add_row(*(row[i] for i in keep))
    console.print(t)
    best = result.recommended
    if best is None:
        console.print(f"[bold red]no configuration carries {result.target_rate:.3g} {result.unit} within the SLOs[/]")
    else:
        console.print(f"[bold]recommended:[/] {best.label}: ${best.usd_per_hour:.2f}/h, capacity "
                      f"{'≥ ' if best.probe_limited else ''}{best.capacity_rps:.3g} {result.unit} (margin "
                      f"{'≥ ' if best.probe_limited else ''}{best.capacity_rps / result.target_rate - 1:+.0%})")
    if out is not None:
        console.print(f"wrote {out}/search.json, search.md, pareto.png")


@app.command()
def compare(scenarios: List[Path] = typer.Argument(..., help="scenario YAMLs (the first one's workload runs on all)"),
            sweep: Optional[List[str]] = typer.Option(None, "--sweep", help="KEY=V1,V2,...: one scenario, one key "
                                                      "swept (several keys: `infersim search`)"),
            out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for compare.json, compare.md, cdf.png"),
            quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
    """Simulate several configurations on the same workload: one table and overlaid latency CDFs."""
    from infersim import compare as cmp
    from sim.config.yaml_file import read_yaml

    try:
        api.check_distinct(scenarios)
        if sweep and len(sweep) > 1:  # typer kept the last and dropped the others without a word
            raise ConfigError(f"given {len(sweep)} times; allowed: once (several keys: `infersim search`)", "--sweep")
        sweep = sweep[0] if sweep else None
        items = []
        for path in scenarios:
            data = read_yaml(path)
            if not isinstance(data, dict):
                raise ConfigError("a scenario is a mapping of keys", file=str(path))
            items.append((path.stem, data))
        stems = [label for label, _ in items]
        # files with the same name in different folders are labelled by their paths
        items = [(str(p) if stems.count(label) > 1 else label, d) for p, (label, d) in zip(scenarios, items)]
        dirs, files = [p.parent for p in scenarios], [str(p) for p in scenarios]
        if sweep is not None:
            if len(items) != 1:
                raise ConfigError("--sweep takes exactly one scenario", "--sweep")
            items = cmp.sweep(items[0][1], *cmp.parse_sweep(sweep))
            dirs, files = dirs * len(items), [f"{scenarios[0]} (--sweep {label})"[:200] for label, _ in items]
        elif len(items) < 2:
            raise ConfigError("give two or more scenarios, or one and --sweep KEY=V1,V2")
        else:
            which, sections = cmp.differing(items, dirs)
            if which:  # they run the first's: say so, a table of unlike workloads would mislead
                names = ", ".join(str(scenarios[i]) for i in which[:3]) + (" ..." if len(which) > 3 else "")
                what = " and ".join(sections)
                print(f"infersim: note: {names}: {what} {'differ' if len(sections) > 1 else 'differs'} from "
                      f"{scenarios[0]}'s; every scenario runs "
                      f"{scenarios[0]}'s {what}", file=sys.stderr)
        api.prepare_out(out)
        results = cmp.compare_data(items, scenarios[0].parent, dirs=dirs, files=files)
    except ConfigError as e:
        _fail(e)
    if out is not None:
        cmp.write_outputs(out, results)
    if not quiet:
        t = Table("configuration", *(c[0] for c in cmp.COLUMNS), title="on the workload of " + str(scenarios[0]))
        for row in cmp.table(results):
            t.add_row(*row)
        Console().print(t)
        if out is not None:
            Console().print(f"wrote {out}/compare.json, compare.md, cdf.png")


@app.command("step-cost")
def step_cost(scenario: Optional[Path] = typer.Argument(None, help="scenario YAML (default: the embedded one)"),
              new_tokens: Optional[List[int]] = typer.Option(None, "--new-tokens", help="new tokens of one sequence "
                                                             "of the step (repeat: one per sequence); default: the "
                                                             "scenario's typical prefill and decode steps"),
              context: Optional[List[int]] = typer.Option(None, "--context", help="its tokens in the KV cache after "
                                                          "the step (repeat, one per --new-tokens; default: the new "
                                                          "tokens)"),
              pool: Optional[str] = typer.Option(None, "--pool", help="disaggregated: prefill or decode (default: "
                                                 "prefill for prompt chunks alone)")) -> None:
    """One engine step's time and where it goes (linear layers, attention, communication, LM head, host
    overhead), as the simulator prices it: the scenario's typical steps, or the one given."""
    from infersim.step_cost import step_of

    path = scenario or api.default_scenario_path()
    try:
        plan = api.load_plan(path)
        steps = [step_of("step", new_tokens, context)] if new_tokens else None
        if pool is not None and steps is None:
            raise ConfigError("names the pool of a step given by --new-tokens", "--pool")
        rows = [("step", api.step_time(path, steps[0].new_tokens, steps[0].context_lens, pool))] if steps \
            else api.step_costs(plan)
        priced = describe_cost(plan.pools.decode if plan.pools is not None else plan)
    except ConfigError as e:
        _fail(e)
    parts = [p for p in ("linear_s", "experts_s", "attention_s", "communication_s", "lm_head_s", "overhead_s", "draft_s",
                         "swap_s") if any(r[p] for _, r in rows)]
    t = Table("step", "total ms", *(f"{p[:-2].replace('_', ' ')} ms (%)" for p in parts), title=plan.name)
    for label, r in rows:
        t.add_row(label, f"{r['total_s'] * 1e3:.3f}",
                  *(f"{r[p] * 1e3:.3f} ({100 * r[p] / r['total_s']:.0f}%)" if r["total_s"] else "0" for p in parts))
    console = _wide_console()
    console.print(t)
    console.print(f"priced by: {cost_line(priced)}")


@app.command()
def models() -> None:
    """List the model catalog (layers: their attention kinds; KV/token: every layer that caches per token)."""
    from sim.config.layers import describe

    t = Table("params", "active", "experts", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
              "vocab", "max_len", "dtype", "KV/token")
    t.columns.insert(0, Column("name", no_wrap=True))
    for m in api.model_catalog().values():
        experts = f"{m.num_experts_per_tok}/{m.num_experts}" if m.num_experts else "-"
        dtype = m.weight_dtype + (f" ({m.expert_weight_dtype} experts)" if m.expert_weight_dtype else "")
        t.add_row(m.name, f"{m.num_params / 1e9:.2f}B", f"{m.active_params / 1e9:.2f}B", experts, describe(m),
                  str(m.hidden_size), str(m.num_heads), str(m.num_kv_heads), str(m.head_size),
                  str(m.intermediate_size), str(m.vocab_size), str(m.max_position_embeddings), dtype,
                  f"{m.kv_bytes_per_token / 1024:.0f} KiB")
    _wide_console().print(t)


@app.command()
def hardware() -> None:
    """List the hardware catalog."""
    t = Table(Column("name", no_wrap=True), "memory", "bandwidth", "bf16 dense", "fp8 dense", "fp4 dense", "int8",
              "interconnect", "$/hour")
    for h in api.hardware_catalog().values():
        rates = [_flops(h.peak_flops[d]) if d in h.peak_flops else "-" for d in ("fp8", "fp4", "int8")]
        t.add_row(h.name, f"{h.memory_gib:.1f} GiB", f"{h.memory_bandwidth / 1e9:,.0f} GB/s",
                  _flops(h.flops("bf16")), *rates, f"{h.interconnect_bandwidth / 1e9:,.0f} GB/s",
                  f"{h.price_per_hour:.2f}")
    _wide_console().print(t)


def _flops(x: float) -> str:
    return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.0f} GFLOP/s"


def _wide_console() -> Console:
    """Tables piped to a file or grep keep their full width."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


@app.command()
def dashboard(port: int = typer.Option(8501, "--port", min=1, max=65535, help="port to serve on")) -> None:
    """Serve the Streamlit dashboard (What-if, Compare, Search, Validation) at http://localhost:PORT."""
    try:
        api.dashboard(port)
    except ConfigError as e:
        _fail(e)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

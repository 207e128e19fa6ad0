"""`infersim`: the command line. Thin: parses flags and calls the command's module (infersim/commands/), imported only
when that command runs, so that `infersim --help` or `infersim run` loads nothing another command needs.
Bad input → one line on stderr and exit code 2."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer
import typer.core
from typer.core import TyperGroup

from infersim.inputs import check_distinct, default_scenario_path, prepare_out, require_executor
from infersim.progress import progress_bar
from sim.config.errors import ConfigError

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
MAX_THREADS = 4096  # the schema's executor.threads bound (torch overflowed on --threads 1e20)
MAX_MINUTES = 24 * 60.0  # a training budget past a day is a typo (inf trained forever)
# options several commands take alike: one declaration, the same flag and help everywhere
Device = Annotated[str, typer.Option("--device", help="cpu or cuda")]
Threads = Annotated[Optional[int], typer.Option("--threads", min=1, max=MAX_THREADS,
                                                help="torch CPU threads (default: all cores)")]
# the options of the commands that train a drafter (distill, train-medusa, train-eagle); each its own defaults
VocabSize = Annotated[int, typer.Option("--vocab-size", min=16, help="tokens the drafter can propose")]
TrainMinutes = Annotated[float, typer.Option("--train-minutes", min=0.0, max=MAX_MINUTES, help="training time budget")]
MaxNew = Annotated[int, typer.Option("--max-new", min=1, help="longest answer of the target model generated to "
                                     "train on")]
DrafterProfile = Annotated[Optional[Path], typer.Option("--profile", help="fitted profile that prices each candidate "
                                                        "tree or chain (default: calibration/profiles/cpu.json)")]
Endpoint = Annotated[Optional[str], typer.Option("--endpoint", help="a running OpenAI-compatible server (URL, e.g. "
                                                 "http://localhost:8000/v1) to measure instead of the executor")]
EndpointModel = Annotated[Optional[str], typer.Option("--served-model", help="--endpoint: the model's name there "
                                                      "(default: the one it serves)")]
EndpointTokenizer = Annotated[Optional[str], typer.Option("--tokenizer", help="--endpoint: a local tokenizer (HF "
                                                          "folder or GGUF) where the server has no /tokenize")]


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
    from infersim.commands.run import run_scenario

    try:
        run_scenario(scenario or default_scenario_path(), out, quiet=quiet, plots=not no_plots)
    except ConfigError as e:
        _fail(e)


def _http_bound(flag: str, low: float, high: float, help: str):
    """A bound of serve --http's front, within [low, high]: None (the server's default) unless given."""
    return typer.Option(None, flag, min=low, max=high, help=f"--http: {help}")


@app.command()
def serve(scenario: Path = typer.Argument(..., help="scenario YAML (a model with real weights: SmolLM2-135M)"),
          out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the report and the step trace"),
          device: Device = "cpu",
          threads: Threads = None,
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
          max_request_bytes: Optional[int] = _http_bound("--max-request-bytes", 1024, 1 << 30, "larger request "
                                                         "bodies get 413 unread (default 4 MiB)"),
          max_connections: Optional[int] = _http_bound("--max-connections", 1, 1_000_000, "past this many open "
                                                       "connections a request gets 503 (default 1024)"),
          request_timeout: Optional[float] = _http_bound("--request-timeout", 0.1, 3600.0, "seconds a connection has "
                                                         "to send a whole request, headers and body (default 30)"),
          stall_timeout: Optional[float] = _http_bound("--stall-timeout", 0.1, 3600.0, "a response its client reads "
                                                       "nothing of for this many seconds is dropped, its KV freed "
                                                       "(default 30)"),
          shutdown_timeout: Optional[float] = _http_bound("--shutdown-timeout", 0.0, 3600.0, "on SIGTERM or Ctrl-C, "
                                                          "seconds requests in flight get to finish before they are "
                                                          "cancelled (default 30)")) -> None:
    """Replay a scenario on the real PyTorch executor (online, requests arrive on their timestamps) and write
    the same report as `run`, with engine "executor", plus steps.jsonl and requests.jsonl; or, with --http, serve
    its model as an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)."""
    from infersim.commands.serve import check_serve_flags, serve_scenario

    front = {"api_key": api_key, "max_request_bytes": max_request_bytes, "max_connections": max_connections,
             "request_timeout_s": request_timeout, "stall_timeout_s": stall_timeout,
             "shutdown_timeout_s": shutdown_timeout}
    try:
        check_serve_flags(http, profile, served_model, front)
        if http:
            _serve_http(scenario, host, port, device, threads, out, quiet, served_model, front)
            return
        require_executor("serve")
        from executor.distributed.launch import WorkerError
    except ConfigError as e:
        _fail(e)
    try:
        serve_scenario(scenario, out, device, threads, quiet=quiet, plots=not no_plots, profile=profile)
    except ConfigError as e:
        _fail(e)
    except WorkerError as e:  # a worker process of a parallel serve failed: one line, the partial traces written
        print(f"infersim: error: {scenario}: {e}", file=sys.stderr)
        raise typer.Exit(1)


def _serve_http(scenario: Path, host: str, port: int, device: str, threads: int | None, out: Path | None,
                quiet: bool, served_model: str | None, front: dict) -> None:
    """serve --http: the engine process dying is one line and exit code 1."""
    require_executor("serve")
    from executor.api_server.engine_client import EngineDied
    from infersim.commands.serve import serve_http, server_limits

    try:
        serve_http(scenario, host, port, device, threads, out, quiet=quiet, served_model=served_model,
                   limits=server_limits(**front))
    except EngineDied as e:
        print(f"infersim: error: {scenario}: {e}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command()
def profile(device: Device = "cpu",
            model: str = typer.Option("SmolLM2-135M", "--model", help="SmolLM2-135M or a local HF checkpoint folder"),
            out: Path = typer.Option(Path("calibration/profiles/cpu.json"), "--out", "-o", parser=_path),
            threads: Threads = None,
            quick: bool = typer.Option(False, "--quick", help="a smaller sweep (tests, smoke runs)"),
            repeats: int = typer.Option(3, "--repeats", min=1, max=100, help="runs of each workload; a step's time is "
                                        "the median over them"),
            refit: bool = typer.Option(False, "--refit", help="no sweep: fit the step-cost model again on the "
                                       "samples stored in the --out profile, in place"),
            scenario: Optional[Path] = typer.Option(None, "--scenario", help="profile the executor as this scenario "
                                                    "runs it: its model (random_weights too), its tensor- or "
                                                    "pipeline-parallel layout, its threads"),
            endpoint: Endpoint = None,
            served_model: EndpointModel = None,
            tokenizer: EndpointTokenizer = None) -> None:
    """Time engine steps of many shapes on the executor (or a server's streams, --endpoint: the model it serves is
    --scenario's, else --model), fit the step-cost model, write a profile JSON."""
    try:
        if endpoint is not None:
            if refit or threads is not None or device != "cpu" or repeats != 3:
                raise ConfigError("--endpoint measures a running server: not with --refit, --threads, --device or "
                                  "--repeats", "--endpoint")
            from infersim.commands.profile_endpoint import profile_endpoint

            profile_endpoint(endpoint, out, served_model, model, scenario, quick, tokenizer)
            return
        if served_model is not None or tokenizer is not None:
            raise ConfigError("--served-model and --tokenizer name an endpoint's: only with --endpoint",
                              "--served-model" if served_model is not None else "--tokenizer")
        require_executor("profile")
        from infersim.commands.profile import profile as measure

        measure(device, model, out, threads, quick, repeats, refit=refit, scenario=scenario)
    except ConfigError as e:
        _fail(e)


@app.command()
def distill(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the draft model (default: "
                                               "~/.cache/infersim/drafts/smollm2-135m)"),
            layers: str = typer.Option("0,1", "--layers", help="teacher layers the student starts from, comma-separated"),
            vocab_size: VocabSize = 8192,
            minutes: TrainMinutes = 10.0,
            max_new: MaxNew = 128,
            threads: Threads = None) -> None:
    """Distill SmolLM2-135M into a small draft model for speculative decoding (method: draft_model)."""
    from infersim.commands.catalogs import model_catalog
    from infersim.commands.training import distill as train_draft

    try:
        picked = [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        _fail(ConfigError(f"--layers takes comma-separated layer numbers, not {layers!r}", "--layers"))
    try:
        require_executor("distill")
    except ConfigError as e:
        _fail(e)
    teacher = model_catalog()["SmolLM2-135M"].num_layers  # checked here: the teacher takes seconds to load
    if not picked or any(not 0 <= n < teacher for n in picked):
        _fail(ConfigError(f"draft layers must be teacher layer numbers in 0..{teacher - 1}, got {picked}", "--layers"))
    try:
        prepare_out(out)  # before minutes of training that would end in the write
        train_draft(out, picked, vocab_size, minutes, max_new, threads)
    except ConfigError as e:
        _fail(e)


@app.command("train-medusa")
def train_medusa(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the heads (default: the "
                                                    "ones shipped in executor/data/medusa-smollm2-135m)"),
                 num_heads: int = typer.Option(3, "--heads", min=1, max=8, help="K: head d guesses d + 1 tokens on"),
                 vocab_size: VocabSize = 8192,
                 minutes: TrainMinutes = 4.0,
                 max_new: MaxNew = 128,
                 threads: Threads = None,
                 profile: DrafterProfile = None,
                 retree: bool = typer.Option(False, "--retree", help="no training: pick the candidate tree of the "
                                             "heads in --out again for --profile (after re-profiling)")) -> None:
    """Train Medusa-1 heads on SmolLM2-135M's own generations and pick their candidate tree."""
    from infersim.commands.training import train_medusa as train_heads

    try:
        require_executor("train-medusa")
        if not retree:  # before minutes of training that would end in the write
            prepare_out(out)
        elif out is not None and out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a folder", "--out")
        train_heads(out, num_heads, vocab_size, minutes, max_new, threads, profile, retree=retree)
    except ConfigError as e:
        _fail(e)


@app.command("train-eagle")
def train_eagle(out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for the head (default: the "
                                                   "one shipped in executor/data/eagle-smollm2-135m)"),
                steps: int = typer.Option(3, "--steps", min=1, max=8, help="chain steps unrolled in training: the "
                                          "deepest draft it is trained for"),
                vocab_size: VocabSize = 8192,
                minutes: TrainMinutes = 12.0,
                max_new: MaxNew = 128,
                threads: Threads = None,
                profile: DrafterProfile = None) -> None:
    """Train an EAGLE head (one decoder layer over SmolLM2-135M's hidden states) and pick its chain or tree."""
    from infersim.commands.training import train_eagle as train_head

    try:
        require_executor("train-eagle")
        prepare_out(out)  # before minutes of training that would end in the write
        train_head(out, vocab_size, minutes, max_new, threads, profile, steps)
    except ConfigError as e:
        _fail(e)


@app.command()
def validate(scenarios: List[Path] = typer.Argument(..., help="scenario YAMLs (or folders of them) with a model "
                                                               "that has real weights"),
             out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for validation.json and the CDF plot "
                                                "(one subfolder per scenario when there are several)"),
             device: Device = "cpu",
             profile_path: Optional[Path] = typer.Option(None, "--profile",
                                                         help="default: calibration/profiles/DEVICE.json"),
             threads: Threads = None,
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
             endpoint: Endpoint = None,
             served_model: EndpointModel = None,
             tokenizer: EndpointTokenizer = None,
             chat: bool = typer.Option(False, "--chat", help="--endpoint: send /v1/chat/completions (the server's "
                                       "chat template around each prompt) instead of /v1/completions"),
             timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, help="--endpoint: a request "
                                                     "not done this many seconds after it was sent ends rejected"),
             published: Optional[Path] = typer.Option(None, "--published", parser=_path, help="score the "
                                                      "simulation per stage against a real run's published figures "
                                                      "(JSON: scenarios/gpu_validation/published/) instead")
             ) -> None:
    """Run scenarios on the executor (or replay one against a server, --endpoint) and in the simulator (--profile,
    else the scenario's cost model); print real vs sim and the % error per metric. With --published, score the simulation against a real run's published figures."""
    runs = [("--real-from", real_from), ("--profile-alongside", alongside), ("--threads", threads),
            ("--repeat", repeat if repeat > 1 else None), ("--capacity", capacity or None), ("--requests", requests),
            ("--device", device if device != "cpu" else None)]  # what only runs of the executor take
    if published is not None:
        return _validate_published(scenarios, published, out, [*runs, ("--endpoint", endpoint), ("--profile", profile_path)])
    if endpoint is not None:
        return _validate_endpoint(scenarios, endpoint, served_model, profile_path, out, tokenizer, chat, timeout, runs)
    if served_model is not None or tokenizer is not None or chat or timeout is not None:
        _fail(ConfigError("--served-model, --tokenizer, --chat and --timeout are for an endpoint: only with "
                          "--endpoint", "--endpoint"))
    _validate_runs(scenarios, out, device, profile_path, threads, repeat, real_from, alongside, capacity, precision,
                   requests)


def _validate_runs(scenarios: List[Path], out, device, profile_path, threads, repeat, real_from, alongside,
                   capacity: bool, precision: float, requests) -> None:
    """`validate` (and `--capacity`) on the executor: the tables of real vs simulated."""
    try:
        require_executor("validate")
        from executor.distributed.launch import WorkerError
    except ConfigError as e:
        _fail(e)
    from infersim.commands import validate as command

    try:
        if capacity:
            if real_from is not None or repeat > 1:
                raise ConfigError("--capacity runs its own probes: not with --real-from or --repeat", "--capacity")
            results, prof = command.validate_capacity(scenarios, out, device, profile_path, threads, alongside,
                                                      precision, requests)
        elif requests is not None:
            raise ConfigError("--requests sizes the capacity probes: only with --capacity", "--requests")
        else:
            results, prof, summary = command.validate(scenarios, out, device, profile_path, threads, repeat, real_from,
                                                      alongside)
    except ConfigError as e:
        _fail(e)
    except WorkerError as e:  # a worker process of a parallel or disaggregated serve failed: one line
        print(f"infersim: error: {e}", file=sys.stderr)
        raise typer.Exit(1)
    if capacity:
        command.print_capacity(results, device, prof)
    else:
        command.print_validations(results, device, prof, summary, out)


def _validate_endpoint(scenarios: List[Path], endpoint: str, served_model, profile_path, out, tokenizer, chat,
                       timeout, others: list) -> None:
    """`validate --endpoint`: one scenario replayed against a server, its table printed."""
    from infersim.commands.validate_endpoint import print_endpoint_validation, validate_endpoint

    try:
        given = [flag for flag, value in others if value is not None]
        if given:
            raise ConfigError(f"--endpoint replays against a running server: not with {', '.join(given)}",
                              "--endpoint")
        if len(scenarios) != 1 or scenarios[0].is_dir():
            raise ConfigError("--endpoint replays one scenario file", "SCENARIO")
        result = validate_endpoint(scenarios[0], endpoint, served_model, profile_path, out, tokenizer, chat, timeout)
    except ConfigError as e:
        _fail(e)
    print_endpoint_validation(result, out)


def _validate_published(scenarios: List[Path], published: Path, out, others: list) -> None:
    """`validate --published`: one scenario simulated and scored against a published run, a table per stage."""
    from infersim.commands.validate_published import print_published, validate_published

    try:
        given = [flag for flag, value in others if value is not None]
        if given:
            raise ConfigError(f"--published scores a simulation against published figures: not with "
                              f"{', '.join(given)}", "--published")
        if len(scenarios) != 1 or scenarios[0].is_dir():
            raise ConfigError("--published scores one scenario file", "SCENARIO")
        result = validate_published(scenarios[0], published, out)
    except ConfigError as e:
        _fail(e)
    print_published(result, out)


@app.command()
def search(spec: Path = typer.Argument(..., help="search spec YAML: scenario, target, space, search"),
           out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for search.json, search.md, pareto.png"),
           backend: str = typer.Option("local", "--backend", help="local (processes on this machine) or ray"),
           address: Optional[str] = typer.Option(None, "--address", help="ray: the cluster (default: a local Ray)"),
           workers: Optional[int] = typer.Option(None, "--workers", min=1, help="local: processes (default: cores)"),
           quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
    """Find each configuration's capacity within the SLOs, the Pareto front and the cheapest one for the target."""
    from infersim.commands.search import configurations, load_search_spec, print_search, run_search, write_outputs

    try:
        found = load_search_spec(spec)
        prepare_out(out)
        with progress_bar(None, quiet, "configurations", len(configurations(found))) as bar:
            result = run_search(found, backend, workers, progress=bar, address=address)
    except ConfigError as e:
        _fail(e.with_file(str(spec)) if e.key_path.startswith(("space", "target", "search", "scenario")) else e)
    if out is not None:
        write_outputs(out, result)
    if not quiet:
        print_search(result, out)


@app.command()
def compare(scenarios: List[Path] = typer.Argument(..., help="scenario YAMLs (the first one's workload runs on all)"),
            sweep: Optional[List[str]] = typer.Option(None, "--sweep", help="KEY=V1,V2,...: one scenario, one key "
                                                      "swept (several keys: `infersim search`)"),
            out: Optional[Path] = typer.Option(None, "--out", "-o", parser=_path, help="folder for compare.json, compare.md, cdf.png"),
            quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
    """Simulate several configurations on the same workload: one table and overlaid latency CDFs."""
    from infersim.commands.compare import compare_files, print_comparison, write_outputs

    try:
        check_distinct(scenarios)
        if sweep and len(sweep) > 1:  # typer kept the last and dropped the others without a word
            raise ConfigError(f"given {len(sweep)} times; allowed: once (several keys: `infersim search`)", "--sweep")
        results = compare_files(scenarios, sweep[0] if sweep else None, out)
    except ConfigError as e:
        _fail(e)
    if out is not None:
        write_outputs(out, results)
    if not quiet:
        print_comparison(results, scenarios[0], out)


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
    from infersim.commands.step_cost import price_steps, print_step_costs

    try:
        plan, rows, priced = price_steps(scenario or default_scenario_path(), new_tokens, context, pool)
    except ConfigError as e:
        _fail(e)
    print_step_costs(plan, rows, priced)


@app.command()
def models() -> None:
    """List the model catalog (layers: their attention kinds; KV/token: every layer that caches per token)."""
    from infersim.commands.catalogs import print_models

    print_models()


@app.command()
def hardware() -> None:
    """List the hardware catalog."""
    from infersim.commands.catalogs import print_hardware

    print_hardware()


@app.command()
def dashboard(port: int = typer.Option(8501, "--port", min=1, max=65535, help="port to serve on")) -> None:
    """Serve the Streamlit dashboard (What-if, Compare, Search, Validation) at http://localhost:PORT."""
    from infersim.commands.dashboard import dashboard as serve_dashboard

    try:
        serve_dashboard(port)
    except ConfigError as e:
        _fail(e)


def _command_name(info) -> str:
    return info.name or info.callback.__name__.lower().replace("_", "-")  # typer's own rule


# the commands that never load torch (whose BLAS threads OPENBLAS_NUM_THREADS could also bound)
SIMULATOR_ONLY = ("run", "search", "compare", "step-cost", "models", "hardware")


def library_defaults(command: str) -> dict[str, str]:
    """Environment defaults for the libraries `command` loads, set before it imports them (a user's own wins)."""
    # no third-party pydantic plugins hook our schemas: skips reading every installed package's entry points
    defaults = {"PYDANTIC_DISABLE_PLUGINS": "__all__"}
    if command in SIMULATOR_ONLY:  # numpy's small arrays need no OpenBLAS thread pool, which takes ~50 ms to start
        defaults["OPENBLAS_NUM_THREADS"] = "1"
    return defaults


def main() -> None:
    """Run the command line. The command it names is built alone (typer first builds every command's parameters
    from its signature: most of the CLI's own start-up); anything else (--help, a typo) meets the whole app."""
    for key, value in library_defaults(sys.argv[1] if len(sys.argv) > 1 else "").items():
        os.environ.setdefault(key, value)
    named = [c for c in app.registered_commands if len(sys.argv) > 1 and _command_name(c) == sys.argv[1]]
    if not named:
        app()
        return
    one = typer.Typer(cls=_OneLineUsage, add_completion=False, no_args_is_help=True, help=app.info.help)
    one.callback()(lambda: None)  # a group still (with one command and no callback, typer drops the command's name)
    one.registered_commands = named
    one()


if __name__ == "__main__":
    main()

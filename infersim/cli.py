"""`infersim`: the command line. Thin: parses flags (argparse) and calls the command's module (infersim/commands/),
imported only when that command runs, so that `infersim --help` or `infersim run` loads nothing another command needs.
Bad input → one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Callable, List, NoReturn, Optional

from infersim.inputs import check_distinct, default_scenario_path, prepare_out, require_executor
from infersim.progress import progress_bar
from sim.config.errors import ConfigError

HELP = "infersim: capacity planning for LLM inference serving (simulate, then validate)."
MAX_THREADS = 4096  # the schema's executor.threads bound (torch overflowed on --threads 1e20)
MAX_MINUTES = 24 * 60.0  # a training budget past a day is a typo (inf trained forever)


class _Parser(argparse.ArgumentParser):
    """A mistake in a command's flags or arguments (a value out of range, a missing argument, an unknown option or
    command) is bad input like any other: one line and exit code 2, not argparse's usage and error lines."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.removeprefix("argument ").split())[:240]
        print(f"infersim: error: {text} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


class Bounded:
    """A number flag's type: its text parsed as `kind` and refused outside [low, high] (argparse names the flag)."""

    def __init__(self, kind: type, low: float | None = None, high: float | None = None):
        self.kind, self.low, self.high = kind, low, high
        self.__name__ = "an integer" if kind is int else "a number"  # argparse's word for a value it cannot parse
        if low is not None and high is not None:
            self.allowed = f"{self.__name__} from {low} to {high}"
        elif low is not None or high is not None:
            self.allowed = f"{self.__name__} at {'least' if high is None else 'most'} {high if low is None else low}"
        else:
            self.allowed = self.__name__

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.__name__}") from None
        if not ((self.low is None or value >= self.low) and (self.high is None or value <= self.high)):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {self.allowed}")
        return value


class _Help(argparse.HelpFormatter):
    """Each option's help followed by its bounds and its default, where it has them (None and off say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if isinstance(action.type, Bounded) and action.type.allowed != action.type.__name__:
            text += f" [{action.type.allowed}]"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            text += " [default: %(default)s]"
        return text


Arg = tuple[tuple[str, ...], dict]
COMMANDS: dict[str, tuple[tuple[Arg, ...], Callable[..., None]]] = {}  # name: (its arguments, its function)
LOADS: dict[str, str] = {}  # a simulating command's name: the module its function imports (see _load_module)


def _arg(*names: str, **options) -> Arg:
    """One argument or option of a command, as argparse's add_argument takes it; an option's value is named after
    its flag in the help (--profile PROFILE, whatever the parameter it fills)."""
    if names[0].startswith("--") and options.get("action", "append") == "append":
        options.setdefault("metavar", names[0][2:].upper().replace("-", "_"))
    return names, options


def _command(name: str, *arguments: Arg, loads: str | None = None) -> Callable:
    """Registers a command under `name` with its arguments (their dests: the function's parameters); the function's
    docstring is its help. `loads`: the simulator's module the function imports, loaded first by _load_module."""
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        COMMANDS[name] = (arguments, fn)
        if loads is not None:
            LOADS[name] = loads
        return fn
    return register


def _path(value: str) -> Path:
    """A path flag's value; an empty one (an unset shell variable) would silently mean the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; give a folder or file name")
    return Path(value)


def _out(help: str | None = None, default: Path | None = None) -> Arg:
    return _arg("--out", "-o", type=_path, default=default, help=help)


def _flag(*names: str, help: str | None = None) -> Arg:
    return _arg(*names, action="store_true", help=help)


# options several commands take alike: one declaration, the same flag and help everywhere
DEVICE = _arg("--device", default="cpu", help="cpu or cuda")
THREADS = _arg("--threads", type=Bounded(int, 1, MAX_THREADS), help="torch CPU threads (default: all cores)")
# the options of the commands that train a drafter (distill, train-medusa, train-eagle); each its own defaults
VOCAB_SIZE = _arg("--vocab-size", type=Bounded(int, 16), default=8192, help="tokens the drafter can propose")
MAX_NEW = _arg("--max-new", type=Bounded(int, 1), default=128, help="longest answer of the target model generated "
               "to train on")
DRAFTER_PROFILE = _arg("--profile", type=Path, help="fitted profile that prices each candidate tree or chain "
                       "(default: calibration/profiles/cpu.json)")
ENDPOINT = _arg("--endpoint", help="a running OpenAI-compatible server (URL, e.g. http://localhost:8000/v1) to "
                "measure instead of the executor")
ENDPOINT_MODEL = _arg("--served-model", help="--endpoint: the model's name there (default: the one it serves)")
ENDPOINT_TOKENIZER = _arg("--tokenizer", help="--endpoint: a local tokenizer (HF folder or GGUF) where the server "
                          "has no /tokenize")


def _train_minutes(default: float) -> Arg:
    return _arg("--train-minutes", dest="minutes", type=Bounded(float, 0.0, MAX_MINUTES), default=default,
                help="training time budget")


# commands whose `infersim` process ends with nothing to release but its objects (no threads, no child processes):
# it ends without freeing them one by one (a Vidur-sized run's ~40k objects and its results: ~35 ms of its wall)
ENDS_AT_ONCE = ("run", "compare", "step-cost")
# and of those, the one that holds one simulation's objects to the end: no collection after its module loads (its
# report and plots paid ~40 collections, ~20 ms; the simulation itself runs with none)
NO_COLLECTION = ("run",)


def _end_process() -> NoReturn:
    """End the `infersim` process now that its command is done: the atexit hooks run (logging's, a coverage tool's)
    and the streams are flushed as at a normal exit, then os._exit skips the interpreter's teardown of every object.
    A process with a thread still running exits normally (its threads are joined)."""
    import threading
    if threading.active_count() > 1:
        raise SystemExit(0)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # stdout closed by its reader (`| head`): the interpreter's own exit code for that
        os._exit(120)
    os._exit(0)


def _load_module(module: str, freeze: bool) -> None:
    """Import a simulating command's module (~40k objects, kept to the end) with no collection running while it
    loads; with `freeze` (the `infersim` process itself) its objects are then frozen, so that no later collection,
    nor the one at exit, walks them (cachegrind: -95 M instructions of a 10-request run, 6%). Inside another program
    nothing is frozen: its own garbage would be kept."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def _fail(e: ConfigError) -> NoReturn:
    print(f"infersim: error: {e.one_line()}", file=sys.stderr)
    raise SystemExit(2)


@_command("run", _arg("scenario", type=Path, nargs="?", help="scenario YAML (default: the embedded one)"),
          _out("folder for report.json, requests.csv, plots"), _flag("--quiet", "-q", help="no table, no progress bar"),
          _flag("--no-plots", help="skip the PNG plots"), loads="infersim.commands.run")
def run(scenario: Optional[Path], out: Optional[Path], quiet: bool, no_plots: bool) -> None:
    """Simulate a scenario and report TTFT / TPOT / ITL / E2E, throughput, goodput, KV use and cost."""
    from infersim.commands.run import run_scenario

    try:
        run_scenario(scenario or default_scenario_path(), out, quiet=quiet, plots=not no_plots)
    except ConfigError as e:
        _fail(e)


def _http_bound(flag: str, kind: type, low: float, high: float, help: str) -> Arg:
    """A bound of serve --http's front, within [low, high]: None (the server's default) unless given."""
    return _arg(flag, type=Bounded(kind, low, high), help=f"--http: {help}")


@_command("serve", _arg("scenario", type=Path, help="scenario YAML (a model with real weights: SmolLM2-135M)"),
          _out("folder for the report and the step trace"), DEVICE, THREADS, _flag("--quiet", "-q"),
          _flag("--no-plots"),
          _arg("--profile", type=Path, help="fitted profile of this device (default: the scenario's "
               "cost_model.profile): a speculative scenario's overhead per step is measured against its predicted "
               "verify steps"),
          _flag("--http", help="serve the scenario's model as an OpenAI-compatible HTTP server (its scheduler, KV "
                "cache and limits) until Ctrl-C, instead of replaying its workload; --out: the report of what it "
                "served, when it stops"),
          _arg("--host", default="127.0.0.1", help="--http: the address to listen on"),
          _arg("--port", type=Bounded(int, 0, 65535), default=8000, help="--http: the port (0: any free one)"),
          _arg("--served-model", help="--http: the model's name in the API (default: the scenario's model)"),
          _arg("--api-key", help="--http: clients must send Authorization: Bearer KEY; /health and /metrics stay "
               "open (default: $INFERSIM_API_KEY, else no key)"),
          _http_bound("--max-request-bytes", int, 1024, 1 << 30, "larger request bodies get 413 unread (default 4 "
                      "MiB)"),
          _http_bound("--max-connections", int, 1, 1_000_000, "past this many open connections a request gets 503 "
                      "(default 1024)"),
          _http_bound("--request-timeout", float, 0.1, 3600.0, "seconds a connection has to send a whole request, "
                      "headers and body (default 30)"),
          _http_bound("--stall-timeout", float, 0.1, 3600.0, "a response its client reads nothing of for this many "
                      "seconds is dropped, its KV freed (default 30)"),
          _http_bound("--shutdown-timeout", float, 0.0, 3600.0, "on SIGTERM or Ctrl-C, seconds requests in flight "
                      "get to finish before they are cancelled (default 30)"))
def serve(scenario: Path, out: Optional[Path], device: str, threads: Optional[int], quiet: bool, no_plots: bool,
          profile: Optional[Path], http: bool, host: str, port: int, served_model: Optional[str],
          api_key: Optional[str], max_request_bytes: Optional[int], max_connections: Optional[int],
          request_timeout: Optional[float], stall_timeout: Optional[float], shutdown_timeout: Optional[float]) -> None:
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
        raise SystemExit(1)


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
        raise SystemExit(1) from None


@_command("profile", DEVICE,
          _arg("--model", default="SmolLM2-135M", help="SmolLM2-135M or a local HF checkpoint folder"),
          _out("the profile JSON written (--refit: read and written again)",
               default=Path("calibration/profiles/cpu.json")), THREADS,
          _flag("--quick", help="a smaller sweep (tests, smoke runs)"),
          _arg("--repeats", type=Bounded(int, 1, 100), default=3, help="runs of each workload; a step's time is the "
               "median over them"),
          _flag("--refit", help="no sweep: fit the step-cost model again on the samples stored in the --out profile, "
                "in place"),
          _arg("--scenario", type=Path, help="profile the executor as this scenario runs it: its model "
               "(random_weights too), its tensor- or pipeline-parallel layout, its threads"),
          ENDPOINT, ENDPOINT_MODEL, ENDPOINT_TOKENIZER)
def profile(device: str, model: str, out: Path, threads: Optional[int], quick: bool, repeats: int, refit: bool,
            scenario: Optional[Path], endpoint: Optional[str], served_model: Optional[str],
            tokenizer: Optional[str]) -> None:
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



@_command("distill", _out("folder for the draft model (default: ~/.cache/infersim/drafts/smollm2-135m)"),
          _arg("--layers", default="0,1", help="teacher layers the student starts from, comma-separated"),
          VOCAB_SIZE, _train_minutes(10.0), MAX_NEW, THREADS)
def distill(out: Optional[Path], layers: str, vocab_size: int, minutes: float, max_new: int,
            threads: Optional[int]) -> None:
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



@_command("train-medusa", _out("folder for the heads (default: the ones shipped in executor/data/medusa-smollm2-135m)"),
          _arg("--heads", dest="num_heads", type=Bounded(int, 1, 8), default=3, help="K: head d guesses d + 1 tokens "
               "on"),
          VOCAB_SIZE, _train_minutes(4.0), MAX_NEW, THREADS, DRAFTER_PROFILE,
          _flag("--retree", help="no training: pick the candidate tree of the heads in --out again for --profile "
                "(after re-profiling)"))
def train_medusa(out: Optional[Path], num_heads: int, vocab_size: int, minutes: float, max_new: int,
                 threads: Optional[int], profile: Optional[Path], retree: bool) -> None:
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



@_command("train-eagle", _out("folder for the head (default: the one shipped in executor/data/eagle-smollm2-135m)"),
          _arg("--steps", type=Bounded(int, 1, 8), default=3, help="chain steps unrolled in training: the deepest "
               "draft it is trained for"),
          VOCAB_SIZE, _train_minutes(12.0), MAX_NEW, THREADS, DRAFTER_PROFILE)
def train_eagle(out: Optional[Path], steps: int, vocab_size: int, minutes: float, max_new: int,
                threads: Optional[int], profile: Optional[Path]) -> None:
    """Train an EAGLE head (one decoder layer over SmolLM2-135M's hidden states) and pick its chain or tree."""
    from infersim.commands.training import train_eagle as train_head

    try:
        require_executor("train-eagle")
        prepare_out(out)  # before minutes of training that would end in the write
        train_head(out, vocab_size, minutes, max_new, threads, profile, steps)
    except ConfigError as e:
        _fail(e)



@_command("validate",
          _arg("scenarios", type=Path, nargs="+", help="scenario YAMLs (or folders of them) with a model that has "
               "real weights"),
          _out("folder for validation.json and the CDF plot (one subfolder per scenario when there are several)"),
          DEVICE, _arg("--profile", dest="profile_path", type=Path, help="default: calibration/profiles/DEVICE.json"),
          THREADS,
          _arg("--repeat", type=Bounded(int, 1, 100), default=1, help="executor runs per scenario: real is their "
               "mean, and two or more report the real-vs-real spread"),
          _arg("--real-from", type=Path, help="score the executor runs recorded by an earlier `validate --out DIR` "
               "(DIR) instead of running them: e.g. to compare a new profile on the same runs"),
          _arg("--profile-alongside", dest="alongside", type=Path, help="profile the device again while validating "
               "(a slice of the sweep before each executor run and after the last; ~4 min more for SmolLM2 on a "
               "CPU), write it here and predict with it: profile and runs then see the machine in the same minutes"),
          _flag("--capacity", help="validate capacity instead: the highest arrival rate meeting the SLOs (a closed "
                "loop: the most users), found by a search of real serves (the scenario's requests, their gaps "
                "scaled) and predicted on the same grid; writes capacity.json"),
          _arg("--precision", type=Bounded(float, 0.01, 1.0), default=0.05, help="--capacity: the rate grid's step "
               "(capacity is found within it)"),
          _arg("--requests", type=Bounded(int, 2), help="--capacity: probe with this many requests of the "
               "scenario's workload instead (a longer probe judges keeping up more finely)"),
          ENDPOINT, ENDPOINT_MODEL, ENDPOINT_TOKENIZER,
          _flag("--chat", help="--endpoint: send /v1/chat/completions (the server's chat template around each "
                "prompt) instead of /v1/completions"),
          _arg("--timeout", type=Bounded(float, 0.001), help="--endpoint: a request not done this many seconds "
               "after it was sent ends rejected"),
          _arg("--published", type=_path, help="score the simulation per stage against a real run's published "
               "figures (JSON: scenarios/gpu_validation/published/) instead"))
def validate(scenarios: List[Path], out: Optional[Path], device: str, profile_path: Optional[Path],
             threads: Optional[int], repeat: int, real_from: Optional[Path], alongside: Optional[Path],
             capacity: bool, precision: float, requests: Optional[int], endpoint: Optional[str],
             served_model: Optional[str], tokenizer: Optional[str], chat: bool, timeout: Optional[float],
             published: Optional[Path]) -> None:
    """Run scenarios on the executor (or replay one against a server, --endpoint) and in the simulator (--profile,
    else the scenario's cost model); print real vs sim and the % error per metric. With --published, score the
    simulation against a real run's published figures."""
    runs = [("--real-from", real_from), ("--profile-alongside", alongside), ("--threads", threads),
            ("--repeat", repeat if repeat > 1 else None), ("--capacity", capacity or None), ("--requests", requests),
            ("--device", device if device != "cpu" else None)]  # what only runs of the executor take
    if published is not None:
        return _validate_published(scenarios, published, out,
                                   [*runs, ("--endpoint", endpoint), ("--profile", profile_path)])
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
        raise SystemExit(1)
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



@_command("search", _arg("spec", type=Path, help="search spec YAML: scenario, target, space, search"),
          _out("folder for search.json, search.md, pareto.png"),
          _arg("--backend", default="local", help="local (processes on this machine) or ray"),
          _arg("--address", help="ray: the cluster (default: a local Ray)"),
          _arg("--workers", type=Bounded(int, 1), help="local: processes (default: cores)"), _flag("--quiet", "-q"),
          loads="infersim.commands.search")
def search(spec: Path, out: Optional[Path], backend: str, address: Optional[str], workers: Optional[int],
           quiet: bool) -> None:
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



@_command("compare", _arg("scenarios", type=Path, nargs="+", help="scenario YAMLs (the first one's workload runs on "
                          "all)"),
          _arg("--sweep", action="append", help="KEY=V1,V2,...: one scenario, one key swept (several keys: "
               "`infersim search`)"),
          _out("folder for compare.json, compare.md, cdf.png"), _flag("--quiet", "-q"),
          loads="infersim.commands.compare")
def compare(scenarios: List[Path], sweep: Optional[List[str]], out: Optional[Path], quiet: bool) -> None:
    """Simulate several configurations on the same workload: one table and overlaid latency CDFs."""
    from infersim.commands.compare import compare_files, print_comparison, write_outputs

    try:
        check_distinct(scenarios)
        if sweep and len(sweep) > 1:  # one sweep a run: a second would be dropped without a word
            raise ConfigError(f"given {len(sweep)} times; allowed: once (several keys: `infersim search`)", "--sweep")
        results = compare_files(scenarios, sweep[0] if sweep else None, out)
    except ConfigError as e:
        _fail(e)
    if out is not None:
        write_outputs(out, results)
    if not quiet:
        print_comparison(results, scenarios[0], out)



@_command("step-cost", _arg("scenario", type=Path, nargs="?", help="scenario YAML (default: the embedded one)"),
          _arg("--new-tokens", type=Bounded(int), action="append", help="new tokens of one sequence of the step "
               "(repeat: one per sequence); default: the scenario's typical prefill and decode steps"),
          _arg("--context", type=Bounded(int), action="append", help="its tokens in the KV cache after the step "
               "(repeat, one per --new-tokens; default: the new tokens)"),
          _arg("--pool", help="disaggregated: prefill or decode (default: prefill for prompt chunks alone)"),
          loads="infersim.commands.step_cost")
def step_cost(scenario: Optional[Path], new_tokens: Optional[List[int]], context: Optional[List[int]],
              pool: Optional[str]) -> None:
    """One engine step's time and where it goes (linear layers, attention, communication, LM head, host
    overhead), as the simulator prices it: the scenario's typical steps, or the one given."""
    from infersim.commands.step_cost import price_steps, print_step_costs

    try:
        plan, rows, priced = price_steps(scenario or default_scenario_path(), new_tokens, context, pool)
    except ConfigError as e:
        _fail(e)
    print_step_costs(plan, rows, priced)



@_command("models")
def models() -> None:
    """List the model catalog (layers: their attention kinds; KV/token: every layer that caches per token)."""
    from infersim.commands.catalogs import print_models

    print_models()


@_command("hardware")
def hardware() -> None:
    """List the hardware catalog."""
    from infersim.commands.catalogs import print_hardware

    print_hardware()


@_command("dashboard", _arg("--port", type=Bounded(int, 1, 65535), default=8501, help="port to serve on"))
def dashboard(port: int) -> None:
    """Serve the Streamlit dashboard (What-if, Compare, Search, Validation) at http://localhost:PORT."""
    from infersim.commands.dashboard import dashboard as serve_dashboard

    try:
        serve_dashboard(port)
    except ConfigError as e:
        _fail(e)


# the commands that never load torch (whose BLAS threads OPENBLAS_NUM_THREADS could also bound)
SIMULATOR_ONLY = ("run", "search", "compare", "step-cost", "models", "hardware")


def library_defaults(command: str) -> dict[str, str]:
    """Environment defaults for the libraries `command` loads, set before it imports them (a user's own wins)."""
    # no third-party pydantic plugins hook our schemas: skips reading every installed package's entry points
    defaults = {"PYDANTIC_DISABLE_PLUGINS": "__all__"}
    if command in SIMULATOR_ONLY:  # numpy's small arrays need no OpenBLAS thread pool, which takes ~50 ms to start
        defaults["OPENBLAS_NUM_THREADS"] = "1"
    return defaults


def _summary(fn: Callable) -> str:
    return " ".join((fn.__doc__ or "").split())


def command_parser(name: str) -> argparse.ArgumentParser:
    """One command's parser: its arguments and options, its function's docstring as its help."""
    arguments, fn = COMMANDS[name]
    parser = _Parser(prog=f"infersim {name}", description=_summary(fn), formatter_class=_Help, allow_abbrev=False)
    for names, options in arguments:
        parser.add_argument(*names, **options)
    return parser


def _no_command(argv: list[str]) -> NoReturn:
    """No command named: the list of commands (--help: exit 0; nothing at all: exit 2), or one line for a typo."""
    parser = _Parser(prog="infersim", description=HELP, formatter_class=_Help, allow_abbrev=False)
    listing = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, fn) in COMMANDS.items():
        listing.add_parser(name, help=_summary(fn).replace("%", "%%"))  # argparse %-formats a command's help
    if argv and argv[0] not in ("-h", "--help"):
        if argv[0].startswith("-"):
            parser.error(f"no such option: {argv[0]}; allowed before a command: --help")
        parser.error(f"no such command {argv[0]!r}; allowed: {', '.join(COMMANDS)}")
    parser.print_help()
    raise SystemExit(0 if argv else 2)


def main(argv: list[str] | None = None) -> None:
    """Run the command line on `argv` (default: the process's). Only the command it names gets its parser built;
    anything else (--help, nothing, a typo) meets the list of commands. Options and arguments may come in any order."""
    own_process = argv is None  # the `infersim` process itself, not main() called inside another program
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    for key, value in library_defaults(argv[0] if argv else "").items():
        os.environ.setdefault(key, value)
    if not argv or argv[0] not in COMMANDS:
        _no_command(argv)
    _, fn = COMMANDS[argv[0]]
    try:
        args = vars(command_parser(argv[0]).parse_intermixed_args(argv[1:]))
        if argv[0] in LOADS:
            _load_module(LOADS[argv[0]], freeze=own_process)
            if own_process and argv[0] in NO_COLLECTION:
                gc.disable()
        fn(**args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (serve --http drains on its own and returns)
        print(f"infersim: interrupted: {argv[0]}", file=sys.stderr)
        raise SystemExit(130) from None
    if own_process and argv[0] in ENDS_AT_ONCE:
        _end_process()


if __name__ == "__main__":
    main()

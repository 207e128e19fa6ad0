"""The command line's parsing (argparse): every command keeps its flags, help, defaults and bounds; a flag given a
value out of its range, an unknown flag or command is one line and exit code 2; --help lists what there is."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from infersim.cli import COMMANDS, command_parser
from tests.cli_runner import run_cli

# each command's flags, as users have typed them since the CLI began (typer's): renaming one breaks their scripts
FLAGS = {
    "run": ["--out", "-o", "--quiet", "-q", "--no-plots"],
    "serve": ["--out", "-o", "--device", "--threads", "--quiet", "-q", "--no-plots", "--profile", "--http", "--host",
              "--port", "--served-model", "--api-key", "--max-request-bytes", "--max-connections",
              "--request-timeout", "--stall-timeout", "--shutdown-timeout"],
    "profile": ["--device", "--model", "--out", "-o", "--threads", "--quick", "--repeats", "--refit", "--scenario",
                "--endpoint", "--served-model", "--tokenizer"],
    "distill": ["--out", "-o", "--layers", "--vocab-size", "--train-minutes", "--max-new", "--threads"],
    "train-medusa": ["--out", "-o", "--heads", "--vocab-size", "--train-minutes", "--max-new", "--threads",
                     "--profile", "--retree"],
    "train-eagle": ["--out", "-o", "--steps", "--vocab-size", "--train-minutes", "--max-new", "--threads",
                    "--profile"],
    "validate": ["--out", "-o", "--device", "--profile", "--threads", "--repeat", "--real-from", "--profile-alongside",
                 "--capacity", "--precision", "--requests", "--endpoint", "--served-model", "--tokenizer", "--chat",
                 "--timeout", "--published"],
    "search": ["--out", "-o", "--backend", "--address", "--workers", "--quiet", "-q"],
    "compare": ["--sweep", "--out", "-o", "--quiet", "-q"],
    "step-cost": ["--new-tokens", "--context", "--pool"],
    "models": [],
    "hardware": [],
    "dashboard": ["--port"],
}
ARGUMENTS = {"serve": ["x.yaml"], "validate": ["x.yaml"], "search": ["x.yaml"], "compare": ["x.yaml"]}


def one_line(r, *needles: str) -> str:
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.output)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("infersim: error: ") and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_help_lists_every_command():
    r = run_cli(["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and r.stderr == ""
    for name, (_, fn) in COMMANDS.items():
        assert f"    {name} " in r.stdout or f"    {name}\n" in r.stdout, name
        assert " ".join(fn.__doc__.split())[:60] in " ".join(r.stdout.split()), name
    nothing = run_cli([], env={"COLUMNS": "200"})
    assert nothing.exit_code == 2 and nothing.stdout == r.stdout  # no command: the same help, but a failure


@pytest.mark.parametrize("name", list(FLAGS))
def test_each_command_keeps_its_flags_and_help(name):
    assert list(COMMANDS) == list(FLAGS)
    r = run_cli([name, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    arguments, _ = COMMANDS[name]
    assert sorted(flag for names, _ in arguments for flag in names if flag.startswith("-")) == sorted(FLAGS[name])
    text = " ".join(r.stdout.split()) + " "
    for flag in FLAGS[name]:
        assert f" {flag} " in text or f" {flag}," in text, (name, flag)
    for _, options in arguments:
        if options.get("help"):  # each option's help, whole, in the command's help
            assert " ".join(options["help"].split()) in text, (name, options["help"])


@pytest.mark.parametrize("name", list(FLAGS))
def test_each_command_s_parameters_are_its_function_s(name):
    """What the parser fills (its defaults) is exactly what the command's function takes."""
    parsed = command_parser(name).parse_intermixed_args(ARGUMENTS.get(name, []))
    inspect.signature(COMMANDS[name][1]).bind(**vars(parsed))


def test_defaults_bounds_lists_and_any_order():
    profile = command_parser("profile").parse_intermixed_args([])
    assert (profile.out, profile.repeats, profile.device, profile.model) == (
        Path("calibration/profiles/cpu.json"), 3, "cpu", "SmolLM2-135M")
    v = command_parser("validate").parse_intermixed_args(["a.yaml", "--repeat", "2", "b.yaml", "-o", "out",
                                                          "--profile-alongside", "p.json", "--precision", "0.5"])
    assert (v.scenarios, v.repeat, v.out, v.alongside, v.precision) == (
        [Path("a.yaml"), Path("b.yaml")], 2, Path("out"), Path("p.json"), 0.5)
    c = command_parser("step-cost").parse_intermixed_args(["--new-tokens", "1", "s.yaml", "--new-tokens", "256"])
    assert (c.scenario, c.new_tokens, c.context) == (Path("s.yaml"), [1, 256], None)
    m = command_parser("train-medusa").parse_intermixed_args(["--heads", "8", "--train-minutes", "0"])
    assert (m.num_heads, m.minutes, m.vocab_size, m.retree) == (8, 0.0, 8192, False)


@pytest.mark.parametrize("args, needles", [
    (["serve", "x.yaml", "--port", "65536"], ["--port", "'65536'", "allowed: an integer from 0 to 65535"]),
    (["dashboard", "--port", "0"], ["--port", "from 1 to 65535"]),
    (["validate", "x.yaml", "--precision", "1.5"], ["--precision", "a number from 0.01 to 1.0"]),
    (["validate", "x.yaml", "--timeout", "0"], ["--timeout", "a number at least 0.001"]),
    (["validate", "x.yaml", "--requests", "1"], ["--requests", "an integer at least 2"]),
    (["train-eagle", "--train-minutes", "inf"], ["--train-minutes", "from 0.0 to 1440.0"]),
    (["train-eagle", "--train-minutes", "nan"], ["--train-minutes"]),
    (["train-medusa", "--heads", "9"], ["--heads", "from 1 to 8"]),
    (["distill", "--vocab-size", "8"], ["--vocab-size", "at least 16"]),
    (["profile", "--repeats", "three"], ["--repeats", "'three' is not an integer"]),
    (["step-cost", "--new-tokens", "1.5"], ["--new-tokens", "not an integer"]),
    (["serve", "x.yaml", "--max-request-bytes", "10"], ["--max-request-bytes", "from 1024 to 1073741824"]),
    (["run", "--out", ""], ["--out", "an empty path"]),
    (["validate", "x.yaml", "--published", " "], ["--published", "an empty path"]),
    (["run", "--out"], ["--out", "expected one argument"]),
    (["run", "--quiet=yes"], ["--quiet"]),
    (["run", "a.yaml", "b.yaml"], ["unrecognized arguments: b.yaml", "infersim run --help"]),
    (["run", "--qui"], ["--qui"]),  # no abbreviations: a later flag would change what an old one means
    (["compare"], ["scenarios"]),
    (["--version"], ["--version", "--help"]),
    (["simulate"], ["'simulate'", "allowed: run, serve,", "dashboard"]),
])
def test_bad_flags_are_one_line_exit_2(args, needles):
    one_line(run_cli(args), *needles)


def test_the_environment_is_the_callers_again():
    """main sets library defaults (OpenBLAS threads) for the command; the runner leaves the test process as it was."""
    import os

    before = dict(os.environ)
    run_cli(["models", "--help"], env={"COLUMNS": "99"})
    assert dict(os.environ) == before


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch):
    import infersim.commands.catalogs as catalogs

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(catalogs, "print_hardware", interrupted)
    r = run_cli(["hardware"])
    assert r.exit_code == 130 and r.stderr == "infersim: interrupted: hardware\n" and r.stdout == ""

"""The `infersim` command line run in-process, as a shell would run it: what it printed and how it exited."""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

from infersim.cli import main


@dataclass
class CliResult:
    """What one run of the command line printed and how it ended (a command's exception: exit code 1)."""

    exit_code: int
    stdout: str
    stderr: str
    output: str  # stdout and stderr as they were printed, interleaved
    exception: BaseException | None  # SystemExit for an exit code other than 0, else what the command raised


class _Both(io.StringIO):
    """One stream of the two, written also to the interleaved output."""

    def __init__(self, both: io.StringIO):
        super().__init__()
        self._both = both

    def write(self, text: str) -> int:
        self._both.write(text)
        return super().write(text)


def run_cli(args: list, env: dict[str, str] | None = None) -> CliResult:
    """`infersim ARGS` in this process (the environment, with `env` over it, restored after)."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    both = io.StringIO()
    out, err = _Both(both), _Both(both)
    code, exception = 0, None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        exception = e if code != 0 else None
    except Exception as e:  # a command's own failure: a traceback for the test to show
        code, exception = 1, e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return CliResult(code, out.getvalue(), err.getvalue(), both.getvalue(), exception)

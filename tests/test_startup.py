"""Start-up stays light: the CLI loads a command's module only when that command runs, and `infersim run` loads
what a simulation needs, not the executor, the plots, the tables or another command (bench/startup.py times it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infersim.cli import library_defaults

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "pydantic", "yaml", "rich", "simpy", "torch", "matplotlib", "PIL", "scipy", "pandas", "transformers",
         "plotly", "streamlit", "calibration", "executor", "dashboard", "sim.config.plan", "infersim.api",
         "infersim.commands")


def probe_lines(code: str, cwd: Path = ROOT, **env: str) -> list[str]:
    """What a fresh interpreter running `code` printed, a line each (this tree first on its path, nothing else)."""
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "", **env})
    return r.stdout.splitlines()


def loaded(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    names = json.loads(probe_lines(f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))")[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in names)}


def test_the_cli_imports_no_command_and_nothing_heavy():
    assert loaded("import infersim.cli") == set()


def test_run_imports_the_simulator_alone():
    assert loaded("import infersim.commands.run") == {"numpy", "pydantic", "yaml", "simpy", "sim.config.plan",
                                                      "infersim.commands"}


def test_the_probe_sees_an_import():
    assert "rich" in loaded("import infersim.commands.catalogs")


def blas_threads(command: str, **env: str) -> int:
    """The threads of a fresh process after `infersim COMMAND --help` and then `import numpy` (OpenBLAS's pool)."""
    probe = (f"import os, sys; sys.argv = ['infersim', '{command}', '--help']\nfrom infersim.cli import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\nimport numpy\nprint(len(os.listdir('/proc/self/task')))")
    return int(probe_lines(probe, **env)[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores")
def test_simulator_commands_start_numpy_without_a_blas_thread_pool():
    assert blas_threads("run") == 1
    assert blas_threads("serve") > 1  # torch's commands keep OpenBLAS's default
    assert blas_threads("run", OPENBLAS_NUM_THREADS="2") == 2  # a user's own setting wins


def test_library_defaults_by_command():
    assert library_defaults("run") == {"PYDANTIC_DISABLE_PLUGINS": "__all__", "OPENBLAS_NUM_THREADS": "1"}
    assert "OPENBLAS_NUM_THREADS" not in library_defaults("serve")
    assert "OPENBLAS_NUM_THREADS" not in library_defaults("--help")



def frozen_after(call: str, cwd: Path) -> tuple[int, bool]:
    """(objects frozen, whether collection is on) in a fresh process at its exit after `call` of `infersim run -q
    --no-plots`, told by an atexit hook (the `infersim` process ends at once, its hooks run)."""
    probe = ("import atexit, gc, sys\nfrom infersim.cli import main\n"
             "sys.argv = ['infersim', 'run', '-q', '--no-plots']\n"
             "atexit.register(lambda: print(gc.get_freeze_count(), gc.isenabled(), flush=True))\n"
             f"try:\n    {call}\nexcept SystemExit:\n    pass\nprint('returned')")
    lines = probe_lines(probe, cwd)
    assert ("returned" in lines) == (call != "main()"), lines
    frozen, enabled = lines[-1].split()
    return int(frozen), enabled == "True"


def test_a_run_process_freezes_its_imports_and_a_run_inside_a_program_does_not(tmp_path):
    """`infersim run` as its own process freezes what its imports made (no collection walks it again), runs with no
    collection and ends at once, its atexit hooks run; main() given its arguments inside another program freezes
    nothing of that program's, leaves collection on and returns."""
    own, embedded = frozen_after("main()", tmp_path), frozen_after("main(sys.argv[1:])", tmp_path)
    assert own[0] > 10_000 and embedded[0] == 0
    assert not own[1] and embedded[1]


def test_a_run_process_with_a_thread_still_running_exits_normally(tmp_path):
    """The early end (cli._end_process) is for a process with nothing else running: with a thread still alive the
    process exits as Python does, after that thread ends, its atexit hooks run once."""
    probe = ("import atexit, sys, threading, time\nsys.argv = ['infersim', 'run', '-q', '--no-plots']\n"
             "done = []\nthreading.Thread(target=lambda: (time.sleep(0.5), done.append(1))).start()\n"
             "atexit.register(lambda: print('hook', len(done), flush=True))\nfrom infersim.cli import main\nmain()")
    assert probe_lines(probe, tmp_path) == ["hook 1"]

"""Start-up stays light: the CLI loads a command's module only when that command runs, and `infersim run` loads
what a simulation needs, not the executor, the plots, the tables or another command (bench/startup.py times it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "pydantic", "yaml", "rich", "simpy", "torch", "matplotlib", "PIL", "scipy", "pandas", "transformers",
         "plotly", "streamlit", "calibration", "executor", "dashboard", "sim.config.plan", "infersim.api",
         "infersim.commands")


def loaded(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": ""})
    names = json.loads(r.stdout.splitlines()[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in names)}


def test_the_cli_imports_no_command_and_nothing_heavy():
    assert loaded("import infersim.cli") == set()


def test_run_imports_the_simulator_alone():
    assert loaded("import infersim.commands.run") == {"numpy", "pydantic", "yaml", "simpy", "sim.config.plan",
                                                      "infersim.commands"}


def test_the_probe_sees_an_import():
    assert "rich" in loaded("import infersim.commands.catalogs")

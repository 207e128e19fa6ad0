"""The layering: each layer imports only the layers below it, nothing imports upward, no import cycles, and
the shared layers never pull in SimPy or torch (so the executor never imports SimPy, and the simulator's
policy, config, cost and report code never imports torch). Inside the executor its sub-packages keep the same rules
(EXECUTOR_LAYERS), and inside infersim/ its commands (INFERSIM_LAYERS)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "calibration", "infersim", "dashboard")

# bottom to top; a module may import its own layer and any layer with a lower rank. The SimPy simulator and the
# executor share a rank but are separate layers: neither imports the other.
LAYERS = [
    ("config", 0, ("sim.config",)),
    ("policy", 1, ("sim.policy",)),
    ("cost", 2, ("sim.cost",)),
    ("report", 3, ("sim.report",)),
    ("simulator", 4, ("sim.simulator",)),
    ("executor", 4, ("executor",)),
    ("calibration", 5, ("calibration",)),
    ("app", 6, ("infersim",)),
    ("cli", 7, ("infersim.cli", "dashboard")),
]

# inside the executor, the same rules one level down, bottom to top: what runs on the device (the model, its layers and
# kernels, KV tensors, CUDA graphs, sampling), speculative decoding's drafters and verification, the engine core (the
# step, the model runner, building an engine), the parallel ranks, then what drives it: training drafters, and serving
# (the replay, the online loop, disaggregated instances) beneath the HTTP API server. Training and serving share a
# rank: neither imports the other.
EXECUTOR_LAYERS = [
    ("model", 0, ("executor.model",)),
    ("speculative", 1, ("executor.speculative",)),
    ("core", 2, ("executor.core",)),
    ("distributed", 3, ("executor.distributed",)),
    ("training", 4, ("executor.training",)),
    ("serving", 4, ("executor.serving",)),
    ("api_server", 5, ("executor.api_server",)),
]

# inside infersim/, bottom to top: what the commands share (inputs, progress, simulation, scenario_keys, backends), the
# commands (infersim.commands.*, each a layer of its own: none imports another), the Python API gathering them, the CLI.
INFERSIM_LAYERS = [
    ("shared", 0, ("infersim",)),
    ("commands", 1, ("infersim.commands",)),
    ("api", 2, ("infersim.api",)),
    ("cli", 3, ("infersim.cli",)),
]


def layer_of(module: str, layers=LAYERS) -> tuple[str, int] | None:
    """The layer a module belongs to (the longest matching prefix), or None if it is not the project's."""
    if module == "sim":  # the bare package: an empty __init__ beneath every sim layer
        return ("config", 0)
    best = None
    for name, rank, prefixes in layers:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[2]):
                best = (name, rank, len(p))
    return best[:2] if best else None


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Every project module `path` imports, at the top or inside functions (a lazy import is still a dependency)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                found.add(n)
    return found


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(p, m, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer():
    assert [m for m in project_modules() if layer_of(m) is None] == []


def test_no_upward_or_sideways_imports():
    bad = []
    for mod, deps in graph().items():
        name, rank = layer_of(mod)
        for dep in deps:
            dep_name, dep_rank = layer_of(dep)
            if dep_rank > rank or (dep_rank == rank and dep_name != name):
                bad.append(f"{mod} ({name}) imports {dep} ({dep_name})")
    assert bad == []


def executor_layer_of(module: str) -> tuple[str, int] | None:
    """An executor module's sub-layer (None outside the executor, or in no sub-package)."""
    if module == "executor":  # the bare package: a docstring beneath every sub-layer
        return EXECUTOR_LAYERS[0][:2]
    return layer_of(module, EXECUTOR_LAYERS) if module.startswith("executor.") else None


def test_every_executor_module_has_a_sublayer():
    assert [m for m in project_modules() if m.startswith("executor") and executor_layer_of(m) is None] == []


def infersim_layer_of(module: str) -> tuple[str, int] | None:
    """A module's layer inside infersim/ (None outside it); each command module is a layer of its own."""
    if module == "infersim.commands":  # the bare package: a docstring beneath every command
        return INFERSIM_LAYERS[0][:2]
    if module != "infersim" and not module.startswith("infersim."):
        return None
    name, rank = layer_of(module, INFERSIM_LAYERS)
    return (module.split(".")[2], rank) if name == "commands" else (name, rank)


def _upward_or_sideways(sublayer_of) -> list[str]:
    """Every import between two modules of one package that goes up or sideways in `sublayer_of`'s layers."""
    bad = []
    for mod, deps in graph().items():
        if sublayer_of(mod) is None:
            continue
        name, rank = sublayer_of(mod)
        for dep in deps:
            if sublayer_of(dep) is None:
                continue
            dep_name, dep_rank = sublayer_of(dep)
            if dep_rank > rank or (dep_rank == rank and dep_name != name):
                bad.append(f"{mod} ({name}) imports {dep} ({dep_name})")
    return bad


def test_no_upward_or_sideways_imports_inside_the_executor():
    assert _upward_or_sideways(executor_layer_of) == []


def test_every_infersim_module_has_a_sublayer():
    assert [m for m in project_modules() if m.startswith("infersim") and infersim_layer_of(m) is None] == []


def test_commands_import_no_other_command():
    """A command imports what lies below it, never another command (what two share moves down into infersim/), and
    the shared helpers import no command."""
    assert len([m for m in project_modules() if m.startswith("infersim.commands.")]) >= 8
    assert _upward_or_sideways(infersim_layer_of) == []


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_layering_test_catches_an_upward_import():
    """The checker itself: an import from the policy layer into the simulator is flagged."""
    assert layer_of("sim.policy.scheduler") == ("policy", 1)
    assert layer_of("infersim.cli") == ("cli", 7) and layer_of("infersim.api") == ("app", 6)
    name, rank = layer_of("sim.policy.scheduler")
    dep_name, dep_rank = layer_of("sim.simulator.cluster")
    assert dep_rank > rank
    dep_name, dep_rank = layer_of("executor.core.engine")
    assert (dep_rank, dep_name) == (4, "executor") and layer_of("sim.simulator.replica") == ("simulator", 4)
    # one level down: the engine core importing the serving loop is flagged, as training importing serving is
    assert executor_layer_of("executor.core.engine") == ("core", 2)
    assert executor_layer_of("executor.serving.serve")[1] > 2 and executor_layer_of("executor") == ("model", 0)
    assert executor_layer_of("executor.training.speculative")[1] == executor_layer_of("executor.serving.serve")[1]
    assert executor_layer_of("sim.policy.scheduler") is None and layer_of("executor") == ("executor", 4)
    # inside infersim/: one command importing another is sideways, a shared helper importing a command upward
    assert infersim_layer_of("infersim.commands.run") == ("run", 1) != infersim_layer_of("infersim.commands.search")
    assert infersim_layer_of("infersim.inputs")[1] < infersim_layer_of("infersim.commands.run")[1]
    assert infersim_layer_of("infersim.commands.run")[1] < infersim_layer_of("infersim.api")[1] \
        < infersim_layer_of("infersim.cli")[1] and infersim_layer_of("sim.config.plan") is None


_PROBE = """
import importlib, json, sys
out = {}
for m in sys.argv[1:]:
    importlib.import_module(m)
print(json.dumps(sorted(k for k in ("simpy", "torch") if k in sys.modules)))
"""


def _heavy_imports(modules: list[str]) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *modules], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_shared_layers_import_neither_simpy_nor_torch():
    shared = [m for m in project_modules() if layer_of(m)[0] in ("config", "policy", "cost", "report")]
    assert len(shared) > 10 and _heavy_imports(shared) == []


@pytest.mark.parametrize("side, forbidden", [("executor", "simpy"), ("simulator", "torch")])
def test_the_two_clocks_do_not_pull_in_each_other(side, forbidden):
    mods = [m for m in project_modules() if layer_of(m)[0] == side]
    assert mods and forbidden not in _heavy_imports(mods)


_RUN_PROBE = """
import sys, tempfile
from pathlib import Path
from infersim import api
with tempfile.TemporaryDirectory() as out:
    api.run_scenario(Path(sys.argv[1]), Path(out), quiet=True, plots=False)
print("torch" in sys.modules)
"""


def test_a_simulation_never_loads_torch():
    """`infersim run` of a plain scenario stays on the simulator's side: torch (~190 MiB resident, seconds to import)
    was pulled in by a drafter check that imported the executor for every run."""
    path = ROOT / "scenarios" / "azure_conv_llama2_7b_a100.yaml"
    r = subprocess.run([sys.executable, "-c", _RUN_PROBE, str(path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"

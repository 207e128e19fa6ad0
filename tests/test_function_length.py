"""No function of the project's Python is longer than MAX_LINES lines (its def line to its last, decorators aside):
a longer one is a sequence of steps that want names of their own."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "executor", "calibration", "infersim", "dashboard")
MAX_LINES = 60


def long_functions(root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """`path:line name (N lines)` of every function or method over `limit` lines under the packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_60_lines():
    offenders = long_functions()
    assert not offenders, f"functions over {MAX_LINES} lines (extract named steps): " + "; ".join(offenders)


def test_the_check_finds_a_long_function(tmp_path):
    (tmp_path / "sim").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "sim" / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"sim/long.py:5 long ({MAX_LINES + 1} lines)"]

"""The user-facing documents stay true to the project: every relative link reaches a file (and its heading, when it
names one), and every scenario written out in them validates."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "bench" / "RESULTS.md",
               *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "runs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```yaml\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a '#' line in a code block is not a heading
    found = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)">', text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading '{anchor}' in {path.name}")
    assert not broken, broken


@pytest.mark.parametrize("doc", [d for d in DOCS if FENCE.search(d.read_text())], ids=lambda p: p.name)
def test_every_scenario_written_in_the_docs_validates(doc, tmp_path):
    from sim.config.plan import load_scenario

    checked = 0
    for block in FENCE.findall(doc.read_text()):
        data = yaml.safe_load(block)
        if not (isinstance(data, dict) and {"model", "hardware", "workload"} <= data.keys()):
            continue  # a fragment (one section), not a whole scenario
        path = tmp_path / f"block{checked}.yaml"
        path.write_text(block)
        load_scenario(path)
        checked += 1
    assert checked or doc.name != "README.md", "the README's worked example is no longer a whole scenario"

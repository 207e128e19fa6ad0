"""Where a page's starting scenario comes from: a scenario file, an uploaded one, or one handed over by another
page (Search's "open in What-if")."""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from infersim import api
from sim.config.errors import ConfigError
from sim.config.scenario import parse_scenario
from sim.config.yaml_file import read_yaml

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "scenarios"


@dataclass(frozen=True)
class Seed:
    """A scenario mapping to start the widgets from, and the folder its relative paths start at."""

    label: str
    data: dict
    base_dir: Path


def scenario_files() -> dict[str, Path]:
    """The scenarios to start from, by label: the embedded default, then scenarios/**/*.yaml (search specs aside)."""
    found = {"default (embedded)": api.default_scenario_path()}
    for p in sorted(SCENARIOS.rglob("*.yaml")):
        if "search" not in p.relative_to(SCENARIOS).parts[:-1]:
            found[str(p.relative_to(REPO))] = p
    return found


def upload_dir() -> Path:
    """This browser session's folder for uploaded files (scenario YAMLs, trace CSVs)."""
    if "upload_dir" not in st.session_state:
        st.session_state["upload_dir"] = tempfile.mkdtemp(prefix="infersim-dashboard-")
    return Path(st.session_state["upload_dir"])


def saved(upload) -> Path:
    """An uploaded file written to this browser session's folder (the readers take paths)."""
    path = upload_dir() / (re.sub(r"[^\w.-]", "_", Path(upload.name).name) or "upload")
    path.write_bytes(upload.getvalue())
    return path


def read_mapping(path: Path, name: str | None = None) -> dict:
    """A YAML file holding a mapping, read within the scenario limits; ConfigError naming the file (or `name`)."""
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise ConfigError(e.message, e.key_path, name or e.file) from None
    if not isinstance(data, dict):
        raise ConfigError(f"holds a {type(data).__name__}, not a mapping of keys", file=name or str(path))
    return data


def read_scenario(path: Path, name: str | None = None) -> dict:
    """A scenario file's mapping, checked against the schema (the widgets take its values as typed)."""
    data = read_mapping(path, name)
    try:
        parse_scenario(data)
    except ConfigError as e:
        raise ConfigError(e.message, e.key_path, name or str(path)) from None
    return data


def hand_over(page: str, seed: Seed) -> None:
    """Make `seed` the next starting scenario of `page` (selected the next time it shows)."""
    st.session_state[f"{page}.handoff"] = seed
    st.session_state[f"{page}.handoff_gen"] = st.session_state.get(f"{page}.handoff_gen", 0) + 1


def pick(page: str) -> Seed | None:
    """A selectbox over the scenario files (first, a scenario handed over to this page) and an uploader that
    overrides it; None, with the reason shown, when the pick cannot be read."""
    files = scenario_files()
    handed: Seed | None = st.session_state.get(f"{page}.handoff")
    options = ([handed.label] if handed else []) + list(files)
    left, right = st.columns([3, 2])
    generation = st.session_state.get(f"{page}.handoff_gen", 0)  # a new key after a hand-over selects it afresh
    label = left.selectbox("Start from a scenario", options, key=f"{page}.seed.{generation}")
    upload = right.file_uploader("or upload a scenario YAML", type=["yaml", "yml"], key=f"{page}.upload")
    try:
        if upload is not None:
            return Seed(upload.name, read_scenario(saved(upload), upload.name), upload_dir())
        if handed and label == handed.label:
            return handed
        path = files[label]
        return Seed(label, read_scenario(path, label), path.parent)
    except ConfigError as e:
        st.error(e.one_line())
        return None

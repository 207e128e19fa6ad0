"""What a command is given, read and checked before anything runs: scenario files and their plans, output paths,
a checkpoint, drafters, torch threads, the executor's packages. Bad input is one line (ConfigError) before minutes
of work, not after them. Light to import (the CLI does at start-up): the scenario schema loads with the first plan."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sim.config.errors import ConfigError

if TYPE_CHECKING:
    from sim.config.plan import Plan

DEFAULT_SCENARIO = "default.yaml"


def default_scenario_path() -> Path:
    """The scenario `infersim run` uses when given none (shipped inside the package)."""
    from importlib.resources import files

    return Path(str(files("sim") / "data" / DEFAULT_SCENARIO))


def load_plan(path: str | Path) -> Plan:
    """A scenario file read, validated and resolved."""
    from sim.config.plan import load_scenario

    return load_scenario(path)[1]


def scenario_files(paths: list[Path]) -> list[Path]:
    """The YAML files named, with each folder expanded to its *.yaml (sorted)."""
    found_all = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.yaml"))
            if not found:
                raise ConfigError(f"{p} holds no *.yaml scenarios", "SCENARIO")
            found_all += found
        else:
            found_all.append(p)
    check_distinct(found_all)
    return found_all


def check_distinct(paths: list[Path]) -> None:
    """Each scenario file named once (twice, one's outputs replaced the other's and the medians counted it twice)."""
    seen: dict[Path, Path] = {}
    for p in paths:
        key = p.resolve() if p.exists() else p
        if key in seen:
            raise ConfigError(f"{seen[key]} and {p} are one file; allowed: each scenario once", "SCENARIO")
        seen[key] = p


def prepare_out(out: Path | None) -> None:
    """Make sure `out` is a folder this process can write, before a run that may take minutes (an error after
    the run would lose it)."""
    if out is None:
        return
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{out} exists and is not a folder", "--out")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".infersim-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to {out} ({type(e).__name__}: {e.strerror or e})", "--out") from None


def prepare_out_file(path: Path | None, key_path: str) -> None:
    """Make sure `path` can be written as a file (its folder made), before minutes of measuring that end in it."""
    if path is None:
        return
    try:
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} exists and is not a file", key_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(f"cannot write to {path} (permission denied)", key_path)
        # os.access says yes to root even where nothing can be written (/sys, a read-only mount): try it
        probe = path.parent / f".{path.name}.infersim-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to {path} ({type(e).__name__}: {e.strerror or e})", key_path) from None


def check_replaces_a_profile(out: Path) -> None:
    """`--out` is a new path or a profile to measure again: any other file there would be overwritten after a sweep
    of minutes (a scenario or a report named by mistake)."""
    if not out.is_file():
        return
    try:
        data = json.loads(out.read_text(encoding="utf-8"))
        ok = isinstance(data, dict) and "samples" in data and "fit" in data
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise ConfigError(f"{out} exists and is not an infersim profile; allowed: a new path, or a profile to "
                          "measure again", "--out")


def check_checkpoint(plan: Plan, path: Path) -> None:
    """The checkpoint a scenario's `model: {hf_config: DIR}` names holds what transformers loads (a config.json with
    its model_type, and weights), checked before anything runs: transformers' own error is a traceback."""
    folder = plan.model_checkpoint
    if folder is None or plan.executor.random_weights:
        return
    config = folder / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{config} names no model_type (e.g. \"llama\"), which loading the checkpoint needs; "
                          "allowed: a Hugging Face checkpoint's config.json, or executor.random_weights: true",
                          "model.hf_config", str(path))
    if not any(f.suffix in (".safetensors", ".bin") for f in folder.iterdir()):
        raise ConfigError(f"{folder} holds no weights (*.safetensors or *.bin) for the executor; allowed: a "
                          "checkpoint folder, or executor.random_weights: true", "model.hf_config", str(path))


def require_executor(what: str) -> None:
    """The executor's heavy dependencies (torch, transformers, ...: the `executor` extra) are installed, else a
    one-line error saying how to get them: planning needs none of them."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "gguf", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"`infersim {what}` runs the PyTorch executor, which needs {', '.join(missing)}: pip "
                          "install 'infersim[executor]' (torch first, pinned: see the README)")


def check_drafters(plans: list, named_only: bool = False) -> None:
    """Each (path, plan)'s draft model or Medusa heads are there, and a Medusa tree fits its heads, checked before
    the target model loads; errors name the scenario file. `named_only`: a simulation may plan with heads or a draft
    not made yet, so only a folder the scenario names that holds them is checked against it."""
    import importlib.util

    if named_only and importlib.util.find_spec("torch") is None:  # planning without the executor: nothing to load
        return
    for path, plan in plans:
        if plan.speculative is not None and plan.speculative.method in ("draft_model", "medusa", "eagle", "mtp"):
            from executor.speculative.build import drafter_dir  # torch: only where a drafter is named

            try:
                drafter_dir(plan, named_only)
            except ConfigError as e:
                raise e.with_file(str(path)) from None


def warn_threads(plan: Plan, threads: int | None) -> None:
    """One line on stderr when the torch threads asked for (`threads`, else executor.threads) outnumber the cores
    this process may run on: each step then waits on threads that share a core, and latencies come out many times
    those of the machine."""
    want = threads or plan.executor.threads
    procs = plan.sharding.tp * plan.pipeline_parallel_size  # each process of a parallel serve takes as many
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if want and want * procs > cores:
        where = ("--threads" if threads else "executor.threads") + f" {want}" + (f" x {procs} processes"
                                                                              if procs > 1 else "")
        print(f"infersim: warning: {where} on {cores} cores here: the threads share cores and every step slows "
              f"down; allowed, but the latencies measured are not this machine's at {cores} threads", file=sys.stderr)

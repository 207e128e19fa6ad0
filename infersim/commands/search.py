"""`infersim search`: the cheapest deployment that meets the SLOs at the traffic, over a space of configurations.

A search spec names a base scenario, a target (a rate the deployment must carry, SLOs on TTFT/TPOT quantiles) and a
space: dotted scenario keys, each with the values to try. Every combination is a configuration. Those that cannot
run (the model does not fit, TP does not divide the heads, more devices than allowed) are pruned with their reason
before anything is simulated. The others are searched cheapest first, and those that cost more per hour than the
cheapest found to carry the target are pruned unsearched (search.prune_costlier). For each of the others, its
capacity: the highest arrival rate on a geometric grid at which the workload's first `max_requests` requests, their
arrival gaps scaled to that rate, still meet the SLOs (counting rejected requests as misses), found by an
exponential then a binary search on the grid, each probe stopped as soon as enough requests have missed to decide
it. The grid and the search depend on the configuration alone, so the results are the same in any order, on any
backend. Then: cost per hour and per million output tokens at capacity, latency at the target rate, the Pareto
fronts, the recommendation and why each other one lost.
"""
from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, PositiveFloat, PositiveInt, ValidationError, model_validator
from rich.console import Console
from rich.table import Column, Table

from infersim.backends import map_unordered
from infersim.scenario_keys import apply, is_ratio
from sim.config.errors import ConfigError
from sim.config.generator import generate_requests
from sim.config.limits import MAX_REQUESTS
from sim.config.plan import Plan, check_profile_device, make_plan, resolve_hardware, resolve_model
from sim.config.profile import read_profile
from sim.config.scenario import Scenario, SLOConfig, parse_scenario, validation_error
from sim.config.schema_base import StrictModel
from sim.config.workload import RequestSpec
from sim.config.yaml_file import read_yaml
from sim.cost.build import speculation_model
from sim.report.capacity import (
    KEEP_UP,
    STEADY_ROUNDS,
    check_has_slo,
    check_scalable,
    judged_metrics,
    lowest,
    probe_rows,
    rates_grid,
    users_grid,
    users_probe,
    warm_up,
    why_failed,
)
from sim.report.metrics import compute_metrics
from sim.simulator.cluster import sim_records, simulate

MAX_CONFIGURATIONS = 10_000
# keys whose candidate values replace a whole section (a mapping value is not merged into the base's)
WHOLE = ("speculative", "pools", "model", "hardware", "workload")
# keys a space may not sweep: every probe replays the base scenario's workload, under target.slo, named by the search
NOT_SWEPT = {"workload": "every probe replays the base scenario's workload at the grid's rates",
             "slo": "the SLOs are the search's target: set target.slo", "name": "the search names each configuration",
             "description": "the search names each configuration",
             "executor": "the simulator does not read it (`infersim serve` and `validate` do): every value would "
                         "give the same capacity"}


class SearchTarget(StrictModel):
    """What the deployment must do: carry `rate` requests/s (default: the workload's mean rate), or serve `users`
    (a closed loop's; default: its users), within the SLOs (default: the scenario's slo)."""

    rate: PositiveFloat | None = Field(None, le=1e6, description="requests/s the deployment must carry")
    users: PositiveInt | None = Field(None, le=MAX_REQUESTS, description="users a closed loop's deployment must serve")
    slo: SLOConfig | None = Field(None, description="ttft_s, tpot_s, quantile; default: the scenario's slo")


class SearchSettings(StrictModel):
    max_requests: PositiveInt = Field(1500, le=200_000, description="requests a probe simulates (the workload's first)")
    precision: float = Field(0.05, ge=0.005, le=1.0, description="rate grid step: capacity is found within it")
    min_rate: PositiveFloat = Field(0.01, le=1e6, description="the grid's lowest rate (requests/s)")
    max_rate: PositiveFloat = Field(1e5, le=1e7, description="the grid's highest rate (requests/s)")
    max_devices: PositiveInt | None = Field(None, le=1_000_000, description="prune configurations with more devices")
    prune_costlier: bool = Field(True, description="skip configurations that cost more per hour than the cheapest "
                                                   "one found to carry the target (false: search every one, for the "
                                                   "whole Pareto front)")

    @model_validator(mode="after")
    def _ordered(self) -> "SearchSettings":
        if self.min_rate >= self.max_rate:  # an empty grid: every probe would fall outside it
            raise ValueError(f"min_rate ({self.min_rate:g}) must be below max_rate ({self.max_rate:g})")
        return self


class SearchSpec(StrictModel):
    """A search spec as the user writes it (YAML)."""

    name: str = "search"
    scenario: str | dict[str, Any] = Field(description="the base scenario: a file (relative to the spec) or a mapping")
    target: SearchTarget = SearchTarget()
    space: dict[str, list[Any]] = Field(description="dotted scenario keys, each with the values to try; 'pools': "
                                                    "null (colocated) or [prefill, decode] replicas")
    search: SearchSettings = SearchSettings()


@dataclass
class Search:
    """A spec resolved: the base scenario's data and folder, the target, the settings."""

    name: str
    base: dict
    base_dir: Path
    space: dict[str, list]
    target_rate: float  # in `unit`
    slo: SLOConfig
    settings: SearchSettings
    unit: str = "req/s"  # what a capacity counts: requests/s, or a closed loop's "users"


@dataclass
class ConfigResult:
    """One configuration's outcome (pruned, or its capacity, costs and latency at the target rate)."""

    label: str
    overrides: dict
    scenario: dict  # the full scenario data, ready to run or open in the dashboard
    status: str = "ok"  # ok | pruned
    reason: str = ""  # pruned: why; else why it lost (empty for the recommended one)
    devices: int = 0
    usd_per_hour: float = 0.0
    capacity_rps: float = 0.0  # 0: misses the SLOs even at the grid's lowest rate (a closed loop: users)
    missed_at_rps: float | None = None  # the grid rate just above capacity (None: met at the grid's top)
    usd_per_million_tokens: float | None = None  # at capacity
    ttft_p90_s: float | None = None  # at the target rate (the SLO's quantile)
    tpot_p90_s: float | None = None
    e2e_p90_s: float | None = None
    meets_at_target: bool = False
    missed_by: str = ""  # what failed the probe at missed_at_rps: slo, keep_up, short or unsteady (why_failed)
    probe_limited: bool = False  # the rate above capacity failed only as the probe was too short (conversations, users)
    probes: int = 0
    pareto: bool = False  # on the cost-vs-capacity front
    pareto_latency: bool = False  # on the cost-vs-TPOT front (at the target rate, among those that meet it)


@dataclass
class SearchResult:
    name: str
    target_rate: float
    slo: dict
    rows: list[ConfigResult]
    recommended: ConfigResult | None
    wall_s: float = 0.0
    probes: int = 0
    settings: dict = field(default_factory=dict)
    unit: str = "req/s"  # of target_rate and each row's capacity_rps and missed_at_rps

    def to_json(self) -> dict:
        return {"name": self.name, "unit": self.unit, "target_rate": self.target_rate, "slo": self.slo,
                "settings": self.settings,
                "recommended": self.recommended.label if self.recommended else None,
                "margin": self.recommended.capacity_rps / self.target_rate - 1 if self.recommended else None,
                "configurations": len(self.rows), "probes": self.probes, "wall_s": self.wall_s,
                "rows": [asdict(r) for r in self.rows]}


# -- the spec ---------------------------------------------------------------------------------------------------
def parse_search_spec(data: Any, base_dir: Path = Path(".")) -> Search:
    """Validate a search spec mapping and resolve its base scenario; every problem is a one-line ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"a search spec is a mapping with scenario, space (and target, search); got "
                          f"{type(data).__name__}")
    try:
        spec = SearchSpec.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, SearchSpec) from None
    base, scenario_dir, scenario = _base_scenario(spec, base_dir)
    _check_space(spec, scenario, base, scenario_dir)
    rate, unit = _target_rate(spec, scenario, scenario_dir)
    bottom, top = lowest(unit, spec.search.min_rate), spec.search.max_rate
    if not bottom <= rate <= top:  # the grid starts from the target: outside it, no verdict would be the SLO's
        raise ConfigError(f"the target, {rate:g} {unit}, lies outside the grid's {bottom:g}..{top:g}; allowed: "
                          "search.min_rate <= target <= search.max_rate",
                          "search.max_rate" if rate > top else "search.min_rate")
    slo = spec.target.slo or scenario.slo
    check_has_slo(slo, "target.slo")
    return Search(spec.name, base, scenario_dir, spec.space, rate, slo, spec.search, unit)


def _base_scenario(spec: SearchSpec, base_dir: Path) -> tuple[dict, Path, Scenario]:
    """The base scenario (its mapping, its folder, parsed), faults in its own file reported against that file; its
    profile read now unless the search sweeps the cost model."""
    if isinstance(spec.scenario, str):
        path = base_dir / spec.scenario
        try:  # a fault inside the base scenario's own file is reported against that file
            base, scenario_dir = read_yaml(path), path.parent
            if not isinstance(base, dict):
                raise ConfigError("a scenario is a mapping of keys")
            scenario = parse_scenario(base)
        except ConfigError as e:
            raise ConfigError(e.message, e.key_path, e.file or str(path)) from None
    else:
        base, scenario_dir = dict(spec.scenario), base_dir
        try:
            scenario = parse_scenario(base)
        except ConfigError as e:
            raise ConfigError(e.message, f"scenario.{e.key_path}" if e.key_path else "scenario") from None
    swept = {k.split(".")[0] for k in spec.space}
    if scenario.cost_model.profile and "cost_model" not in swept:  # else every configuration is pruned for it
        try:
            read_profile(scenario_dir / scenario.cost_model.profile)
        except ConfigError as e:
            raise ConfigError(e.message, e.key_path if e.file else "scenario.cost_model.profile", e.file) from None
    return base, scenario_dir, scenario


def _check_space(spec: SearchSpec, scenario: Scenario, base: dict, scenario_dir: Path) -> None:
    """Every key of the space is a scenario key that can be searched, with values, not too many configurations."""
    if not spec.space:
        raise ConfigError("no keys to search; allowed: dotted scenario keys, each with the values to try (e.g. "
                          "serving.max_num_seqs: [64, 256])", "space")
    for key, values in spec.space.items():
        if not values:
            raise ConfigError("give at least one value to try", f"space.{key}")
        if key.split(".")[0] not in type(scenario).model_fields:
            raise ConfigError(f"not a scenario key; allowed: {', '.join(type(scenario).model_fields)} (dotted: "
                              "serving.max_num_seqs)", f"space.{key}")
        if key.startswith("pools.") and scenario.pools is None and "pools" not in spec.space:
            raise ConfigError("the base scenario has no pools to set this in (every configuration would be pruned); "
                              "allowed: give the base scenario pools, or search 'pools' too", f"space.{key}")
        if key.split(".")[0] in NOT_SWEPT:
            raise ConfigError(f"not searched: {NOT_SWEPT[key.split('.')[0]]}", f"space.{key}")
        if key == "pools" and any(v is not None and not is_ratio(v) and not isinstance(v, dict) for v in values):
            raise ConfigError("each value: null (colocated), [prefill replicas, decode replicas] or a pools mapping",
                              "space.pools")
    count = math.prod(len(v) for v in spec.space.values())
    if count > MAX_CONFIGURATIONS:
        raise ConfigError(f"{count:,} configurations; allowed: at most {MAX_CONFIGURATIONS:,}", "space")
    for key, values in spec.space.items():
        _check_values(spec, key, values, base, scenario_dir)


def _check_values(spec: SearchSpec, key: str, values: list, base: dict, scenario_dir: Path) -> None:
    """One key's values: each once (as given and as the configuration it makes), none clashing with a section the
    space also sets."""
    twice = next((i for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:  # the same configuration twice: two rows of one label, probed twice
        raise ConfigError(f"{_short_value(values[twice])} is listed twice; allowed: each value once",
                          f"space.{key}[{twice}]")
    for within in (k for k in spec.space if k != key and key.startswith(k + ".")):
        inner = key[len(within) + 1:].split(".")
        clash = next((i for i, v in enumerate(spec.space[within]) if _has_path(v, inner)), None)
        if clash is not None:  # the section is applied first: the dotted key would silently replace its value
            raise ConfigError(f"space.{within}[{clash}] sets {'.'.join(inner)}, which space.{key} searches too; "
                              "allowed: one or the other", f"space.{key}")
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        same = _check_value(base, key, v, f"space.{key}[{i}]", scenario_dir)
        if same is not None and same in seen:  # e.g. "cpu" and {base: cpu}: one configuration searched twice
            raise ConfigError(f"{_short_value(v)} is the configuration of value [{seen[same]}] again; allowed: "
                              "each value once", f"space.{key}[{i}]")
        seen.setdefault(same, i)


def _target_rate(spec: SearchSpec, scenario: Scenario, scenario_dir: Path) -> tuple[float, str]:
    """The load the search must carry and its unit: users for a closed loop, else requests per second (the
    workload's own mean rate unless target.rate says)."""
    loop = scenario.workload.closed_loop
    if loop is not None:  # its load is its users: the capacity is the most users it serves within the SLOs
        if spec.target.rate is not None:
            raise ConfigError("a closed loop's target is users, not a rate: give target.users (default: "
                              "workload.closed_loop.users)", "target.rate")
        rate = float(spec.target.users or loop.users)
        probe = users_probe(scenario.workload, scenario_dir, int(rate), spec.search.max_requests)  # its faults now
        if len(probe) < STEADY_ROUNDS:
            raise ConfigError(f"probes of {len(probe)} requests cannot judge even one user (a closed loop's probe "
                              f"needs {STEADY_ROUNDS} requests per user or more)", "search.max_requests")
        return rate, "users"
    if spec.target.users is not None:
        raise ConfigError("target.users is a closed loop's (scenario workload.closed_loop); give target.rate",
                          "target.users")
    return spec.target.rate or _mean_rate(_probe_specs(scenario, scenario_dir, spec.search.max_requests)), "req/s"


def load_search_spec(path: str | Path) -> Search:
    path = Path(path)
    try:
        return parse_search_spec(read_yaml(path), path.parent)
    except ConfigError as e:
        raise e.with_file(str(path)) from None


def _has_path(value, path: list[str]) -> bool:
    """Whether a mapping value sets the nested key `path`."""
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _short_value(v) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:59] + "…"


def _check_value(base: dict, key: str, value, where: str, base_dir: Path) -> str | None:
    """A value the key itself refuses (a type, a bound, an unknown sub-key: the key's own schema, or a model or
    hardware spec) is an error in the spec; one that only clashes with other keys prunes its configurations.
    Returns the configuration the value makes, as canonical JSON (None where it clashes), so that two spellings
    of one configuration are found."""
    try:
        scenario = parse_scenario(apply(base, key, value))
        same = scenario.model_dump(mode="json")
        if key.split(".")[0] == "model":
            spec, folder = resolve_model(scenario.model, base_dir)
            same["model"] = [spec.model_dump(mode="json"), str(folder)]
        elif key.split(".")[0] == "hardware":
            same["hardware"] = resolve_hardware(scenario.hardware).model_dump(mode="json")
        return json.dumps(same, sort_keys=True, default=str)
    except ConfigError as e:
        at = e.key_path
        if at and (at == key or at.startswith((key + ".", key + "[")) or key.startswith(at + ".")):
            raise ConfigError(e.message if at == key else f"{at}: {e.message}", where) from None
        return None


def _probe_specs(scenario, base_dir: Path, n: int) -> list[RequestSpec]:
    every = generate_requests(scenario.workload, base_dir)
    check_scalable(every[:n], "scenario.workload", "search.max_requests" if len(every) > n else None)
    return every[:n]


def _mean_rate(specs: list[RequestSpec]) -> float:
    span = specs[-1].arrival_s - specs[0].arrival_s
    return (len(specs) - 1) / span if span > 0 else float(len(specs))


# -- configurations ---------------------------------------------------------------------------------------------
def configurations(search: Search) -> list[tuple[str, dict, dict]]:
    """(label, overrides, scenario data) for every combination of the space's values, in the space's order."""
    keys = list(search.space)
    # a whole section before the dotted keys inside it, whatever the spec's order: those refine it
    order = sorted(range(len(keys)), key=lambda i: keys[i].count("."))
    names = [_value_labels(search.space[k]) for k in keys]
    short = _key_labels(keys)
    out = []
    for picks in itertools.product(*(range(len(search.space[k])) for k in keys)):
        values = [search.space[k][j] for k, j in zip(keys, picks)]
        data = search.base
        for i in order:
            data = apply(data, keys[i], values[i])
        overrides = dict(zip(keys, values))
        label = " ".join(f"{short[k]}={names[i][j]}" for i, (k, j) in enumerate(zip(keys, picks)))
        data = {**data, "name": f"{search.name}: {label}", "slo": search.slo.model_dump(mode="json")}
        out.append((label, overrides, data))
    return out


SHORT_KEYS = {"parallel.tensor_parallel_size": "tp", "parallel.pipeline_parallel_size": "pp",
              "parallel.data_parallel_size": "dp", "parallel.enable_expert_parallel": "ep"}


def _key_labels(keys: list[str]) -> dict[str, str]:
    """Each key's name in a label: its last part (tp, pp for the parallel sizes), with the parts before it that tell
    it from the others (pools.prefill.replicas and pools.decode.replicas: prefill.replicas, decode.replicas; a
    pool's key keeps its pool's name even alone)."""
    parts = {k: k.split(".") for k in keys}
    depth = dict.fromkeys(keys, 1)

    def name(k: str) -> str:
        tail = parts[k][-depth[k]:]
        pool = parts[k][1] if k.startswith("pools.") and len(parts[k]) > 2 and len(tail) < len(parts[k]) - 1 else None
        return ".".join(([pool] if pool else []) + tail)

    while True:
        names = {k: SHORT_KEYS.get(k) or name(k) for k in keys}
        shared = [k for k in keys if list(names.values()).count(names[k]) > 1 and depth[k] < len(parts[k])]
        if not shared:
            return names
        for k in shared:
            depth[k] += 1


def _value_labels(values: list) -> list[str]:
    """One short label per value of a key, each its own: mappings that share a name (two `ngram` speculative
    sections, two A100 variants) add the sub-keys on which they differ, so that no two rows share a label."""
    labels = [_value_label(v) for v in values]
    for name in {x for x in labels if labels.count(x) > 1}:
        group = [i for i, x in enumerate(labels) if x == name]
        dicts = [values[i] if isinstance(values[i], dict) else {} for i in group]
        keys = sorted({k for d in dicts for k in d} - {"method", "name", "base"})  # those make the name itself
        differ = [k for k in keys if len({json.dumps(d.get(k), sort_keys=True, default=str) for d in dicts}) > 1]
        for i, d in zip(group, dicts):
            inner = ",".join(f"{k}={_value_label(d[k])}" for k in differ if k in d)
            labels[i] = f"{name}({inner})" if inner else name
    for i, x in enumerate(labels):  # still shared (spellings the parser tells apart): the position decides
        if labels.count(x) > 1:
            labels[i] = f"{x}#{i}"
    return labels


def _value_label(v) -> str:
    if v is None:
        return "none" if not isinstance(v, list) else ""
    if is_ratio(v):
        return f"{v[0]}:{v[1]}"
    if isinstance(v, dict):
        return v.get("method") or v.get("name") or v.get("base") or json.dumps(v, sort_keys=True)
    return f"{v:.6g}" if isinstance(v, float) else str(v)  # 1.2e+12, not 1200000000000.0


def devices_of(plan: Plan) -> int:
    plans = [plan.pools.prefill, plan.pools.decode] if plan.pools is not None else [plan]
    return sum(p.replicas * p.devices_per_replica for p in plans)


def usd_per_hour(plan: Plan) -> float:
    plans = [plan.pools.prefill, plan.pools.decode] if plan.pools is not None else [plan]
    return sum(p.hardware.price_per_hour * p.replicas * p.devices_per_replica for p in plans)


# -- one configuration's capacity (runs in a worker) ------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    """Everything a worker needs to search one configuration."""

    label: str
    overrides: dict
    data: dict
    base_dir: str
    specs: tuple  # (arrival_s, prompt_len, output_len) of the probe requests, at the workload's own rate
    target_rate: float
    settings: dict
    unit: str = "req/s"  # "users": a closed loop, its probes made per user count (users_probe), `specs` unused


def run_probe(plan: Plan, specs: list[RequestSpec], early_stop: bool = True, users: int | None = None
              ) -> tuple[bool, dict | None, str]:
    """Simulate `specs` on `plan`: (whether the SLOs hold, counting rejected requests as misses; the report's
    metrics when the run went to its end; what failed it, as sim.report.capacity.why_failed, `users` for a closed
    loop's). With `early_stop` the run stops once more requests have missed a target than its quantile allows: the
    SLO cannot hold any more."""
    slo = plan.slo
    warm = warm_up(specs) if users is not None else set()  # a closed loop's first wave: not judged
    allowed = (1 - slo.quantile) * (len(specs) - len(warm)) + 1
    misses = [0, 0, 0]  # requests past the TTFT, TPOT and E2E targets so far

    def watch(r) -> bool:
        if r is not None and r.id in warm:
            return False
        if r is None or r.first_token_s is None:
            misses[:] = [m + 1 for m in misses]
        else:
            if slo.ttft_s is not None and r.first_token_s - r.arrival_s > slo.ttft_s:
                misses[0] += 1
            if slo.tpot_s is not None and r.max_tokens > 1 and \
                    (r.finish_s - r.first_token_s) / (r.max_tokens - 1) > slo.tpot_s:
                misses[1] += 1
            if slo.e2e_s is not None and r.finish_s - r.arrival_s > slo.e2e_s:
                misses[2] += 1
        return max(misses) > allowed

    result = simulate(plan, specs, watch=watch if early_stop else None)
    if result.stopped:
        return False, None, "slo"
    records = sim_records(result)
    metrics = judged_metrics(compute_metrics(records, slo, plan.client), records, specs, users)
    why = why_failed(metrics, records, specs, users)
    return not why, metrics, why


def prune(probe: Probe) -> tuple[ConfigResult, Plan | None]:
    """The configuration's row, pruned with the reason if it cannot run, and its plan if it can."""
    row = ConfigResult(probe.label, probe.overrides, probe.data)
    try:
        plan = make_plan(parse_scenario(probe.data), Path(probe.base_dir))
        check_profile_device(plan)
        speculation_model(plan, 0)  # what simulating needs of a speculative section (α, Medusa's rank chances)
    except ConfigError as e:
        return replace(row, status="pruned", reason=e.one_line()), None
    row.devices, row.usd_per_hour = devices_of(plan), usd_per_hour(plan)
    limit = probe.settings.get("max_devices")
    if limit is not None and row.devices > limit:
        return replace(row, status="pruned", reason=f"{row.devices} devices; allowed: at most {limit}"), None
    return row, plan


def search_one(probe: Probe) -> ConfigResult:
    """Search one configuration that can run (a top-level function: local processes and Ray workers run it)."""
    row, plan = prune(probe)
    if plan is None:
        return row
    settings = SearchSettings(**probe.settings)
    grid = users_grid(plan.workload, plan.base_dir, settings.max_requests, probe.target_rate) \
        if probe.unit == "users" else rates_grid(probe.specs, probe.target_rate)
    runs: dict[float, tuple[bool, dict | None, str]] = {}

    def meets(x: float) -> bool:
        runs[x] = run_probe(plan, grid.probe(x), users=grid.users(x))
        return runs[x][0]

    found = grid.search(meets, settings.precision, settings.min_rate, settings.max_rate)
    at_target = runs.get(probe.target_rate)
    row.meets_at_target = at_target is not None and at_target[0]
    if row.meets_at_target:  # a probe that meets the SLOs ran to its end: its quantiles are the run's
        q = at_target[1]["slo"]
        row.ttft_p90_s, row.tpot_p90_s, row.e2e_p90_s = (q["ttft_at_quantile_s"], q["tpot_at_quantile_s"],
                                                         q["e2e_at_quantile_s"])
    row.probes = len(runs)
    row.capacity_rps, row.missed_at_rps = found.rate, found.missed_at
    row.missed_by = runs[found.missed_at][2] if found.missed_at is not None else ""
    row.probe_limited = row.missed_by in ("unsteady", "short")
    if found.rate:  # a probe that meets the SLOs ran to its end: its throughput prices the tokens
        tokens_s = runs[found.rate][1]["throughput"]["output_tokens_per_s"]
        row.usd_per_million_tokens = row.usd_per_hour / 3600 / tokens_s * 1e6 if tokens_s else None
    return row


# -- the whole search ---------------------------------------------------------------------------------------------
def probes_of(search: Search) -> list[Probe]:
    scenario = parse_scenario(search.base)
    specs = () if search.unit == "users" else \
        probe_rows(_probe_specs(scenario, search.base_dir, search.settings.max_requests))
    return [Probe(label, overrides, data, str(search.base_dir), specs, search.target_rate,
                  search.settings.model_dump(), search.unit)
            for label, overrides, data in configurations(search)]


def run_search(search: Search, backend: str = "local", workers: int | None = None,
               progress: Callable[[int, int], None] | None = None, cancel=None, address: str | None = None
               ) -> SearchResult:
    """Search every configuration on `backend` ("local": processes on this machine; "ray": a Ray cluster at
    `address`, or a local one), cheapest first, skipping (with search.prune_costlier) those costlier than the
    cheapest found to carry the target; `progress(done, total)` as configurations finish; `cancel` (a
    threading.Event) stops the search between configurations (ConfigError)."""
    t0 = time.perf_counter()
    probes = probes_of(search)
    rows = pruned_rows(probes)
    todo = sorted((i for i, r in enumerate(rows) if r.status == "ok"), key=lambda i: (rows[i].usd_per_hour, i))
    cheapest = [math.inf]  # $/h of the cheapest configuration found to carry the target so far
    costlier = search.settings.prune_costlier
    done = len(probes) - len(todo)
    for j, row in map_unordered(search_one, [probes[i] for i in todo], backend, workers, address,
                                wanted=lambda j: not costlier or rows[todo[j]].usd_per_hour <= cheapest[0]):
        rows[todo[j]] = row
        if row.capacity_rps >= search.target_rate:
            cheapest[0] = min(cheapest[0], row.usd_per_hour)
        done += 1
        if progress:
            progress(done, len(probes))
        if cancel is not None and cancel.is_set():
            raise ConfigError("search cancelled")
    for i in todo:  # skipped, or searched before a cheaper one was found: pruned alike, whatever the backend's order
        if costlier and rows[i].usd_per_hour > cheapest[0]:
            rows[i] = replace(rows[i], status="pruned", reason=f"not searched: ${rows[i].usd_per_hour:.2f}/h, more "
                              f"than ${cheapest[0]:.2f}/h, the cheapest that carries the target "
                              "(search.prune_costlier)", **CLEAR)
    if progress:
        progress(len(probes), len(probes))
    result = rank(search, rows)
    result.wall_s = time.perf_counter() - t0
    return result


# what a searched row found, cleared when the row is pruned for its cost after all
CLEAR = {f: ConfigResult.__dataclass_fields__[f].default for f in (
    "capacity_rps", "missed_at_rps", "usd_per_million_tokens", "ttft_p90_s", "tpot_p90_s", "e2e_p90_s",
    "meets_at_target", "missed_by", "probe_limited", "probes")}


def pruned_rows(probes: list[Probe]) -> list[ConfigResult]:
    """Every configuration's row before anything is simulated: pruned with the reason if it cannot run, or as a
    repeat of an earlier one's deployment (e.g. `replicas` beside `pools`); status ok with its devices and $/h
    otherwise."""
    rows, seen = [], {}
    for i, probe in enumerate(probes):
        key = json.dumps({k: v for k, v in probe.data.items() if k != "name"}, sort_keys=True)
        row, plan = prune(probe)
        if plan is not None and key in seen:
            row = replace(row, status="pruned", reason=f"the same deployment as {probes[seen[key]].label}")
        elif plan is not None:
            seen[key] = i
        rows.append(row)
    return rows


def rank(search: Search, rows: list[ConfigResult]) -> SearchResult:
    """Mark the Pareto fronts, pick the cheapest configuration that carries the target rate, say why others lost."""
    ok = [r for r in rows if r.status == "ok"]
    for r in ok:
        r.pareto = not any(o is not r and o.usd_per_hour <= r.usd_per_hour and o.capacity_rps >= r.capacity_rps
                           and (o.usd_per_hour < r.usd_per_hour or o.capacity_rps > r.capacity_rps) for o in ok)
    meeting = [r for r in ok if r.meets_at_target and r.tpot_p90_s is not None]
    for r in meeting:
        r.pareto_latency = not any(o is not r and o.usd_per_hour <= r.usd_per_hour and o.tpot_p90_s <= r.tpot_p90_s
                                   and (o.usd_per_hour < r.usd_per_hour or o.tpot_p90_s < r.tpot_p90_s)
                                   for o in meeting)
    able = [r for r in ok if r.capacity_rps >= search.target_rate]
    slo = search.slo

    def load(r: ConfigResult) -> float:
        """How close to its SLOs a configuration runs at the target (its largest latency over bound): decides ties."""
        pairs = [(r.ttft_p90_s, slo.ttft_s), (r.tpot_p90_s, slo.tpot_s), (r.e2e_p90_s, slo.e2e_s)]
        return max((math.inf if v is None else v / b for v, b in pairs if b), default=0.0)

    best = min(able, key=lambda r: (r.usd_per_hour, -r.capacity_rps, load(r), r.label)) if able else None
    target, unit = search.target_rate, search.unit
    bottom = lowest(unit, search.settings.min_rate)
    for r in ok:
        if r is best:
            continue
        if r.capacity_rps < target:
            at = f"{r.missed_at_rps:.3g}" if r.missed_at_rps is not None else "the grid's top"
            # a probe within its SLOs can still fall behind its arrivals (capacity.pace)
            missed = (f"fell behind its arrivals (completed < {KEEP_UP:.0%} of them)" if r.missed_by == "keep_up"
                      else "SLO missed")
            r.reason = (f"{missed} at {at} {unit}: capacity {r.capacity_rps:.3g} < target {target:.3g}"
                        if r.capacity_rps else f"{missed} even at {bottom:g} {unit}")
            if r.probe_limited:
                why = (f"are fewer than {STEADY_ROUNDS} per user, too few to show a sustained load" if unit == "users"
                       else "arrive over too short a time, beside their latency, to tell whether it keeps up"
                       if r.missed_by == "short"
                       else "start their conversations too close together to show a sustained rate")
                r.reason = (f"capacity {r.capacity_rps:.3g} {unit} or more: at {at} its {search.settings.max_requests} "
                            f"probe requests {why} (raise search.max_requests)")
        elif r.usd_per_hour > best.usd_per_hour:
            r.reason = f"carries the target but costs ${r.usd_per_hour - best.usd_per_hour:.2f}/h more"
        elif r.capacity_rps < best.capacity_rps:
            r.reason = "as cheap, less capacity"
        else:
            r.reason = (f"as cheap and as much capacity, nearer its SLOs at the target ({load(r):.0%} of a bound, "
                        f"the recommended {load(best):.0%})")
    return SearchResult(search.name, target, search.slo.model_dump(mode="json"), rows, best,
                        probes=sum(r.probes for r in rows), settings=search.settings.model_dump(), unit=unit)


# -- output -------------------------------------------------------------------------------------------------------
def table_rows(result: SearchResult) -> list[list[str]]:
    """The Pareto table (every configuration, cheapest first, pruned last) as strings."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    ordered = sorted(result.rows, key=lambda r: (r.status != "ok", r.usd_per_hour, -r.capacity_rps, r.label))
    out = []
    for r in ordered:
        mark = "*" if r is result.recommended else ("P" if r.pareto else "")
        out.append([mark, r.label, r.status, str(r.devices or "-"), num(r.usd_per_hour, ".2f"),
                    ("≥ " if r.probe_limited else "") + num(r.capacity_rps if r.status == "ok" else None, ".3g"),
                    num(r.usd_per_million_tokens, ".3f"),
                    num(r.ttft_p90_s, ".3f"), num(None if r.tpot_p90_s is None else r.tpot_p90_s * 1e3, ".1f"),
                    num(r.e2e_p90_s, ".3f"), r.reason])
    return out


HEADER = ["", "configuration", "status", "devices", "$/h", "capacity req/s", "$/1M tok", "TTFT q s (target)",
          "TPOT q ms (target)", "E2E q s (target)", "why not / note"]


def header(unit: str) -> list[str]:
    """The table's columns, the capacity in `unit` (req/s, or a closed loop's users)."""
    return [f"capacity {unit}" if h == "capacity req/s" else h for h in HEADER]


def write_outputs(out: Path, result: SearchResult) -> None:
    """search.json, search.md (the table) and pareto.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "search.json").write_text(json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n")
    lines = ["| " + " | ".join(header(result.unit)) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table_rows(result)]
    (out / "search.md").write_text("\n".join(lines) + "\n")
    write_pareto_png(out / "pareto.png", result)


def write_pareto_png(path: Path, result: SearchResult) -> None:
    """Cost against capacity and against TPOT at the target, every configuration that ran, the Pareto fronts, the
    recommendation and the target rate (1210 x 462 pixels)."""
    from sim.report.png import Canvas  # Pillow only where the plot is drawn

    ok = [r for r in result.rows if r.status == "ok"]
    fig = Canvas(11, 4.2, dpi=110)
    fig.title, fig.title_pt = f"{result.name}: {len(result.rows)} configurations", 10
    a, b = fig.subplots(2, left=0.057, right=0.977, bottom=0.139, top=0.894, wspace=0.161)
    for ax, ys, ylabel, front in ((a, [r.capacity_rps for r in ok], f"capacity ({result.unit} within the SLOs)",
                                   "pareto"),
                                  (b, [(r.tpot_p90_s or np.nan) * 1e3 for r in ok], "TPOT at the SLO quantile (ms, "
                                   "at the target)", "pareto_latency")):
        xs = [r.usd_per_hour for r in ok]
        ax.scatter(xs, ys, s=14, color="#bbbbbb", label="configuration")
        pts = sorted((x, y) for r, x, y in zip(ok, xs, ys) if getattr(r, front))
        if pts:
            ax.plot(*zip(*pts), color="#1f77b4", marker="o", ms=5, label="Pareto front")
        if result.recommended is not None:
            r = result.recommended
            ax.scatter([r.usd_per_hour], [r.capacity_rps if front == "pareto" else (r.tpot_p90_s or np.nan) * 1e3],
                       s=90, marker="*", color="#d62728", z=5, label=f"recommended: {r.label}")
        ax.xlabel, ax.ylabel = "$ per hour", ylabel
    a.hline(result.target_rate, color="#2ca02c", lw=1, label=f"target {result.target_rate:.3g} {result.unit}")
    a.legend, a.legend_loc = True, "best"
    fig.save(path)


def print_search(result: SearchResult, out: Path | None) -> None:
    """The configurations that decide (search.md has every column), the recommendation and its margin."""
    console = Console()
    keep = [0, 1, 4, 5, 6, 8, 10]  # search.md has every column; the terminal the ones that decide
    columns = header(result.unit)
    t = Table(*(columns[i] for i in keep[:-1]), Column(columns[-1], overflow="fold"),
              title=f"{result.name}: {len(result.rows)} configurations, target {result.target_rate:.3g} {result.unit} "
              f"({result.probes} probes, {result.wall_s:.1f} s)")
    for row in table_rows(result)[:30]:
        t.add_row(*(row[i] for i in keep))
    console.print(t)
    best = result.recommended
    if best is None:
        console.print(f"[bold red]no configuration carries {result.target_rate:.3g} {result.unit} within the SLOs[/]")
    else:
        console.print(f"[bold]recommended:[/] {best.label}: ${best.usd_per_hour:.2f}/h, capacity "
                      f"{'≥ ' if best.probe_limited else ''}{best.capacity_rps:.3g} {result.unit} (margin "
                      f"{'≥ ' if best.probe_limited else ''}{best.capacity_rps / result.target_rate - 1:+.0%})")
    if out is not None:
        console.print(f"wrote {out}/search.json, search.md, pareto.png")

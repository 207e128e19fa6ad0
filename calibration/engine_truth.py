"""End-to-end truth: the published real runs (scenarios/gpu_validation/: vLLM on H100-SXM, BLIS's 16 experiments)
simulated stage by stage and scored on vLLM's TPOT ((e2e - TTFT) / (out - 1), mean per stage), TTFT mean, and
whether the simulator and vLLM agree on keeping up with each stage's rate (sim.report.stages.keeps_up); and what is
fitted end to end, judged leave one experiment out.

The harness for a candidate cost model or setting: `evaluate(candidate)` simulates every experiment with
`candidate(plan) -> plan` applied (e.g. `lambda p: replan(p, cost_model={...})`) and returns the per-stage rows and
the headline; `leave_one_out(family)` fits a `Family`'s few parameters to 15 experiments and predicts the 16th, for
each. bench/engine_truth.py prints both."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from calibration.published import Published, read_published
from sim.config.client import MEASURED_TRANSPORT, TransportConfig, resolve_client
from sim.config.engines import CALIBRATION_PATH
from sim.config.generator import plan_requests
from sim.config.moe import has_experts, uses_mla
from sim.config.plan import Plan, load_scenario, replan
from sim.cost.gpu import VLLM_PER_SEQ_OVERHEAD_S, VLLM_STEP_OVERHEAD_S
from sim.report.stages import stage_sections
from sim.simulator.cluster import sim_records, simulate

FOLDER = Path(__file__).resolve().parents[1] / "scenarios" / "gpu_validation"
STAGE_S = 180.0  # simulated seconds per stage by default: ~30 request lifetimes at 5-6 s, steady state long before

Candidate = Callable[[Plan], Plan]


@dataclass
class Experiment:
    """One published run: its scenario resolved and its published figures."""

    name: str
    plan: Plan
    published: Published


def load_experiments(folder: Path = FOLDER) -> list[Experiment]:
    """Every scenario of `folder` that has published/<its stem>.json beside it, in name order."""
    out = []
    for path in sorted(folder.glob("*.yaml")):
        pub = folder / "published" / f"{path.stem}.json"
        if pub.is_file():
            out.append(Experiment(path.stem, load_scenario(path)[1], read_published(pub)))
    return out


def shortened(plan: Plan, stage_s: float | None) -> Plan:
    """The plan with every load stage cut to `stage_s` simulated seconds (None: as published)."""
    cfg = plan.workload.load_stages
    if stage_s is None or all(s.duration_s <= stage_s for s in cfg.stages):
        return plan
    stages = [{"rate": s.rate, "duration_s": min(s.duration_s, stage_s)} for s in cfg.stages]
    workload = {**plan.source["workload"], "load_stages": {**plan.source["workload"]["load_stages"], "stages": stages}}
    return replan(plan, workload=workload)


def cut(experiments: list[Experiment], stage_s: float | None) -> list[Experiment]:
    """The experiments with their stages cut to `stage_s` (before a candidate changes a plan: cutting resolves the
    scenario again, and would drop a change made to the resolved plan)."""
    return [Experiment(e.name, shortened(e.plan, stage_s), e.published) for e in experiments]


def simulate_stages(plan: Plan) -> list[dict]:
    """The plan's workload simulated: report.json's `stages`."""
    return stage_sections(plan, sim_records(simulate(plan, plan_requests(plan))))


def _err(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else 100.0 * (sim - real) / real


def stage_rows(exp: Experiment, sims: list[dict]) -> list[dict]:
    """Per stage: real and simulated TPOT mean, TTFT mean, their % errors, and each side's keeping up."""
    from sim.report.stages import keeps_up

    rows = []
    for real, sim in zip(exp.published.stages, sims):
        up = keeps_up(real.sent, real.completed, real.ttft_s.mean, real.duration_s)
        rows.append({"experiment": exp.name, "stage": real.stage, "rate": real.rate,
                     "tpot_real": real.tpot_s.mean, "tpot_sim": sim["tpot_s"]["mean"],
                     "tpot_err_pct": _err(sim["tpot_s"]["mean"], real.tpot_s.mean),
                     "ttft_real": real.ttft_s.mean, "ttft_sim": sim["ttft_s"]["mean"],
                     "ttft_err_pct": _err(sim["ttft_s"]["mean"], real.ttft_s.mean),
                     "keeps_up_real": up, "keeps_up_sim": bool(sim["keeps_up"])})
    return rows


def headline(rows: list[dict]) -> dict:
    """Median |error| of TPOT and TTFT over the stages real vLLM kept up with; the share of all stages where the
    simulator and vLLM agree on keeping up."""
    served = [r for r in rows if r["keeps_up_real"]]

    def median_abs(key: str) -> float | None:
        errs = [abs(r[key]) for r in served if r[key] is not None]
        return float(np.median(errs)) if errs else None
    agree = [r["keeps_up_real"] == r["keeps_up_sim"] for r in rows]
    return {"tpot_abs_err_median_pct": median_abs("tpot_err_pct"),
            "ttft_abs_err_median_pct": median_abs("ttft_err_pct"),
            "saturation_agreement": float(np.mean(agree)) if agree else None,
            "stages": len(rows), "stages_served": len(served)}


def evaluate(candidate: Candidate | None = None, experiments: list[Experiment] | None = None,
             stage_s: float | None = STAGE_S) -> tuple[list[dict], dict]:
    """Every experiment simulated with `candidate(plan)` (None: the plan as it is) and scored: (rows, headline)."""
    rows = []
    for exp in cut(load_experiments() if experiments is None else experiments, stage_s):
        rows += stage_rows(exp, simulate_stages(candidate(exp.plan) if candidate is not None else exp.plan))
    return rows, headline(rows)


@dataclass(frozen=True)
class Family:
    """A few parameters fitted end to end: their names, starting values, the step each one's finite difference
    takes, lower bounds, how a plan takes them, which plans take them, and which errors the fit reduces ("tpot",
    "ttft")."""

    names: tuple[str, ...]
    start: tuple[float, ...]
    step: tuple[float, ...]
    lower: tuple[float, ...]
    apply: Callable[[Plan, tuple[float, ...]], Plan]
    applies: Callable[[Plan], bool] = lambda plan: True
    metrics: tuple[str, ...] = ("tpot", "ttft")


def _overheads(plan: Plan, theta: tuple[float, ...]) -> Plan:
    return replan(plan, cost_model={**plan.source.get("cost_model", {}), "step_overhead_s": theta[0],
                                    "per_seq_overhead_s": theta[1]})


# the host's cost per step and per sequence in it (cost_model.step_overhead_s, per_seq_overhead_s), from the kernel
# model's defaults (vLLM's, as BLIS fitted them)
HOST_OVERHEADS = Family(("step_overhead_s", "per_seq_overhead_s"), (VLLM_STEP_OVERHEAD_S, VLLM_PER_SEQ_OVERHEAD_S),
                        (1e-3, 2e-5), (0.0, 0.0), _overheads)


def _refined(plan: Plan, theta: tuple[float, ...]) -> Plan:
    """The plan's GPU kernel model with its parts scaled (sim/cost/gpu.py's Refinement, as a profile refines it):
    set on the resolved plan, no scenario key (a fitting device, not a setting)."""
    parts = dict(zip(("linear", "attention", "communication"), theta))
    refinement = {**parts, "step_overhead_s": VLLM_STEP_OVERHEAD_S, "per_seq_overhead_s": VLLM_PER_SEQ_OVERHEAD_S}
    return replace(plan, cost=replace(plan.cost, refinement=refinement))


def _dense_kernels(plan: Plan) -> bool:
    return plan.cost.source == "kernels" and not (has_experts(plan.model) or uses_mla(plan.model)) \
        and plan.expert_layout.data_parallel_size == 1


# the kernel model's linear, attention and communication parts each times a factor (dense models: a mixture of
# experts' cost model takes no refinement), fitted to TPOT alone: TTFT holds the client-server time no engine part
# prices (docs/published-runs.md)
REFINEMENT = Family(("linear", "attention", "communication"), (1.0, 1.0, 1.0), (0.1, 0.1, 0.1), (0.0, 0.0, 0.0),
                    _refined, _dense_kernels, ("tpot",))


def residuals(rows: list[dict], metrics: tuple[str, ...] = ("tpot", "ttft")) -> np.ndarray:
    """The relative errors a fit reduces: `metrics` of each stage both sides kept up with (NaN elsewhere)."""
    out = []
    for r in rows:
        both = r["keeps_up_real"] and r["keeps_up_sim"]
        out += [r[f"{m}_err_pct"] / 100 if both else np.nan for m in metrics]
    return np.array(out, float)


def without_front_end(plan: Plan) -> Plan:
    """The plan served straight to the engine: no front end's time between client and engine (nothing fitted)."""
    return replace(plan, client=resolve_client(plan.workload),
                   engine=replace(plan.engine, front_end=None) if plan.engine is not None else None)


def front_end_transport(frontend_s: float) -> TransportConfig:
    """vLLM's API server as a transport: the client's and the HTTP server's parts as measured here
    (bench/client_time.py), and its own work per request before the engine sees it, `frontend_s` (fitted)."""
    return MEASURED_TRANSPORT.model_copy(update={"frontend_s": frontend_s})


def _front_end(plan: Plan, theta: tuple[float, ...]) -> Plan:
    t = front_end_transport(theta[0])
    return replace(plan, client=resolve_client(plan.workload, t), engine=replace(plan.engine, front_end=t))


# the engine's API server's work per request before the engine sees it: its share of TTFT (the TPOT is the engine's)
FRONT_END = Family(("frontend_s",), (MEASURED_TRANSPORT.frontend_s,), (2e-3,), (0.0,), _front_end, metrics=("ttft",))
FAMILIES = {"front_end": FRONT_END, "host_overheads": HOST_OVERHEADS, "refinement": REFINEMENT}


def bounded_lstsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """x minimizing |a x - b| subject to x >= lower, for a few columns: the best feasible solution over every
    choice of the columns held at their bound (exact: the minimum sits on one such face)."""
    best, best_cost = lower.astype(float), float(np.sum((a @ lower - b) ** 2))
    n = a.shape[1]
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            x = lower.astype(float).copy()
            cols = list(free)
            x[cols] = np.linalg.lstsq(a[:, cols], b - a @ lower + a[:, cols] @ lower[cols], rcond=None)[0]
            cost = float(np.sum((a @ x - b) ** 2))
            if np.all(x >= lower - 1e-15) and cost < best_cost:
                best, best_cost = x, cost
    return best


def linearized(family: Family, experiments: list[Experiment], at: tuple[float, ...] | None = None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per experiment (stages already cut): its residuals at `at` (default: the family's start) and their derivatives
    in each parameter (finite differences, one simulation per parameter): (r0, J) with r(theta) ~ r0 + J (theta -
    at)."""
    at = family.start if at is None else at
    out = []
    for exp in experiments:
        r0 = residuals(stage_rows(exp, simulate_stages(family.apply(exp.plan, at))), family.metrics)
        cols = []
        for i, h in enumerate(family.step):
            theta = tuple(v + (h if j == i else 0.0) for j, v in enumerate(at))
            rows = stage_rows(exp, simulate_stages(family.apply(exp.plan, theta)))
            cols.append((residuals(rows, family.metrics) - r0) / h)
        out.append((r0, np.column_stack(cols)))
    return out


def fit(lin: list[tuple[np.ndarray, np.ndarray]], family: Family, at: tuple[float, ...] | None = None
        ) -> tuple[float, ...]:
    """The parameters minimizing the squared relative errors of the experiments linearized at `at` (default: the
    family's start), within bounds: one Gauss-Newton step."""
    at = family.start if at is None else at
    r0 = np.concatenate([r for r, _ in lin])
    jac = np.concatenate([j for _, j in lin])
    keep = ~np.isnan(r0) & ~np.isnan(jac).any(axis=1)
    if not keep.any() or not jac[keep].any():  # nothing to fit, or nothing the parameters move
        return at
    # each parameter in units of its step, so the columns are of one size
    scale = np.array(family.step)
    x = bounded_lstsq(jac[keep] * scale, -r0[keep] + jac[keep] @ np.array(at), np.array(family.lower) / scale)
    return tuple(float(v) for v in x * scale)


def leave_one_out(family: Family = HOST_OVERHEADS, experiments: list[Experiment] | None = None,
                  stage_s: float | None = STAGE_S, iterations: int = 1
                  ) -> tuple[list[dict], dict, list[tuple[float, ...]]]:
    """Fit `family` to all experiments it applies to but one and predict that one's stages by simulating it, for each:
    (rows, headline, the parameters each held-out experiment was predicted with). The first step linearizes every
    experiment once at the family's start; each further iteration linearizes a fold's own experiments again at its
    last fit (p + 1 simulations per experiment per fold: for the fit of parameters far from the start)."""
    experiments = [e for e in cut(load_experiments() if experiments is None else experiments, stage_s)
                   if family.applies(e.plan)]
    lin = linearized(family, experiments)
    rows, thetas = [], []
    for k, exp in enumerate(experiments):
        rest = experiments[:k] + experiments[k + 1:]
        theta = fit(lin[:k] + lin[k + 1:], family)
        for _ in range(iterations - 1):
            theta = fit(linearized(family, rest, theta), family, theta)
        thetas.append(theta)
        rows += stage_rows(exp, simulate_stages(family.apply(exp.plan, theta)))
    return rows, headline(rows), thetas


def write_calibration(family: Family, experiments: list[Experiment], stage_s: float | None, loo_headline: dict,
                      path: Path = CALIBRATION_PATH) -> dict:
    """Fit the front end to every experiment and write it, with the leave-one-out error it was judged by, to the
    engines' calibration file (sim/data/engine_calibration.json) the plans of vLLM (and, until measured, SGLang's
    and TensorRT-LLM's) read."""
    import json

    cut_experiments = cut(experiments, stage_s)
    (frontend_s,) = fit(linearized(family, cut_experiments), family)
    figures = front_end_transport(frontend_s).model_dump()
    stages = "as long as they ran" if stage_s is None else f"cut to {stage_s:g} simulated s"
    error = {"H100-SXM": {"what": f"BLIS's {len(experiments)} published vLLM runs (inference-sim/training), "
                                  f"{loo_headline['stages']} load stages {stages}; the front end fitted leave one "
                                  "experiment out",
                          **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in loo_headline.items()}}}
    vllm = {"front_end": figures, "error": error,
            "front_end_source": f"vLLM's API server: {frontend_s * 1e3:.2f} ms a request fitted to the TTFT of BLIS's "
                                "published vLLM runs on H100-SXM (calibration/engine_truth.py); the client's and HTTP "
                                "parts measured here (bench/client_time.py)"}
    stand_in = {"front_end": figures, "front_end_source": "vLLM's API server (this engine's not measured): "
                + vllm["front_end_source"]}
    data = {"vllm": vllm, "sglang": stand_in, "trtllm": stand_in}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data

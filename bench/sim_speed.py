"""How fast the simulator runs: the whole Azure LLM 2023 conversation trace (19,366 requests, one hour)
on Llama-2-7B / A100-80GB, continuous batching + paged KV, end to end (workload, simulation, token
times, metrics) on one core. Also runs the same simulation stepping every engine step on its own,
side by side, to show what advancing runs of identical decode steps at once buys; and a speculative
(Medusa) scenario, whose verify steps are simulated one at a time, to show that rate too.

`--against REV_OR_TREE` times `simulate()` side by side with another tree (a folder, or a commit checked out in a
detached worktree for the run), each in a fresh process with its own code, the trees alternating round by round: CPU
time and wall of the plain scenario on both (this tree plans it as the engine it names by default, vLLM, serves it:
chunked prefill, async scheduling's one-step lag, each request's client transport), and on this tree the same
scenario with `engine: infersim` too (synchronous, the project's own defaults: the plan the code before the engine
work made of it). Ends with the ratios to the other tree (over 1: slower here), one per line `name: value`.

`--scenario FILE` times that scenario instead of the Azure hour (the Vidur-sized run:
bench/scenarios/vidur_llama2_7b_a100.yaml).

Usage: python bench/sim_speed.py [--repeats N] [--against REV_OR_TREE [--rounds R] [--scenario FILE]]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from sim.config.generator import plan_requests
from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.report.metrics import compute_metrics
from sim.simulator.cluster import sim_records, simulate

SCENARIO = {"name": "azure-conv-llama2-7b-a100", "model": "Llama-2-7B", "hardware": "A100-80GB",
            "serving": {"batching": "continuous"}, "kv_cache": {"allocator": "paged"},
            "workload": {"trace": {"path": "builtin:azure_conv"}}}
# Medusa verify steps: each row keeps its own number of tokens a step, so every step is its own event
SPEC_SCENARIO = {"name": "medusa-long", "model": "Llama-3.1-8B", "hardware": "H100-SXM", "serving": {"max_num_seqs": 64},
                 "speculative": {"method": "medusa",
                                 "medusa_tree": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
                                 "medusa_rank_probs": [[0.5, 0.15, 0.05, 0.05, 0.25], [0.4, 0.15, 0.45], [0.35, 0.65]]},
                 "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 4}, "num_requests": 100,
                              "prompt_len": {"dist": "uniform", "min": 64, "max": 512},
                              "output_len": {"dist": "uniform", "min": 500, "max": 2000}}}


def one_run(bulk: bool, scenario: dict = SCENARIO) -> tuple[float, dict, int, int]:
    """(wall s, metrics, engine steps, output tokens) of one run end to end."""
    t0 = time.perf_counter()
    plan = make_plan(parse_scenario(scenario))
    specs = plan_requests(plan)  # as `infersim run` sends them: through the engine's front end
    result = simulate(plan, specs, bulk=bulk)
    metrics = compute_metrics(sim_records(result))
    wall = time.perf_counter() - t0
    return wall, metrics, sum(len(r.step_end) for r in result.replicas), sum(r.num_generated for r in result.requests)


ROOT = Path(__file__).resolve().parents[1]
# a fresh process's plan and requests on its tree's code, from argv[1] (a scenario as JSON)
PLANNED = """
import json, sys, time
from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.simulator.cluster import simulate
try:
    from sim.config.generator import plan_requests
except ImportError:  # a tree from before the client's transport
    from sim.config.generator import generate_requests
    def plan_requests(plan):
        return generate_requests(plan.workload, plan.base_dir)
plan = make_plan(parse_scenario(json.loads(sys.argv[1])))
specs = plan_requests(plan)
"""
# one tree's simulate() timed in a fresh process with its own code: argv scenario (JSON), repeats; prints JSON
CHILD = PLANNED + """
simulate(plan, specs)  # warm-up: the cost model's caches, the first calls
cpu, wall = [], []
for _ in range(int(sys.argv[2])):
    c0, t0 = time.process_time(), time.perf_counter()
    result = simulate(plan, specs)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - t0)
print(json.dumps({"cpu_s": min(cpu), "wall_s": min(wall), "steps": sum(len(r.step_end) for r in result.replicas),
                  "completed": sum(r.finish_s is not None for r in result.requests)}))
"""


def knows_engines(tree: Path) -> bool:
    """Whether `tree`'s scenarios take `engine:` (a tree from before the engine work plans every scenario as
    `engine: infersim` does now)."""
    probe = "from sim.config.scenario import parse_scenario; import sys, json; parse_scenario(json.loads(sys.argv[1]))"
    data = {**SCENARIO, "engine": "infersim"}
    return subprocess.run([sys.executable, "-c", probe, json.dumps(data)], cwd=tree, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}).returncode == 0


def variants(scenario: dict, base_knows_engines: bool) -> dict[str, tuple[str, dict]]:
    """The runs of --against: the scenario on the other tree (also as `engine: infersim` plans it, where that tree
    knows engines), and here as it is and as `engine: infersim` plans it."""
    same = {**scenario, "engine": "infersim"}
    base = {"base": ("base", scenario), **({"base_same_plan": ("base", same)} if base_knows_engines else {})}
    return {**base, "default_plan": ("this", scenario), "same_plan": ("this", same)}


def time_tree(tree: Path, scenario: dict, repeats: int) -> dict:
    """simulate()'s best CPU time and wall of `repeats` in a fresh process on `tree`'s code, its steps and completions."""
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(scenario), str(repeats)], cwd=tree, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def tree_of(rev_or_tree: str, scratch: Path) -> Path:
    """A folder as it is, or a commit checked out (git archive) under `scratch`."""
    if Path(rev_or_tree).is_dir():
        return Path(rev_or_tree).resolve()
    tree = scratch / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev_or_tree], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def against(rev_or_tree: str, rounds: int, repeats: int, scenario: dict = SCENARIO) -> None:
    """The plain scenario on the other tree and both variants here, alternating round by round; the ratios."""
    print(f"scenario: {scenario['name']}", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="sim_speed_"))
    try:
        trees = {"base": tree_of(rev_or_tree, scratch), "this": ROOT}
        plans = variants(scenario, knows_engines(trees["base"]))
        runs: dict[str, list[dict]] = {name: [] for name in plans}
        for i in range(rounds):
            for name in list(plans) if i % 2 == 0 else list(reversed(plans)):
                tree, data = plans[name]
                runs[name].append(r := time_tree(trees[tree], data, repeats))
                print(f"round {i + 1} {name}: cpu {r['cpu_s']:.3f} s, wall {r['wall_s']:.3f} s, {r['steps']} steps, "
                      f"{r['completed']} completed (load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(scratch)
    med = {name: {m: statistics.median(r[m] for r in v) for m in ("cpu_s", "wall_s")} for name, v in runs.items()}
    for name in plans:
        print(f"{name}_cpu_s: {med[name]['cpu_s']:.3f}")
    for name, base in (("same_plan", "base_same_plan" if "base_same_plan" in med else "base"),
                       ("default_plan", "base")):
        for m in ("cpu", "wall"):
            print(f"{name}_{m}_ratio: {med[name][m + '_s'] / med[base][m + '_s']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", help="a tree or a commit to time side by side with this one")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: rounds of the trees, alternating")
    ap.add_argument("--scenario", type=Path, help="with --against: this scenario file instead of the Azure hour "
                    "(bench/scenarios/vidur_llama2_7b_a100.yaml: the Vidur-sized run)")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    if args.against:
        scenario = yaml.safe_load(args.scenario.read_text()) if args.scenario else SCENARIO
        against(args.against, args.rounds, args.repeats, scenario)
        return
    one_run(True)  # warm-up: imports, trace parse
    fast, slow = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        wall, metrics, steps, _ = one_run(True)
        fast.append(wall)
        wall_slow, metrics_slow, *_ = one_run(False)
        slow.append(wall_slow)
        assert metrics == metrics_slow, "bulk stepping changed the result"
    n = metrics["requests"]["arrived"]
    best, best_slow = min(fast), min(slow)
    print(f"workload: {n} requests ({metrics['requests']['completed']} completed, "
          f"{metrics['requests']['rejected']} rejected), {metrics['duration_s']:.0f} s simulated, {steps} engine steps")
    print(f"runs of identical decode steps at once: {', '.join(f'{w:.2f}' for w in fast)} s")
    print(f"every step on its own:                  {', '.join(f'{w:.2f}' for w in slow)} s")
    print(f"sim_wall_s: {best:.3f}")
    print(f"sim_wall_s_median: {statistics.median(fast):.3f}")
    print(f"sim_requests_per_wall_s: {n / best:.0f}")
    print(f"simulated_s_per_wall_s: {metrics['duration_s'] / best:.0f}")
    print(f"bulk_vs_single_step_speedup: {best_slow / best:.2f}")
    one_run(True, SPEC_SCENARIO)  # warm-up
    spec = [one_run(True, SPEC_SCENARIO) for _ in range(args.repeats)]
    best_spec = min(w for w, *_ in spec)
    _, spec_metrics, spec_steps, spec_tokens = spec[0]
    print(f"speculative (Medusa): {spec_metrics['requests']['arrived']} requests, {spec_tokens} output tokens, "
          f"{spec_steps} engine steps: {', '.join(f'{w:.2f}' for w, *_ in spec)} s")
    print(f"spec_sim_requests_per_wall_s: {spec_metrics['requests']['arrived'] / best_spec:.0f}")
    print(f"spec_sim_tokens_per_wall_s: {spec_tokens / best_spec:.0f}")

if __name__ == "__main__":
    main()

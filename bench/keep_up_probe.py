"""The capacity search's keep-up rule against the probe's length: one configuration's capacity found with probes of
300 to 3,000 requests, judged by the rule before 2026-12-06 (completed requests over the whole run, drain included,
at 80% of the offered rate) and by the rule now (sim.report.capacity.pace: completions over arrivals in the second
half of the arrival window, at 80%), side by side on the same simulated probes. Then one probe well above the
capacity run to its end (overloaded: both rules must fail it) and a burst (a few requests at 100 times the capacity,
within the SLOs: both must fail it). Headlines: each rule's capacity spread (highest over lowest) over the probes of
600 requests or more, and whether the overloaded probe and the burst fail keep-up.

Cases: the Qwen3-30B-A3B tp=4 dp=2 layout of scenarios/search/qwen3_moe_layouts.yaml, and the recommendations of
scenarios/search/llama2_70b_capacity.yaml under the old rule (llama2: H100, TP 4, chunked prefill at 2048) and the new
(llama2_pp2: H100, TP 2, PP 2, chunked prefill at 512). A probe of N requests is the workload's first N (a synthetic
one drawn with N or more). Simulated only: the figures do not depend on the machine's load.

Usage: python bench/keep_up_probe.py [--lengths 300 600 1000 1500 3000] [--case qwen3 llama2 llama2_pp2]
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import replace
from pathlib import Path

import infersim.commands.search as search_cmd
from infersim.api import load_search_spec
from infersim.commands.search import SearchSettings, probes_of, prune, run_probe
from sim.report.capacity import KEEP_UP, offered_rate, pace, rates_grid, steady, why_failed

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "qwen3": ("scenarios/search/qwen3_moe_layouts.yaml",
              "tp=4 dp=2 ep=False"),
    "llama2": ("scenarios/search/llama2_70b_capacity.yaml",
               'hardware=H100-SXM tp=4 pp=1 serving={"enable_chunked_prefill": true, "max_num_batched_tokens": 2048} '
               "max_num_seqs=256 pools=none"),
    "llama2_pp2": ("scenarios/search/llama2_70b_capacity.yaml",
                   'hardware=H100-SXM tp=2 pp=2 serving={"enable_chunked_prefill": true, "max_num_batched_tokens": 512} '
                   "max_num_seqs=256 pools=none"),
}
SEEN: list = []  # the (metrics, records, specs) of the last probe run_probe judged


def seen_why_failed(metrics, records, specs, users=None):
    """sim.report.capacity.why_failed, keeping what it judged (the bench judges the same run by the old rule)."""
    SEEN[:] = [metrics, records, specs]
    return why_failed(metrics, records, specs, users)


def old_ratio(metrics: dict, records) -> float:
    """The rule before: completed requests over the whole run (drain included) per offered request/s."""
    meant = records.arrival_s if records.client_wait_s is None else records.arrival_s - records.client_wait_s
    return metrics["throughput"]["requests_per_s"] / offered_rate(meant)


def judge(plan, specs, early_stop: bool = True) -> dict:
    """One probe run once, judged by both rules: verdicts, and the two keep-up ratios (None: stopped early)."""
    SEEN.clear()
    ok, _, why = run_probe(plan, specs, early_stop=early_stop)
    if not SEEN:  # stopped once the SLO could not hold: both rules fail it
        return {"new": False, "old": False, "why": why, "pace": None, "old_ratio": None}
    metrics, records, _ = SEEN
    slo_ok = metrics["slo"]["met_counting_rejected"]
    old = old_ratio(metrics, records)
    return {"new": ok, "old": slo_ok and old >= KEEP_UP and steady(records, specs), "why": why,
            "pace": pace(records), "old_ratio": old, "slo": slo_ok}


def case_probe(spec: str, label: str, n: int):
    """The configuration's probe (search.Probe) of the spec's first `n` requests, and its plan."""
    search = load_search_spec(ROOT / spec)
    base = copy.deepcopy(search.base)
    if "num_requests" in base["workload"]:  # draw enough for the longest probe
        base["workload"]["num_requests"] = max(base["workload"]["num_requests"], n)
    settings = SearchSettings(**{**search.settings.model_dump(), "max_requests": n})
    search = replace(search, base=base, settings=settings)
    probe = next(p for p in probes_of(search) if p.label == label)
    _, plan = prune(probe)
    return probe, plan, settings


def capacities(spec: str, label: str, n: int) -> tuple[float, float, dict]:
    """(old rule's capacity, new rule's capacity, every rate's judgement) with probes of `n` requests."""
    probe, plan, settings = case_probe(spec, label, n)
    grid = rates_grid(probe.specs, probe.target_rate)
    runs: dict[float, dict] = {}

    def verdict(rule: str):
        def meets(x: float) -> bool:
            if x not in runs:
                runs[x] = judge(plan, grid.probe(x))
            return runs[x][rule]
        return meets

    old = grid.search(verdict("old"), settings.precision, settings.min_rate, settings.max_rate)
    new = grid.search(verdict("new"), settings.precision, settings.min_rate, settings.max_rate)
    return old.rate, new.rate, runs


def stress(spec: str, label: str, capacity: float) -> dict:
    """An overloaded probe (twice the capacity, run to its end) and a burst (its first 8 requests at 100 times the
    capacity): each judged by both rules."""
    probe, plan, _ = case_probe(spec, label, 600)
    grid = rates_grid(probe.specs, probe.target_rate)
    return {"overloaded": judge(plan, grid.probe(2 * capacity), early_stop=False),
            "burst": judge(plan, rates_grid(probe.specs[:8], probe.target_rate).probe(100 * capacity))}


def ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[300, 600, 1000, 1500, 3000])
    ap.add_argument("--case", choices=sorted(CASES), nargs="+", default=list(CASES))
    ap.add_argument("--spread-from", type=int, default=600, help="the headline spread over probes this long or more")
    args = ap.parse_args()
    search_cmd.why_failed = seen_why_failed  # the search module's name: run_probe reports what it judged
    headline = []
    for name in args.case:
        spec, label = CASES[name]
        print(f"\n{name}: {label}\n{'requests':>9} {'old req/s':>10} {'new req/s':>10}  "
              f"{'old ratio':>9} {'new pace':>9}  (ratios at the new capacity)")
        found = []
        for n in args.lengths:
            old, new, runs = capacities(spec, label, n)
            found.append((old, new))
            at = runs.get(new, {})
            print(f"{n:>9} {old:>10.3g} {new:>10.3g}  {ratio(at.get('old_ratio')):>9} {ratio(at.get('pace')):>9}")
        judged = [f for n, f in zip(args.lengths, found) if n >= args.spread_from]  # shorter: ~2 latencies long
        for rule, k in (("old", 0), ("new", 1)):
            caps = [f[k] for f in judged]
            headline.append(f"{name}_{rule}_capacity_spread_{args.spread_from}_up: {max(caps) / min(caps):.3f}")
        for kind, j in stress(spec, label, found[-1][1]).items():
            print(f"{kind:>11}: old {'pass' if j['old'] else 'fail'} (ratio {ratio(j['old_ratio'])}), new "
                  f"{'pass' if j['new'] else 'fail'} ({j['why'] or 'passes'}, pace {ratio(j['pace'])}), "
                  f"SLO {'met' if j.get('slo') else 'missed'}")
            headline.append(f"{name}_{kind}_fails_keep_up: {int(j['pace'] is not None and j['pace'] < KEEP_UP)}")
    print()
    print("\n".join(headline))


if __name__ == "__main__":
    main()

"""Prefix caching on the real executor and in the simulator, side by side in one run: SmolLM2-135M on the CPU serving
`scenarios/validation/prefix_caching.yaml` (30 prompts of 400-700 tokens, the first 384 one of 4 shared prefixes,
0.6 requests/s) with `kv_cache.enable_prefix_caching` on and off, the two alternating round by round (`--rounds`) so
each ratio is taken on the same minutes of this machine; the simulator predicts both with the shipped CPU profile.

Per configuration: TTFT p50, TPOT p50, output tokens/s and the prompt tokens found cached, real and simulated; the
headline is each side's speedup from caching (off / on).

Usage: python bench/prefix_caching.py [--rounds 2] [--threads 2]
Ends with `name: value` headline lines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import yaml  # noqa: E402

from infersim.api import run_scenario, serve_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "validation" / "prefix_caching.yaml"
PROFILE = ROOT / "calibration" / "profiles" / "cpu.json"
METRICS = (("TTFT p50 s", lambda r: r["ttft_s"]["p50"]), ("TPOT p50 s", lambda r: r["tpot_s"]["p50"]),
           ("out tok/s", lambda r: r["throughput"]["output_tokens_per_s"]),
           ("cached tokens", lambda r: r["kv_cache"].get("prefix_cache_hit_tokens", 0)))


def variant(folder: Path, caching: bool, threads: int, profile: bool) -> Path:
    """The scenario with caching on or off (and, for the simulator, priced by the shipped CPU profile)."""
    data = yaml.safe_load(SCENARIO.read_text())
    data["name"] += "-on" if caching else "-off"
    data["kv_cache"]["enable_prefix_caching"] = caching
    data["executor"]["threads"] = threads
    if profile:
        data["cost_model"] = {"profile": str(PROFILE)}
    path = folder / f"{data['name']}{'-sim' if profile else ''}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    real: dict[bool, list[dict]] = {True: [], False: []}
    sim: dict[bool, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        for caching in (True, False):
            sim[caching] = run_scenario(variant(folder, caching, args.threads, True), None, quiet=True, plots=False)
        for i in range(args.rounds):
            for caching in ((True, False) if i % 2 == 0 else (False, True)):
                report = serve_scenario(variant(folder, caching, args.threads, False), None, quiet=True, plots=False)
                real[caching].append(report)
                print(f"round {i + 1}, caching {'on ' if caching else 'off'}: TTFT p50 {report['ttft_s']['p50']:.3f} s, "
                      f"TPOT p50 {report['tpot_s']['p50'] * 1e3:.1f} ms", flush=True)
    print(f"\n{'metric':<14} {'real on':>10} {'real off':>10} {'sim on':>10} {'sim off':>10}")
    med = {c: {name: statistics.median(f(r) for r in real[c]) for name, f in METRICS} for c in (True, False)}
    for name, f in METRICS:
        print(f"{name:<14} {med[True][name]:>10.4g} {med[False][name]:>10.4g} {f(sim[True]):>10.4g} "
              f"{f(sim[False]):>10.4g}")
    ttft = {"real": med[False]["TTFT p50 s"] / med[True]["TTFT p50 s"],
            "sim": sim[False]["ttft_s"]["p50"] / sim[True]["ttft_s"]["p50"]}
    tpot = {"real": med[False]["TPOT p50 s"] / med[True]["TPOT p50 s"],
            "sim": sim[False]["tpot_s"]["p50"] / sim[True]["tpot_s"]["p50"]}
    print(f"\nprefix_caching_ttft_p50_speedup_real: {ttft['real']:.2f}")
    print(f"prefix_caching_ttft_p50_speedup_sim: {ttft['sim']:.2f}")
    print(f"prefix_caching_tpot_p50_speedup_real: {tpot['real']:.2f}")
    print(f"prefix_caching_tpot_p50_speedup_sim: {tpot['sim']:.2f}")
    print(f"prefix_caching_hit_rate_real: {real[True][0]['kv_cache']['prefix_cache_hit_rate']:.3f}")
    print(f"prefix_caching_hit_rate_sim: {sim[True]['kv_cache']['prefix_cache_hit_rate']:.3f}")


if __name__ == "__main__":
    main()

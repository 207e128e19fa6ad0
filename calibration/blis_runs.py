"""The BLIS experiments (github inference-sim/training, `default_args/`: vLLM on H100-SXM driven by inference-perf) as
infersim scenarios and published result files: `python -m calibration.blis_runs GIT_DIR --out scenarios/gpu_validation`
reads a clone's (or a bare mirror's) HEAD and writes one scenario per experiment and `published/<name>.json` beside
it. A fitting-time tool: nothing at run time reads the mirror.

What each file carries over, and why (docs/published-runs.md has the source lines):
- the workload inference-perf ran, from `results/config.yaml`: its shared_prefix keys there are the defaults (10
  groups x 10 prompts; the run's version ignored profile.yaml's num_unique_system_prompts, num_users_per_system_prompt
  and enable_multi_turn_chat), so 100 fixed prompts, each a group's system prompt and its own question, cycled;
- vLLM's settings from `exp-config.yaml`, with its V1 engine's defaults (chunked prefill and prefix caching on);
- per stage, vLLM's TPOT ((e2e - TTFT) / (out - 1)) derived from inference-perf's `time_per_output_token`, which
  divides the stream's span by 2K + 1 gaps for K tokens: each SSE event is two lines and it times both.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import yaml

REPO = "github.com/inference-sim/training"
MODELS = {"meta-llama/Llama-2-7b-hf": "Llama-2-7B", "meta-llama/Llama-2-70b-hf": "Llama-2-70B",
          "mistralai/Mixtral-8x7B-v0.1": "Mixtral-8x7B", "codellama/CodeLlama-34b-Instruct-hf": "CodeLlama-34B"}
SHORT = {"Llama-2-7B": "llama2_7b", "Llama-2-70B": "llama2_70b", "Mixtral-8x7B": "mixtral_8x7b",
         "CodeLlama-34B": "codellama_34b"}
CLIENT = ("inference-perf, main between 2025-10-15 (request_timeout, circuit_breakers) and 2025-11-14 (load.trace): "
          "results/config.yaml has the first and not the second, nor shared_prefix.enable_multi_turn_chat")
# the release current when the runs were made (0.14.0: 2026-01-17; the version itself is not recorded)
VLLM_RELEASE = "0.14.0"
ENGINE = {"name": "vllm", "version": None,
          "note": "not recorded in the source; an instrumented build (journey tracing, OTEL step spans) of vLLM's V1 "
                  "engine, run 2026-02-17/18; dtype auto (the checkpoint's), gpu_memory_utilization 0.9, block 16"}
# inference-perf's percentile keys -> ours
LEVELS = {"mean": "mean", "median": "p50", "p90": "p90", "p99": "p99"}
QUANTILE_KEYS = [("min", 0.0), ("p0.1", 0.001), ("p1", 0.01), ("p5", 0.05), ("p10", 0.1), ("p25", 0.25),
                 ("median", 0.5), ("p75", 0.75), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99), ("p99.9", 0.999),
                 ("max", 1.0)]
POOL_DRAWS = 20  # prompt lengths listed per scenario: the published distribution at 20 evenly spaced quantiles


def _show(git_dir: Path, path: str) -> str:
    return subprocess.run(["git", "-C", str(git_dir), "show", f"HEAD:{path}"], capture_output=True, text=True,
                          check=True).stdout


def experiments(git_dir: Path) -> list[str]:
    """The experiment folders under default_args/."""
    out = subprocess.run(["git", "-C", str(git_dir), "ls-tree", "--name-only", "HEAD", "default_args/"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(line.split("/")[-1] for line in out.split())


def _pick(d: dict, scale: float = 1.0) -> dict:
    return {ours: d[theirs] * scale for theirs, ours in LEVELS.items()}


def _stage(m: dict, k: int, stage: dict, max_tokens: int) -> dict:
    """One stage of the published figures, with vLLM's TPOT derived (module docstring; docs/published-runs.md)."""
    load, ok = m["load_summary"], m["successes"]
    lat = ok["latency"]
    events = 2 * max_tokens + 1  # inference-perf's gaps per request: two lines per SSE event, [DONE] included
    to_vllm = events / (max_tokens - 1)
    itl_ip = lat["inter_token_latency"]
    return {
        "stage": k, "rate": load["requested_rate"], "duration_s": float(stage["duration"]), "sent": load["count"],
        "completed": ok["count"], "achieved_rate": load["achieved_rate"],
        "completed_rate": ok["throughput"]["requests_per_sec"],
        "prompt_len": _pick(ok["prompt_len"]), "output_len": max_tokens,
        "ttft_s": _pick(lat["time_to_first_token"]), "e2e_s": _pick(lat["request_latency"]),
        "tpot_s": _pick(lat["time_per_output_token"], to_vllm),
        # the real token gaps are the upper (K - 1) / (2K + 1) of inference-perf's: their median near its p75
        "itl_s": {"mean": lat["time_per_output_token"]["mean"] * to_vllm, "p50": itl_ip["p75"], "p90": itl_ip["p95"],
                  "p99": None},
        "output_tokens_per_s": ok["throughput"]["requests_per_sec"] * max_tokens,
        "tool": {"time_per_output_token_s": _pick(lat["time_per_output_token"]),
                 "inter_token_latency_s": _pick(itl_ip),
                 "normalized_time_per_output_token_s": _pick(lat["normalized_time_per_output_token"]),
                 "output_len_retokenized": _pick(ok["output_len"]),
                 "output_tokens_per_s_retokenized": ok["throughput"]["output_tokens_per_sec"],
                 "tpot_mean_from_e2e_s": (lat["request_latency"]["mean"] - lat["time_to_first_token"]["mean"])
                 / (max_tokens - 1),
                 "failures": m["failures"]["count"],
                 "failure_latency_mean_s": (m["failures"]["request_latency"] or {}).get("mean")}}


def _name(exp: dict) -> str:
    return f"{SHORT[MODELS[exp['model']]]}_tp{exp['tensor_parallelism']}"


def convert(git_dir: Path, folder: str, commit: str) -> tuple[str, dict, dict]:
    """(file stem, the scenario, the published figures) of one experiment folder."""
    base = f"default_args/{folder}"
    exp = yaml.safe_load(_show(git_dir, f"{base}/exp-config.yaml"))
    ran = yaml.safe_load(_show(git_dir, f"{base}/results/config.yaml"))
    sp, load = ran["data"]["shared_prefix"], ran["load"]
    workload_name = folder.rsplit("-", 1)[-1]
    stem = f"{_name(exp)}_{workload_name}"
    stages = [json.loads(_show(git_dir, f"{base}/results/stage_{k}_lifecycle_metrics.json"))
              for k in range(len(load["stages"]))]
    published = {
        "format": "infersim-published-run/1", "name": stem,
        "source": {"repository": REPO, "commit": commit, "path": base,
                   "files": ["exp-config.yaml", "profile.yaml", "results/config.yaml",
                             *(f"results/stage_{k}_lifecycle_metrics.json" for k in range(len(stages)))]},
        "engine": ENGINE, "hardware": "H100-SXM", "model": MODELS[exp["model"]],
        "tensor_parallel_size": exp["tensor_parallelism"],
        "client": {"name": "inference-perf", "version": CLIENT, "api": "completions, streaming", "ignore_eos": True,
                   "max_tokens": sp["output_len"], "load": "constant (exponential gaps scaled to each stage)",
                   "prompts": f"{sp['num_groups']} x {sp['num_prompts_per_group']} fixed prompts, cycled",
                   "request_timeout_s": 300},
        "stages": [_stage(m, k, st, sp["output_len"]) for k, (m, st) in enumerate(zip(stages, load["stages"]))]}
    return stem, scenario_of(exp, ran, stages, stem, folder, commit), published


def _prompt_lengths(stages: list[dict]) -> list[int]:
    """The prompt lengths the engine saw (inference-perf counts them with the model's tokenizer, BOS included, as
    vLLM does), as POOL_DRAWS values at evenly spaced quantiles of the published distribution."""
    d = stages[0]["successes"]["prompt_len"]
    qs, xs = zip(*[(q, d[key]) for key, q in QUANTILE_KEYS])
    at = (np.arange(POOL_DRAWS) + 0.5) / POOL_DRAWS
    return [int(round(v)) for v in np.interp(at, qs, xs)]


def scenario_of(exp: dict, ran: dict, stages: list[dict], stem: str, folder: str, commit: str) -> dict:
    """The scenario of one experiment: vLLM's settings, the workload inference-perf ran."""
    sp, load = ran["data"]["shared_prefix"], ran["load"]
    prompt = stages[0]["successes"]["prompt_len"]["mean"]
    # the system prompt's tokens as the engine counts them: BOS, then its share of the re-tokenized text
    prefix = 1 + round(sp["system_prompt_len"] * (prompt - 1) / (sp["system_prompt_len"] + sp["question_len"]))
    return {
        "name": f"blis-{stem.replace('_', '-')}", "model": MODELS[exp["model"]], "hardware": "H100-SXM",
        "engine": {"name": "vllm", "version": VLLM_RELEASE},
        "parallel": {"tensor_parallel_size": exp["tensor_parallelism"]},
        "serving": {"max_num_seqs": exp["max_num_seqs"], "max_num_batched_tokens": exp["max_num_batched_tokens"],
                    "max_model_len": exp["max_model_len"], "enable_chunked_prefill": True},
        "kv_cache": {"enable_prefix_caching": True, "gpu_memory_utilization": 0.9, "block_size": 16},
        "workload": {"seed": 0,
                     "load_stages": {"process": "poisson_fixed_count", "gap_s": 2.0,
                                     "stages": [{"rate": float(s["rate"]), "duration_s": float(s["duration"])}
                                                for s in load["stages"]]},
                     "prompt_len": {"dist": "empirical", "values": _prompt_lengths(stages)},
                     "output_len": {"dist": "fixed", "value": sp["output_len"]},
                     "shared_prefix": {"prefix_len": prefix, "num_prefixes": sp["num_groups"],
                                       "prompts_per_prefix": sp["num_prompts_per_group"]}},
        "_header": header(folder, commit, exp, sp, stem)}


def header(folder: str, commit: str, exp: dict, sp: dict, stem: str) -> str:
    """The comment that heads a scenario file: its source and what it reproduces."""
    pool = sp["num_groups"] * sp["num_prompts_per_group"]
    text = (f"Source: {REPO} @ {commit[:7]}, default_args/{folder}: vLLM (V1 engine, version not recorded; "
            f"planned as {VLLM_RELEASE}, the release current in February 2026) serving {exp['model']} on {exp['tensor_parallelism']}x H100-SXM, driven by "
            "inference-perf at constant-rate stages. vLLM's settings from exp-config.yaml (chunked prefill and "
            "prefix caching: its V1 defaults); the workload is what inference-perf ran (results/config.yaml): "
            f"{sp['num_groups']} system prompts of {sp['system_prompt_len']} tokens x {sp['num_prompts_per_group']} "
            f"questions of {sp['question_len']}, {pool} fixed prompts sent in turn, {sp['output_len']} output "
            f"tokens (ignore_eos). Real figures per stage: published/{stem}.json (README.md: attribution; "
            "docs/published-runs.md: how).")
    return "".join(f"# {line}\n" for line in textwrap.wrap(text, 116))


def write(git_dir: Path, out: Path) -> list[str]:
    """Every experiment's scenario and published file under `out`; returns the stems written."""
    commit = subprocess.run(["git", "-C", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    (out / "published").mkdir(parents=True, exist_ok=True)
    stems = []
    for folder in experiments(git_dir):
        stem, scen, pub = convert(git_dir, folder, commit)
        head = scen.pop("_header")
        (out / f"{stem}.yaml").write_text(head + yaml.safe_dump(scen, sort_keys=False, default_flow_style=None,
                                                                width=118))
        (out / "published" / f"{stem}.json").write_text(json.dumps(pub, indent=1) + "\n")
        stems.append(stem)
    return stems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("git_dir", type=Path, help="a clone or bare mirror of inference-sim/training")
    p.add_argument("--out", type=Path, default=Path("scenarios/gpu_validation"))
    a = p.parse_args()
    print("\n".join(write(a.git_dir, a.out)))


if __name__ == "__main__":
    main()

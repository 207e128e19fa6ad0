"""Small builders shared by the simulator tests."""
from __future__ import annotations

import copy

import numpy as np
from PIL import Image

from sim.config.plan import make_plan
from sim.config.scenario import parse_scenario
from sim.policy.request import Status
from sim.report.metrics import summarize
from sim.report.outputs import build_report
from sim.simulator.cluster import itl_sample, sim_records, simulate

# infersim's engine: the simulator's mechanisms under the project's own defaults (no prefix caching, chunked prefill
# only past 32k tokens); what the serving engines' defaults change is tests/test_engines.py's
BASE = {
    "model": "Llama-2-7B",
    "hardware": "A100-80GB",
    "engine": "infersim",
    "workload": {"seed": 1, "arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 300,
                 "prompt_len": {"dist": "lognormal", "median": 400, "sigma": 0.8, "max": 2000},
                 "output_len": {"dist": "lognormal", "median": 150, "sigma": 0.8, "max": 1000}},
}


def scenario(**overrides) -> dict:
    """BASE with nested overrides: scenario(serving={"max_num_seqs": 8}, workload={"seed": 3})."""
    s = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(s.get(key), dict):
            s[key] = {**s[key], **value}
        else:
            s[key] = value
    return s


def plan_of(data: dict):
    return make_plan(parse_scenario(data))


def run(data: dict, bulk: bool = True):
    """Simulate; returns (report.json content without wall_time_s, RunResult, RequestRecords)."""
    plan = plan_of(data)
    result = simulate(plan, bulk=bulk)
    rec = sim_records(result)
    report = build_report(plan, rec, result.replicas, wall_time_s=0.0, extra=result.extra)
    return report, result, rec


def tiny_checkpoint(folder, seed: int, max_position_embeddings: int = 512):
    """A tiny random-weight llama saved as a HF checkpoint folder (for `model: {hf_config: folder}`)."""
    from executor.model.tiny import tiny_model, to_transformers

    to_transformers(tiny_model(seed=seed, num_kv_heads=2, vocab_size=1000,
                               max_position_embeddings=max_position_embeddings)).save_pretrained(folder)
    return folder


def write_tiny_scenario(tmp_path, checkpoint, **over):
    """A small executor scenario on a tiny checkpoint; `over` merges into its sections."""
    import yaml

    sc = {"name": "tiny-serve", "model": {"hf_config": str(checkpoint)}, "hardware": "cpu",
          "serving": {"max_num_seqs": 8, "max_model_len": 256, "max_num_batched_tokens": 256},
          "kv_cache": {"num_blocks": 64, "block_size": 8},
          "workload": {"seed": 2, "arrival": {"process": "poisson", "rate": 40.0}, "num_requests": 24,
                       "prompt_len": {"dist": "uniform", "min": 4, "max": 60},
                       "output_len": {"dist": "uniform", "min": 2, "max": 30}},
          "executor": {"threads": 1}}
    for k, v in over.items():
        sc[k] = {**sc.get(k, {}), **v} if isinstance(v, dict) else v
    path = tmp_path / f"{sc['name']}.yaml"
    path.write_text(yaml.safe_dump(sc))
    return path


def token_times(result) -> list[np.ndarray]:
    """Every completed request's token times written out from the replicas' step tables and its runs of steps
    (a run's first step, then each step in (first, last] that decoded everyone): the oracle the simulator's
    weighted inter-token gaps are checked against."""
    runs: dict[int, list] = {}
    for trace in result.replicas:
        for rid, first, last in trace.runs.tolist():
            runs.setdefault(rid, []).append((trace, first, last))
    out = []
    for r in result.requests:
        if r.token_times or r.status.value != "finished":
            out.append(np.asarray(r.token_times, float))
            continue
        t = []
        for trace, first, last in sorted(runs[r.id], key=lambda x: x[1]):
            ends = np.asarray(trace.step_end, float)
            decode = np.flatnonzero(np.asarray(trace.step_decodes_all, bool))
            t.append(ends[first])
            t.extend(ends[decode[(decode > first) & (decode <= last)]])
        out.append(np.asarray(t))
    return out


def assert_itl_is_the_token_gaps(result, records, times: list[np.ndarray], rel: float = 1e-12, abs: float = 0.0) -> None:
    """The report's inter-token latencies are the gaps between the finished requests' written-out token times
    (`times`, one array per request; warm-up requests left out): where no request kept its own token times, the simulator's weighted sample is
    those gaps value for value; the ITL statistics match them (None where there are none)."""
    import pytest

    gaps = np.concatenate([np.diff(t) for t, r in zip(times, result.requests)  # a client's warm-ups: in no figure
                           if r.status.value == "finished" and not r.warmup] + [np.zeros(0)])
    gaps = gaps[gaps > 0]  # tokens of one step (accepted drafts) arrive as one chunk: one gap
    if not any(r.token_times for r in result.requests):
        values, weights = itl_sample(result)
        assert np.array_equal(np.sort(np.repeat(values, weights)), np.sort(gaps))
    assert records.itl.count == len(gaps)
    for key, value in summarize(gaps).items():  # no gaps (nothing completed, one token each): None
        if value is None:
            assert records.itl.stats[key] is None, (key, records.itl.stats[key])
        else:
            assert records.itl.stats[key] == pytest.approx(value, rel=rel, abs=abs)


def in_flight(requests) -> int:
    """The most requests ever between their arrival (when sent) and their end (a rejected one ends when it
    arrives); ends come before sends at one instant, as a slot frees before the request waiting for it takes it."""
    events = sorted([(r.arrival_s, 1) for r in requests] +
                    [(r.finish_s if r.status is Status.FINISHED else r.arrival_s, -1) for r in requests])
    return int(np.max(np.cumsum([d for _, d in events])))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer(folder, vocab_size: int = 1000):
    """A word-level tokenizer of `vocab_size` ids saved beside a tiny checkpoint (text prompts, a chat template and
    streamed text for the HTTP server's tests): <unk> <s> </s> (EOS 2), the chat roles, then words w5, w6, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<user>", "<assistant>", "<system>"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def words(n: int, start: int = 0) -> str:
    """Text of exactly `n` tokens for tiny_tokenizer."""
    return " ".join(f"w{6 + (start + i) % 900}" for i in range(n))


def png_size(path) -> tuple[int, int]:
    """The pixel size of a PNG file that decodes whole (a truncated or corrupt one raises)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size

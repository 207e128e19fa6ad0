"""Bad input for EAGLE / MTP speculative decoding: keys of another method, rates of the wrong shape, a tree that does
not fit, a head that is missing or broken — each exits 2 with one line naming the file and the key."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tests.test_bad_input_more import BASE, invoke, one_line_error, run_broken, write
from tests.test_bad_input_round2 import PROFILE, smollm2, tiny

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "executor" / "data" / "eagle-smollm2-135m"
PROBS = [[0.6, 0.2, 0.2]] * 5  # the default chain is num_speculative_tokens (5) deep


def spec(**keys) -> dict:
    return {**copy.deepcopy(BASE), "speculative": keys}


SCENARIOS = {
    "eagle-tree-on-medusa": (spec(method="medusa", medusa_tree=[[0]], medusa_rank_probs=PROBS, eagle_tree=[[0]]),
                             "eagle_tree"),
    "eagle-rank-probs-on-ngram": (spec(acceptance_rate=0.5, eagle_rank_probs=PROBS), "eagle_rank_probs"),
    "eagle-head-on-draft-model": (spec(method="draft_model", acceptance_rate=0.5, eagle_head="h"), "eagle_head"),
    "medusa-tree-on-eagle": (spec(method="eagle", eagle_rank_probs=PROBS, medusa_tree=[[0]]), "medusa_tree"),
    "method-unknown": (spec(method="eagle3"), "speculative.method"),
    "rank-probs-rows-short": (spec(method="eagle", num_speculative_tokens=3, eagle_rank_probs=PROBS[:2]),
                              "eagle_rank_probs"),
    "rank-probs-row-long": (spec(method="eagle", num_speculative_tokens=1, eagle_rank_probs=[[0.05] * 12]),
                            "eagle_rank_probs"),
    "rank-probs-not-a-distribution": (spec(method="mtp", num_speculative_tokens=1, eagle_rank_probs=[[0.9, 0.9]]),
                                      "eagle_rank_probs"),
    "rank-probs-not-numbers": (spec(method="eagle", num_speculative_tokens=1, eagle_rank_probs=[["a"]]),
                               "eagle_rank_probs"),
    "rank-probs-flat": (spec(method="eagle", num_speculative_tokens=1, eagle_rank_probs=[0.5, 0.5]),
                        "eagle_rank_probs"),
    "rank-probs-missing": (spec(method="eagle", num_speculative_tokens=2), "speculative.eagle_rank_probs"),
    "tree-and-gamma-disagree": (spec(method="eagle", num_speculative_tokens=5, eagle_tree=[[0], [1]],
                                     eagle_rank_probs=PROBS), "eagle_tree"),
    "tree-orphan": (spec(method="eagle", eagle_tree=[[0, 0]], eagle_rank_probs=PROBS), "speculative"),
    "tree-rank-too-wide": (spec(method="eagle", eagle_tree=[[10]], eagle_rank_probs=PROBS), "speculative"),
    "rates-on-eagle": (spec(method="eagle", eagle_rank_probs=PROBS, request_rates=[[1.0, 0.5]]), "request_rates"),
    "with-prefix-caching": ({**spec(method="eagle", eagle_rank_probs=PROBS),
                             "kv_cache": {"enable_prefix_caching": True}}, "prefix"),
    "tree-on-flash": ({**spec(method="eagle", eagle_tree=[[0], [1]], eagle_rank_probs=PROBS),
                       "executor": {"attention": "flash"}}, "executor.attention"),
}


@pytest.mark.parametrize("data, key", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_broken_eagle_scenario(tmp_path, data, key):
    run_broken(tmp_path, data, key)


def test_a_chain_runs_on_any_attention(tmp_path):
    path = write(tmp_path / "s.yaml", {**spec(method="eagle", num_speculative_tokens=3, eagle_rank_probs=PROBS),
                                       "executor": {"attention": "flash"}})
    r = invoke("run", path, "-q", "--no-plots")
    assert r.exit_code == 0, r.output


def _head(tmp_path: Path, meta=None, weights: bool = True, text: str | None = None) -> Path:
    folder = tmp_path / "head"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eagle.json").write_text(text if text is not None else json.dumps(
        meta or json.loads((HEAD / "eagle.json").read_text())))
    if weights:
        shutil.copy(HEAD / "eagle.safetensors", folder)
    return folder


HEADS = {
    "missing": (lambda t: str(t / "no-such-head"), "nothing in"),
    "no-weights": (lambda t: str(_head(t, weights=False)), "no eagle.safetensors"),
    "meta-not-json": (lambda t: str(_head(t, text="{")), "not readable JSON"),
    "meta-no-vocab": (lambda t: str(_head(t, meta={"hidden_size": 576, "num_layers": 1})), "vocab"),
}


@pytest.mark.parametrize("folder, needle", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("command", ["serve", "validate"])
def test_broken_head(tmp_path, command, folder, needle):
    speculative = {"method": "eagle", "num_speculative_tokens": 2, "eagle_head": folder(tmp_path),
                   **({"eagle_rank_probs": PROBS} if command == "validate" else {})}
    path = write(tmp_path / "s.yaml", smollm2(speculative=speculative))
    r = invoke("validate", path, "--profile", PROFILE) if command == "validate" else invoke("serve", path, "-q")
    one_line_error(r, path, "speculative.eagle_head", needle)


def test_head_of_another_model(tmp_path):
    path = write(tmp_path / "s.yaml", tiny(tmp_path, speculative={"method": "mtp", "num_speculative_tokens": 2}))
    one_line_error(invoke("serve", path, "-q"), path, "speculative.eagle_head", "hidden size 576")


def test_train_eagle_refuses_an_out_that_is_a_file(tmp_path):
    out = write(tmp_path / "file.txt", "x")
    one_line_error(invoke("train-eagle", "--out", out, "--train-minutes", "0"), "--out")

"""The real SmolLM2-135M split over processes gives the single process's greedy output token for token: tensor
parallel over 3 ranks (its 9 heads and 3 KV heads split in three, not two) and pipeline parallel over 2 stages with
two batches in flight, on prompts cut from real text."""
from __future__ import annotations

import pytest
import torch

from executor.core.build import make_engine
from executor.core.prompts import corpus_ids, prompt_ids
from executor.distributed.pipeline import pipeline
from executor.distributed.tensor_parallel import tensor_parallel
from sim.config import environment
from tests.parallel_workloads import outputs, policy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not environment.long_tests(), reason="four SmolLM2 loads over 5 processes, ~45 s; the "
                                 "tiny model's twins (tests/test_executor_tensor_parallel.py, test_executor_pipeline.py) "
                                 "run by default: INFERSIM_LONG=1 pytest ...")]

LENGTHS = [(40, 6), (150, 3), (9, 10), (90, 5), (230, 2), (61, 8)]  # (prompt, output): mixed steps


@pytest.fixture(scope="module")
def smollm2():
    from executor.model.weights import load_hf_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, _, tokenizer = load_hf_model(path)
    corpus = corpus_ids(tokenizer)
    prompts = [prompt_ids(corpus, n, i) for i, (n, _) in enumerate(LENGTHS)]
    torch.set_num_threads(1)
    reference = outputs(make_engine(model, policy(max_num_seqs=4, num_blocks=96, block_size=16)), prompts,
                        [m for _, m in LENGTHS])
    return model, prompts, reference


def test_smollm2_tensor_parallel_3_is_token_for_token_the_single_process(smollm2):
    model, prompts, reference = smollm2
    with tensor_parallel(model, 3, timeout_s=120) as tp:
        engine = tp.engine(policy(max_num_seqs=4, num_blocks=96, block_size=16))
        assert outputs(engine, prompts, [m for _, m in LENGTHS]) == reference


def test_smollm2_pipeline_parallel_2_is_token_for_token_the_single_process(smollm2):
    model, prompts, reference = smollm2
    with pipeline(model, 2, timeout_s=120) as pipe:
        engine = pipe.engine([policy(max_num_seqs=4, num_blocks=96, block_size=16) for _ in range(2)])
        assert outputs(engine, prompts, [m for _, m in LENGTHS]) == reference
        assert {r.virtual_engine for r in engine.records} == {0, 1}

"""Distilling a draft model (tiny random-weight teacher): the training forward is the serving forward, the
recipe lowers the held-out loss to the teacher, and a bad layer list is refused before any work."""
from __future__ import annotations

import pytest
import torch

from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache
from executor.model.tiny import tiny_model
from executor.training.speculative import dense_hidden, distill, draft_vocab, teacher_data, teacher_targets
from tests.test_engine import prompts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def teacher():
    return tiny_model(seed=5, num_kv_heads=2, num_layers=4, vocab_size=256, tie_word_embeddings=True)


def test_training_forward_matches_the_serving_forward(teacher):
    ids = prompts(1)[0]
    kv = KVCache.for_model(teacher.config, 8, 16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(8))], 16)
    served = teacher(torch.tensor(ids), meta.positions(), meta, kv)
    assert torch.allclose(dense_hidden(teacher, torch.tensor([ids]))[0], served, atol=1e-5)


def test_draft_vocab_ranks_by_frequency_and_keeps_eos(teacher):
    data = teacher_targets(teacher, [[5, 5, 5, 7, 9], [5, 7, 11]], k=4)
    vocab = draft_vocab(data, 3, always=[2])
    assert vocab[0] == 2 and vocab[1] == 5 and len(vocab) == 3


def test_teacher_data_keeps_long_enough_pairs_with_their_groups(teacher):
    # what distill, train-medusa (min_len 2) and train-eagle (min_len 3) train on
    prompts = [[5, 6], [7], [8, 9, 10], [11], [12, 13]] + [[20 + i, 21] for i in range(11)]
    answers = [[1], [], [2, 3], [4], [14]] + [[30 + i] for i in range(11)]
    groups = ["a", "b", "a", "c", "d"] + [f"g{i}" for i in range(11)]
    data, vocab, held = teacher_data(teacher, prompts, answers, groups, eos=2, vocab_size=20, min_len=3,
                                     keep_hidden=True)
    kept = [p + a for p, a in zip(prompts, answers) if len(p + a) >= 3]
    assert data.sequences == kept and [5, 6, 1] in kept and [11, 4] not in kept
    assert data.prompt_lens == [2, 3] + [2] * 12 and data.hidden is not None
    assert vocab[0] == 2 and len(vocab) == 20
    assert held == [0, 1, 9]  # every 8th group of the kept sequences, whole: "a" (two of them) and "g6"
    short, _, _ = teacher_data(teacher, prompts, answers, groups, eos=None, vocab_size=8)
    assert short.sequences == [p + a for p, a in zip(prompts, answers) if p + a != [7]] and short.hidden is None


def test_distill_lowers_the_held_out_loss(teacher):
    g = torch.Generator().manual_seed(0)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    work = [torch.randint(3, 256, (12,), generator=g).tolist() for _ in range(128)]
    student, rec = distill(teacher, work, None, [0, 3], 256, minutes=5.0, max_new=16, max_steps=100,
                           log=lambda *_: None)
    assert rec["steps"] == 100 and student.config.num_layers == 2 and len(student.vocab) == 256
    assert rec["heldout_loss_after"] < 0.85 * rec["heldout_loss_before"]  # KL to the teacher (1.33 -> 1.00)
    assert student.model.embed_tokens is teacher.embed_tokens
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())  # the teacher is untouched


def test_bad_layers_are_refused_before_any_work(teacher):
    with pytest.raises(ValueError, match="0..3"):
        distill(teacher, [[1, 2, 3]], None, [0, 7], 64, minutes=1.0)

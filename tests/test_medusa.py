"""Medusa in the executor (tiny random-weight model): tree attention, greedy tree verification giving the
plain greedy output with candidate trees whose accepted paths take any branch (so accepted K/V is moved),
sampled tree verification keeping the target distribution, and the heads' drafter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.model.attention import AttentionMetadata, get_backend
from executor.model.sampling import SamplingParams, target_probs
from executor.model.tiny import tiny_model
from executor.speculative.drafter import Drafter
from executor.speculative.medusa import MedusaDrafter, MedusaHeads, load_medusa
from executor.speculative.verify import tree_depths, tree_mask, verify_tree
from sim.cost.speculation import best_tree, tree_expected_tokens
from sim.policy.request import Status
from tests.test_engine import make_engine, prompts, serve_all
from tests.test_speculative_engine import _chi2_p

torch.set_num_threads(1)
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


@pytest.fixture(scope="module")
def plain(model):
    work = [(p, 24) for p in prompts(6)]
    engine = make_engine(model)
    reqs = serve_all(engine, work)
    return work, {tuple(p): engine.output_ids(r) for (p, _), r in zip(work, reqs)}


class OracleTree(Drafter):
    """A candidate tree like Medusa's, built from the true greedy continuation: at each depth the true token
    sits at rank 0, rank 1 or nowhere (drawn), the other ranks hold wrong tokens — so accepted paths run
    through first and second children alike."""

    def __init__(self, reference, tree, seed=0):
        self.reference, self.tree = reference, tree
        index = {p: i + 1 for i, p in enumerate(tree)}
        self.tree_parents = [index.get(p[:-1], 0) for p in tree]
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids, k):
        for prompt, out in self.reference.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                truth = out[done:done + 3]
                where = self.rng.integers(0, 3, len(truth))  # rank of the true token; 2: not a candidate
                cands = [[(t + 1 + r) % 256 if r != w else t for r in range(2)] for t, w in zip(truth, where)]
                return [cands[len(p) - 1][p[-1]] for p in self.tree[:k] if len(p) <= len(cands)][:k]
        return []


def test_tree_mask_and_depths():
    parents = [0, 0, 1, 1, 2, 3]
    m = tree_mask(parents)
    assert m[3].tolist() == [True, True, False, True, False, False, False]  # node 3: root, 1, itself
    assert m[6].tolist() == [True, True, False, True, False, False, True]
    assert tree_depths(parents) == [0, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_tree_attention_equals_attending_each_path_alone(backend):
    """Each node of a tree row attends to exactly the context and its ancestors: its output equals that of
    a causal row holding just its own path."""
    g = torch.Generator().manual_seed(0)
    heads, kvh, d, bs = 4, 2, 8, 4
    k_cache = torch.randn(16, bs, kvh, d, generator=g)
    v_cache = torch.randn(16, bs, kvh, d, generator=g)
    parents, ctx0 = [0, 0, 1, 2], 9
    n = len(parents) + 1
    q = torch.randn(n, heads, d, generator=g)
    table = list(range(4))
    meta = AttentionMetadata.build([n], [ctx0 + n], [table], bs)
    meta.trees[0] = tree_mask(parents)
    out = get_backend(backend)(q, k_cache, v_cache, meta)
    for node in range(n):
        path = [j for j in range(n) if tree_mask(parents)[node, j]]  # ancestors, root first
        kc, vc = k_cache.clone(), v_cache.clone()
        flat_k, flat_v = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
        src = [ctx0 + j for j in path]
        flat_k[ctx0:ctx0 + len(path)] = k_cache.view(-1, kvh, d)[src]
        flat_v[ctx0:ctx0 + len(path)] = v_cache.view(-1, kvh, d)[src]
        m = AttentionMetadata.build([1], [ctx0 + len(path)], [table], bs)
        alone = get_backend("naive")(q[node:node + 1], kc, vc, m)
        assert torch.allclose(out[node], alone[0], atol=1e-5), (backend, node)


CFGS = [{"num_speculative_tokens": len(TREE)},
        {"num_speculative_tokens": len(TREE), "enable_chunked_prefill": True, "max_num_batched_tokens": 24,
         "prefill_chunk_size": 8},
        {"num_speculative_tokens": len(TREE), "num_blocks": 24}]  # too small: preemption


@pytest.mark.parametrize("cfg", CFGS)
def test_greedy_tree_speculation_gives_the_plain_greedy_output(model, plain, cfg):
    work, want = plain
    engine = make_engine(model, **cfg)
    engine.drafter = OracleTree(want, TREE)
    reqs = serve_all(engine, work)
    for (p, _), r in zip(work, reqs):
        assert r.status is Status.FINISHED and engine.output_ids(r) == want[tuple(p)], r.id
    assert sum(r.num_accepted for r in reqs) > 30  # paths through second children too (K/V moved)
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks
    if "num_blocks" in cfg:
        assert engine.scheduler.num_preemptions > 0


def test_sampled_tree_verification_keeps_the_target_distribution():
    """SpecInfer's rule on a tree whose root has two candidate children: the first token and, given the
    first child was taken, the second are distributed as the target's."""
    g = torch.Generator().manual_seed(1)
    vocab = 8
    logits = torch.randn(4, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, seed=0)
    p = target_probs(logits, params).numpy()
    tokens, parents = [3, 5, 1], [0, 0, 1]  # nodes 1, 2 under the root; node 3 under node 1
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(6000):
        out, path = verify_tree(logits, tokens, parents, params, g)
        first[out[0]] += 1
        if path[:1] == [1]:
            second[out[1]] += 1
    assert _chi2_p(first, p[0]) > 1e-3
    assert _chi2_p(second, p[1]) > 1e-3


def test_medusa_heads_drafter_serves_the_plain_greedy_output_and_measures_ranks(model, plain, tmp_path):
    work, want = plain
    heads = MedusaHeads(model, 3, list(range(256)))
    with torch.no_grad():
        for b in heads.blocks:
            b.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    heads.save(tmp_path, {"tree": [list(p) for p in TREE]})
    drafter = MedusaDrafter(load_medusa(tmp_path, model), TREE)
    engine = make_engine(model, num_speculative_tokens=len(TREE))
    engine.drafter = drafter
    reqs = serve_all(engine, work)
    for (p, _), r in zip(work, reqs):
        assert engine.output_ids(r) == want[tuple(p)], r.id
    assert sum(r.num_drafted for r in reqs) > 0
    probs = drafter.rank_probs()
    assert probs is not None and abs(sum(probs[0]) - 1) < 1e-9 and sum(drafter.rank_counts[0]) > 20


def test_tree_expectation_and_construction():
    probs = [[0.6, 0.2, 0.2], [0.5, 0.1, 0.4]]
    assert tree_expected_tokens([(0,), (1,), (0, 0)], probs) == pytest.approx(1 + 0.6 + 0.2 + 0.3)
    tree = best_tree(probs, 3, topk=2)
    assert tree == [(0,), (1,), (0, 0)]  # 0.6, 0.3, 0.2 > 0.12, 0.06
    # a chain with one candidate per depth is the α-chain: each depth accepted with probability α
    chain = [(0,) * d for d in range(1, 5)]
    assert tree_expected_tokens(chain, [[0.7, 0.3]] * 4) == pytest.approx((1 - 0.7 ** 5) / 0.3)


def test_training_medusa_heads_lowers_their_held_out_kl_and_picks_a_tree():
    from executor.training.speculative import choose_tree, teacher_targets, train_medusa

    teacher = tiny_model(seed=5, num_kv_heads=2, num_layers=2, vocab_size=256, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 256, (40,), generator=g).tolist() for _ in range(48)]
    data = teacher_targets(teacher, seqs, keep_hidden=True)
    heads, rec = train_medusa(teacher, data, 2, list(range(256)), minutes=5.0, max_steps=150, log=lambda *_: None)
    assert rec["steps"] == 150
    for before, after in zip(rec["heldout_kl_before"], rec["heldout_kl_after"]):
        assert after < 0.9 * before
    probs = rec["heldout_rank_probs"]
    assert len(probs) == 2 and all(abs(sum(p) - 1) < 1e-6 for p in probs)
    tree, table = choose_tree(probs, None, max_size=6)
    assert len(tree) == 6 and table[-1]["expected_tokens"] >= table[0]["expected_tokens"]  # free verify: biggest
    assert tree_expected_tokens(tree, probs) == pytest.approx(table[-1]["expected_tokens"])


def test_retree_picks_the_tree_again_for_a_profile(tmp_path):
    """`train-medusa --retree` rewrites only the saved tree: free verify rows (no profile) take the biggest one."""
    import json

    from executor.training.speculative import retree_command

    probs = [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1]]
    (tmp_path / "medusa.json").write_text(json.dumps({"heldout_rank_probs": probs, "tree": [[0]], "vocab": [1]}))
    rec = retree_command(tmp_path, None)
    saved = json.loads((tmp_path / "medusa.json").read_text())
    assert saved["tree"] == rec["tree"] and saved["vocab"] == [1]
    assert len(saved["tree"]) == max(row["size"] for row in saved["tree_choice"]) > 1
    with pytest.raises(FileNotFoundError):
        retree_command(tmp_path / "none", None)


def test_simulated_medusa_steps_yield_the_tree_expectation():
    """The simulator walks the tree with the measured rank probabilities: tokens per verify step average
    tree_expected_tokens, and a request's output length is kept exactly."""
    from tests.helpers import run

    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    probs = [[0.6, 0.15, 0.25], [0.5, 0.2, 0.3], [0.4, 0.1, 0.5]]
    sc = {"model": "Llama-2-7B", "hardware": "A100-80GB",
          "workload": {"seed": 3, "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 60,
                       "prompt_len": {"dist": "fixed", "value": 128}, "output_len": {"dist": "fixed", "value": 400}},
          "speculative": {"method": "medusa", "medusa_tree": tree, "medusa_rank_probs": probs}}
    report = run(sc)[0]
    spec = report["speculative"]
    assert report["requests"]["completed"] == 60
    want = tree_expected_tokens([tuple(p) for p in tree], probs)
    assert 1 + spec["mean_accepted_length"] == pytest.approx(want, rel=0.05)


def test_tree_row_padded_among_decodes_matches_naive():
    """A candidate-tree row that sdpa attends in one padded call with the step's decodes (and a shorter chain
    verify row) gives what the naive backend gives for every token."""
    g = torch.Generator().manual_seed(3)
    heads, kvh, d, bs = 4, 2, 8, 4
    k_cache = torch.randn(40, bs, kvh, d, generator=g)
    v_cache = torch.randn(40, bs, kvh, d, generator=g)
    parents = [0, 0, 1, 2, 1]
    query_lens, context_lens = [1, len(parents) + 1, 3, 1], [3, 30, 17, 44]
    tables = [list(range(0, 1)), list(range(1, 9)), list(range(9, 14)), list(range(14, 25))]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, num_decode_rows=4)
    meta.trees[1] = tree_mask(parents)
    assert [(n, seqs) for n, seqs, *_ in meta.verify_groups] == [(6, [0, 1, 2, 3])]
    q = torch.randn(sum(query_lens), heads, d, generator=g)
    ref = AttentionMetadata.build(query_lens, context_lens, tables, bs)
    ref.trees[1] = tree_mask(parents)
    torch.testing.assert_close(get_backend("sdpa")(q, k_cache, v_cache, meta),
                               get_backend("naive")(q, k_cache, v_cache, ref), atol=1e-5, rtol=1e-5)

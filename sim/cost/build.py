"""The cost side of a resolved plan: its step-cost model, the pricer of its steps and the simulator's drafter."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sim.config.errors import ConfigError
from sim.config.expert_parallel import ExpertLayout
from sim.config.hardware import LINK_FIELDS, as_in_catalog
from sim.config.models import ModelSpec
from sim.config.moe import has_experts, kv_bytes_per_device_token, uses_mla
from sim.config.plan import Plan
from sim.config.sharding import shard
from sim.cost.blocks import StepBlocks, step_blocks
from sim.cost.comm import Collectives, Interconnect, MeasuredCollectives
from sim.cost.gpu import VLLM_PER_SEQ_OVERHEAD_S, VLLM_STEP_OVERHEAD_S, KernelCostModel, Refinement
from sim.cost.kernels import KERNEL_ENGINES, DeviceKernels, engine_kernels, kernel_report, load_accuracy, load_kernels
from sim.cost.nccl import NcclCollectives, engine_collectives
from sim.cost.pricer import StepPricer
from sim.cost.roofline import RooflineCostModel
from sim.cost.step import StepCostModel

if TYPE_CHECKING:
    from sim.cost.speculation import SpeculationModel

ROOFLINE_STEP_OVERHEAD_S = 2e-3
ROOFLINE_PER_SEQ_OVERHEAD_S = 2e-5


def make_cost_model(plan: Plan) -> StepCostModel:
    """The plan's step-cost model: its fitted profile (scaled; for a tensor- or pipeline-parallel plan, a profile
    measured through that layout as it is, one of one device composed with its communication: sim/cost/parallel.py),
    else the GPU kernel model where the device's kernels were measured (sim/cost/gpu.py), else the roofline; the last
    two price the model's blocks on one device of the plan's layout (sim/cost/blocks.py)."""
    c = plan.cost
    if c.source == "kernels":
        return kernel_cost_model(plan)
    if c.profile is not None:
        if plan.expert_layout.data_parallel_size > 1:
            raise ConfigError(f"{c.profile.path.name} fitted one engine's steps; it prices no data-parallel ranks; "
                              "allowed: data_parallel_size 1 with a profile, or no profile", "cost_model.profile")
        from sim.cost.fitted import FittedCostModel  # a fitted profile's models: most scenarios name none
        from sim.cost.parallel import ParallelFittedCostModel

        fitted = FittedCostModel.from_profile(c.profile)
        if c.profile.parallel == (1, 1) and plan.sharding.tp * plan.pipeline_parallel_size > 1:
            coefs, knot, ramp_knot = c.profile.forward
            fitted = ParallelFittedCostModel(fitted, FittedCostModel(coefs, knot=knot, ramp_knot=ramp_knot),
                                             MeasuredCollectives(c.profile.comm), plan.model,
                                             plan.sharding.tp, plan.pipeline_parallel_size)
        return fitted.scaled(c.profile_scale)
    return RooflineCostModel(plan_blocks(plan), plan.hardware, compute_efficiency=c.compute_efficiency,
                             memory_efficiency=c.memory_efficiency,
                             step_overhead_s=_given(c.step_overhead_s, ROOFLINE_STEP_OVERHEAD_S),
                             per_seq_overhead_s=_given(c.per_seq_overhead_s, ROOFLINE_PER_SEQ_OVERHEAD_S),
                             block_bytes=plan.block_bytes, sequence_parallel=plan.sequence_parallel)


def plan_blocks(plan: Plan) -> StepBlocks:
    """What one device of the plan's replica computes for each block of its model (sim/cost/blocks.py): its sharding,
    expert layout, one attention layer's K/V a token there, and the engine's fused residual add."""
    kv_layer = plan.kv_groups.bytes_per_token_layer if plan.kv_groups is not None else plan.kv_bytes_per_token_layer
    fused = plan.engine is not None and plan.engine.release.fused_add_norm
    return step_blocks(plan.model, plan.sharding, plan.expert_layout, kv_layer, plan.model.act_bytes, fused,
                       plan.cost.expert_load_imbalance)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def device_kernels(plan: Plan) -> DeviceKernels:
    """The kernels the plan's engine runs on its device: vLLM's, SGLang's or TensorRT-LLM's own where AIConfigurator
    measured them (sim/cost/kernels.py: engine_kernels), else the device's engine-agnostic fits."""
    r, name = plan.engine.release if plan.engine is not None else None, plan.hardware.name
    k = engine_kernels(name, r.engine, r.version) if r is not None and r.engine in KERNEL_ENGINES else None
    return k if k is not None else load_kernels()[0][name]


def _collectives(plan: Plan, kernels: DeviceKernels, graph: bool = True) -> Collectives:
    """The NCCL collectives measured on the kernels' system where the device's links are the catalog's, else the
    link's; with the engine's own all-reduce (its CUDA-graph or eager kernel) below its message limit where it runs one
    and it was measured."""
    link = Interconnect.of(plan.hardware)
    _, collective_fits = load_kernels()
    if not as_in_catalog(plan.hardware, LINK_FIELDS):
        return link
    if kernels.engine and plan.engine is not None and plan.engine.custom_all_reduce:
        return engine_collectives(kernels, collective_fits, link, graph)
    return NcclCollectives(kernels.collectives, collective_fits[kernels.collectives], link) \
        if kernels.collectives in collective_fits else link


def tensor_parallel_blocks(model: ModelSpec, tensor_parallel_size: int = 1) -> StepBlocks:
    """What one device of a tensor-parallel group alone computes of `model` (no pipeline, data or expert parallelism,
    no engine): how calibration prices a measured model on a catalog GPU."""
    sharding = shard(model, tensor_parallel_size)
    return step_blocks(model, sharding, ExpertLayout(tensor_parallel_size, 1, False),
                       kv_bytes_per_device_token(model, sharding) / model.num_layers, model.act_bytes)


def kernel_cost_model(plan: Plan) -> KernelCostModel:
    """The GPU kernel model of the plan's device (its engine's measured kernels and, where its links are the catalog's,
    the NCCL collectives measured on its system), with the host overheads the scenario set or a profile refined."""
    k, c = device_kernels(plan), plan.cost
    if c.refinement is not None and (has_experts(plan.model) or uses_mla(plan.model)
                                     or plan.expert_layout.data_parallel_size > 1):
        raise ConfigError(f"{c.profile.path.name} refines the kernel model's dense parts; a mixture of experts' "
                          "refinement is not modelled; allowed: cost_model.type auto (the profile's own fit), or "
                          "no profile", "cost_model.type")
    refinement = Refinement(**c.refinement) if c.refinement is not None else \
        Refinement(step_overhead_s=_given(c.step_overhead_s, VLLM_STEP_OVERHEAD_S),
                   per_seq_overhead_s=_given(c.per_seq_overhead_s, VLLM_PER_SEQ_OVERHEAD_S))
    return KernelCostModel(plan_blocks(plan), k, plan.hardware, _collectives(plan, k), plan.pipeline_parallel_size,
                           refinement, plan.block_bytes, plan.engine, _collectives(plan, k, graph=False))


def describe_cost(plan: Plan) -> dict:
    """What priced the plan's steps, for the report: the engine it runs on (and the defaults it supplied), the source
    and its error where it was measured (a profile's held-out error; the kernel model's on what its fit left out; the
    roofline's on the GPUs that were measured)."""
    described = _describe_source(plan)
    return described if plan.engine is None else {**described, "engine": plan.engine.to_json()}


def _describe_source(plan: Plan) -> dict:
    c = plan.cost
    if c.source == "profile":
        fit = c.profile.data.get("fit", {}).get("heldout", {})
        host = c.profile.data.get("host", {})
        return {"source": "profile", "profile": c.profile.path.name, "device": host.get("gpu") or host.get("cpu"),
                "scale": c.profile_scale, "error": {"what": "the profile's held-out steps",
                                                    "mape_pct": round(100 * fit["mape"], 1) if "mape" in fit else None}}
    accuracy = load_accuracy()
    if c.source == "kernels":
        k = device_kernels(plan)
        # a dense model runs no experts, a model of bf16 experts no MXFP4 kernel: its report keeps the notes of what
        # it runs
        experts_or_mla = has_experts(plan.model) or uses_mla(plan.model)
        runs = {"grouped": experts_or_mla, "grouped_mxfp4": plan.model.expert_weight_dtype == "mxfp4"}
        notes = {part: note for part, note in k.notes.items() if runs.get(part, True)}
        out = {"source": "gpu_kernels", "device": k.device, "fitted_to": k.source, "measured_on": k.measured_on,
               "notes": notes, "collectives": k.collectives, "error": accuracy.get(k.measured_on)}
        if k.engine:  # an engine's own kernels: per op family, their source and error on what their fit left out
            report = out["kernels"] = kernel_report(k, has_experts(plan.model), "fit" if k.attention_fit else "today",
                                                    plan.model.expert_weight_dtype == "mxfp4")
            layer = report["families"].get(f"gemm.{plan.model.matmul_dtype(plan.hardware.peak_flops)}",
                                           report["families"]["gemm.fp16"])
            out["error"] = layer["error"]
        if experts_or_mla and "grouped_gemm" in accuracy:  # the routed experts' grouped GEMMs
            out["experts_error"] = accuracy["grouped_gemm"]
        if c.refinement is not None:  # refined by a profile's measured steps: that fit's held-out error
            out["refined_by"] = c.profile.path.name
            out["error"] = {"what": "the profile's held-out steps",
                            "mape_pct": round(100 * c.profile.kernels["heldout"]["mape"], 1)}
        return out
    gpu = plan.hardware.name != "cpu"  # the roofline was judged on GPUs' measurements
    return {"source": "roofline", "compute_efficiency": c.compute_efficiency,
            "memory_efficiency": c.memory_efficiency, "error": accuracy.get("roofline") if gpu else None}


def make_pricer(plan: Plan, cost: StepCostModel | None = None) -> StepPricer:
    """The whole price of the plan's steps: `cost` (default: the plan's cost model), speculative decoding's verify
    cost ratio, and a pipelined replica's stages, split evenly with the activations sent over the hardware's link
    where the cost model does not price stages itself."""
    cost = make_cost_model(plan) if cost is None else cost
    spec, link, m = plan.speculative, Interconnect.of(plan.hardware), plan.model
    return StepPricer(cost, spec.verify_cost_ratio if spec is not None else 1.0, plan.pipeline_parallel_size,
                      link.send_bytes_s(m.hidden_size * m.act_bytes), link.latency_s)


def speculation_model(plan: Plan, replica: int, draw: int = 0, cost: StepCostModel | None = None
                      ) -> SpeculationModel | None:
    """The simulator's drafter for one replica (its own seeded acceptance draws; `draw` picks another
    sequence of them), or None. With `draft_s_reference_step` the drafter's times are scaled by how fast
    `cost` (default: the plan's) runs that reference step against the profile they were measured with."""
    spec = plan.speculative
    if spec is None:
        return None
    from sim.cost.speculation import SpeculationModel, reference_step_s  # speculative plans alone load it

    seed = plan.workload.seed * 1000 + replica + 7919 * draw
    scale = reference_step_s(cost or make_cost_model(plan)) / spec.draft_s_reference_step \
        if spec.draft_s_reference_step else 1.0
    per_seq, per_step, per_token = (scale * spec.draft_s_per_seq, scale * spec.draft_s_per_step,
                                    scale * spec.draft_s_per_token)
    tree = spec.candidate_tree
    if tree is not None:  # Medusa, EAGLE, MTP: a walk down the tree (a chain) with the measured rank chances
        key = spec.rank_probs_key
        probs = getattr(spec, key)
        if probs is None:
            raise ConfigError(f"required to simulate {spec.method} (per depth, the chance of each candidate rank; "
                              "`infersim serve` of the scenario measures it)", f"speculative.{key}")
        return SpeculationModel(len(tree), 0.0, spec.proposal_rate, per_seq, per_step, seed, tree, probs,
                                draft_s_per_token=0.0 if spec.method == "medusa" else per_token,  # heads read none
                                feeds_features=spec.method != "medusa")
    if spec.acceptance_rate is None and not spec.request_rates:
        raise ConfigError("required to simulate speculative decoding (α, the chance each draft is accepted; "
                          "`infersim serve` of the scenario measures it), or request_rates",
                          "speculative.acceptance_rate")
    return SpeculationModel(spec.num_speculative_tokens, spec.acceptance_rate or 0.0, spec.proposal_rate,
                            per_seq, per_step, seed, draft_s_per_token=per_token,
                            request_rates=[tuple(p) for p in spec.request_rates] if spec.request_rates else None)

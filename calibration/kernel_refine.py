"""Refine the GPU kernel model with steps a whole engine ran on that GPU: `infersim profile --device cuda` records
each step's shape and time (the same samples the linear step-cost fit takes); here each part of the kernel model's
price for those shapes gets a multiplier and the host overhead is fitted again, by non-negative least squares on
relative error with a light pull of the multipliers toward 1, on all but every fifth step (held out: the error the
profile reports).

    time ≈ a·linear + b·attention + c·LM head + d·communication + e + f·sequences + g·[a prompt chunk in the step]

The result goes into the profile (`kernels`: the device, the Refinement, its held-out error and the unrefined
model's); a plan whose cost_model names that profile, on that device, prices its steps with the refined kernel model
where its held-out error beats the linear fit's (or with cost_model.type: kernels).
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from sim.config.hardware import HARDWARE_CATALOG, measured_devices
from sim.config.models import ModelSpec
from sim.config.profile import REFINEMENT_TERMS as TERMS
from sim.cost.build import tensor_parallel_blocks
from sim.cost.comm import Interconnect
from sim.cost.gpu import KernelCostModel
from sim.cost.kernels import load_kernels
from sim.cost.pricer import StepPricer
from sim.policy.batch import record_shape

MULTIPLIERS = TERMS[:4]  # linear, attention, LM head, communication: the first features, in order
PULL = 0.001  # the weight of each multiplier's pull toward 1, per step fitted


def catalog_gpu(name: str | None) -> str | None:
    """The measured catalog device a CUDA device name (torch.cuda.get_device_name) is: "NVIDIA H200" -> "H200"."""
    if not name:
        return None
    n = name.upper().replace(" ", "")
    for device in measured_devices():
        d = device.upper().replace("-SXM", "").replace("-", "")
        memory = d[4:] if d.startswith("A100") else ""
        if d[:4] in n and (not memory or memory in n):
            return device
    return None


def kernel_model(model: dict, device: str, tensor_parallel_size: int = 1) -> KernelCostModel:
    """The unrefined kernel model of a profile's model (its `model` section) on a catalog device."""
    spec = ModelSpec(**{k: v for k, v in model.items() if k in ModelSpec.model_fields})
    kernels, _ = load_kernels()
    hw = HARDWARE_CATALOG[device]
    return KernelCostModel(tensor_parallel_blocks(spec, tensor_parallel_size), kernels[device], hw,
                           Interconnect.of(hw))


def _features(pricer: StepPricer, sample: dict) -> list[float]:
    c, shape = pricer.record_cost(sample), record_shape(sample)
    return [c.linear_s, c.attention_s, c.lm_head_s, c.communication_s, 1.0, float(shape.num_seqs),
            1.0 if shape.num_prefill else 0.0]


def refine(samples: list[dict], model: dict, device: str, tensor_parallel_size: int = 1,
           holdout_every: int = 5) -> dict:
    """{"device", "refinement": the Refinement's fields, "heldout": {mape, r2, n}, "unrefined_heldout": {mape}}."""
    pricer = StepPricer(kernel_model(model, device, tensor_parallel_size))  # its own price: what is refined
    x = np.array([_features(pricer, s) for s in samples])
    y = np.array([s["time_s"] for s in samples], float)
    held = np.zeros(len(y), bool)
    held[::holdout_every] = True
    train = ~held if held.sum() < len(y) else held
    # rows divided by y: relative error; and a pull of each multiplier toward 1, so that parts the steps barely
    # tell apart (a host-bound engine's) keep the kernels' measured proportions instead of trading places
    pull = np.zeros((len(MULTIPLIERS), x.shape[1]))
    pull[range(len(MULTIPLIERS)), range(len(MULTIPLIERS))] = np.sqrt(PULL * train.sum())
    a = np.vstack([x[train] / y[train, None], pull])
    b = np.concatenate([np.ones(train.sum()), pull.sum(axis=1)])
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, b)
    coef = coef / scale
    pred, raw = x @ coef, np.array([pricer.record_s(s) for s in samples])
    ss = float(((y[held] - y[held].mean()) ** 2).sum())
    return {"device": device, "refinement": dict(zip(TERMS, map(float, coef))),
            "heldout": {"mape": float(np.mean(np.abs(pred[held] / y[held] - 1))),
                        "r2": 1 - float(((pred[held] - y[held]) ** 2).sum()) / ss if ss > 0 else 1.0,
                        "n": int(held.sum())},
            "unrefined_heldout": {"mape": float(np.mean(np.abs(raw[held] / y[held] - 1)))}}


def refine_profile(prof: dict) -> dict | None:
    """The `kernels` section of a profile measured on a GPU whose kernels the kernel model has, else None."""
    device = catalog_gpu(prof.get("host", {}).get("gpu"))
    if device is None or not prof.get("samples"):
        return None
    tp = (prof.get("parallel") or {}).get("tensor_parallel_size", 1)
    if (prof.get("parallel") or {}).get("pipeline_parallel_size", 1) > 1:
        return None  # a pipeline's steps overlap: their times are not one step's price
    return refine(prof["samples"], prof["model"], device, tp)

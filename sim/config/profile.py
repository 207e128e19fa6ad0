"""A calibration profile file (`infersim profile` writes it): read and checked once, when a plan is made."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sim.config.errors import ConfigError
from sim.config.hardware import measured_devices

# the fitted step-cost model's terms, in the order of its feature vector (sim.cost.fitted)
FEATURES = ("step", "new_tokens", "decode_seqs", "prefill_seqs", "has_prefill", "batched_prefill", "has_verify",
            "sampled", "attn_pairs", "kv_tokens", "prefill_kv", "few_tokens", "ramp_tokens", "experts_touched",
            "window_kv", "window_pairs")
_OLD_TERMS = ("seqs",)  # an older profile's single per-sequence term
MAX_KNOT = 4096
MIN_STEP_S = 1e-7  # the fastest step a fit may predict: real engine steps take microseconds or more


# the communication a profile may have measured (executor/distributed/comm_bench.py): op -> fitted latency and slope
COMM_OPS = ("all_reduce_shm", "gather_shm", "all_reduce_gloo", "send_gloo", "message_gloo")


@dataclass(frozen=True)
class ProfileFile:
    """The fitted step-cost coefficients of one device and model, and everything else the file records.
    `forward`: the same fit of the steps' forward alone (coefficients, knot, ramp_knot), and `comm`: per operation
    its latency_s and s_per_byte — what composing tensor- and pipeline-parallel steps needs; None where not measured.
    `parallel`: (tensor, pipeline parallel size) of the engine the sweep ran through ((1, 1): one device);
    `expert_parallel`: whether its ranks held a mixture of experts' experts whole (enable_expert_parallel)."""

    path: Path
    coefs: dict
    knot: int
    data: dict
    forward: tuple[dict, int, int] | None = None
    comm: dict | None = None
    parallel: tuple[int, int] = (1, 1)
    ramp_knot: int = 0
    kernels: dict | None = None  # the GPU kernel model refined by these steps (calibration/kernel_refine.py)
    expert_parallel: bool = False


def read_profile(path: Path, model=None, key_path: str = "cost_model.profile") -> ProfileFile:
    """Read a profile; with `model`, check it was measured for that model (its coefficients are model-specific).
    A fault inside the file is reported against the file and the key in it; a missing file or one measured for
    another model against `key_path`, the setting that names it."""
    path = Path(path)
    try:
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} is not a profile file", key_path)
        if path.exists() and path.stat().st_size > 64 * 2**20:
            raise ConfigError(f"{path} is {path.stat().st_size / 2**20:.0f} MiB, not an infersim profile", key_path)
        data = json.loads(path.read_text(encoding="utf-8-sig"), parse_constant=_no_constant)  # a BOM, as traces
    except FileNotFoundError:
        raise ConfigError(f"profile not found: {path}; make one with `infersim profile`", key_path) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"not an infersim profile: not readable JSON ({type(e).__name__})", file=str(path)) from None
    profile = check_profile(data, path)
    m = data.get("model", {})
    if model is not None and m and (m.get("num_layers"), m.get("hidden_size")) != (model.num_layers,
                                                                                    model.hidden_size):
        raise ConfigError(f"{path} was measured for {str(m.get('name'))[:40]} ({m.get('num_layers')} layers, hidden "
                          f"{m.get('hidden_size')}), not {model.name}; profile this model with `infersim profile`",
                          key_path)
    experts = (m.get("num_experts", 0), m.get("num_experts_per_tok", 0))
    if model is not None and m and experts != (model.num_experts, model.num_experts_per_tok):
        what = f"{experts[1]} of {experts[0]} experts" if experts[0] else "a dense model"
        raise ConfigError(f"{path} was measured on {what}; it prices no other routing, and {model.name} runs "
                          f"{model.num_experts_per_tok} of {model.num_experts} experts a token; profile this model "
                          "with `infersim profile`", key_path)
    have, want = (_compression(m), _compression(model.model_dump())) if model is not None and m else (None, None)
    if have != want:
        raise ConfigError(f"{path} was measured with {_describe(have)}, not {_describe(want)}: compression changes "
                          "every step's cost; profile it with `infersim profile --scenario`", key_path)
    return profile


def check_profile(data, path: Path) -> ProfileFile:
    """A profile's content (parsed JSON) checked as every reader of `path` checks it: its fit, forward fit,
    communication and parallel layout, and the model it names."""
    coefs, knot, ramp_knot = _check(data, path)
    forward = check_fit(data["fit"]["forward"], path, "fit.forward") if "forward" in data["fit"] else None
    comm = _check_comm(data["comm"], path) if "comm" in data else None
    parallel, expert_parallel = _check_parallel(data.get("parallel") or {}, path)
    kernels = _check_kernels(data["kernels"], path) if data.get("kernels") is not None else None
    return ProfileFile(path, coefs, knot, data, forward, comm, parallel, ramp_knot, kernels, expert_parallel)


REFINEMENT_TERMS = ("linear", "attention", "lm_head", "communication", "step_overhead_s", "per_seq_overhead_s",
                    "prefill_overhead_s")  # sim.cost.gpu.Refinement's fields


def _check_kernels(section, path: Path) -> dict:
    """A profile's refinement of the GPU kernel model: the catalog device, its terms, the held-out error."""
    if not isinstance(section, dict) or section.get("device") not in measured_devices():
        raise _bad(path, "kernels.device", f"{str(section)[:40]!r}: one of {', '.join(measured_devices())}")
    terms = section.get("refinement")
    if not isinstance(terms, dict) or set(terms) != set(REFINEMENT_TERMS):
        raise _bad(path, "kernels.refinement", f"a mapping of exactly {', '.join(REFINEMENT_TERMS)}")
    for name, value in terms.items():
        _seconds(value, path, f"kernels.refinement.{name}", "a multiplier or a time in seconds")
    mape = (section.get("heldout") or {}).get("mape")
    _seconds(mape, path, "kernels.heldout.mape", "the held-out error, a fraction")
    return section


def _compression(model: dict) -> tuple:
    """(weight dtype, KV dtype, sparsity) where any is compressed, else None: uncompressed dtypes price alike."""
    key = (model.get("weight_dtype"), model.get("kv_dtype"), model.get("sparsity") or "none")
    compressed = key[0] in ("int8", "int4", "fp8") or key[1] in ("int8", "fp8") or key[2] != "none"
    return key if compressed else None


def _describe(key: tuple | None) -> str:
    if key is None:
        return "uncompressed weights and KV"
    weights, kv, sparsity = key
    return f"{weights} weights, {kv or 'unquantized'} KV" + (f", {sparsity} sparsity" if sparsity != "none" else "")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a profile may hold")


def _check(data, path: Path) -> tuple[dict, int, int]:
    """The coefficients and knots of a profile's fit, and the model it names, checked."""
    if not isinstance(data, dict):
        raise _bad(path, "", f"a JSON object with a 'fit' section, not a {type(data).__name__}")
    coefs, knot, ramp_knot = check_fit(data.get("fit"), path, "fit")
    m = data.get("model", {})
    if not isinstance(m, dict) or m and any(not isinstance(m.get(k), int) or isinstance(m.get(k), bool)
                                            for k in ("num_layers", "hidden_size")):
        raise _bad(path, "model", "the model it was measured for: a mapping with integer num_layers and hidden_size")
    for k in ("name", "weight_dtype", "kv_dtype", "sparsity"):  # compared with the scenario's model as text
        if not isinstance(m.get(k), (str, type(None))):
            raise _bad(path, f"model.{k}", f"{str(m.get(k))[:40]!r}: a name (text) or null")
    return coefs, knot, ramp_knot


def _bad(path: Path, key: str, what: str) -> ConfigError:
    return ConfigError(f"not an infersim profile: {what}", key, str(path))


def _seconds(value, path: Path, key: str, what: str = "a time in seconds") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
        raise _bad(path, key, f"{str(value)[:40]!r}: {what}, finite and >= 0")
    return float(value)


def check_fit(fit, path: Path, key: str) -> tuple[dict, int, int]:
    """A fit section's coefficients and knots, every one checked: finite, non-negative, known terms."""
    if not isinstance(fit, dict) or not isinstance(fit.get("coefs"), dict):
        raise _bad(path, f"{key}.coefs", "missing: the fitted coefficients (`infersim profile` writes them)")
    coefs = {}
    for name, value in fit["coefs"].items():
        if name not in FEATURES and name not in _OLD_TERMS:
            raise _bad(path, f"{key}.coefs.{str(name)[:40]}", f"unknown term; allowed: {', '.join(FEATURES)}")
        coefs[name] = _seconds(value, path, f"{key}.coefs.{name}", "a step time in seconds")
    knots = []
    for name in ("knot", "ramp_knot"):  # a profile from before the ramp term has no ramp_knot: 0, the term off
        knot = fit.get(name, 0)
        if isinstance(knot, bool) or not isinstance(knot, int) or not 0 <= knot <= MAX_KNOT:
            raise _bad(path, f"{key}.{name}", f"{str(knot)[:40]!r}: a whole number of tokens in 0..{MAX_KNOT}")
        knots.append(knot)
    # the simulator divides by the time of a one-row decode step: a fit that makes it (nearly) free cannot be priced
    one_row = sum(coefs.get(t, 0.0) for t in ("step", "new_tokens", "decode_seqs", "sampled", "attn_pairs",
                                              "kv_tokens", "seqs"))
    one_row += coefs.get("few_tokens", 0.0) * max(0, knots[0] - 1) + coefs.get("ramp_tokens", 0.0) * min(1, knots[1])
    if one_row < MIN_STEP_S:
        raise _bad(path, f"{key}.coefs", f"a one-row decode step priced at {one_row:.3g} s; allowed: at least "
                   f"{MIN_STEP_S:g} s (a fit of real steps)")
    return coefs, knots[0], knots[1]


def _check_parallel(layout, path: Path) -> tuple[tuple[int, int], bool]:
    """The (tensor, pipeline) parallel sizes a profile was measured through, and whether with expert parallelism."""
    keys = ("tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel")
    if not isinstance(layout, dict) or set(layout) - set(keys):
        raise _bad(path, "parallel", f"a mapping of {', '.join(keys)}")
    sizes = []
    for k in keys[:2]:
        v = layout.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
            raise _bad(path, f"parallel.{k}", f"{str(v)[:40]!r}: a whole number in 1..64")
        sizes.append(v)
    ep = layout.get("enable_expert_parallel", False)
    if not isinstance(ep, bool):
        raise _bad(path, "parallel.enable_expert_parallel", f"{str(ep)[:40]!r}: true or false")
    return (sizes[0], sizes[1]), ep


def _check_comm(comm, path: Path) -> dict:
    """The measured communication: per known operation, latency_s and s_per_byte (finite, >= 0)."""
    fits = comm.get("fit") if isinstance(comm, dict) else None
    if not isinstance(fits, dict):
        raise _bad(path, "comm.fit", "missing: the fitted costs of each communication (`infersim profile` writes them)")
    out = {}
    for op, fit in fits.items():
        if op not in COMM_OPS:
            raise _bad(path, f"comm.fit.{str(op)[:40]}", f"unknown operation; allowed: {', '.join(COMM_OPS)}")
        if not isinstance(fit, dict):
            raise _bad(path, f"comm.fit.{op}", "a mapping with latency_s and s_per_byte")
        out[op] = {k: _seconds(fit.get(k), path, f"comm.fit.{op}.{k}") for k in ("latency_s", "s_per_byte")}
    return out

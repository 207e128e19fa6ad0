"""A calibration profile file (`infersim profile` writes it): read and checked once, when a plan is made."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sim.config.errors import ConfigError


@dataclass(frozen=True)
class ProfileFile:
    """The fitted step-cost coefficients of one device and model, and everything else the file records."""

    path: Path
    coefs: dict
    knot: int
    data: dict


def read_profile(path: Path, model=None, key_path: str = "cost_model.profile") -> ProfileFile:
    """Read a profile; with `model`, check it was measured for that model (its coefficients are model-specific)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        prof = ProfileFile(path, dict(data["fit"]["coefs"]), int(data["fit"].get("knot", 0)), data)
    except FileNotFoundError:
        raise ConfigError(f"profile not found: {path}; make one with `infersim profile`", key_path) from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not an infersim profile ({type(e).__name__}: {e})", key_path) from None
    m = data.get("model", {})
    if model is not None and m and (m.get("num_layers"), m.get("hidden_size")) != (model.num_layers,
                                                                                    model.hidden_size):
        raise ConfigError(f"{path} was measured for {m.get('name')} ({m.get('num_layers')} layers, hidden "
                          f"{m.get('hidden_size')}), not {model.name}; profile this model with `infersim profile`",
                          key_path)
    return prof

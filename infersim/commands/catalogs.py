"""`infersim models` and `infersim hardware`: the catalogs, by name."""
from __future__ import annotations

from sim.config.hardware import HARDWARE_CATALOG
from sim.config.models import MODEL_CATALOG


def model_catalog() -> dict:
    """The model catalog, by name."""

    return dict(MODEL_CATALOG)


def hardware_catalog() -> dict:
    """The hardware catalog, by name."""

    return dict(HARDWARE_CATALOG)

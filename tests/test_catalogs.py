"""The model and hardware catalogs are built unvalidated at import (a run validates no spec it names by catalog):
every entry must be what validating it gives, field for field and type for type, and pass the specs' checks."""
from __future__ import annotations

import pytest

from sim.config.hardware import HARDWARE_CATALOG, HardwareSpec
from sim.config.models import MODEL_CATALOG, ModelSpec


def _typed(spec) -> dict:
    return {k: (type(v), v) for k, v in spec.model_dump().items()}


@pytest.mark.parametrize("name", list(MODEL_CATALOG))
def test_each_catalog_model_is_valid_as_built(name):
    entry = MODEL_CATALOG[name]
    checked = ModelSpec.model_validate(entry.model_dump(exclude_unset=True))
    assert checked == entry and _typed(checked) == _typed(entry)
    assert checked.model_fields_set == entry.model_fields_set


@pytest.mark.parametrize("name", list(HARDWARE_CATALOG))
def test_each_catalog_device_is_valid_as_built(name):
    entry = HARDWARE_CATALOG[name]
    checked = HardwareSpec.model_validate(entry.model_dump(exclude_unset=True))
    assert checked == entry and _typed(checked) == _typed(entry)


def test_a_catalog_entry_breaking_a_check_would_fail_here():
    bad = ModelSpec.model_construct(**{**MODEL_CATALOG["Llama-2-7B"].model_dump(), "num_kv_heads": 5})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec.model_validate(bad.model_dump())

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


def test_a_lazy_catalog_builds_an_entry_on_its_first_lookup_only_once():
    from sim.config.errors import LazyCatalog, catalog_entry

    built = []
    catalog = LazyCatalog({name: (lambda name=name: built.append(name) or {"name": name}) for name in ("A", "b")})
    assert "b" in catalog and "c" not in catalog and list(catalog) == ["A", "b"] and len(catalog) == 2 and built == []
    first = catalog_entry(catalog, "a", "model", "", "model")
    assert first == {"name": "A"} and catalog["A"] is first and built == ["A"]
    assert catalog.get("c") is None and built == ["A"]


def test_the_cpu_entry_reads_its_profile_on_its_first_lookup_alone(monkeypatch):
    from sim.config import hardware
    from sim.config.errors import LazyCatalog, catalog_entry

    read = []
    monkeypatch.setattr(hardware, "_measured_cpu", lambda spec: read.append(spec.name) or spec.model_copy(
        update={"memory_bandwidth": 1e9}))
    catalog = LazyCatalog(dict(hardware.HARDWARE_CATALOG._makers))
    assert catalog_entry(catalog, "a100-80gb", "hardware", "", "hardware").name == "A100-80GB"
    assert "cpu" in catalog and read == []
    assert catalog_entry(catalog, "CPU", "hardware", "", "hardware").memory_bandwidth == 1e9
    assert catalog["cpu"].memory_bandwidth == 1e9 and read == ["cpu"]


def test_the_catalog_cpu_takes_the_shipped_profile_figures():
    import json
    from pathlib import Path

    measured = json.loads((Path(__file__).resolve().parents[1] / "calibration/profiles/cpu.json").read_text())["measured"]
    cpu = HARDWARE_CATALOG["cpu"]
    assert (cpu.peak_flops["fp32"], cpu.memory_bandwidth) == (measured["matmul_flops"], measured["memory_bandwidth"])

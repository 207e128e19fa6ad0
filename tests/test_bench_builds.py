"""bench/builds.py: the benches' workers run each native-kernel build in a process of its own, under its INFERSIM_ISA,
and report what goes wrong in them."""
import sys
from pathlib import Path

import pytest

from executor.model import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import builds  # noqa: E402


class Probe:
    """A worker's object: what the worker's process has."""

    def __init__(self, fail: bool = False):
        if fail:
            raise ValueError("no model here")

    def isa(self) -> str | None:
        return native.isa()

    def twice(self, x: int) -> int:
        return 2 * x


def test_default_builds_are_the_best_and_avx2_beside_avx512():
    best = native.best_isa(native.cpu_flags())
    assert builds.isas(None) == (["auto", "avx2"] if best == "avx512" else ["auto"])
    assert builds.isas(["avx2", "auto", "avx2"]) == ["avx2", "auto"]
    assert builds.label("auto") == best


@pytest.mark.skipif(not native.available() or not {"avx2", "fma", "f16c"} <= native.cpu_flags(),
                    reason="needs the native kernels and an AVX2 CPU")
def test_a_worker_runs_its_own_build_and_reports_errors():
    workers = builds.isa_workers(Probe, (), ["avx2", "avx2"], threads=1)
    try:
        assert list(workers) == ["avx2"]
        assert workers["avx2"].call("isa") == "avx2" and workers["avx2"].call("twice", 21) == 42
        with pytest.raises(RuntimeError, match="AttributeError"):
            workers["avx2"].call("missing")
    finally:
        for w in workers.values():
            w.close()
    with pytest.raises(RuntimeError, match="ValueError: no model here"):
        builds.Worker(Probe, (True,), threads=1)


def test_an_interpreter_without_llamacpp_is_named_before_any_model_loads():
    import importlib.util

    import vs_llamacpp
    here = importlib.util.find_spec("llama_cpp") is not None
    assert vs_llamacpp.missing_llamacpp([sys.executable]) == (
        None if here else f"--llamacpp-python {sys.executable}: that interpreter has no llama-cpp-python")
    assert vs_llamacpp.missing_llamacpp(None) == (None if here else "llama-cpp-python is not installed")
    assert vs_llamacpp.missing_llamacpp(["/nonexistent/python"]).startswith("--llamacpp-python /nonexistent/python: ")

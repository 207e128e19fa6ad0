"""Every environment variable the project reads, read here and nowhere else (each at call time, so that a test's or a
shell's setting in between is seen). The scenario's `executor:` section and explicit arguments are the way to
configure a run; these only place caches and artifacts, switch off native code, and widen the test suite.

| variable | what it does |
|---|---|
| `INFERSIM_CACHE_DIR` | the cache folder (default `~/.cache/infersim`): dequantized GGUF copies, native kernels, drafts |
| `INFERSIM_NATIVE=0` | the executor runs its torch paths, never builds or loads the native kernels |
| `INFERSIM_ISA` | the instruction set the native kernels are built for: `auto` (default: the best the CPU has, `-march=native`), `avx2` (AVX2 + FMA + F16C only, as on AMD Zen 2/3) or `avx512`; each cached apart |
| `CXX` | the C++ compiler the native kernels are built with (default `c++`, else `g++`) |
| `INFERSIM_API_KEY` | `serve --http`: the API key clients must send (`--api-key` overrides it) |
| `INFERSIM_ARTIFACTS` | where browser tests keep screenshots (default `runs/artifacts/`) |
| `INFERSIM_LONG=1` | tests: add the long real-model checks |
| `INFERSIM_EXPLORE=N` | tests: N examples of the long random-scenario exploration (0: skip it) |
"""
from __future__ import annotations

import os
from pathlib import Path

from sim.config.errors import ConfigError

ISAS = ("auto", "avx2", "avx512")


def cache_dir() -> Path:
    """$INFERSIM_CACHE_DIR, default ~/.cache/infersim: every cache of the project lives under it."""
    return Path(os.environ.get("INFERSIM_CACHE_DIR") or Path.home() / ".cache" / "infersim")


def native_enabled() -> bool:
    """False where INFERSIM_NATIVE=0: no native kernels are built or loaded."""
    return os.environ.get("INFERSIM_NATIVE", "1") != "0"


def isa() -> str:
    """INFERSIM_ISA: the instruction set the native kernels are built for, one of ISAS (default auto: the best the
    CPU has); anything else is a ConfigError."""
    value = (os.environ.get("INFERSIM_ISA") or "auto").strip().lower()
    if value not in ISAS:
        raise ConfigError(f"INFERSIM_ISA={os.environ['INFERSIM_ISA']!r} is not an instruction set the native kernels "
                          f"are built for; allowed: {', '.join(ISAS)}")
    return value


def cxx() -> str | None:
    """The C++ compiler $CXX names, if any."""
    return os.environ.get("CXX") or None


def artifacts_dir(default: Path) -> Path:
    """$INFERSIM_ARTIFACTS, else `default`: where tests keep what a person may want to look at afterwards."""
    return Path(os.environ.get("INFERSIM_ARTIFACTS") or default)


def long_tests() -> bool:
    """INFERSIM_LONG set: the test suite adds its long real-model checks."""
    return bool(os.environ.get("INFERSIM_LONG"))


def explore_examples() -> int:
    """INFERSIM_EXPLORE: examples of the long random-scenario exploration (0: skip it)."""
    return int(os.environ.get("INFERSIM_EXPLORE", "0"))


def api_key() -> str | None:
    """$INFERSIM_API_KEY: the key `serve --http` asks clients for when --api-key is not given (unset or empty: none)."""
    return os.environ.get("INFERSIM_API_KEY") or None

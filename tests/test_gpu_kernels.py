"""The GPU kernel model: its shipped fits come from the shipped measurements, it predicts shapes it was not fitted to,
and the kernel sweep's output feeds the same fits (checked here by a CPU dry run)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from calibration.aic_fit import without_aic
from calibration.kernel_fit import (
    LINEAR_OPS,
    fit_all,
    fit_attention,
    fit_elementwise,
    fit_gemm,
    fit_linear,
    kernel_tables,
    linear_rows,
    read_table,
)
from sim.cost.kernels import KERNELS_PATH, DeviceKernels, GemmFit, layer_gemms, layer_passes, load_kernels, pass_time


def test_the_shipped_fits_are_the_fits_of_the_shipped_tables():
    shipped = without_aic(json.loads(KERNELS_PATH.read_text()))  # AIConfigurator's: tests/test_engine_kernels.py
    refit = json.loads(json.dumps(fit_all()))
    assert sorted(shipped["devices"]) == sorted(refit["devices"])

    def close(a, b, path=""):
        if isinstance(a, dict):
            assert sorted(a) == sorted(b), path
            for k in a:
                close(a[k], b[k], f"{path}.{k}")
        elif isinstance(a, float):
            # least_squares lands a few 1e-4 apart across scipy releases (1.17.1: 7e-4 on one GEMM rate)
            assert a == pytest.approx(b, rel=3e-3, abs=1e-12), path
        else:
            assert a == b, path
    close(shipped, refit)


def test_a_gemm_costs_more_with_every_dimension_and_streams_its_weights_at_one_token():
    fit = load_kernels()[0]["H100-SXM"].gemm["fp16"]
    t = [fit.time(m, 8192, 8192) for m in (1, 64, 512, 4096)]
    assert t == sorted(t) and fit.time(64, 16384, 8192) > t[1] and fit.time(64, 8192, 16384) > t[1]
    weights = 8192 * 8192 * 2 / fit.bandwidth
    assert weights < fit.time(1, 8192, 8192) < 1.5 * weights + fit.floor_s  # M = 1: the weight stream, not compute
    assert fit.time(8192, 8192, 8192) == pytest.approx(2 * 8192**3 / fit.flops, rel=0.1)  # large: the FLOP rate


def test_layer_shapes_shard_heads_and_replicate_kv_heads_past_their_count():
    # Llama-3-70B at TP 8: 8 query heads and 1 KV head (of 8) per device; at TP 16 the KV head is replicated
    assert layer_gemms(8192, 64, 8, 128, 28672, 8, 5)[0] == ("qkv", 5, (8 + 2) * 128, 8192)
    assert layer_gemms(8192, 64, 8, 128, 28672, 16, 5)[0] == ("qkv", 5, (4 + 2) * 128, 8192)
    passes = layer_passes(4096, 32, 8, 128, 14336, 2, 10)
    assert passes["act"] == 3 * 10 * 7168 * 2 and passes["input_norm"] == 2 * 10 * 4096 * 2


def test_a_model_left_out_of_the_fit_is_predicted_within_a_few_percent():
    ops = read_table(LINEAR_OPS)
    for device, model in (("A100-80GB", "Qwen-72B"), ("H100-SXM", "CodeLlama-34b-Instruct-hf")):
        gemm, passes = fit_linear(linear_rows(ops, device, exclude_model=model))
        k = DeviceKernels(device, "vidur", {"fp16": gemm}, passes)
        errs = []
        for r in (r for r in ops if r["device"] == device and r["model"] == model):
            args = (r["hidden"], r["heads"], r["kv_heads"], r["hidden"] // r["heads"], r["intermediate"], r["tp"],
                    r["tokens"])
            pred = sum(k.gemm["fp16"].time(m, n, kk) for _, m, n, kk in layer_gemms(*args))
            pred += sum(pass_time(k.passes[op], b) for op, b in layer_passes(*args).items())
            errs.append(pred / (sum(v for key, v in r.items() if key.endswith("_us")) * 1e-6) - 1)
        assert np.median(np.abs(errs)) < 0.06 and np.percentile(np.abs(errs), 90) < 0.2, (device, model)


def test_fits_recover_the_parameters_of_synthetic_gemms():
    true = GemmFit(4e-6, 2e12, 300e12, 2.0, 50.0)
    shapes = [(m, n, k) for m in (1, 8, 64, 256, 1024, 4096) for n, k in ((4096, 4096), (14336, 4096), (4096, 1024))]
    fit = fit_gemm(*zip(*[(m, n, k, true.time(m, n, k)) for m, n, k in shapes]))
    for m, n, k in shapes:
        assert fit.time(m, n, k) == pytest.approx(true.time(m, n, k), rel=0.01)


def test_the_kernel_sweep_feeds_the_fits(tmp_path):
    out = tmp_path / "kernels.json"
    subprocess.run([sys.executable, "-m", "calibration.gpu_kernels", "--device", "cpu", "--dry", "--out", str(out),
                    "--only", "gemm,attention,elementwise"], check=True, capture_output=True, timeout=300)
    tables = kernel_tables(out, "cpu")
    assert {r["op"] for r in json.loads(out.read_text())["records"]} == {"gemm", "attn_prefill", "attn_decode",
                                                                         "elementwise"}
    fit = fit_gemm(*zip(*[(r["m"], r["n"], r["k"], r["us"] * 1e-6) for r in tables["gemm"]]))
    assert fit.flops > 0 and fit.bandwidth > 0
    assert set(fit_elementwise(tables["elementwise"])) == {"input_norm", "post_norm", "rope", "act", "add"}
    attn = fit_attention(tables["attention"], sms=2)
    assert attn["prefill_flops"] > 0 and attn["decode_bandwidth"] > 0

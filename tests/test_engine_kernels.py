"""The engines' kernels (sim/cost/kernels.py: engine_kernels), fitted to AIConfigurator's engine-collected timings
(calibration/aic_fit.py): every measured device and engine resolves, versions fall back as documented, the fits
reproduce measured points within their stated error, an engine's own all-reduce beats NCCL on small messages as
measured, and every device new to the catalog prices a step with the kernel model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from calibration.aic_fit import (
    AicTables,
    comm_curve,
    default_kernels,
    fit_engine,
    nccl_fits,
    points,
    write_engine_kernels,
)
from calibration.aic_tables import DEVICES, model_gemm_shapes
from sim.config.hardware import HARDWARE_CATALOG, has_kernels
from sim.cost.build import describe_cost, make_cost_model
from sim.cost.comm import Interconnect
from sim.cost.gpu import KernelCostModel
from sim.cost.kernels import (
    KERNEL_ENGINES,
    KERNELS_PATH,
    AttentionFit,
    DeviceKernels,
    device_engines,
    engine_devices,
    engine_kernels,
    engine_versions,
    kernel_accuracy,
    kernel_report,
    load_accuracy,
    load_engine_kernels,
    load_kernels,
    version_key,
)
from sim.cost.nccl import CustomAllReduce, NcclCollectives, engine_collectives
from tests.helpers import plan_of, scenario

NEW_DEVICES = ("B200", "GB200", "B300", "GB300", "L40S", "RTX-PRO-6000")
TABLES = AicTables()  # each compact table read once, when first asked for


def test_every_measured_device_and_engine_resolves_to_its_newest_version():
    data = load_engine_kernels()
    assert sorted(data["devices"]) == sorted(DEVICES.values())
    for device, engines in data["devices"].items():
        assert set(engines) <= set(KERNEL_ENGINES)
        for engine, entry in engines.items():
            k = engine_kernels(device, engine)
            assert k.device == device and k.engine == engine and k.source == "aic"
            assert k.version == entry["default"] == engine_versions(device, engine)[0]
            assert "fp16" in k.gemm and k.attention is not None and k.attention_fit is not None
            assert k.passes == load_kernels()[0][device].passes
            assert {"version", "gemm.fp16", "attention", "collectives"} <= set(k.notes)
            assert k.collectives in load_kernels()[1]
            assert kernel_accuracy(device, engine)["gemm.fp16"]["median_pct"] < 20


def test_a_file_per_device_reads_back_whole_and_a_run_reads_only_its_own(tmp_path):
    data = load_engine_kernels()
    write_engine_kernels(data, tmp_path)
    assert load_engine_kernels(tmp_path) == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{d}.json" for d in engine_devices()]
    write_engine_kernels({**data, "devices": {"H200": data["devices"]["H200"]}}, tmp_path)  # a stale file goes
    assert [p.name for p in tmp_path.iterdir()] == ["H200.json"]
    assert device_engines("H200")["engines"] == data["devices"]["H200"]
    assert device_engines("A40") == device_engines("../data/engine_kernels/H200") == {}  # unmeasured, or a path


def test_what_was_not_measured_is_none_and_versions_fall_back_as_documented():
    assert engine_kernels("A40", "vllm") is None
    assert engine_kernels("H100-SXM", "tgi") is None
    versions = engine_versions("H100-SXM", "vllm")
    newest, oldest = versions[0], versions[-1]
    assert engine_kernels("H100-SXM", "vllm", newest).version == newest
    older = engine_kernels("H100-SXM", "vllm", "0.0.1")  # older than any measured: the oldest measured
    assert older.version == oldest and "newer" in older.notes["version"]
    between = engine_kernels("H100-SXM", "vllm", "0.20.0")  # between 0.19 and 0.24: the nearest older one
    assert version_key(between.version) <= version_key("0.20.0") and "nearest older" in between.notes["version"]
    alias = load_engine_kernels()["devices"]["H100-SXM"]["vllm"]["aliases"]
    assert alias, "vLLM 0.22.0 reuses 0.24.0's data in AIConfigurator"
    for asked, runs in alias.items():
        assert engine_kernels("H100-SXM", "vllm", asked).version == runs


def test_version_keys_order_releases():
    ordered = ["0.5.6.post2", "0.5.9", "0.5.10", "1.3.0rc10", "1.3.0rc20", "1.3.0", "2.27", "2.27.3"]
    assert sorted(reversed(ordered), key=version_key) == ordered


def test_the_json_round_trips_an_engines_kernels():
    k = engine_kernels("B200", "trtllm")
    assert DeviceKernels.from_json(k.to_json()) == k
    assert isinstance(k.attention_fit, AttentionFit)


def _measured(name: str, device: str, engine: str, **where) -> list[dict]:
    version = engine_kernels(device, engine).version
    rows, _ = TABLES.rows(name, {"gemm": "gemm", "comm": "comm"}.get(name, "attention"),
                               {"gemm": "gemm_perf", "comm": "custom_allreduce_perf"}.get(name, f"{name}_perf"),
                               device, engine, version)
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def test_gemm_fits_reproduce_measured_projection_shapes_within_their_stated_error():
    """Llama-3-70B's projections at TP 4 (the grid shapes nearest them), every M: nine in ten within the stated p90,
    the median near the stated median."""
    for device, engine in (("H100-SXM", "vllm"), ("B200", "sglang"), ("L40S", "trtllm")):
        k, acc = engine_kernels(device, engine), kernel_accuracy(device, engine)["gemm.fp16"]
        rows = _measured("gemm", device, engine, dtype="bf16")
        shapes = model_gemm_shapes("Llama-3-70B", sorted({r["n"] for r in rows} | {r["k"] for r in rows}))
        errs = np.array([abs(k.gemm["fp16"].time(m, r["n"], r["k"]) / t - 1) for r, m, t in points(rows, "m")
                         if (r["n"], r["k"]) in shapes])
        assert len(errs) > 50
        assert np.mean(errs < acc["p90_pct"] / 100) >= 0.85, (device, engine)
        assert np.median(errs) < 1.5 * acc["median_pct"] / 100, (device, engine)


def test_attention_fits_reproduce_measured_points_within_their_stated_error():
    k, acc = engine_kernels("H100-SXM", "vllm"), kernel_accuracy("H100-SXM", "vllm")
    fit = k.attention_fit
    for r, kv_len, t in points(_measured("generation_attention", "H100-SXM", "vllm", heads=32, kv_heads=8), "kv"):
        if r["batch"] >= 16 and kv_len >= 1024:  # the serving regime: KV well past the L2 cache
            pred = fit.decode_s(r["batch"], kv_len, 8, 2 * 8 * 128 * 2)
            assert abs(pred / t - 1) < acc["attention.decode"]["p90_pct"] / 100, (r["batch"], kv_len)
    for r, isl, t in points(_measured("context_attention", "H100-SXM", "vllm", heads=32, kv_heads=8), "s"):
        if r["batch"] <= 4 and isl >= 512:
            pred = fit.prefill_s(r["batch"], isl, 32, 8, 128)
            assert abs(pred / t - 1) < acc["attention.prefill"]["p90_pct"] / 100, (r["batch"], isl)


def test_paged_decode_reads_the_kv_near_the_hbm_bandwidth():
    """FlashAttention-3 in vLLM reads a large batch's KV at over 90% of the H100's 3.35 TB/s; the default fit (SDPA's
    FlashAttention-2, timed on an H200) reads it at 58%."""
    fit = engine_kernels("H100-SXM", "vllm").attention_fit
    rows, kv_heads = 128, 8
    assert 1 / (fit.s_per_kv_byte(rows, kv_heads) * HARDWARE_CATALOG["H100-SXM"].memory_bandwidth) > 0.9
    assert load_kernels()[0]["H100-SXM"].attention["decode_bandwidth"] / 3.35e12 < 0.6


def test_attention_terms_add_up_to_the_fitted_layer():
    fit = engine_kernels("H200", "sglang").attention_fit
    terms = fit.terms(heads=16, kv_heads=2, head_dim=128, kv_bytes_per_token=2 * 2 * 128 * 2)
    rows, kv_len = 96, 1500
    step = terms.decode_floor_s + rows * terms.s_per_decode_row + rows * kv_len * terms.per_kv_token_s(rows)
    assert step == pytest.approx(fit.decode_s(rows, kv_len, 2, 2 * 2 * 128 * 2), rel=1e-12)
    n = 700
    chunk = terms.prefill_floor_s + terms.s_per_prefill_seq + n * (n + 1) / 2 * terms.s_per_prefill_pair + \
        n * terms.s_per_prefill_key
    assert chunk == pytest.approx(fit.prefill_s(1, n, 16, 2, 128), rel=1e-12)
    assert terms.per_kv_token_s(0) == 0.0


def test_an_engines_own_all_reduce_beats_nccl_on_small_messages_as_measured():
    k = engine_kernels("H100-SXM", "vllm")
    fits = load_kernels()[1]
    link = Interconnect.of(HARDWARE_CATALOG["H100-SXM"])
    engine, nccl = engine_collectives(k, fits, link), NcclCollectives(k.collectives, fits[k.collectives], link)
    assert isinstance(engine, CustomAllReduce)
    for devices in (2, 4, 8):
        limit = k.custom_all_reduce["graph"][str(devices)]["max_bytes"]
        for nbytes in (8192, 65536):
            assert engine.all_reduce_s(nbytes, devices) < 0.7 * nccl.all_reduce_s(nbytes, devices)
        assert engine.all_reduce_s(4 * limit, devices) == nccl.all_reduce_s(4 * limit, devices)
        assert engine.gather_s(1e6, devices) == nccl.gather_s(1e6, devices)
    # as measured: vLLM's CUDA-graph all-reduce of 8 KiB on 4 H100s against NCCL's
    comm = TABLES.table("comm")
    mine = next(r for r in comm if (r["device"], r["source"], r["version"], r["mode"], r["gpus"])
                == ("H100-SXM", "vllm", k.version, "graph", 4))
    theirs = next(r for r in comm if (r["device"], r["source"], r["op"], r["gpus"]) == ("H100-SXM", "nccl",
                                                                                          "all_reduce", 4))
    assert mine["b8192"] < 0.7 * theirs["b8192"]
    assert engine.all_reduce_s(8192, 4) == pytest.approx(mine["b8192"] * 1e-6, rel=0.25)
    eager = engine_collectives(k, fits, link, graph=False)
    assert eager.all_reduce_s(8192, 4) > engine.all_reduce_s(8192, 4)  # eager pays the launch and the copy in
    trt = engine_kernels("H100-SXM", "trtllm")  # timed under CUDA graphs only: the same kernel either way
    assert engine_collectives(trt, fits, link, graph=False).all_reduce_s(8192, 4) == \
        engine_collectives(trt, fits, link).all_reduce_s(8192, 4)


def test_nccl_systems_price_gathers_and_all_to_alls_as_measured():
    k = engine_kernels("B200", "vllm")
    fits = load_kernels()[1][k.collectives]
    nccl = NcclCollectives(k.collectives, fits, Interconnect.of(HARDWARE_CATALOG["B200"]))
    row = next(r for r in TABLES.table("comm") if (r["device"], r["source"], r["op"], r["gpus"])
               == ("B200", "nccl", "all_gather", 8))
    sizes, times = comm_curve(row)
    pred = np.array([nccl.gather_s(x, 8) for x in sizes])
    assert np.median(np.abs(pred / times - 1)) < 0.15
    assert nccl.all_to_all_s(2**20, 8) != pytest.approx(nccl.gather_s(2**20, 8), rel=1e-3)


@pytest.mark.parametrize("device", NEW_DEVICES)
def test_every_new_device_prices_a_step_with_the_kernel_model(device):
    hw = HARDWARE_CATALOG[device]
    assert has_kernels(hw) and hw.price_per_hour > 0 and "fp8" in hw.peak_flops
    plan = plan_of(scenario(model="Llama-3-8B", hardware=device, parallel={"tensor_parallel_size": 2}))
    cost = make_cost_model(plan)
    assert isinstance(cost, KernelCostModel)
    assert 0 < cost.decode_time(16, 16 * 1000) < cost.decode_time(64, 64 * 1000)
    described = describe_cost(plan)
    assert described["source"] == "gpu_kernels" and described["fitted_to"] == "aic"
    assert described["error"]["median_pct"] < 20


def test_blackwell_steps_run_faster_than_hopper_steps():
    def decode(device):
        return make_cost_model(plan_of(scenario(model="Llama-3-8B", hardware=device))).decode_time(64, 64 * 2000)
    assert decode("B200") < 0.7 * decode("H100-SXM")
    assert decode("GB300") < decode("H200")


def _close(a, b, path=""):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=3e-3, abs=1e-12), path  # least_squares across scipy releases
    else:
        assert a == b, path


def test_the_shipped_engine_fits_are_the_fits_of_the_compact_tables():
    t = TABLES
    shipped = json.loads(KERNELS_PATH.read_text())
    reference = DeviceKernels.from_json(shipped["devices"]["H200"])
    kernels, accuracy = default_kernels(t, "B200", reference)
    _close(shipped["devices"]["B200"], json.loads(json.dumps(kernels)))
    _close(shipped["accuracy"]["B200"], accuracy)
    _close(shipped["collectives"]["aic_h100_sxm"], json.loads(json.dumps(nccl_fits(t, "H100-SXM"))))
    k = engine_kernels("H100-SXM", "vllm")
    refit = fit_engine(t, "H100-SXM", "vllm", k.version, k.passes)
    _close(k.to_json(), {**json.loads(json.dumps(refit.to_json())), "notes": k.notes})


def test_the_kernel_report_names_each_familys_source_and_error():
    report = kernel_report(engine_kernels("H100-SXM", "sglang"), has_experts=True, attention_form="fit")
    assert report["engine"] == "sglang" and report["version"] == engine_versions("H100-SXM", "sglang")[0]
    fams = report["families"]
    assert "fa3" in fams["attention"]["source"] and fams["attention"]["error"]["decode"]["median_pct"] < 15
    assert fams["gemm.fp16"]["error"]["what"].startswith("a decoder layer's four GEMMs")
    assert fams["moe"]["error"] is not None and "sglang" in fams["all_reduce"]["source"]
    assert fams["all_reduce"]["error"]["engine"]["median_pct"] < fams["all_reduce"]["error"]["nccl"]["p90_pct"]
    today = kernel_report(engine_kernels("H100-SXM", "sglang"))["families"]["attention"]["error"]["prefill"]
    assert today["median_pct"] > fams["attention"]["error"]["prefill"]["median_pct"]
    default = kernel_report(load_kernels()[0]["H100-SXM"])
    assert default["engine"] is None and default["error"] == load_accuracy()["H100-SXM"]
    assert "moe" not in default["families"]

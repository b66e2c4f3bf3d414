"""The GPU device files' GEMM curves come from published kernel benchmarks at their shapes, not from a
training step: each file that names its benchmark is what fitting that benchmark gives."""
import math

import pytest

from predict.fitting import KERNEL_MIN_DIM, fit_gemm, fit_kernels, kernel_rows
from workload.compute import GpuCompute, device_files, read_device
from workload.configs import MODEL_CONFIGS


def test_a_device_files_gemm_curve_is_its_kernel_benchmarks_fit():
    fitted = {}  # one fit per chip (the 16 and 32 GB V100 share one), every file of it compared
    files = [read_device(p) for p in device_files() if read_device(p).kernels]
    assert {d.part for d in files} >= {"V100 SXM2", "A100 SXM"}
    for device in files:
        assert not device.calibrated_on, "a kernel-fitted device file carries no whole-step calibration"
        if device.part not in fitted:
            fitted[device.part] = fit_kernels(device)
        for prec, fit in fitted[device.part].items():
            e, half = device.gemm_curve(prec)
            assert e == pytest.approx(fit["efficiency"], abs=2e-3) and half == pytest.approx(fit["half"], rel=0.02)
            assert device.kernels[prec]["rows"] == fit["rows"]


def test_the_v100_fit_models_deepbench_within_its_spread():
    v100 = read_device(next(p for p in device_files() if p.stem == "v100-sxm2-16gb"))
    for prec in ("fp32", "fp16"):
        rows = kernel_rows("v100-deepbench.json", prec)
        assert len(rows) > 50 and all(min(r[:3]) >= KERNEL_MIN_DIM for r in rows)
        cm = GpuCompute(v100, MODEL_CONFIGS["tiny"], prec)
        ratios = sorted(cm.gemm(m, n, k) / t for m, n, k, t in rows)
        assert 0.9 < ratios[len(ratios) // 2] < 1.1  # the median GEMM within 10 %
        big = [cm.gemm(m, n, k) / t for m, n, k, t in rows if 2 * m * n * k > 1e11]
        assert all(0.8 < r < 1.25 for r in big)  # the large ones, which a layer's time is made of


def test_one_benchmark_row_sets_the_efficiency_alone():
    a100 = read_device(next(p for p in device_files() if p.stem == "a100-sxm4-80gb"))
    rows = kernel_rows("a100-cublas.json", "fp16")
    fit = fit_gemm(a100, "fp16", rows)
    assert fit["rows"] == 1 and fit["half"] == a100.gemm_curve("fp16")[1]
    m, n, k, t = rows[0]
    modelled = GpuCompute(a100.with_gemm("fp16", fit["efficiency"]), MODEL_CONFIGS["tiny"], "fp16").gemm(m, n, k)
    assert math.isclose(modelled, t, rel_tol=1e-3)

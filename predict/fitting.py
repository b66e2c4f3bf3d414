"""Calibration: what the profile does not measure, fitted to runs without emulated delay.

- CPU (this machine): each system's framework overheads (``Overheads``: per step, per micro-batch or
  unit, per data-parallel sync) by non-negative least squares of the relative error between the
  simulated and the measured median step time of runs with ``--network none``.
- GPU kernels: a device's GEMM curve (``efficiency``: the share of its datasheet peak the largest GEMMs
  reach; ``half``: the depth K at which a GEMM's main loop reaches half of that) by least squares of the
  log of modelled over measured time, on published kernel benchmarks at their shapes
  (``workload/devices/kernels/``; ``fit_gemm``).
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

from workload.compute import DEVICES, Device, GpuCompute, Overheads
from predict.step_time import predict


def _nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """argmin ||A x - y|| with x >= 0, by trying every active set (a handful of unknowns)."""
    n = len(rows[0]) if rows else 0
    best, best_err = [0.0] * n, sum(v * v for v in y)
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            a = [[r[j] for j in free] for r in rows]
            x = _lstsq(a, y)
            if x is None or any(v < 0 for v in x):
                continue
            full = [0.0] * n
            for j, v in zip(free, x):
                full[j] = v
            err = sum((sum(r[j] * full[j] for j in range(n)) - t) ** 2 for r, t in zip(rows, y))
            if err < best_err - 1e-18:
                best, best_err = full, err
    return best


def _lstsq(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Normal equations with Gaussian elimination (k <= 4)."""
    k = len(a[0])
    ata = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * t for r, t in zip(a, y)) for i in range(k)]
    m = [row[:] + [v] for row, v in zip(ata, aty)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-24:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [u - f * v for u, v in zip(m[r], m[c])]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit_overheads(system: str, runs: list[tuple], cores: float | None,
                  params: tuple[str, ...] = ("step", "unit")) -> tuple[Overheads, list[dict]]:
    """The overheads of ``system`` that make the simulated step times of ``runs`` (spec, measured
    seconds, the compute model of its shape[, the cores the run had]) closest in relative terms; only
    ``params`` are free, the others stay as the first run's compute model has them. ``cores``: for
    runs that do not say.

    The step time is nearly linear in each overhead; the fit linearises it twice (around zero, then
    around the first solution) and solves a non-negative least squares problem."""
    base = runs[0][2].overheads(system)
    x = [0.0] * len(params)

    def times(values) -> list[float]:
        o = replace(base, **dict(zip(params, values)))
        return [predict(run[0], run[2].with_overheads(system, o), run[3] if len(run) > 3 else cores).step_time
                for run in runs]

    for _ in range(2):
        t0 = times(x)
        grads = []
        for j in range(len(params)):
            delta = max(1e-4, 0.2 * x[j])
            xd = list(x)
            xd[j] += delta
            grads.append([(a - b) / delta for a, b in zip(times(xd), t0)])
        measured = [run[1] for run in runs]
        rows = [[grads[j][i] / m for j in range(len(params))] for i, m in enumerate(measured)]
        # relative residual of the linearisation: (t0 + G (x' - x)) / m - 1
        y = [1.0 - (t0[i] - sum(grads[j][i] * x[j] for j in range(len(params)))) / m for i, m in enumerate(measured)]
        x = _nnls(rows, y)
    fitted = replace(base, **dict(zip(params, x)))
    report = []
    for run, p in zip(runs, times(x)):
        spec, m = run[0], run[1]
        report.append(dict(system=spec.system, model=spec.model.name, pp=spec.pp, tp=spec.tp, dp=spec.dp,
                           batch=spec.batch_size, slices=len(spec.token_slices), dp_mode=spec.dp_mode, measured=m,
                           fitted=p, error=(p - m) / m, cores=run[3] if len(run) > 3 else cores))
    return fitted, report


KERNELS = DEVICES / "kernels"
# The GEMMs a transformer layer runs have every dimension >= 128 (tokens, hidden / tp, 4 hidden / tp at tp <= 8
# for hidden >= 256): the benchmark rows fitted are those.
KERNEL_MIN_DIM = 128


def kernel_rows(name: str, precision: str, min_dim: int = KERNEL_MIN_DIM) -> list[tuple[int, int, int, float]]:
    """(M, N, K, seconds) of the GEMMs a kernel benchmark file (``workload/devices/kernels/NAME``) holds for
    ``precision``, every dimension at least ``min_dim``."""
    data = json.loads((KERNELS / name).read_text())
    return [(m, n, k, ms / 1e3) for m, n, k, _, _, ms in data["gemm"].get(precision, [])
            if min(m, n, k) >= min_dim]


def fit_gemm(device: Device, precision: str, rows: list[tuple[int, int, int, float]]) -> dict:
    """The GEMM curve of ``device`` in ``precision`` that models ``rows`` (M, N, K, seconds) best: the
    least squares of log(modelled / measured) over (efficiency, half); with fewer than three rows, the
    efficiency alone (half as the device has it). Returns efficiency, half, the rows' count and the
    root-mean-square of the log error."""
    from scipy.optimize import minimize

    from workload.configs import MODEL_CONFIGS

    model = MODEL_CONFIGS["tiny"]  # a GEMM's time does not depend on the model
    _, half0 = device.gemm_curve(precision)

    def err(e: float, half: float) -> float:
        if not (0 < e <= 1 and half > 0):
            return 1e9
        cm = GpuCompute(device.with_gemm(precision, e, half), model, precision)
        return sum(math.log(cm.gemm(m, n, k) / t) ** 2 for m, n, k, t in rows) / len(rows)

    if len(rows) < 3:
        res = minimize(lambda x: err(x[0], half0), [0.8], method="Nelder-Mead", options=dict(xatol=1e-5))
        e, half = float(res.x[0]), half0
    else:  # the depth on a log scale: it spans orders of magnitude
        starts = [(e0, h0) for e0 in (0.6, 0.9) for h0 in (16.0, 128.0)]
        # (half >= 1: a depth that never halves the main loop's rate is as good as K / (K + 1))
        res = min((minimize(lambda x: err(x[0], math.exp(max(0.0, x[1]))), [e0, math.log(h0)],
                            method="Nelder-Mead", options=dict(xatol=1e-5, fatol=1e-9)) for e0, h0 in starts),
                  key=lambda r: r.fun)
        e, half = float(res.x[0]), float(math.exp(max(0.0, res.x[1])))
    return dict(efficiency=round(e, 4), half=round(half, 1), rows=len(rows),
                rms_log_error=round(math.sqrt(err(e, half)), 4))


def fit_kernels(device: Device) -> dict[str, dict]:
    """Every precision of ``device`` whose GEMM curve comes from a kernel benchmark (its ``kernels``
    entry names the file), fitted again: {precision: fit_gemm's answer and the file}."""
    out = {}
    for precision, entry in device.kernels.items():
        rows = kernel_rows(entry["file"], entry.get("from", precision), entry.get("min_dim", KERNEL_MIN_DIM))
        out[precision] = dict(fit_gemm(device, precision, rows), file=entry["file"])
    return out


def write_kernel_fits() -> dict[str, dict]:
    """Every device file whose GEMM curves come from kernel benchmarks, fitted again and written:
    {file name: {precision: fit}}."""
    from workload.compute import device_files, read_device

    out = {}
    for path in device_files():
        device = read_device(path)
        if not device.kernels:
            continue
        fits = fit_kernels(device)
        d = json.loads(Path(path).read_text())
        for precision, fit in fits.items():
            d["gemm"][precision] = dict(efficiency=fit["efficiency"], half=fit["half"])
            d["kernels"][precision].update(rows=fit["rows"], rms_log_error=fit["rms_log_error"])
        Path(path).write_text(json.dumps(d, indent=1) + "\n")
        out[Path(path).name] = fits
    return out

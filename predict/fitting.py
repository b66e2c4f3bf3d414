"""Calibration: what the profile does not measure, fitted to runs without emulated delay.

- CPU (this machine): each system's framework overheads (``Overheads``: per step, per micro-batch or
  unit, per data-parallel sync) by non-negative least squares of the relative error between the
  simulated and the measured median step time of runs with ``--network none``.
- GPU: a device's GEMM efficiency (the share of its datasheet peak large GEMMs reach) by bisection, so
  that the simulated step of one published or measured cell equals its step time.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from workload.compute import GpuCompute, Overheads
from predict.step_time import predict
from predict.run_spec import RunSpec


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


def fit_efficiency(spec: RunSpec, compute: GpuCompute, measured: float, lo: float = 0.05, hi: float = 1.0,
                   tol: float = 1e-4) -> float:
    """The GEMM efficiency (e_max of ``compute``'s precision) at which the simulated step of ``spec``
    takes ``measured`` seconds: a device file's calibration on one cell."""
    def t(eff):
        dev = compute.device.with_gemm(compute.precision, eff)
        return predict(spec, compute.with_device(dev)).step_time

    if t(hi) > measured:
        raise ValueError(f"even at efficiency {hi:.2f} the predicted step ({t(hi):.2f} s) exceeds {measured:.2f} s")
    if t(lo) < measured:
        raise ValueError(f"even at efficiency {lo:.2f} the predicted step ({t(lo):.2f} s) is below {measured:.2f} s")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if t(mid) > measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2

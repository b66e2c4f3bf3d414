"""Ours' slicing planner with the simulator: predictions of the planner's own evaluation.

TeraPipe's formula (``ours.plan``), T = B/b sum t_i + (P - 1) max t_i plus per-step terms, leaves out
what each slice costs beyond its math (the engine's per-slice and per-layer work, the receives and
sends) and what the pipeline's ranks do to each other (two ranks on shared cores, the closing
barrier); the simulator runs ours' program with those. ``check_evaluation`` predicts every row of an
``python -m bench plan-evaluation`` result (its measured medians untouched) with both.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from predict.this_machine import CALIBRATIONS, Calibration, load_calibration, load_profile
from workload.compute import CpuCompute
from predict.step_time import predict
from predict.run_spec import RunSpec
from workload.configs import get_model_config


def ours_spec(model, pp: int, batch: int, micro: int, slices, cal: Calibration) -> RunSpec:
    return RunSpec("ours", model, batch_size=batch, micro_batch_size=micro, link=cal.link("none"), pp=pp,
                   slices=tuple(int(s) for s in slices))


def compute_for(model, cal: Calibration) -> CpuCompute:
    return cal.compute(model, load_profile(model, cal.directory, batch_slices=(1,)))


def check_evaluation(path: str | Path, cal: Calibration | None = None, directory: Path = CALIBRATIONS,
                     cores: tuple | None = None) -> dict:
    """Simulated predictions of every row of a ``python -m bench plan-evaluation`` result, raw (nothing fitted to its
    measurements), against the formula's raw predictions stored in it."""
    ev = json.loads(Path(path).read_text())
    cal = cal or load_calibration(directory)
    model = get_model_config(ev["model"]).with_overrides(n_layer=ev["n_layer"], seq_len=ev["seq_len"])
    cm = compute_for(model, cal)
    rows = []
    for r in ev["rows"]:
        if r.get("measured") is None:
            continue
        spec = ours_spec(model, ev["pp"], ev["batch_size"], ev["micro_batch_size"], r["slices"], cal)
        sim = predict(spec, cm, cores or (1.0, 2.0)).step_time
        rows.append(dict(name=r["name"], slices=len(r["slices"]), measured=r["measured"],
                         formula=r["predicted_raw"], simulated=sim,
                         error_formula=(r["predicted_raw"] - r["measured"]) / r["measured"],
                         error_simulated=(sim - r["measured"]) / r["measured"]))
    def med(k):
        return statistics.median(abs(x[k]) for x in rows) if rows else None

    return dict(evaluation=str(path), rows=rows, median_abs_error_formula=med("error_formula"),
                median_abs_error_simulated=med("error_simulated"))


def markdown(res: dict) -> str:
    lines = ["| slicing | slices | measured (ms) | formula, raw (ms) | error | simulated, raw (ms) | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        lines.append(f"| {r['name']} | {r['slices']} | {r['measured'] * 1e3:.0f} | {r['formula'] * 1e3:.0f} | "
                     f"{r['error_formula'] * 100:+.1f} % | {r['simulated'] * 1e3:.0f} | "
                     f"{r['error_simulated'] * 100:+.1f} % |")
    lines += ["", f"Median absolute error: formula {res['median_abs_error_formula'] * 100:.1f} %, simulator "
              f"{res['median_abs_error_simulated'] * 100:.1f} % (raw: nothing fitted to these measurements)."]
    return "\n".join(lines) + "\n"

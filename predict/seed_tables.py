"""The seed's GPT-3 XL tables (``/work/shared/seeds/gpt3-xl-results.md``), every cell as a scenario, and
``python -m predict validate-seed``: each cell predicted from the device file, the cells the V100's
file was calibrated on named and never scored, the cells the seed marks ``??`` shown and not scored.

The seed's workload, read from its own numbers: 24 layers, hidden 2048, 16 heads, sequence 2048, QQP
(a two-class head; "626 MB" on the first instance are 28,996 x 2048 + 2048 x 2048 fp32 embeddings over
the 400 MB of two layers); "Storage of a micro-batch: 16 MB" is a 1 x 2048 x 2048 fp32 activation, what
each GPipe stage keeps of a micro-batch under recompute. Every table ran on V100 SXM2 16 GB: GPipe
(DT-FM's, with its central PS for DP 4) on p3.2xlarge nodes (one GPU each, the emulated network
between them); PyTorch's Pipe on one p3.16xlarge (8 GPUs, NVLink); Megatron on one p3.16xlarge and
on six (25 Gbit/s between them, DP 6, batch 252). The PyTorch Pipe + Fairscale table and Megatron's
one-node fp16 table have no numbers.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from predict.scenario import Scenario, parse, predict_scenario

MODEL = dict(layers=24, hidden=2048, heads=16, seq_len=2048, vocab=28996, head="classifier:2")
GPU = "V100 SXM2 16GB"
NETWORKS = {  # the seed's labels: (one-way delay ms, Gbit/s)
    "default": (0.1, 10.0), "d1-5g": (1.0, 5.0), "d5-2g": (5.0, 2.0), "d10-1g": (10.0, 1.0), "d50-1g": (50.0, 1.0)}
P3_16XLARGE_GBPS = 25.0  # between p3.16xlarge nodes (the seed: "25 Gbps inter-node connection")
P3_16XLARGE_DELAY_MS = 0.05  # one-way, inside one AWS placement group: a datasheet-level guess, not fitted
LAYOUTS = {"T-8": (8, 1), "P-8": (1, 8), "T-4 P-2": (4, 2), "T-2 P-4": (2, 4)}  # (tp, pp)
OOM = "oom"
UNSURE = "??"

GPIPE = {"default": 15.16, "d1-5g": 15.49, "d5-2g": 16.80, "d10-1g": 22.90, "d50-1g": 29.08}
GPIPE_DP4 = {"default": 16.17, "d1-5g": 17.55, "d5-2g": 21.99, "d10-1g": 33.39}
TORCH_PIPE = {1: 17.78, 2: 18.77, 4: OOM}  # the seed: "Fail ... due to OOM"
MEGATRON_1NODE_FP32 = {
    1: {"T-8": 25.00, "P-8": 19.71, "T-4 P-2": 20.64, "T-2 P-4": 20.81},
    2: {"T-8": 24.18, "P-8": 21.52, "T-4 P-2": 26.72, "T-2 P-4": 21.46},
    4: {"T-8": 23.31, "P-8": 25.14, "T-4 P-2": 20.91, "T-2 P-4": 22.79},
    8: {"T-8": 20.90, "P-8": OOM, "T-4 P-2": 21.67, "T-2 P-4": OOM},
    16: {"T-8": OOM, "P-8": OOM, "T-4 P-2": OOM, "T-2 P-4": OOM},
}
MEGATRON_6NODE = {  # (precision, recompute) -> micro-batch -> layout -> seconds
    ("fp32", True): {
        1: {"T-8": 19.71, "P-8": 20.04, "T-4 P-2": 15.91, "T-2 P-4": 25.59},
        2: {"T-8": 20.46, "P-8": 18.90, "T-4 P-2": 17.79, "T-2 P-4": 21.34},
        3: {"T-8": 23.48, "P-8": 19.44, "T-4 P-2": 16.18, "T-2 P-4": 20.59}},
    ("fp16", True): {
        1: {"T-8": 9.19, "P-8": 7.58, "T-4 P-2": 5.25, "T-2 P-4": 10.86},
        2: {"T-8": (41.06, UNSURE), "P-8": 7.47, "T-4 P-2": 12.45, "T-2 P-4": 10.33},
        3: {"T-8": 20.68, "P-8": 6.07, "T-4 P-2": 7.33, "T-2 P-4": 8.68}},
    ("fp16", False): {
        1: {"T-8": 7.22, "P-8": 7.03, "T-4 P-2": 4.21, "T-2 P-4": 10.09},
        2: {"T-8": (18.75, UNSURE), "P-8": OOM, "T-4 P-2": 6.78, "T-2 P-4": 9.06},
        3: {"T-8": 10.18, "P-8": OOM, "T-4 P-2": 4.51, "T-2 P-4": OOM}},
}
# The cells the V100 device file is calibrated on (one per precision), by name: never scored.
CALIBRATION = {"fp32": "gpipe default", "fp16": "megatron 6-node fp16 recompute mb1 T-4 P-2"}


@dataclass(frozen=True)
class Cell:
    """One cell of the seed's tables: its name, its table, the scenario that expresses it and what the
    seed measured (seconds, ``oom``, or a time the seed itself doubts: ``??``)."""

    name: str
    table: str
    scenario: dict
    seed: float | str
    unsure: bool = False

    def load(self) -> Scenario:
        return parse(self.scenario, self.name)


def _scenario(cluster: dict, **run) -> dict:
    return dict(model=dict(MODEL), cluster=dict(gpu=GPU, **cluster), run=run)


def _cell(name: str, table: str, scenario: dict, value) -> Cell:
    if isinstance(value, tuple):
        return Cell(name, table, scenario, value[0], unsure=True)
    return Cell(name, table, scenario, value)


def cells() -> list[Cell]:
    """Every cell of the seed's tables that has a number or a failure."""
    out = []
    for net, t in GPIPE.items():
        d, g = NETWORKS[net]
        sc = _scenario(dict(nodes=12, gpus_per_node=1, inter_gbps=g, inter_delay_ms=d), system="gpipe", tp=1, pp=12,
                       dp=1, batch=64, micro_batch=1, precision="fp32", recompute=True)
        out.append(_cell(f"gpipe {net}", "GPipe P-12, 12 x p3.2xlarge", sc, t))
    for net, t in GPIPE_DP4.items():
        d, g = NETWORKS[net]
        sc = _scenario(dict(nodes=48, gpus_per_node=1, inter_gbps=g, inter_delay_ms=d), system="gpipe", tp=1, pp=12,
                       dp=4, batch=256, micro_batch=1, precision="fp32", recompute=True, dp_mode="central_ps")
        out.append(_cell(f"gpipe dp4 {net}", "GPipe P-12 + central PS D-4, 48 x p3.2xlarge", sc, t))
    for mb, t in TORCH_PIPE.items():
        sc = _scenario(dict(nodes=1, gpus_per_node=8), system="torch_pipe", tp=1, pp=8, dp=1, batch=64,
                       micro_batch=mb, precision="fp32", recompute=True)
        out.append(_cell(f"torch pipe mb{mb}", "PyTorch Pipe P-8, one p3.16xlarge", sc, t))
    for mb, row in MEGATRON_1NODE_FP32.items():
        for layout, t in row.items():
            tp, pp = LAYOUTS[layout]
            sc = _scenario(dict(nodes=1, gpus_per_node=8), system="megatron", tp=tp, pp=pp, dp=1, batch=64,
                           micro_batch=mb, precision="fp32", recompute=True)
            out.append(_cell(f"megatron 1-node fp32 recompute mb{mb} {layout}",
                             "Megatron, one p3.16xlarge, fp32 + recompute", sc, t))
    for (prec, rec), rows in MEGATRON_6NODE.items():
        label = f"{prec} {'recompute' if rec else 'no recompute'}"
        for mb, row in rows.items():
            for layout, t in row.items():
                tp, pp = LAYOUTS[layout]
                sc = _scenario(dict(nodes=6, gpus_per_node=8, inter_gbps=P3_16XLARGE_GBPS,
                                    inter_delay_ms=P3_16XLARGE_DELAY_MS),
                               system="megatron", tp=tp, pp=pp, dp=6, batch=252, micro_batch=mb, precision=prec,
                               recompute=rec)
                out.append(_cell(f"megatron 6-node {label} mb{mb} {layout}", f"Megatron, 6 x p3.16xlarge, {label}",
                                 sc, t))
    return out


def calibration_cells() -> dict[str, Cell]:
    by_name = {c.name: c for c in cells()}
    return {prec: by_name[name] for prec, name in CALIBRATION.items()}


def validate(device=None) -> dict:
    """Every cell predicted (``device``: a Device to use instead of the device file's), scored where it
    is neither a calibration cell nor one the seed doubts."""
    calibrating = set(CALIBRATION.values())
    rows = []
    for cell in cells():
        sc = cell.load()
        if device is not None:
            from dataclasses import replace

            sc = replace(sc, device=device)
        res = predict_scenario(sc)
        pred = res["step_time_s"] if res["status"] == "ok" else OOM
        row = dict(name=cell.name, table=cell.table, seed=cell.seed, predicted=pred, memory_gb=res["memory_gb"],
                   calibration=cell.name in calibrating, unsure=cell.unsure)
        if isinstance(cell.seed, float) and isinstance(pred, float):
            row["error"] = (pred - cell.seed) / cell.seed
        row["scored"] = not row["calibration"] and not cell.unsure
        rows.append(row)
    scored = [r for r in rows if r["scored"] and "error" in r]
    errors = [abs(r["error"]) for r in scored]
    oom_cells = [r for r in rows if r["seed"] == OOM]
    ok_cells = [r for r in rows if isinstance(r["seed"], float) and not r["unsure"]]
    summary = dict(
        scored=len(scored), median_error=statistics.median(errors) if errors else None,
        largest_error=max(errors) if errors else None,
        oom_cells=len(oom_cells), oom_predicted=sum(r["predicted"] == OOM for r in oom_cells),
        ok_predicted_oom=sum(r["predicted"] == OOM for r in ok_cells),
        calibration=dict(CALIBRATION))
    per_table = {}
    for table in dict.fromkeys(r["table"] for r in rows):
        e = [abs(r["error"]) for r in scored if r["table"] == table]
        per_table[table] = dict(scored=len(e), median=statistics.median(e) if e else None,
                                largest=max(e) if e else None)
    return dict(rows=rows, summary=summary, tables=per_table)


def markdown(res: dict) -> str:
    def val(v):
        return "Fail (OOM)" if v == OOM else f"{v:.2f} s"

    lines = ["| cell | seed | predicted | error | GiB |", "| --- | --- | --- | --- | --- |"]
    table = None
    for r in res["rows"]:
        if r["table"] != table:
            table = r["table"]
            t = res["tables"][table]
            stat = (f"median {t['median'] * 100:.1f} %, largest {t['largest'] * 100:.1f} % over {t['scored']}"
                    if t["scored"] else "nothing scored")
            lines.append(f"| **{table}** ({stat}) | | | | |")
        note = " (calibration)" if r["calibration"] else (" (?? in the seed: not scored)" if r["unsure"] else "")
        err = f"{r['error'] * 100:+.1f} %" if "error" in r else ("right" if r["seed"] == r["predicted"] == OOM else "-")
        if r["seed"] == OOM and r["predicted"] != OOM:
            err = "missed: predicted to fit"
        elif r["predicted"] == OOM and r["seed"] != OOM:
            err = "wrong: predicted oom"
        lines.append(f"| {r['name']}{note} | {val(r['seed'])} | {val(r['predicted'])} | {err} | {r['memory_gb']:.1f} |")
    s = res["summary"]
    lines += ["", f"Scored cells: {s['scored']} (not the calibration cells: "
              f"{', '.join(f'{k}: {v}' for k, v in s['calibration'].items())}; not the seed's ?? cells). "
              f"Median error {s['median_error'] * 100:.1f} %, largest {s['largest_error'] * 100:.1f} %. "
              f"Fail (OOM) cells predicted oom: {s['oom_predicted']} of {s['oom_cells']}; cells that ran "
              f"predicted oom: {s['ok_predicted_oom']}."]
    return "\n".join(lines) + "\n"


def calibrate(write: bool = False) -> dict:
    """The V100's GEMM efficiency per precision fitted on its one calibration cell (``CALIBRATION``),
    fp32 first; with ``write``, into the V100 SXM2 device files (16 and 32 GB: one chip). Returns
    {precision: efficiency}."""
    import json
    from dataclasses import replace

    from predict.fitting import fit_efficiency
    from predict.scenario import compute_of, spec_of
    from workload.compute import DEVICES, find_device

    device = find_device(GPU)
    fitted = {}
    for prec, cell in calibration_cells().items():
        sc = replace(cell.load(), device=device)
        eff = fit_efficiency(spec_of(sc), compute_of(sc), cell.seed)
        fitted[prec] = round(eff, 4)
        device = device.with_gemm(prec, fitted[prec])
    if write:
        for path in sorted(DEVICES.glob("v100-sxm2-*.json")):
            d = json.loads(path.read_text())
            for prec, eff in fitted.items():
                d["gemm"][prec]["efficiency"] = eff
                cell = calibration_cells()[prec]
                d["calibrated_on"][prec] = (f"the seed's {CALIBRATION[prec]} cell ({cell.seed:.2f} s, {cell.table}): "
                                            "python -m predict validate-seed --calibrate")
            path.write_text(json.dumps(d, indent=1) + "\n")
    return fitted

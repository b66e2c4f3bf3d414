"""The development set beyond the seed: Megatron-LM's published tables, every cell a scenario, and
``python -m predict validate-published``: each cell predicted from the device files, at most one
calibration cell per GPU and precision named and never scored, each GPU type's median and largest error.

The tables, with where they stand (repository@commit:path, as NVIDIA/Megatron-LM published them):

- ``NVIDIA/Megatron-LM@5281919420:README.md`` (September 2020; the numbers in ``images/tables.tex`` at
  ``50a4b5fa02^``): GPT-2 shapes 1B to 8B (vocabulary 51,200, sequence 1,024) on 1 to 8 GPUs with tensor
  parallelism only, on a DGX-2 (V100, batch 8) and a DGX-A100 (batch 16), and the same four shapes with
  128-way data parallelism on DGX-A100 nodes (batch 2,048). Iteration times in ms.
- ``NVIDIA/Megatron-LM@50a4b5fa02:images/cases_april2021.png`` (April 2021; the SC'21 paper's weak
  scaling, Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM"): GPT 1.7B to 1T (vocabulary 51,200, sequence 2,048) on 32 to 3,072 A100 80 GB (Selene:
  DGX A100 nodes, eight 200 Gbit/s HDR InfiniBand cards each). Achieved teraFLOP/s per GPU, counted as
  the paper counts them with activation recomputation: F = 96 B s l h^2 (1 + s / 6h + V / 16 l h).
- ``NVIDIA/Megatron-LM@f2e5db402c:images/model_table.png`` (July 2024; Megatron-Core on H100): GPT 1.7B to
  462B (vocabulary 131,072, sequence 4,096) on 48 to 6,144 H100 (Eos: DGX H100 nodes, eight 400 Gbit/s NDR
  InfiniBand cards each), data-parallel size 48. Per-GPU teraFLOP/s as Megatron-LM's
  ``num_floating_point_operations`` counts model FLOPs at that commit: F = 72 B s l h^2 (1 + s / 6h +
  V / 12 l h) for these models.

A published throughput becomes a step time by its own formula: t = F / (per-GPU FLOP/s x GPUs).

What the tables do not say is taken from the repository's own example scripts of the same commit, and
named so in each cell (``assumed``): ``examples/pretrain_gpt3_175B.sh@50a4b5fa02`` (micro-batch 1, fp16,
``--checkpoint-activations``, no virtual pipeline stages) for 2020-2021; ``README.md@f2e5db402c`` for 2024
(``--overlap-grad-reduce --overlap-param-gather``: the distributed optimizer; ``--tp-comm-overlap``:
sequence parallelism) with micro-batch 1, bf16 and no recomputation on the 80 GB H100. The SC'21 table
gives the model-parallel size; its tensor-parallel part is 8 up to a node (``MP <= 8``: all tensor
parallel, beyond: T-8 and P = MP / 8), as the paper's Table 1 lists it. The DGX-2's V100 SXM3 32 GB has the
V100 SXM2's peaks; its device file stands for it.
"""
from __future__ import annotations

import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from predict.scenario import Scenario, parse, predict_scenario
from runners.lifetime import die_with_parent_now

OOM = "oom"
V100, A100_40, A100_80, H100 = "V100 SXM2 32GB", "A100 SXM4 40GB", "A100 SXM4 80GB", "H100 SXM"
# Inter-node links: one card per GPU (nics_per_node = 8), each card's rate; one-way delay of an InfiniBand hop.
SELENE_GBPS = 200.0  # DGX A100: eight HDR InfiniBand cards
EOS_GBPS = 400.0  # DGX H100: eight NDR InfiniBand cards
IB_DELAY_MS = 0.002

README_2020 = "NVIDIA/Megatron-LM@5281919420:README.md (images/tables.tex at 50a4b5fa02^)"
SC21 = "NVIDIA/Megatron-LM@50a4b5fa02:images/cases_april2021.png (SC'21 weak scaling)"
MCORE_H100 = "NVIDIA/Megatron-LM@f2e5db402c:images/model_table.png (Megatron-Core on H100)"

# Sept 2020: case -> (hidden, heads, layers, tensor-parallel GPUs); iteration ms (DGX-2, batch 8),
# (DGX-A100, batch 16), and with 128-way data parallelism (DGX-A100, batch 2048)
GPT2_CASES = {"1B": (1920, 15, 24, 1), "2B": (2304, 18, 30, 2), "4B": (3072, 24, 36, 4), "8B": (4096, 32, 42, 8)}
DGX2_MS = {"1B": 1121, "2B": 1093, "4B": 1238, "8B": 1407}
DGXA100_MS = {"1B": 1076, "2B": 1026, "4B": 1162, "8B": 1343}
DGXA100_DP128_MS = {"1B": 1153, "2B": 1101, "4B": 1242, "8B": 1380}
# SC'21: name -> (hidden, heads, layers, model-parallel size, GPUs, batch, teraFLOP/s per GPU)
SC21_ROWS = {
    "1.7B": (2304, 24, 24, 1, 32, 512, 137), "3.6B": (3072, 32, 30, 2, 64, 512, 138),
    "7.5B": (4096, 32, 36, 4, 128, 512, 142), "18B": (6144, 48, 40, 8, 256, 1024, 135),
    "39B": (8192, 64, 48, 16, 512, 1536, 138), "76B": (10240, 80, 60, 32, 1024, 1792, 140),
    "145B": (12288, 96, 80, 64, 1536, 2304, 148), "310B": (16384, 128, 96, 128, 1920, 2160, 155),
    "530B": (20480, 128, 105, 280, 2520, 2520, 163), "1T": (25600, 160, 128, 512, 3072, 3072, 163),
}
# Megatron-Core on H100: name -> (heads, hidden, layers, TP, PP, DP, GPUs, batch, teraFLOP/s per GPU)
H100_ROWS = {
    "1.7B": (16, 2048, 24, 1, 1, 48, 48, 192, 408.8), "7.1B": (32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    "16B": (48, 6144, 32, 4, 1, 48, 192, 192, 489.1), "32B": (56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    "70B": (64, 8192, 84, 8, 2, 48, 768, 384, 419.7), "119B": (80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    "177B": (96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8), "314B": (128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    "462B": (144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
}
# The cells that set each stack's stalls (what a whole step adds beyond the device file's kernels: one per GPU
# and precision, by one rule chosen before any was predicted: the table's smallest run, one GPU where the table
# has one), by name: never scored.
CALIBRATION = {"V100 SXM2 fp16": "megatron-2020 DGX-2 (V100) 1B T-1", "A100 SXM fp16": "megatron-2020 DGX-A100 1B T-1",
               "H100 SXM bf16": "mcore-h100 1.7B T-1 P-1 D-48"}
STACK_2020, STACK_2024 = "megatron-2020", "mcore-2024"  # predict/stacks.json


@dataclass(frozen=True)
class Cell:
    """One published cell: its name, its table (with its provenance), the scenario that expresses it,
    the published step time (seconds, from the table's own figure) and what the table does not say."""

    name: str
    table: str
    source: str
    scenario: dict
    published: float
    figure: str
    assumed: tuple[str, ...] = field(default_factory=tuple)

    @property
    def gpu(self) -> str:
        return self.scenario["cluster"]["gpu"]

    @property
    def precision(self) -> str:
        return self.scenario["run"]["precision"]

    def load(self) -> Scenario:
        return parse(self.scenario, self.name)


def flops_sc21(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The SC'21 paper's FLOPs of one iteration with activation recomputation."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def flops_mcore(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (f2e5db402c) for a GPT without grouped-query
    attention or a gated MLP: model FLOPs, recomputation not counted."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def _model(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> dict:
    """A GPT of this shape, as a [run] table names it: the gpt3-xl entry with every field overridden."""
    return dict(model="gpt3-xl", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=seq,
                vocab_size=vocab)


def _scenario(model: dict, cluster: dict, stack: str, attention: str | None = None, **run) -> dict:
    """A cell's scenario: megatron with Adam, ``run``'s layout with the batch per pipeline (the tables give
    the global one: ``batch`` here, divided by ``dp``), on ``stack``."""
    batch = run.pop("batch")
    run = dict(system="megatron", optimizer="adam", **model, batch_size=batch // run["dp"], **run)
    out = dict(run=run, cluster=cluster, predict=dict(stack=stack))
    if attention:
        out["predict"]["attention"] = attention
    return out


def _node_cluster(gpu: str, gpus: int, per_node: int, inter_gbps: float) -> dict:
    nodes = -(-gpus // per_node)
    c = dict(gpu=gpu, nodes=nodes, gpus_per_node=min(gpus, per_node))
    if nodes > 1:
        c.update(inter_gbps=inter_gbps, inter_delay_ms=IB_DELAY_MS, nics_per_node=per_node)
    return c


def _readme_2020() -> list[Cell]:
    out = []
    assumed = ("micro-batch = batch (no pipeline)", "fp16", "full recomputation (--checkpoint-activations)",
               "Adam")
    for case, (h, heads, layers, tp) in GPT2_CASES.items():
        model = _model(layers, h, heads, 1024, 51200)
        for gpu, per_node, batch, ms, label in ((V100, 16, 8, DGX2_MS, "DGX-2 (V100)"),
                                                (A100_40, 8, 16, DGXA100_MS, "DGX-A100")):
            sc = _scenario(model, _node_cluster(gpu, tp, per_node, SELENE_GBPS), STACK_2020, tp=tp, pp=1, dp=1,
                           batch=batch,
                           micro_batch_size=batch, precision="fp16", recompute=True, attention="materialized")
            out.append(Cell(f"megatron-2020 {label} {case} T-{tp}", f"Megatron-LM 2020, {label}, batch {batch}",
                            README_2020, sc, ms[case] / 1e3, f"{ms[case]} ms", assumed))
        sc = _scenario(model, _node_cluster(A100_40, tp * 128, 8, SELENE_GBPS), STACK_2020, tp=tp, pp=1, dp=128,
                       batch=2048,
                       micro_batch_size=16, precision="fp16", recompute=True, attention="materialized")
        out.append(Cell(f"megatron-2020 DGX-A100 {case} T-{tp} D-128", "Megatron-LM 2020, DGX-A100 x 128 DP, "
                        "batch 2048", README_2020, sc, DGXA100_DP128_MS[case] / 1e3, f"{DGXA100_DP128_MS[case]} ms",
                        assumed[1:] + ("micro-batch 16 (the batch a replica holds)", "one 200 Gbit/s card per GPU")))
    return out


def _sc21() -> list[Cell]:
    out = []
    assumed = ("micro-batch 1", "fp16", "full recomputation", "1F1B without virtual stages", "Adam",
               "one 200 Gbit/s card per GPU")
    for name, (h, heads, layers, mp, gpus, batch, tflops) in SC21_ROWS.items():
        tp, pp = min(mp, 8), max(1, mp // 8)
        model = _model(layers, h, heads, 2048, 51200)
        sc = _scenario(model, _node_cluster(A100_80, gpus, 8, SELENE_GBPS), STACK_2020, tp=tp, pp=pp, dp=gpus // mp,
                       batch=batch, micro_batch_size=1, precision="fp16", recompute=True, attention="materialized")
        t = flops_sc21(batch, 2048, layers, h, 51200) / (tflops * 1e12 * gpus)
        out.append(Cell(f"megatron-sc21 {name} T-{tp} P-{pp} D-{gpus // mp}", "Megatron-LM SC'21 weak scaling, "
                        "A100 80 GB", SC21, sc, t, f"{tflops} TFLOP/s per GPU", assumed))
    return out


def _mcore_h100() -> list[Cell]:
    out = []
    assumed = ("micro-batch 1", "bf16", "no recomputation", "1F1B without virtual stages", "Adam",
               "the distributed optimizer with --overlap-grad-reduce --overlap-param-gather (the README)",
               "sequence parallelism with --tp-comm-overlap where T > 1 (the README)", "one 400 Gbit/s card per GPU")
    for name, (heads, h, layers, tp, pp, dp, gpus, batch, tflops) in H100_ROWS.items():
        model = _model(layers, h, heads, 4096, 131072)
        overlap = dict(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
        if tp > 1:
            overlap.update(sequence_parallel=True, tp_comm_overlap=True)
        sc = _scenario(model, _node_cluster(H100, gpus, 8, EOS_GBPS), STACK_2024, tp=tp, pp=pp, dp=dp, batch=batch,
                       micro_batch_size=1, precision="bf16", recompute=False, **overlap)
        t = flops_mcore(batch, 4096, layers, h, 131072) / (tflops * 1e12 * gpus)
        out.append(Cell(f"mcore-h100 {name} T-{tp} P-{pp} D-{dp}", "Megatron-Core weak scaling, H100",
                        MCORE_H100, sc, t, f"{tflops} TFLOP/s per GPU", assumed))
    return out


def cells() -> list[Cell]:
    """Every cell of the development set."""
    return _readme_2020() + _sc21() + _mcore_h100()


def _predict(cell: Cell) -> dict:
    res = predict_scenario(cell.load())
    return _row(cell, res)


def _row(cell: Cell, res: dict) -> dict:
    pred = res["step_time_s"] if res["status"] == "ok" else OOM
    row = dict(name=cell.name, table=cell.table, source=cell.source, gpu=cell.gpu, precision=cell.precision,
               published=cell.published, figure=cell.figure, predicted=pred, memory_gb=res["memory_gb"],
               parts=res.get("parts"), assumed=list(cell.assumed))
    if isinstance(pred, float):
        row["error"] = (pred - cell.published) / cell.published
    return row


def validate(calibration: dict[str, str] | None = None, jobs: int = 1, progress=None,
             select: str | None = None) -> dict:
    """Every cell predicted (``jobs`` processes), scored unless it is a calibration cell
    (``calibration``: {"GPU precision": cell name}, default ``CALIBRATION``); per GPU type the median and
    largest error of the scored cells. ``select``: only the cells whose name contains it."""
    calibration = CALIBRATION if calibration is None else calibration
    chosen = [c for c in cells() if select is None or select in c.name]
    calibrating = set(calibration.values())
    rows = []
    with ProcessPoolExecutor(max_workers=jobs, initializer=die_with_parent_now) if jobs > 1 else _Serial() as pool:
        for row in pool.map(_predict, chosen):
            row["calibration"] = row["name"] in calibrating
            row["scored"] = not row["calibration"] and "error" in row
            rows.append(row)
            if progress:
                progress(row)
    per_gpu = {}
    for gpu in dict.fromkeys(r["gpu"] for r in rows):
        e = [abs(r["error"]) for r in rows if r["gpu"] == gpu and r["scored"]]
        per_gpu[gpu] = dict(scored=len(e), median=statistics.median(e) if e else None,
                            largest=max(e) if e else None)
    per_table = {}
    for table in dict.fromkeys(r["table"] for r in rows):
        e = [abs(r["error"]) for r in rows if r["table"] == table and r["scored"]]
        per_table[table] = dict(scored=len(e), median=statistics.median(e) if e else None,
                                largest=max(e) if e else None)
    return dict(rows=rows, gpus=per_gpu, tables=per_table, calibration=dict(calibration))


def write_validated(res: dict) -> list[str]:
    """Each GPU type's scored cells of a whole run of the development set written into its device file
    (``validated``: what ``pipebench predict compare`` reports as the file's status); the files written."""
    import json
    from pathlib import Path

    from workload.compute import device_files, read_device

    written = []
    for path in device_files():
        got = res["gpus"].get(read_device(path).name)
        if not got or not got["scored"]:
            continue
        d = json.loads(Path(path).read_text())
        d["validated"] = dict(cells=got["scored"], median_error=round(got["median"], 4),
                              largest_error=round(got["largest"], 4),
                              by="pipebench predict validate-published --calibrate (Megatron-LM's published "
                                 "tables; the calibration cells not scored)")
        Path(path).write_text(json.dumps(d, indent=1) + "\n")
        written.append(Path(path).name)
    return written


class _Serial:
    """``map`` in this process (a ProcessPoolExecutor's interface for one job)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def map(fn, items):
        return map(fn, items)


def markdown(res: dict) -> str:
    """The validation as a page: per GPU type, then every cell by table."""
    from tabulate import tabulate

    def pct(v):
        return "-" if v is None else f"{v * 100:.1f} %"

    lines = ["## Per GPU type (scored cells)", ""]
    lines.append(tabulate([[g, s["scored"], pct(s["median"]), pct(s["largest"])] for g, s in res["gpus"].items()],
                          ["GPU", "scored", "median error", "largest"], tablefmt="github"))
    lines += ["", "Calibration cells (not scored): " + (", ".join(f"{k}: {v}" for k, v in res["calibration"].items())
                                                      or "none"), ""]
    for table in res["tables"]:
        rows = [r for r in res["rows"] if r["table"] == table]
        t = res["tables"][table]
        lines += [f"## {table}", "", f"{rows[0]['source']}; median {pct(t['median'])}, largest {pct(t['largest'])} "
                  f"over {t['scored']}. Assumed: {'; '.join(rows[0]['assumed'])}.", ""]
        body = []
        for r in rows:
            pred = "oom" if r["predicted"] == OOM else f"{r['predicted']:.3f} s"
            err = pct(r["error"]) if "error" in r else "-"
            note = " (calibration)" if r["calibration"] else ""
            body.append([r["name"] + note, r["figure"], f"{r['published']:.3f} s", pred,
                         err if "error" not in r else f"{r['error'] * 100:+.1f} %", f"{r['memory_gb']:.1f}"])
        lines.append(tabulate(body, ["cell", "published", "as a step", "predicted", "error", "GiB"],
                              tablefmt="github"))
        lines.append("")
    return "\n".join(lines)


def calibrate(write: bool = False) -> dict[str, float]:
    """Each stack's stall share per GPU part and precision fitted on its one calibration cell
    (``CALIBRATION``); with ``write``, into ``predict/stacks.json``. Returns {"part precision": share}."""
    from predict.stacks import fit_share, term_key, write_share

    by_name = {c.name: c for c in cells()}
    fitted = {}
    for key, name in CALIBRATION.items():
        cell = by_name[name]
        sc = cell.load()
        assert term_key(sc.device.part, sc.config.precision) == key, (key, name)

        def step(share, sc=sc):
            res = predict_scenario(sc, share)
            return res["step_time_s"] if res["status"] == "ok" else float("inf")

        fitted[key] = round(fit_share(step, cell.published), 4)
        if write:
            write_share(sc.stack, sc.device.part, sc.config.precision, fitted[key],
                        f"{name} ({cell.figure}, {cell.table})", "pipebench predict validate-published --calibrate")
    return fitted

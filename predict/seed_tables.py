"""The seed's GPT-3 XL tables (``/work/shared/seeds/gpt3-xl-results.md``), every cell as a scenario, and
``python -m predict validate-seed``: each cell predicted from the V100's device file (its kernels, from
DeepBench's published GEMMs) and the seed's stack (``predict/stacks.json`` ``seed-p3-2022``: what the
seed's steps spend beyond their kernels, a share of the math per precision, each set from one named
cell, never scored); the cells the seed marks ``??`` and the six-node fp16 T-8 columns its own numbers
contradict shown and not scored.

The seed's workload, read from its own numbers: 24 layers, hidden 2048, 16 heads, sequence 2048, QQP
(a two-class head; "626 MB" on the first instance are 28,996 x 2048 + 2048 x 2048 fp32 embeddings over
the 400 MB of two layers); "Storage of a micro-batch: 16 MB" is a 1 x 2048 x 2048 fp32 activation, what
each GPipe stage keeps of a micro-batch under recompute. Every table ran on V100 SXM2 16 GB: GPipe
(DT-FM's, with its central PS for DP 4) on p3.2xlarge nodes (one GPU each, the emulated network
between them); PyTorch's Pipe on one p3.16xlarge (8 GPUs, NVLink); Megatron on one p3.16xlarge and
on six (25 Gbit/s between them, DP 6: a global batch of 252, 42 sequences a pipeline). The PyTorch
Pipe + Fairscale table and Megatron's one-node fp16 table have no numbers.

The optimizers, as the seed's scripts ran them (DS3Lab's Decentralized_FM_alpha, spring 2022): DT-FM's
GPipe and PyTorch's Pipe plain SGD (``torch.optim.SGD(params, lr)``: no state); Megatron
``--optimizer sgd`` (apex's FusedSGD with Megatron's default momentum 0.9: one buffer) in every
six-node version of ``local_test_multi_GPU_megatron_QQP.sh``. The one-node script ran Adam until
2022-03-28 and SGD from then on, and the seed does not say which version made its one-node fp32 table:
its last fp32 one (SGD) is taken; Adam would predict the same Fail (OOM) cells.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from predict.scenario import Scenario, load, parse, predict_scenario

MODEL = dict(model="gpt3-xl", vocab_size=28996)  # GPT-3 XL's shape, QQP's (BERT's) vocabulary
HEAD = "classifier:2"  # QQP's two classes: the output layer (a scenario's [predict] head)
GPU = "V100 SXM2 16GB"
NETWORKS = {  # the seed's labels: (one-way delay ms, Gbit/s)
    "default": (0.1, 10.0), "d1-5g": (1.0, 5.0), "d5-2g": (5.0, 2.0), "d10-1g": (10.0, 1.0), "d50-1g": (50.0, 1.0)}
P3_16XLARGE_GBPS = 25.0  # between p3.16xlarge nodes (the seed: "25 Gbps inter-node connection")
P3_16XLARGE_DELAY_MS = 0.05  # one-way, inside one AWS placement group: a datasheet-level guess, not fitted
LAYOUTS = {"T-8": (8, 1), "P-8": (1, 8), "T-4 P-2": (4, 2), "T-2 P-4": (2, 4)}  # (tp, pp)
OOM = "oom"
UNSURE = "??"
STACK = "seed-p3-2022"  # predict/stacks.json: what the seed's steps add beyond their kernels
# Cells shown and not scored, and why: the six-node fp16 T-8 columns grow with the micro-batch (9.19 -> 20.68 s
# with recompute, 7.22 -> 10.18 s without), where a T-8 step (data parallel across the nodes: the same
# sequences, gradients and all-reduces at every micro-batch) cannot (``consistency_floor``); the seed marks
# their mb2 cells ?? itself.
CONTRADICTED = {(prec, rec, "T-8"): "the seed's six-node fp16 T-8 column grows with the micro-batch, which a T-8 "
                "step cannot (see the floor below)" for prec, rec in (("fp16", True), ("fp16", False))}

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
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
TERAPIPE_PAPER_SPEEDUP = 5.0  # TeraPipe (Li et al., 2021): GPT-3 175B on 48 p3.16xlarge, over GPipe
# The cells the seed's stack's stall shares are set from (one per precision), by name: never scored.
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
    contradicted: str | None = None
    """Why the seed's own numbers contradict this cell (shown, not scored), or None."""

    def load(self) -> Scenario:
        return parse(self.scenario, self.name)


OPTIMIZER = {"gpipe": "sgd", "torch_pipe": "sgd", "megatron": "sgd_momentum"}  # as the seed's scripts ran


def _scenario(cluster: dict, **run) -> dict:
    """A cell's scenario: ``run`` (batch_size per pipeline, as every run's) with the seed's workload and
    the optimizer its script ran, on V100s."""
    return dict(run=dict(MODEL, **run, optimizer=OPTIMIZER[run["system"]]), cluster=dict(gpu=GPU, **cluster),
                predict=dict(head=HEAD, stack=STACK))


def _cell(name: str, table: str, scenario: dict, value, contradicted: str | None = None) -> Cell:
    if isinstance(value, tuple):
        return Cell(name, table, scenario, value[0], unsure=True, contradicted=contradicted)
    return Cell(name, table, scenario, value, contradicted=contradicted)


def cells() -> list[Cell]:
    """Every cell of the seed's tables that has a number or a failure."""
    out = []
    for net, t in GPIPE.items():
        d, g = NETWORKS[net]
        sc = _scenario(dict(nodes=12, gpus_per_node=1, inter_gbps=g, inter_delay_ms=d), system="gpipe", tp=1, pp=12,
                       dp=1, batch_size=64, micro_batch_size=1, precision="fp32", recompute=True)
        out.append(_cell(f"gpipe {net}", "GPipe P-12, 12 x p3.2xlarge", sc, t))
    for net, t in GPIPE_DP4.items():
        d, g = NETWORKS[net]
        sc = _scenario(dict(nodes=48, gpus_per_node=1, inter_gbps=g, inter_delay_ms=d), system="gpipe", tp=1, pp=12,
                       dp=4, batch_size=64, micro_batch_size=1, precision="fp32", recompute=True,
                       dp_mode="central_ps")
        out.append(_cell(f"gpipe dp4 {net}", "GPipe P-12 + central PS D-4, 48 x p3.2xlarge", sc, t))
    for mb, t in TORCH_PIPE.items():
        sc = _scenario(dict(nodes=1, gpus_per_node=8), system="torch_pipe", tp=1, pp=8, dp=1, batch_size=64,
                       micro_batch_size=mb, precision="fp32", recompute=True)
        out.append(_cell(f"torch pipe mb{mb}", "PyTorch Pipe P-8, one p3.16xlarge", sc, t))
    for mb, row in MEGATRON_1NODE_FP32.items():
        for layout, t in row.items():
            tp, pp = LAYOUTS[layout]
            sc = _scenario(dict(nodes=1, gpus_per_node=8), system="megatron", tp=tp, pp=pp, dp=1, batch_size=64,
                           micro_batch_size=mb, precision="fp32", recompute=True)
            out.append(_cell(f"megatron 1-node fp32 recompute mb{mb} {layout}",
                             "Megatron, one p3.16xlarge, fp32 + recompute", sc, t))
    for (prec, rec), rows in MEGATRON_6NODE.items():
        label = f"{prec} {'recompute' if rec else 'no recompute'}"
        for mb, row in rows.items():
            for layout, t in row.items():
                tp, pp = LAYOUTS[layout]
                sc = _scenario(dict(nodes=6, gpus_per_node=8, inter_gbps=P3_16XLARGE_GBPS,
                                    inter_delay_ms=P3_16XLARGE_DELAY_MS),
                               system="megatron", tp=tp, pp=pp, dp=6, batch_size=42, micro_batch_size=mb,
                               precision=prec, recompute=rec)
                out.append(_cell(f"megatron 6-node {label} mb{mb} {layout}", f"Megatron, 6 x p3.16xlarge, {label}",
                                 sc, t, CONTRADICTED.get((prec, rec, layout))))
    return out


def calibration_cells(calibration: dict[str, str] | None = None) -> dict[str, Cell]:
    by_name = {c.name: c for c in cells()}
    return {prec: by_name[name] for prec, name in (calibration or CALIBRATION).items()}


def _precision(cell: Cell) -> str:
    return cell.scenario["run"]["precision"]


def _layout(cell: Cell) -> tuple[str | None, int]:
    """(layout as the seed's Megatron tables name it, or None elsewhere; micro-batch) of a cell."""
    run = cell.scenario["run"]
    names = {v: k for k, v in LAYOUTS.items()}
    return names.get((run["tp"], run["pp"])) if run["system"] == "megatron" else None, run["micro_batch_size"]


def _row(cell: Cell, shares: dict[str, float] | None = None) -> dict:
    """A cell predicted (``shares``: {precision: the stack's stall share to use instead of its file's});
    validate marks calibration and scoring."""
    sc = cell.load()
    res = predict_scenario(sc, None if shares is None else shares.get(_precision(cell)))
    pred = res["step_time_s"] if res["status"] == "ok" else OOM
    layout, micro = _layout(cell)
    row = dict(name=cell.name, table=cell.table, layout=layout, micro_batch=micro, seed=cell.seed, predicted=pred,
               memory_gb=res["memory_gb"], unsure=cell.unsure, contradicted=cell.contradicted,
               parts=res.get("parts"))
    if isinstance(cell.seed, float) and isinstance(pred, float):
        row["error"] = (pred - cell.seed) / cell.seed
    return row


def validate(shares: dict[str, float] | None = None, calibration: dict[str, str] | None = None,
             _rows: dict | None = None, headline: bool = True) -> dict:
    """Every cell predicted (``shares``: {precision: stall share} instead of the stack's), scored where it
    is neither a calibration cell (``calibration``: {precision: cell name}, default ``CALIBRATION``) nor
    one the seed doubts (``??``) or contradicts. ``_rows``: rows already predicted with these shares, by
    cell name (reused); ``headline``: TeraPipe's pair too (``terapipe``, from the device files)."""
    calibrating = set((calibration or CALIBRATION).values())
    rows = []
    for cell in cells():
        row = dict(_rows[cell.name]) if _rows and cell.name in _rows else _row(cell, shares)
        row["calibration"] = cell.name in calibrating
        row["scored"] = not row["calibration"] and not cell.unsure and not cell.contradicted
        rows.append(row)
    scored = [r for r in rows if r["scored"] and "error" in r]
    errors = [abs(r["error"]) for r in scored]
    oom_cells = [r for r in rows if r["seed"] == OOM]
    ok_cells = [r for r in rows if isinstance(r["seed"], float) and not r["unsure"] and not r["contradicted"]]
    summary = dict(
        scored=len(scored), median_error=statistics.median(errors) if errors else None,
        largest_error=max(errors) if errors else None,
        oom_cells=len(oom_cells), oom_predicted=sum(r["predicted"] == OOM for r in oom_cells),
        ok_predicted_oom=sum(r["predicted"] == OOM for r in ok_cells),
        calibration=dict(calibration or CALIBRATION))
    per_table = {}
    for table in dict.fromkeys(r["table"] for r in rows):
        e = [abs(r["error"]) for r in scored if r["table"] == table]
        per_table[table] = dict(scored=len(e), median=statistics.median(e) if e else None,
                                largest=max(e) if e else None)
    fastest = fastest_layouts(rows)
    scale = six_nodes_against_one(rows)
    summary["fastest_layout_right"] = sum(f["right"] for f in fastest.values())
    summary["fastest_layout_tables"] = len(fastest)
    floor = consistency_floor()
    summary["floor"] = max((f["floor"] for f in floor if f["scored"]), default=0.0)
    summary["floor_any_calibration"] = max((f["any_calibration"] for f in floor if f["scored"]), default=0.0)
    return dict(rows=rows, summary=summary, tables=per_table, fastest=fastest, floor=floor, scale=scale,
                terapipe=terapipe() if headline else [])


def terapipe() -> list[dict]:
    """TeraPipe's headline as the repository's scenario pairs (``predict/scenarios/terapipe-175b-*``):
    GPT-3 175B on 48 p3.16xlarge, batch 2, fp16, GPipe (ours' engine at one token slice) against ours
    with the planner's slicing, at T-8 P-48 and T-4 P-96."""
    out = []
    for layout in ("t8-p48", "t4-p96"):
        g = predict_scenario(load(SCENARIOS / f"terapipe-175b-{layout}-gpipe.toml"))
        o = predict_scenario(load(SCENARIOS / f"terapipe-175b-{layout}-ours.toml"))
        out.append(dict(layout=g["layout"].rsplit(" D-", 1)[0], gpipe_s=g["step_time_s"], ours_s=o["step_time_s"],
                        slices=o["slices"], speedup=g["step_time_s"] / o["step_time_s"]))
    return out


def six_nodes_against_one(rows: list[dict]) -> list[dict]:
    """Megatron fp32 with recompute, per layout and micro-batch both tables ran: the six-node step (42
    sequences a pipeline, DP 6 across nodes) over the one-node step (64 sequences), as the seed measured
    it and as predicted: what crossing nodes costs each layout beyond its share of the work."""
    def by_layout(table: str) -> dict[tuple, dict]:
        return {(r["layout"], r["micro_batch"]): r for r in rows if r["table"] == table}

    one = by_layout("Megatron, one p3.16xlarge, fp32 + recompute")
    six = by_layout("Megatron, 6 x p3.16xlarge, fp32 recompute")
    out = []
    for key, r6 in six.items():
        r1 = one.get(key)
        if r1 is None or not all(isinstance(v, float) for v in (r1["seed"], r6["seed"], r1["predicted"],
                                                                   r6["predicted"])):
            continue
        out.append(dict(layout=key[0], micro_batch=key[1], seed=r6["seed"] / r1["seed"],
                        predicted=r6["predicted"] / r1["predicted"]))
    return sorted(out, key=lambda r: (r["micro_batch"], list(LAYOUTS).index(r["layout"])))


def fastest_layouts(rows: list[dict]) -> dict[str, dict]:
    """Per Megatron table (8-GPU p3.16xlarge nodes): the layout of the cell the seed measured fastest and
    of the cell predicted fastest, among the cells that ran and the seed does not doubt."""
    out = {}
    for table in dict.fromkeys(r["table"] for r in rows if r["table"].startswith("Megatron")):
        ran = [r for r in rows if r["table"] == table and isinstance(r["seed"], float) and not r["unsure"]]
        fit = [r for r in ran if isinstance(r["predicted"], float)]
        if not fit:
            continue
        seed = min(ran, key=lambda r: r["seed"])
        pred = min(fit, key=lambda r: r["predicted"])
        out[table] = dict(seed=seed["layout"], seed_cell=seed["name"], seed_s=seed["seed"],
                          predicted=pred["layout"], predicted_cell=pred["name"], predicted_s=pred["predicted"],
                          right=seed["layout"] == pred["layout"])
    return out


def allowed_growth(n_seq: int, pp: int, a: int, b: int) -> float:
    """How much slower a Megatron step (non-interleaved 1F1B over ``n_seq`` sequences a pipeline, P = ``pp``)
    can get from micro-batch ``a`` to a larger ``b`` when a sequence's work, messages and all-reduces do not
    get slower in a larger micro-batch (its GEMMs only grow, its launches and messages only merge): the
    step is (n_seq / mb + P - 1) micro-batch times plus what does not depend on the micro-batch, so it
    grows at most by the bubble's share, (n_seq + (P - 1) b) / (n_seq + (P - 1) a); 1 without a pipeline."""
    return (n_seq + (pp - 1) * b) / (n_seq + (pp - 1) * a)


def consistency_floor() -> list[dict]:
    """What the seed's own numbers cost any model, whatever it is, as long as a larger micro-batch does not
    make a sequence's work slower (``allowed_growth``: at most the bubble's growth; without a pipeline,
    T-8, none at all: the one-node fp32 T-8 column, 25.00 -> 20.90 s over mb 1-8, shrinks). Where the
    seed's step grows from t_a (smaller micro-batch) to t_b > g t_a, the best a model can do is predict
    x and g x with x = 2 t_a t_b / (t_b + g t_a), off by (t_b - g t_a) / (t_b + g t_a) each; where the
    smaller cell is a calibration cell, which the model reproduces exactly, the larger is off by at least
    (t_b - g t_a) / t_b (and where the larger is, the smaller by (t_b / g - t_a) / t_a). One entry per such
    pair of Megatron cells the seed ran and does not doubt; ``scored``: whether the floor binds the scored
    cells' largest error (neither cell contradicted, and not both calibration cells); ``any_calibration``:
    the floor whichever cells calibrate (a pinned cell only raises it), (t_b - g t_a) / (t_b + g t_a)."""
    calibrating = set(CALIBRATION.values())
    by_table: dict[tuple, list[Cell]] = {}
    for c in cells():
        if c.table.startswith("Megatron") and not c.unsure and isinstance(c.seed, float):
            by_table.setdefault((c.table, _layout(c)[0]), []).append(c)
    out = []
    for (table, layout), cs in by_table.items():
        cs.sort(key=lambda c: _layout(c)[1])
        for i, a in enumerate(cs):
            for b in cs[i + 1:]:
                run = a.scenario["run"]
                g = allowed_growth(run["batch_size"], run["pp"], _layout(a)[1], _layout(b)[1])
                if b.seed <= g * a.seed:
                    continue
                pinned_a, pinned_b = a.name in calibrating, b.name in calibrating
                both = (b.seed - g * a.seed) / (b.seed + g * a.seed)
                if pinned_a:
                    floor, how = (b.seed - g * a.seed) / b.seed, "smaller pinned by calibration"
                elif pinned_b:
                    floor, how = (b.seed / g - a.seed) / a.seed, "larger pinned by calibration"
                else:
                    floor, how = both, "both predicted"
                out.append(dict(table=table, layout=layout, smaller=a.name, larger=b.name, smaller_mb=_layout(a)[1],
                                larger_mb=_layout(b)[1], smaller_s=a.seed, larger_s=b.seed, growth=g, floor=floor,
                                how=how, scored=not (a.contradicted or b.contradicted or (pinned_a and pinned_b)),
                                any_calibration=both))
    return sorted(out, key=lambda f: -f["floor"])


def sensitivity(candidates: dict[str, list[str]] | None = None, progress=None) -> list[dict]:
    """How much the validation owes to the choice of calibration cells: for each precision, every cell of
    that precision the seed ran and does not doubt (``candidates``: only these, {precision: [cell
    names]}) taken in turn as its one calibration cell (the other precision's as ``CALIBRATION``), the
    stack's stall share refitted on it and every cell predicted and scored again. One summary per
    candidate; the committed choice marked ``committed``."""
    committed = calibrate()
    all_cells = cells()
    precision = {c.name: _precision(c) for c in all_cells}
    base: dict[str, dict] = {}

    def base_rows(precisions: set) -> dict[str, dict]:
        """The committed calibration's rows of cells of ``precisions`` (predicted once, when first asked)."""
        for c in all_cells:
            if precision[c.name] in precisions and c.name not in base:
                base[c.name] = _row(c, committed)
        return {n: r for n, r in base.items() if precision[n] in precisions}

    out = []
    if candidates is None:
        candidates = {prec: [c.name for c in all_cells if precision[c.name] == prec and isinstance(c.seed, float)
                             and not c.unsure and not c.contradicted] for prec in CALIBRATION}
    for prec, names in candidates.items():
        for name in names:
            choice = {**CALIBRATION, prec: name}
            same = set(CALIBRATION) - {prec}  # the other precision keeps its fit and its cells' predictions
            try:
                fitted = calibrate(calibration=choice, known={p: committed[p] for p in same})
            except ValueError as exc:  # even no stall is slower than the cell
                out.append(dict(precision=prec, cell=name, committed=False, unfit=str(exc)))
                if progress:
                    progress(out[-1])
                continue
            res = validate(fitted, calibration=choice, _rows=base_rows(same), headline=False)
            s = res["summary"]
            mine = [abs(r["error"]) for r in res["rows"]
                    if r["scored"] and "error" in r and precision[r["name"]] == prec]
            out.append(dict(precision=prec, cell=name, share=fitted[prec], committed=name == CALIBRATION[prec],
                            median=s["median_error"], largest=s["largest_error"],
                            precision_median=statistics.median(mine) if mine else None,
                            oom_predicted=s["oom_predicted"], oom_cells=s["oom_cells"],
                            ok_predicted_oom=s["ok_predicted_oom"], fastest_layout_right=s["fastest_layout_right"],
                            fastest_layout_tables=s["fastest_layout_tables"]))
            if progress:
                progress(out[-1])
    return out


def sensitivity_markdown(rows: list[dict]) -> str:
    lines = ["# The seed validation's calibration cells, each in turn",
             "",
             "`python -m predict validate-seed --sensitivity [--out DIR]`: for each precision, every "
             "cell of that precision the seed ran (not its `??` or contradicted cells) as the one calibration cell, "
             "the other precision's as committed; the seed's stack's stall share refitted on it, every other cell "
             "predicted and scored. The committed choice in bold.",
             "",
             "| precision | calibration cell | stall share | median | largest | median of the precision's cells | "
             "OOM right | fastest layout right |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cell = f"**{r['cell']}**" if r["committed"] else r["cell"]
        if "unfit" in r:
            lines.append(f"| {r['precision']} | {cell} | - | cannot calibrate: {r['unfit']} | | | | |")
            continue
        lines.append(f"| {r['precision']} | {cell} | {r['share']:.3f} | {r['median'] * 100:.1f} % | "
                     f"{r['largest'] * 100:.1f} % | {r['precision_median'] * 100:.1f} % | "
                     f"{r['oom_predicted']} of {r['oom_cells']} ({r['ok_predicted_oom']} wrong) | "
                     f"{r['fastest_layout_right']} of {r['fastest_layout_tables']} |")
    for prec in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == prec and "unfit" not in r]
        unfit = sum(r["precision"] == prec and "unfit" in r for r in rows)
        if not mine:
            continue
        med = [r["median"] for r in mine]
        lines += ["", f"{prec}: over its {len(mine)} candidate cells that calibrate"
                  f"{f' ({unfit} do not)' if unfit else ''} the median error runs "
                  f"{min(med) * 100:.1f}-{max(med) * 100:.1f} % (median of them {statistics.median(med) * 100:.1f} %), "
                  f"the largest never below {min(r['largest'] for r in mine) * 100:.1f} %."]
    return "\n".join(lines) + "\n"


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
        note = (" (calibration)" if r["calibration"] else " (?? in the seed: not scored)" if r["unsure"] else
                " (contradicted by the seed's own column: not scored)" if r["contradicted"] else "")
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
    if res.get("terapipe"):
        lines += ["", "## TeraPipe's headline: GPT-3 175B on 48 p3.16xlarge, batch 2, fp16", "",
                  "`python -m predict scenario predict/scenarios/terapipe-175b-{t8-p48,t4-p96}-{gpipe,ours}.toml`. "
                  f"The paper measured {TERAPIPE_PAPER_SPEEDUP:.1f}x.", "",
                  "| layout | GPipe (ours' engine, one slice) | ours, planned slicing | speedup |",
                  "| --- | --- | --- | --- |"]
        for t in res["terapipe"]:
            sl = t["slices"]
            how = (f"K={len(sl)} slices of {sl[0]} tokens" if len(set(sl)) == 1
                   else f"K={len(sl)}: {', '.join(map(str, sl))} tokens")
            lines.append(f"| {t['layout']} | {t['gpipe_s']:.2f} s | {t['ours_s']:.2f} s ({how}) | "
                         f"**{t['speedup']:.2f}x** |")
    if res.get("fastest"):
        lines += ["", "## The fastest layout of each 8-GPU-node table", "",
                  "| table | the seed's fastest | predicted fastest | |", "| --- | --- | --- | --- |"]
        for table, f in res["fastest"].items():
            lines.append(f"| {table} | {f['seed']} ({f['seed_cell']}, {f['seed_s']:.2f} s) | {f['predicted']} "
                         f"({f['predicted_cell']}, {f['predicted_s']:.2f} s) | {'right' if f['right'] else 'wrong'} |")
    if res.get("scale"):
        lines += ["", "## Six nodes against one (Megatron, fp32, recompute)", "",
                  "The six-node step over the one-node step of the same layout and micro-batch (42 sequences a "
                  "pipeline against 64, DP 6 across the nodes' 25 Gbit/s):", "",
                  "| micro-batch | layout | seed | predicted |", "| --- | --- | --- | --- |"]
        for r in res["scale"]:
            lines.append(f"| {r['micro_batch']} | {r['layout']} | {r['seed']:.2f} | {r['predicted']:.2f} |")
    if res.get("floor"):
        lines += ["", "## What the seed's own numbers cost any model", "",
                  "A larger micro-batch does not make a sequence's work slower (its GEMMs only grow, its launches "
                  "and messages only merge; the gradients and all-reduces are the same), so a Megatron step grows "
                  "from micro-batch a to b at most by its bubble's share, g = (N + (P - 1) b) / (N + (P - 1) a) "
                  "over N sequences a pipeline (1 without a pipeline). Where the seed's step grows more, no model "
                  "of that kind scores both cells within (t_b - g t_a) / (t_b + g t_a); where one of them is a "
                  "calibration cell, which the model reproduces exactly, the other is off by at least "
                  "(t_b - g t_a) / t_b (`predict.seed_tables.consistency_floor`):", "",
                  "| table | layout | smaller micro-batch | larger | g | floor | |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for f in res["floor"]:
            note = f["how"] + ("" if f["scored"] else "; contradicted cells, not scored")
            lines.append(f"| {f['table']} | {f['layout']} | mb{f['smaller_mb']} {f['smaller_s']:.2f} s | "
                         f"mb{f['larger_mb']} {f['larger_s']:.2f} s | {f['growth']:.3f} | {f['floor'] * 100:.1f} % | "
                         f"{note} |")
        lines += ["", "So no such model, calibrated on these cells, scores every scored cell within "
                  f"{s['floor'] * 100:.1f} %, and whichever cells calibrate it, within "
                  f"{s['floor_any_calibration'] * 100:.1f} %."]
    return "\n".join(lines) + "\n"


def calibrate(write: bool = False, calibration: dict[str, str] | None = None,
              known: dict[str, float] | None = None) -> dict:
    """The seed's stack's stall share per precision (``predict/stacks.json``: what the seed's steps spend
    beyond their kernels, as a share of the modelled math) fitted on its one calibration cell
    (``calibration``, default ``CALIBRATION``; ``known``: precisions already fitted, taken as given); with
    ``write``, into the stack. Returns {precision: share}."""
    from predict.stacks import fit_share, write_share

    fitted = {}
    for prec, cell in calibration_cells(calibration).items():
        if known and prec in known:
            fitted[prec] = known[prec]
            continue
        sc = cell.load()

        def step(share, sc=sc):
            res = predict_scenario(sc, share)
            return res["step_time_s"] if res["status"] == "ok" else float("inf")

        fitted[prec] = round(fit_share(step, cell.seed), 4)
    if write:
        part = cells()[0].load().device.part
        for prec, share in fitted.items():
            cell = calibration_cells(calibration)[prec]
            write_share(STACK, part, prec, share, f"{cell.name} ({cell.seed:.2f} s, {cell.table})",
                        "pipebench predict validate-seed --calibrate")
    return fitted

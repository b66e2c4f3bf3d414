"""``pipebench predict compare FILE.toml``: the question a researcher brings. Given a model and a cluster,
every system, layout (T x P x D over the cluster's GPUs), schedule, micro-batch size and recompute choice
that the system runs and that fits the GPUs' memory, predicted and ranked by step time.

The file is a scenario (``predict.scenario``) whose ``[run]`` may be partial, and a ``[compare]`` table:

    [run]
    model = "gpt3-xl"           # required: the model (and any of its fields, as a run's table overrides them)
    precision = "bf16"          # optional: every [run] key given is kept in every candidate
    [cluster]
    gpu = "H100 SXM"
    nodes = 2
    gpus_per_node = 8
    inter_gbps = 400
    [compare]
    global_batch = 64           # required: sequences a step, over all data-parallel replicas
    systems = ["megatron", "ours"]   # optional (default: every system the simulator models but the
                                # seed's own GPipe)
    micro_batch_sizes = [1, 2, 4]    # optional (default: 1, 2, 4, 8 where they divide a replica's batch)

What a candidate is: a system, its schedules the simulator has a program for (``run_spec.MODELLED``; one
where P = 1), every T x P x D with T x P x D = the cluster's GPUs, T at most a node and dividing the heads,
P dividing the layers (the system's own dimensions only), each micro-batch size dividing the replica's
batch; without recomputation, and with it where that alone does not fit. Each is judged as the run
command judges a request (a layout the system refuses is not a candidate) and by the memory model before
it is simulated. A candidate only the simulator runs (megatron's zero-bubble schedules, published but not
in megatron-core 0.16.1) is ranked with the others, marked ``*`` (``runnable`` false in ``--json``). The
answer names, per GPU type, whether its device file is measured, fitted to kernel benchmarks, validated on
published cells (``validated`` in the file) or a datasheet prior.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from predict.scenario import ScenarioError, parse, predict_scenario
from workload.compute import read_data
from runners.lifetime import die_with_parent_now

MICRO_BATCHES = (1, 2, 4, 8)
LEFT_OUT = ("reference", "diloco", "gpipe")  # one process; another algorithm; the seed's DT-FM GPipe only


@dataclass(frozen=True)
class Candidate:
    system: str
    schedule: str | None
    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: bool

    @property
    def layout(self) -> str:
        return f"T-{self.tp} P-{self.pp} D-{self.dp}"

    def run(self, base: dict, global_batch: int) -> dict:
        run = dict(base, system=self.system, tp=self.tp, pp=self.pp, dp=self.dp,
                   batch_size=global_batch // self.dp, micro_batch_size=self.micro_batch, recompute=self.recompute)
        if self.schedule is not None:
            run["schedule"] = self.schedule
        return run


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _read(path: str | Path) -> tuple[dict, dict]:
    """(the scenario part, the [compare] table) of a compare file; ScenarioError (one line) if malformed."""
    data = read_data(Path(path), "compare file", ScenarioError, tomllib.loads)
    cmp = data.pop("compare", None)
    if not isinstance(cmp, dict) or "global_batch" not in cmp:
        raise ScenarioError("[compare] global_batch is missing (sequences a step over every replica)")
    unknown = sorted(set(cmp) - {"global_batch", "systems", "micro_batch_sizes"})
    if unknown:
        raise ScenarioError(f"[compare] unknown key {unknown[0]} (known: global_batch, systems, micro_batch_sizes)")
    gb = cmp["global_batch"]
    if isinstance(gb, bool) or not isinstance(gb, int) or gb < 1:
        raise ScenarioError(f"[compare] global_batch must be a whole number >= 1, got {gb!r}")
    mbs = cmp.get("micro_batch_sizes", list(MICRO_BATCHES))
    if not isinstance(mbs, list) or not mbs or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                                                    for m in mbs):
        raise ScenarioError(f"[compare] micro_batch_sizes must be a list of whole numbers >= 1, got {mbs!r}")
    systems = cmp.get("systems", [])
    if not isinstance(systems, list) or any(not isinstance(x, str) for x in systems):
        raise ScenarioError(f"[compare] systems must be a list of system names, e.g. [\"ours\"], got {systems!r}")
    if "run" not in data or "model" not in data.get("run", {}):
        raise ScenarioError("[run] model is missing (the model to compare the systems on)")
    for key in ("system", "tp", "pp", "dp", "batch_size", "micro_batch_size", "recompute", "schedule"):
        if key in data["run"]:
            raise ScenarioError(f"[run] {key}: compare chooses it (leave it out)")
    return data, dict(cmp, micro_batch_sizes=sorted(set(mbs)))


def _probe(data: dict):
    """The compare file's model, cluster and device, read as a scenario of one reference rank."""
    return parse(dict(data, run=dict(data["run"], system="reference", batch_size=1, micro_batch_size=1)), "probe")


def candidates(data: dict, cmp: dict) -> list[Candidate]:
    """Every candidate of a compare file (see the module docstring), not yet judged."""
    from predict.run_spec import MODELLED
    from predict.systems import prediction_systems

    probe = _probe(data)
    model, cluster = probe.model, probe.cluster
    gpus, gb = cluster.gpus, cmp["global_batch"]
    specs = prediction_systems()
    wanted = cmp.get("systems") or [s for s in specs if s in MODELLED and s not in LEFT_OUT]
    unknown = [s for s in wanted if s not in specs or s not in MODELLED]
    if unknown:
        raise ScenarioError(f"[compare] systems: {unknown[0]!r} is not a system the simulator models (known: "
                            f"{', '.join(s for s in specs if s in MODELLED)})")
    out = []
    for system in wanted:
        dims = specs[system].dims
        for tp in _divisors(gpus):
            if tp > 1 and ("tp" not in dims or tp > cluster.gpus_per_node or model.n_head % tp):
                continue
            for pp in _divisors(gpus // tp):
                if pp > 1 and ("pp" not in dims or model.n_layer % pp):
                    continue
                dp = gpus // (tp * pp)
                if (dp > 1 and "dp" not in dims) or gb % dp:
                    continue
                schedules = MODELLED[system] if pp > 1 else MODELLED[system][:1]
                if "schedule" not in {f.name for f in dataclasses.fields(specs[system].options)}:
                    schedules = (None,)  # one the system has no option for (fairscale: GPipe only)
                for schedule in schedules:
                    for mb in cmp["micro_batch_sizes"]:
                        if (gb // dp) % mb == 0:
                            out.append(Candidate(system, schedule, tp, pp, dp, mb, False))
    return out


def _evaluate(args: tuple[dict, dict, Candidate]) -> dict:
    """One candidate judged, its memory checked (recomputation where it alone does not fit) and predicted:
    a row, or None where the system refuses it."""
    data, cmp, cand = args
    from dataclasses import replace

    from predict.scenario import memory_of
    from predict.systems import runnable
    from workload.flops import GPU_PEAK_TFLOPS, flops_per_token

    def load(c: Candidate):
        return parse(dict(data, run=c.run(data["run"], cmp["global_batch"])), "compare")

    try:  # judged as the run command judges it, then by what the simulator models
        sc = load(cand)
        if memory_of(sc).total > sc.device.usable_bytes():
            cand = replace(cand, recompute=True)
            sc = load(cand)
        res = predict_scenario(sc)
    except ScenarioError as exc:
        return dict(candidate=cand, refused=str(exc))
    row = dict(candidate=cand, status=res["status"], memory_gb=res["memory_gb"], step_time_s=res["step_time_s"],
               usable_gb=res["usable_gb"], runnable=runnable(cand.system, cand.schedule))
    if res["status"] == "ok":
        tokens = cmp["global_batch"] * sc.model.seq_len
        peaks = GPU_PEAK_TFLOPS[sc.device.part]  # MFU against the datasheet's peak, as the report's
        peak = (peaks.get(sc.config.precision) or peaks["fp32"]) * 1e12 * sc.cluster.gpus
        row["mfu"] = tokens * flops_per_token(sc.model) / res["step_time_s"] / peak
        parts = {k: v for k, v in res["parts"].items() if k != "optimizer"}
        row["largest_part"] = max(parts, key=parts.get)
        if "n_slices" in res:
            row["n_slices"] = res["n_slices"]
    return row


def device_status(device) -> str:
    """What a prediction on ``device`` stands on: measured, validated on published cells, kernels fitted
    to benchmarks, or a datasheet prior."""
    if device.measured:
        return "measured (scripts/gpu_profile.sh)"
    v = getattr(device, "validated", None) or {}
    if v.get("cells"):
        return (f"validated on {v['cells']} published cells (median error {v['median_error'] * 100:.0f} %; "
                f"{v['by']})")
    if device.kernels:
        return "kernels from published benchmarks, not validated on a published step"
    return "datasheet prior (no kernels measured, no published step validated)"


def compare(path: str | Path, jobs: int | None = None, progress: bool = True) -> dict:
    """Every candidate of the compare file at ``path`` predicted (``jobs`` processes), ranked: rows that run
    (fastest first), then those that do not fit; with the device's status and the counts refused."""
    data, cmp = _read(path)
    cands = candidates(data, cmp)
    jobs = max(1, jobs or min(len(cands), os.cpu_count() or 1))
    # the widest data parallelism first (the longest to simulate), one candidate at a time: the workers end together
    work = [(data, cmp, c) for c in sorted(cands, key=lambda c: (-c.dp, c.system == "ours"), reverse=False)]
    rows = []
    bar = None
    if progress:
        import sys

        from tqdm import tqdm
        bar = tqdm(total=len(work), desc="predict compare", unit="run", file=sys.stderr, dynamic_ncols=True)
    with ProcessPoolExecutor(max_workers=jobs, initializer=die_with_parent_now) as pool:  # none outlives us
        for row in pool.map(_evaluate, work):
            rows.append(row)
            if bar:
                bar.update()
    if bar:
        bar.close()
    refused: dict[str, dict[str, int]] = {}  # system -> why -> candidates refused for it
    for r in rows:
        if "refused" in r:
            why = refused.setdefault(r["candidate"].system, {})
            why[r["refused"]] = why.get(r["refused"], 0) + 1
    ok = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["step_time_s"])
    oom = sorted((r for r in rows if r.get("status") == "oom"), key=lambda r: r["memory_gb"])
    probe = _probe(data)
    return dict(model=probe.model.name, gpu=probe.device.name, gpus=probe.cluster.gpus,
                global_batch=cmp["global_batch"], precision=probe.config.precision,
                device_status=device_status(probe.device), ranked=ok, oom=oom,
                refused=sum(n for why in refused.values() for n in why.values()), refused_why=refused,
                candidates=len(cands))


def _label(c: Candidate) -> str:
    return c.system + (f" {c.schedule}" if c.schedule and c.pp > 1 else "")


PREDICTED_ONLY = "*"  # the label's mark of a candidate only the simulator runs


def _note_predicted_only(rows: list[dict]) -> str:
    marked = sorted({_label(r["candidate"]) for r in rows if not r.get("runnable", True)})
    return (f"{PREDICTED_ONLY} predicted only: {', '.join(marked)} (published, not in this repository's build: "
            "pipebench run refuses them)\n" if marked else "")


def table(res: dict, top: int | None = None) -> str:
    """The ranked table for people."""
    from tabulate import tabulate

    body = []
    for i, r in enumerate(res["ranked"][:top], 1):
        c = r["candidate"]
        k = f", K={r['n_slices']}" if r.get("n_slices", 1) > 1 else ""
        mark = "" if r.get("runnable", True) else f" {PREDICTED_ONLY}"
        body.append([i, _label(c) + k + mark, c.layout, c.micro_batch, "yes" if c.recompute else "no",
                     f"{r['step_time_s']:.3f}", f"{r['mfu'] * 100:.1f} %", f"{r['memory_gb']:.1f}",
                     r["largest_part"].replace("_", " ")])
    head = (f"{res['model']} on {res['gpus']} x {res['gpu']} ({res['precision']}), global batch {res['global_batch']}: "
            f"{len(res['ranked'])} of {res['candidates']} candidates run, {len(res['oom'])} do not fit, "
            f"{res['refused']} refused by their system.\n{res['gpu']}: {res['device_status']}.\n")
    if not res["candidates"]:
        head += ("No candidate: no micro-batch size of [compare] divides a replica's batch on any layout the "
                 "systems can take on this cluster.\n")
    if not res["ranked"] and res["oom"]:
        least = res["oom"][0]  # the smallest first
        c = least["candidate"]
        head += (f"None fits: the least memory a GPU, {least['memory_gb']:.1f} GiB of {least['usable_gb']:.1f} usable, "
                 f"is {_label(c)} {c.layout} mb {c.micro_batch}{' with recompute' if c.recompute else ''} "
                 "(it needs more GPUs or GPUs with more memory).\n")
    for system, why in res.get("refused_why", {}).items():  # the most frequent reason of each system first
        (first, n), more = max(why.items(), key=lambda kv: kv[1]), sum(why.values())
        head += (f"{system}: {more} refused, {n} of them: {first}"
                 + (f" (and {more - n} for {len(why) - 1} other reason{'s' if len(why) > 2 else ''}: --json)"
                    if more > n else "") + "\n")
    return head + "\n" + tabulate(body, ["#", "system", "layout", "mb", "recompute", "step s", "MFU", "GiB/GPU",
                                         "largest part"], tablefmt="github") + "\n" + _note_predicted_only(
        res["ranked"][:top])


def as_json(res: dict, top: int | None = None) -> dict:
    """The comparison as plain JSON (candidates as their fields); ``top``: only the N fastest ranked."""
    from dataclasses import asdict

    def plain(r):
        return {**{k: v for k, v in r.items() if k != "candidate"}, **asdict(r["candidate"])}

    return dict({k: v for k, v in res.items() if k not in ("ranked", "oom")},
                ranked=[plain(r) for r in res["ranked"][:top]], oom=[plain(r) for r in res["oom"]])


"""This machine: profiles, calibration from runs without emulated delay, the validation on recorded
runs (predicted against measured), and the predictions the report shows.

    calibrate_here(): profile each model shape, run the calibration set with ``--network none`` and
        fit every system's overheads; kept per host and per code version (``calibration_dir``) beside
        this code, in ``predict/calibration/`` (``CALIBRATIONS``), with a probe of the host's speed while
        it was made;
    validate_records(): every ok CPU run of records files (the main job's: sweeps/local.toml) predicted
        against its measured median over repetitions, grouped into cases (``case_of``: system, layout,
        sequence); a case is modelled where its median error is <= 10 % and each error within 20 %;
    predict_records(): the predictions the report shows beside a records file: only with this host's
        and code version's calibration, only while the host's speed is within ``SPEED_BOUND`` of it
        (else one line, no prediction, and an earlier file of predictions kept), and only for modelled
        cases; every other run "not modelled";
    at_host_speed(): a one-run prediction here at the host's speed now (stretched, with a warning, where
        it moved from its calibration's).

Runs go through ``python -m runners.run`` (a subprocess, an argument list), each appending its record
to a JSON-lines file; the record's median step time is the measurement. The host is shared: while a
run measures its steps, the other runnable threads on the host are counted (``predict.host_load``)
and the simulation can share the two cores with them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from contract import ConfigError, RunConfig
from contract.records import layout_words, predictions_path, read_records
from predict.fitting import fit_overheads
from workload.compute import CpuCompute, Overheads
from predict.from_config import (NotModelled, check_faults_modelled, config_of_record, single_link, spec_from_config,
                                 spec_from_record)
from predict.step_time import predict
from contract.links import Link
from predict.run_spec import Prediction
from contract.registry import read_options
from workload.configs import ModelConfig, get_model_config
from workload.flops import cpu_name

REPO = Path(__file__).resolve().parents[1]
CALIBRATIONS = Path(__file__).resolve().parent / "calibration"  # what the simulator reads: calibrations, validation
# The code a calibration is of: what the ranks run and what the simulator makes of it. Any change to
# these files is another code version, whose runs the calibration has not seen.
CODE = ("workload", "contract", "baselines", "ours", "runners/worker.py", "runners/launcher.py",
        *(f"predict/{m}.py" for m in ("simulator", "programs", "placement", "collectives", "step_time", "fitting",
                                      "run_spec", "from_config", "gloo_stall", "host_load")))
SPEED_BOUND = 0.10  # the host's speed may drift this far from its calibration's before predictions are refused
MODELLED_MEDIAN, MODELLED_MAX = 0.10, 0.20  # a case is modelled where its validation errors stay within these


def host_name() -> str:
    """This host as a calibration names it: its host name, CPU model and cores."""
    return f"{platform.node()}, {cpu_name()}, {os.cpu_count()} cores"


def code_version(root: Path = REPO) -> str:
    """The code version a calibration is of: the first 12 hex digits of a hash of ``CODE``'s sources."""
    from runners.reference_cache import source_digest

    return source_digest(root, CODE)[:12]


def calibration_dir(directory: Path = CALIBRATIONS) -> Path:
    """Where this host's calibration of this code version is kept: ``<directory>/<host>-<code>/``."""
    host = re.sub(r"[^A-Za-z0-9.]+", "-", f"{platform.node()}-{os.cpu_count()}c").strip("-")
    return directory / f"{host}-{code_version()}"


def latest_calibration(directory: Path = CALIBRATIONS) -> Path | None:
    """The newest calibration kept in ``directory`` (of any host and code version), or None."""
    kept = [(json.loads(p.read_text()).get("identity", {}).get("when", ""), p.parent)
            for p in directory.glob("*/calibration.json")]
    return max(kept)[1] if kept else None


SPEED_TRIALS = 12  # the probe's trials: one trial alone reads 10-25 % low in a slow second of this host
SPEED_PROBE = f"workload.cpu_peak: cpu-small ops at 256 tokens, 1 thread, best of {SPEED_TRIALS} trials within 3 s"


def speed_probe() -> float:
    """The host's speed now, quickly (1-3 s): one thread's best model-FLOP rate on the host's operations
    (``workload.cpu_peak.host_ops``: cpu-small's at 256 tokens), in TFLOP/s, the best of
    ``SPEED_TRIALS`` trials."""
    from workload.cpu_peak import best_times, host_ops, model_peak

    ops = host_ops()
    return model_peak(ops, best_times(ops, trials=SPEED_TRIALS, budget_s=3.0))


def overheads_for(overhead: dict, model_overhead: dict, m: ModelConfig) -> dict:
    """Every system's overheads for model ``m``: those fitted to its runs of ``m``'s width where there are
    such (``model_overhead``: {model_key: {system: {field: value}}}), else those of all its runs."""
    own = model_overhead.get(model_key(m), {})
    return {k: dataclasses.replace(o, **own.get(k, {})) for k, o in overhead.items()}


def keep_speed(path: Path, speed: float, label: str = "") -> None:
    """Append a speed probe (TFLOP/s) to ``path``, a JSON line with when it was taken (epoch seconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"when": time.time(), "speed_tflops": speed, "label": label}) + "\n")


SPEED_SPAN_S = 3600.0  # a sweep's probe counts for records made within this long of it


def speeds_during(records_file: Path, records: list[dict]) -> list[float]:
    """The host's speed probes its sweep took between its experiments (``runners.sweep.execute.
    speed_probes_path``), those within ``SPEED_SPAN_S`` of the records' own times (a probe of an earlier
    sweep into a file since made again is not theirs); [] where there are none."""
    import datetime

    from runners.sweep.execute import speed_probes_path

    path = speed_probes_path(records_file)
    times = [datetime.datetime.fromisoformat(r["timestamp"]).timestamp() for r in records if r.get("timestamp")]
    if not path.is_file() or not times:
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            p = json.loads(line)
            if min(times) - SPEED_SPAN_S <= p["when"] <= max(times) + SPEED_SPAN_S and p["speed_tflops"] > 0:
                out.append(float(p["speed_tflops"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def speed_moved(cal: "Calibration", now: float | None = None) -> str | None:
    """Why ``cal`` no longer holds for this host (its speed probe now differs from the one taken while
    calibrating by more than ``SPEED_BOUND``), or None."""
    then = (cal.identity or {}).get("speed_tflops")
    if not then:
        return f"the calibration {cal.name} has no speed probe to compare with"
    now = speed_probe() if now is None else now
    if abs(now / then - 1) > SPEED_BOUND:
        return (f"this host runs at {now / then:.2f}x the speed of its {cal.name} (speed probe "
                f"{now * 1e3:.1f} against {then * 1e3:.1f} GFLOP/s; bound ±{SPEED_BOUND:.0%}): "
                "python -m predict calibrate")
    return None


def at_host_speed(cm: CpuCompute, cal: "Calibration", log=print):
    """``cm`` (``cal``'s compute model) at this host's speed now: where the speed probe (``speed_probe``)
    has moved beyond ``SPEED_BOUND`` from the calibration's, its math and its overheads' seconds
    stretched by the calibration's speed over today's, said in one line (``log``); else ``cm``."""
    then = (cal.identity or {}).get("speed_tflops")
    if not then:
        log(f"warning: {speed_moved(cal)}: predicted at its speed, whatever this host's now")
        return cm
    now = speed_probe()
    why = speed_moved(cal, now)
    if why is None:
        return cm
    from workload.compute import Scaled

    stretch = then / now
    overhead = {k: dataclasses.replace(o, step=o.step * stretch, unit=o.unit * stretch,
                                       unit_layer=o.unit_layer * stretch, dp=o.dp * stretch)
                for k, o in cm.overhead.items()}
    log(f"warning: {why.removesuffix(': python -m predict calibrate')}; predicted with its compute and overheads "
        f"stretched {stretch:.2f}x (python -m predict calibrate: a calibration at this speed)")
    return Scaled(CpuCompute(cm.profile, overhead), stretch)


@dataclass(frozen=True)
class LocalRun:
    """One run of the run command on this machine (fp32, no recompute)."""

    system: str
    model: str
    network: str = "none"
    pp: int = 2
    dp: int = 1
    tp: int = 1
    batch: int = 2
    micro: int = 1
    seq: int = 128
    n_slices: int = 1
    dp_mode: str = "allreduce"
    schedule: str = "gpipe"  # torch_pipe's, or ours' order of units (its calibration and validation ran gpipe)

    @property
    def name(self) -> str:
        what = self.system if self.system != "torch_pipe" else f"torch_pipe {self.schedule}"
        if self.system == "ours":
            what += f" K={self.n_slices}" + (f" {self.dp_mode}" if self.dp > 1 else "")
        layout = layout_words(dict(tp=self.tp, pp=self.pp, dp=self.dp))
        return f"{what} {self.model} s{self.seq} {layout} B={self.batch} b={self.micro}"

    def argv(self, out: Path, steps: int, warmup: int) -> list[str]:
        a = [sys.executable, "-m", "runners.run", "--system", self.system, "--model", self.model,
             "--seq-length", str(self.seq), "--pp", str(self.pp), "--tp", str(self.tp), "--dp", str(self.dp),
             "--batch-size",
             str(self.batch), "--micro-batch-size", str(self.micro), "--steps", str(steps), "--warmup", str(warmup),
             "--network", self.network, "--out", str(out), "--timeout", "600"]
        if self.system == "ours":
            a += ["--n-slices", str(self.n_slices), "--dp-mode", self.dp_mode]
        return a + ["--schedule", self.schedule]

    def shape(self) -> ModelConfig:
        return get_model_config(self.model).with_overrides(seq_len=self.seq)


# Runs without emulated delay whose step times fix the overheads (two per system that differ in the
# number of micro-batches or slices, so that per-step and per-unit costs separate).
CALIBRATION_RUNS = (
    LocalRun("torch_pipe", "tiny", batch=2),
    LocalRun("torch_pipe", "tiny", batch=4),
    LocalRun("ours", "tiny", n_slices=1),
    LocalRun("ours", "tiny", n_slices=4),
    LocalRun("ours", "tiny", dp=2, n_slices=4, dp_mode="central_ps"),
    # the main job's two sequences (sweeps/local.toml) and its batches, ours in its default order of
    # units (1f1b) with the slices its auto kept there (K=1-2 at 256 tokens, 4-8 at 1024)
    LocalRun("torch_pipe", "cpu-small", seq=256, batch=2),
    LocalRun("ours", "cpu-small", seq=256, batch=2, n_slices=2, schedule="1f1b"),
    LocalRun("torch_pipe", "cpu-small", seq=1024, batch=1),
    LocalRun("ours", "cpu-small", seq=1024, batch=2, n_slices=4, schedule="1f1b"),
    # four ranks on the two cores (P-2 D-2): what the host loses switching between them (``crowded``)
    LocalRun("ours", "cpu-small", seq=256, batch=2, dp=2, n_slices=2, dp_mode="allreduce", schedule="1f1b"),
    # tensor parallelism (the main job's T-2): what a tensor-parallel rank's math costs beyond half the
    # profiled math (``Overheads.tp``), at two amounts of math per step (Megatron's per-step cost too)
    LocalRun("megatron", "cpu-small", pp=1, tp=2, seq=256, batch=2, schedule="1f1b"),
    LocalRun("megatron", "cpu-small", pp=1, tp=2, seq=1024, batch=1, schedule="1f1b"),
    LocalRun("ours", "cpu-small", pp=1, tp=2, seq=256, batch=2, schedule="1f1b"),
    LocalRun("ours", "cpu-small", pp=1, tp=2, seq=1024, batch=1, schedule="1f1b"),  # auto keeps K=1 there
)
# The shapes a calibration profiles beyond its runs' own, with the batch slices each profiles: the main
# job's (cpu-small at 1024 tokens, whose profile covers its 256-token runs too; its llama experiment,
# llama-cpu-small at 4096 tokens and batch 1, about 10 minutes here)
PROFILED = ((get_model_config("cpu-small"), (1, 2)),
            (get_model_config("llama-cpu-small").with_overrides(seq_len=4096), (1,)))


def run_and_read(run: LocalRun, out: Path, steps: int, warmup: int,
                 timeout: float = 900) -> tuple[dict | None, float | None, float]:
    """Run ``run`` through the run command, its record appended to ``out``: (the record if the run
    was ok, else None; the host's background load over its measured steps, other runnable processes
    (``predict.host_load``), kept beside the record (``record_load``); the seconds it took)."""
    from predict.host_load import watch_run

    out.parent.mkdir(parents=True, exist_ok=True)
    start, before = time.perf_counter(), len(read_records(out))
    _, background = watch_run(run.argv(out, steps, warmup), REPO, timeout)
    records = read_records(out)
    rec = records[-1] if len(records) > before and records[-1].get("status") == "ok" else None
    if rec is not None:
        record_load(out, rec, background)
    return rec, background, time.perf_counter() - start


def shape_key(m: ModelConfig) -> str:
    """A profile's shape in its file name, as the planner names its profiles (``ours.plan.auto``: a gpt
    profile is never read for llama)."""
    from ours.plan.auto import _shape

    return f"{_shape(m)}-s{m.seq_len}-v{m.vocab_size}"


def model_key(m: ModelConfig) -> str:
    """A model's width (hidden size, heads, vocabulary) at any sequence length and of either family: what
    a system's overheads fitted to its runs of one width (``Calibration.model_overhead``) are kept under."""
    return f"h{m.n_embd}-a{m.n_head}-v{m.vocab_size}"


def find_profile(m: ModelConfig, directory: Path) -> dict:
    """A profile that covers shape ``m``: its own, else the shortest one of a longer sequence with the
    same layer shape and vocabulary (its (b, l, c) points hold every shorter slice and context).
    FileNotFoundError if none."""
    from ours.plan.auto import _shape

    pattern = re.compile(rf"^profile-{re.escape(_shape(m))}-s(\d+)-v{m.vocab_size}\.json$")
    found = sorted((int(g.group(1)), p) for p in directory.glob("profile-*.json") if (g := pattern.match(p.name)))
    longer = [p for s, p in found if s >= m.seq_len]
    if not longer:
        raise FileNotFoundError(f"no profile covers {shape_key(m)} in {directory} (python -m predict calibrate)")
    return json.loads(longer[0].read_text())


def load_profile(m: ModelConfig, directory: Path, make: bool = True, p2p: bool = True,
                 batch_slices: tuple[int, ...] = (1, 2)) -> dict:
    """The profile of shape ``m`` (cached as profile-<shape>.json; measured if missing and ``make``)."""
    path = directory / f"profile-{shape_key(m)}.json"
    if path.exists():
        return json.loads(path.read_text())
    if not make:
        raise FileNotFoundError(f"no profile {path}")
    from ours.plan.profile import profile

    prof = profile(m, batch_slices, reps=7, p2p=p2p, progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1))
    return prof


@dataclass(frozen=True)
class Calibration:
    """Everything fitted on this machine: overheads per system, the loopback link (gloo between two local
    processes), the cores (a quiet host), the emulated links' per-message stall and gloo's own latency
    per message over them (``message_probe``; None: not probed, the loopback latency stands in), the
    fit's report."""

    overhead: dict
    loopback: tuple[float, float]
    cores: tuple  # cores' worth 1, 2, ... computing ranks get (a quiet host: 1, 2, then 2 x crowded)
    runs: tuple = ()
    stall_bytes: float | None = None
    message_latency: float | None = None
    # which host and code version it is of, when it was made, the host's speed then (``speed_probe``)
    identity: dict = field(default_factory=dict)
    directory: Path = CALIBRATIONS  # where its profiles are (not kept in the file: where the file was read)
    # {model_key: {system: {field: value}}}: a system's overheads fitted to its runs of that model alone
    # (the math's factor), where they span several models (``fit_calibration``: ``_fit_per_model``)
    model_overhead: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """How a prediction names the calibration it used."""
        i = self.identity or {}
        if not i.get("code"):
            return f"calibration of an unknown host and code version ({self.directory})"
        return f"calibration of {i['host']}, code {i['code']}, {i.get('when', '?')}"

    def overheads_for(self, m: ModelConfig) -> dict:
        return overheads_for(self.overhead, self.model_overhead, m)

    def compute(self, m: ModelConfig, profile: dict | None = None) -> CpuCompute:
        """The compute model of ``m`` on this host: the profile that covers its shape (``find_profile``;
        FileNotFoundError where none does) or ``profile``, with ``m``'s overheads (``overheads_for``)."""
        return CpuCompute(profile if profile is not None else find_profile(m, self.directory), self.overheads_for(m))

    def to_json(self) -> dict:
        return dict(kind="predict.calibration", identity=self.identity,
                    overhead={k: asdict(v) for k, v in self.overhead.items()}, model_overhead=self.model_overhead,
                    loopback=list(self.loopback), cores=list(self.cores), stall_bytes=self.stall_bytes,
                    message_latency=self.message_latency, runs=list(self.runs))

    @classmethod
    def from_json(cls, d: dict, directory: Path) -> "Calibration":
        return cls({k: Overheads(**v) for k, v in d["overhead"].items()}, tuple(d["loopback"]), tuple(d["cores"]),
                   tuple(d.get("runs") or ()), d.get("stall_bytes"), d.get("message_latency"),
                   d.get("identity") or {}, directory, d.get("model_overhead") or {})

    def link(self, network: str, probed: dict | None = None, matrix: dict | None = None):
        return local_link(network, self.loopback, probed, self.stall_bytes, self.message_latency, matrix)


def load_stall(directory: Path, make: bool = True, log=print) -> tuple[float | None, float | None]:
    """The emulated links' per-message stall and gloo's latency per message over them
    (``message_probe``), cached as stall-probe.json; (None, None) when not probed and not ``make``."""
    path = directory / "stall-probe.json"
    if path.exists():
        res = json.loads(path.read_text())
        return res["stall_bytes"], res.get("message_latency")
    if not make:
        return None, None
    from predict.gloo_stall import probe_stall

    res = probe_stall(log=log)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return res["stall_bytes"], res["message_latency"]


def matches(run: LocalRun, record: dict) -> bool:
    """Whether ``record`` is a run of ``run`` (same system, shape, layout, batch and options)."""
    c = record.get("config") or {}
    same = (c.get("system") == run.system and c.get("model", {}).get("name") == run.model
            and c.get("model", {}).get("seq_len") == run.seq and c.get("pp") == run.pp and c.get("dp") == run.dp
            and c.get("tp", 1) == run.tp
            and c.get("batch_size") == run.batch and c.get("micro_batch_size") == run.micro
            and c.get("network") == run.network)
    if not same:
        return False
    # a system's own options (contract.SystemOptions), as it reads them (a record from before ours'
    # --schedule ran gpipe)
    o = read_options(run.system, c.get("options") or {})
    if run.system == "ours":
        return (o.get("n_slices") == run.n_slices and (run.dp == 1 or o.get("dp_mode") == run.dp_mode)
                and o.get("schedule") == run.schedule)
    return o.get("schedule") == run.schedule


def loads_file(path: Path) -> Path:
    return path.with_name(path.stem + "-loads.jsonl")


def record_load(path: Path, record: dict, background: float | None) -> None:
    """Keep a run's background load beside its record (by run_id) in <records>-loads.jsonl."""
    with open(loads_file(path), "a") as f:
        f.write(json.dumps({"run_id": record["run_id"], "background": background}) + "\n")


def recorded_runs(runs, path: Path) -> list[tuple[LocalRun, dict, float]]:
    """Every ok record in ``path`` of each run, with the background load measured during it (0 where
    none was recorded)."""
    records = [x for x in read_records(path) if x.get("status") == "ok"]
    lf = loads_file(path)
    loads = {}
    if lf.exists():
        for line in lf.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                loads[d["run_id"]] = d["background"]
    return [(r, x, loads.get(x["run_id"]) or 0.0) for r in runs for x in records if matches(r, x)]


QUIET_CORES = 2.0  # this host's cores, as the simulator sees them when nothing else runs


def median_runs(measured: list[tuple[LocalRun, dict, float]]) -> list[tuple[LocalRun, dict, float]]:
    """One row per calibration run out of its repetitions (``recorded_runs``): the record of its median
    step time (the lower middle one of an even count) and the median of their background loads. A
    moment the host ran slow then moves one repetition, not the fit."""
    by_run: dict[LocalRun, list[tuple[dict, float]]] = {}
    for r, rec, bg in measured:
        by_run.setdefault(r, []).append((rec, bg))
    out = []
    for r, reps in by_run.items():
        ordered = sorted(reps, key=lambda x: x[0]["median_step_time"])
        out.append((r, ordered[(len(ordered) - 1) // 2][0], statistics.median(bg for _, bg in reps)))
    return out


def calibrate_here(runs=CALIBRATION_RUNS, steps: int = 6, warmup: int = 1, directory: Path | None = None,
                   repeats: int = 3, log=print) -> Calibration:
    """Profile the shapes, run the calibration set without emulated delay ``repeats`` times, round-robin
    (every run once, then again: a slow spell of the host falls on one repetition of several runs,
    not on every repetition of one), fit the overheads to each run's median repetition
    (``median_runs``), simulated with the background load measured while it ran
    (``predict.host_load``; ``fit_calibration``). Everything goes to this host's and code version's
    directory (``calibration_dir``), with the host's speed (``speed_probe``, the best of one probe
    before and one after). Runs kept there from an earlier calibration are moved aside
    (calibration-runs-<when>.jsonl), not mixed into this one."""
    directory = directory or calibration_dir()
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "calibration-runs.jsonl"
    if out.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(out.stat().st_mtime))
        aside = out.with_name(f"calibration-runs-{stamp}.jsonl")
        if loads_file(out).exists():
            loads_file(out).rename(loads_file(aside))
        out.rename(aside)
        log(f"calibration: the earlier calibration's runs moved aside (calibration-runs-{stamp}.jsonl)")
    speed = speed_probe()
    log(f"calibration into {directory}: host speed probe {speed * 1e3:.1f} GFLOP/s")
    profiles_of(runs, directory)  # measured now, before the runs
    for i in range(repeats):
        for r in runs:
            rec, background, took = run_and_read(r, out, steps, warmup)
            bg = "-" if background is None else f"{background:.1f}"
            log(f"  [{i + 1}/{repeats}] {r.name}: {rec['median_step_time'] if rec else 'failed'} "
                f"(background load {bg}; {took:.0f} s)")
    return fit_calibration(runs, directory, max(speed, speed_probe()), log=log)


# What each system's fit leaves free, to the two-rank runs of the calibration set it selects, in this
# order: first the pipeline runs (the math's factor over the profiled kernels, the per-step and
# per-unit costs), then what they left open: the tensor-parallel math of ours and of Megatron (its
# per-step cost with it: Megatron has no pipeline run here). Both pipelines' math runs at a factor of
# the profile's: torch_pipe's plain blocks, and ours' slices with their key/value context, each
# fitted with their overheads, the cpu-small runs giving the factor its leverage over the tiny ones
# (ours' fixed at 1 predicts its cpu-small runs at 256 and 1024 tokens 15-30 % fast). The four-rank
# runs come last (``fit_calibration``: ``crowded``).
FIT_STAGES = (("torch_pipe", ("step", "unit", "compute"), lambda r: r.dp == 1 and r.tp == 1),
              ("ours", ("step", "unit_layer", "compute"), lambda r: r.dp == 1 and r.tp == 1),
              ("ours", ("tp",), lambda r: r.tp > 1),
              ("megatron", ("step", "tp"), lambda r: r.tp > 1))
CROWDED_GRID = tuple(round(1.0 - 0.02 * i, 2) for i in range(26))  # 1.0 .. 0.5


def profiles_of(runs, directory: Path) -> dict[str, dict]:
    """The profile of each shape the calibration needs (its runs' and ``PROFILED``), by ``shape_key``;
    measured where ``directory`` has none yet (``load_profile``)."""
    shapes = {shape_key(m): (m, (1, 2)) for m in [r.shape() for r in runs]}
    shapes.update({shape_key(m): (m, slices) for m, slices in PROFILED})
    return {k: load_profile(m, directory, batch_slices=slices) for k, (m, slices) in shapes.items()}


def _fit_per_model(system: str, widths: list[str], rows_of, model_overhead: dict) -> list[dict]:
    """A system's runs of several models: the math's factor of each model fitted to its runs alone, its
    other overheads as the fit of all its runs found them (the rows' own). A profile measures each
    width's kernels apart, and how far a step of two ranks departs from them depends on the width: on
    this host ours' tiny runs take 0.84 of its profile's math, its cpu-small runs 1.20, where one factor
    for both (0.99) predicts the cpu-small runs 15-17 % fast. The overheads stay shared: fitted per model
    (two runs each) or with the factors together, they explain tiny's runs by overheads alone at a factor
    of 0. ``rows_of(key)``: the fit's rows of the model ``key``. Fills ``model_overhead``; returns each
    model's runs as fitted (``fit_overheads``' report)."""
    report = []
    for key in widths:
        o, part = fit_overheads(system, rows_of(key), None, ("compute",))
        model_overhead.setdefault(key, {})[system] = {"compute": o.compute}
        report += part
    return report


def _shared(fitted: Overheads, before: Overheads | None, model_overhead: dict, system: str,
            params: tuple[str, ...]) -> Overheads:
    """A stage's fit of ``params`` kept as the overheads of all the system's runs: its fit started from its
    first run's model's own overheads (``model_overhead``), whose per-model fields are put back to those of
    all the runs (``before``)."""
    own = {f for key in model_overhead.values() for f in key.get(system, {})} - set(params)
    return dataclasses.replace(fitted, **{f: getattr(before, f) for f in own}) if own else fitted


def fit_calibration(runs, directory: Path, speed: float, log=print) -> Calibration:
    """Fit every system's overheads (``FIT_STAGES``) to the runs kept in ``directory``'s
    calibration-runs.jsonl, each run's median repetition (``median_runs``), simulated with the
    background load measured while it ran (``predict.host_load``): two cores shared with that many
    other processes; then, on the runs of more ranks than cores (ours' P-2 D-2), ours' data-parallel
    sync with the share of the cores such ranks keep (``crowded``, the best of ``CROWDED_GRID``).
    ``speed``: the host's speed probe while they ran. Writes and returns the calibration
    (``python -m predict calibrate --refit`` fits kept runs again)."""
    from predict.host_load import cores_with_background

    profiles = profiles_of(runs, directory)
    fits = [p["p2p_fit"] for p in profiles.values() if p.get("p2p_fit")]
    loopback = (statistics.median(f["latency"] for f in fits), statistics.median(f["bandwidth"] for f in fits)) \
        if fits else (50e-6, 2e9)
    log(f"calibration: loopback latency {loopback[0] * 1e6:.0f} us, {loopback[1] / 1e9:.2f} GB/s")
    measured = median_runs(recorded_runs(runs, directory / "calibration-runs.jsonl"))
    link = local_link("none", loopback)
    overhead: dict = {}
    model_overhead: dict = {}  # {model_key: {system: {field: value}}}
    report: list = []

    def rows(select, crowded: float = 1.0):
        return [(spec_from_record(rec, link), rec["median_step_time"],
                 CpuCompute(profiles[shape_key(r.shape())], overheads_for(overhead, model_overhead, r.shape())),
                 cores_with_background(QUIET_CORES, bg, crowded=crowded))
                for r, rec, bg in measured if select(r)]

    for system, params, select in FIT_STAGES:
        sel = rows(lambda r: r.system == system and select(r))
        if not sel:
            continue
        fitted, rep = fit_overheads(system, sel, None, params)
        overhead[system] = _shared(fitted, overhead.get(system), model_overhead, system, params)
        widths = sorted({model_key(r.shape()) for r, _, _ in measured if r.system == system and select(r)})
        if len(widths) > 1 and "compute" in params:
            rep = _fit_per_model(system, widths, lambda key: rows(
                lambda r: r.system == system and select(r) and model_key(r.shape()) == key), model_overhead)
            log(f"calibration: {system} per model: " + "; ".join(
                f"{key} " + ", ".join(f"{f} {v:.3g}" for f, v in model_overhead[key][system].items())
                for key in widths) + " (all its runs: " + ", ".join(
                f"{f} {getattr(overhead[system], f):.3g}" for f in params) + ")")
        report += rep
    crowded = 1.0
    if any(r.system == "ours" and r.dp > 1 for r, _, _ in measured):
        at = {e: fit_overheads("ours", rows(lambda r: r.system == "ours" and r.dp > 1, e), None, ("dp",))
              for e in CROWDED_GRID}
        crowded = min(at, key=lambda e: sum(row["error"] ** 2 for row in at[e][1]))
        fitted, rep = at[crowded]
        overhead["ours"] = _shared(fitted, overhead["ours"], model_overhead, "ours", ("dp",))
        report += rep
        log(f"calibration: {len(rep)} runs of more ranks than cores keep {crowded:.2f} of the cores' worth")
    for row in report:
        log(f"  fitted {row['system']} {row['model']} T-{row['tp']} P-{row['pp']} D-{row['dp']} B={row['batch']} "
            f"K={row['slices']}: "
            f"measured {row['measured']:.4f} s, simulated {row['fitted']:.4f} s ({row['error'] * 100:+.1f} %; "
            f"{row['cores'][1]:.2f} cores for two)")
    for k, v in overhead.items():
        log(f"  overheads {k}: {v}")
    identity = dict(host=host_name(), code=code_version(), when=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    speed_tflops=speed, speed_probe=SPEED_PROBE)
    cal = Calibration(overhead, loopback, cores_with_background(QUIET_CORES, 0.0, crowded=crowded), tuple(report),
                      *load_stall(directory, log=log), identity, directory, model_overhead)
    (directory / "calibration.json").write_text(json.dumps(cal.to_json(), indent=1))
    log(f"calibration written: {directory / 'calibration.json'} ({cal.name})")
    return cal


def refit_here(directory: Path | None = None, log=print) -> Calibration:
    """This host and code version's kept calibration runs fitted again (``fit_calibration``), with the
    host's speed the calibration recorded while they ran. FileNotFoundError where there are none."""
    directory = directory or calibration_dir()
    runs_file, kept = directory / "calibration-runs.jsonl", directory / "calibration.json"
    if not runs_file.exists() or not kept.exists():
        raise FileNotFoundError(f"no kept calibration runs in {directory}: python -m predict calibrate")
    speed = (json.loads(kept.read_text()).get("identity") or {}).get("speed_tflops") or speed_probe()
    return fit_calibration(CALIBRATION_RUNS, directory, speed, log=log)


def load_calibration(directory: Path = CALIBRATIONS, strict: bool = False) -> Calibration:
    """This host's calibration of this code version (``calibration_dir``). Where there is none:
    ``strict``, FileNotFoundError (one line); else the newest calibration kept in ``directory`` (of
    another host or code version, as ``Calibration.name`` then says)."""
    own = calibration_dir(directory)
    if (own / "calibration.json").is_file():
        return Calibration.from_json(json.loads((own / "calibration.json").read_text()), own)
    other = None if strict else latest_calibration(directory)
    if other is None:
        raise FileNotFoundError(f"no calibration of this host ({platform.node()}) and code version "
                                f"({code_version()}) in {directory}: python -m predict calibrate")
    return Calibration.from_json(json.loads((other / "calibration.json").read_text()), other)


def predict_here(cfg: RunConfig, probed: dict | None = None, cal: Calibration | None = None) -> Prediction:
    """The prediction of a run on this machine from a calibration (default ``load_calibration()``): the
    link is the probed one under emulation (``probed``: a LinkMeasurement.describe() dict), else the
    profile's. FileNotFoundError without a calibration or a profile that covers the shape; NotModelled."""
    cal = cal or load_calibration()
    spec = spec_from_config(cfg, cal.link(cfg.network, probed, cfg.network_matrix))
    return predict(spec, cal.compute(cfg.model), cal.cores)


def record_prediction(cfg: RunConfig, probed: dict | None = None, cal: Calibration | None = None) -> dict | None:
    """A run's predicted step time and its parts, and the calibration it used; None where there is no
    calibration for the run (a GPU cluster, an unprofiled shape) or the simulator does not model it."""
    if cfg.device == "cuda":
        return None
    try:
        cal = cal or load_calibration()
        p = predict_here(cfg, probed, cal)
    except (FileNotFoundError, NotModelled):
        return None
    except Exception as exc:  # the simulator's own fault: the run it annotates stands, without a prediction
        print(f"prediction not made: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return {"step_time": p.step_time, **p.parts(), "source": f"predict, {cal.name}"}


def case_of(record: dict) -> str:
    """The case a record's prediction is validated as: its system as the report labels it, its layout
    and its sequence length (e.g. 'ours allreduce P-2 D-2 s256'); its batch and network vary within."""
    system = record.get("label") or record["system"]
    return f"{system} {layout_words(record.get('layout') or {})} s{record.get('seq_len')}"


def config_as_run(record: dict) -> RunConfig:
    """A record's config as the run resolved it: ours' ``auto`` slicing replaced by the slices it used."""
    cfg = config_of_record(record)
    used = (record.get("options") or {}).get("slices")
    if record["system"] == "ours" and getattr(cfg.options, "auto", False) and used:
        cfg = cfg.replace(options=dataclasses.replace(cfg.options, slices=tuple(used)))
    return cfg


def _cpu_ok(rec: dict) -> bool:
    env = rec.get("environment") or {}
    return rec.get("status") == "ok" and env.get("device_kind") == "cpu" and bool(rec.get("config"))


def _warn(why: str) -> None:
    """A records file's line that is skipped or cut (``contract.records``), told on stderr (the command gives
    its own ``warn``, with its name)."""
    print(f"python -m predict: {why}", file=sys.stderr)


def predict_records(path: Path, directory: Path = CALIBRATIONS, log=print, warn=_warn) -> dict[str, dict]:
    """The report's predictions of the ok CPU runs recorded in ``path``, by run id, kept beside it
    (``contract.records.predictions_path``): a prediction (``record_prediction``, over the link the run's
    probe measured; it names its calibration) only with this host's and code version's calibration
    (``load_calibration(strict=True)``), while the host's speed (during the runs: the median of the
    probes their sweep took, ``speeds_during``; else now) is within ``SPEED_BOUND`` of it, and for
    a case its validation found modelled (``validate_records``) on runs other than this one (a run the
    validation scored gets none: a prediction is never shown beside a run it was judged on); every other
    run gets {"not_modelled": why}. Where the calibration is missing or the host's speed has moved, one line
    says so, and an earlier file of predictions (made while they held) is kept as it is; so it is where
    the records hold no ok CPU run; else it is replaced. Returns the predictions made."""
    records = [r for r in read_records(path, warn=warn) if _cpu_ok(r)]
    out = predictions_path(path)
    if not records:
        if out.exists():
            log(f"predict records: {path} has no ok CPU run to predict; its earlier predictions are kept ({out})")
        return {}
    why_not = None
    try:
        cal = load_calibration(directory, strict=True)
        during = speeds_during(path, records)
        why_not = speed_moved(cal, statistics.median(during) if during else None)
        if during:
            then = (cal.identity or {}).get("speed_tflops") or 0.0
            log(f"predict records: the host's speed during {path}'s runs, the median of the {len(during)} probes its "
                f"sweep took: {statistics.median(during) * 1e3:.1f} GFLOP/s (min {min(during) * 1e3:.1f}, max "
                f"{max(during) * 1e3:.1f}; the calibration's {then * 1e3:.1f})")
            why_not = why_not and f"during the runs, {why_not}"
    except FileNotFoundError as exc:
        cal, why_not = None, str(exc)
    if why_not:
        earlier = f"; its earlier predictions are kept ({out})" if out.exists() else ""
        log(f"predict records: not predicting {path}: {why_not}{earlier}")
        if earlier:
            return {}
    cases = {} if cal is None else modelled_cases(cal, directory)
    kept: dict[str, dict] = {}
    for rec in records:
        case = case_of(rec)
        verdict = cases.get(case)
        try:
            cfg = config_as_run(rec)
            single_link(cfg.network, cfg.network_matrix)
            check_faults_modelled(cfg)
        except NotModelled as exc:  # a per-link matrix, loss, faults: said, not predicted as if absent
            log(f"{path}: run {rec['run_id']} ({rec.get('label')}): not predicted: {exc}")
            kept[rec["run_id"]] = {"not_modelled": str(exc)}
            continue
        except (ConfigError, KeyError, TypeError, ValueError):  # a record of an unknown system or option
            kept[rec["run_id"]] = {"not_modelled": f"{case}: its config cannot be read"}
            continue
        if why_not:
            kept[rec["run_id"]] = {"not_modelled": why_not}
            continue
        if verdict is not None and verdict["modelled"] and rec["run_id"] in verdict.get("run_ids", ()):
            kept[rec["run_id"]] = {"not_modelled": f"{case}: its validation scored this very run; a prediction "
                                                   "is shown only beside runs it was not validated on"}
            continue
        if verdict is None or not verdict["modelled"]:
            if verdict is None:
                why = "not validated on this calibration's runs"
            elif verdict.get("median") is None:  # none of its runs could be predicted
                why = f"the validation predicted none of its runs: {verdict.get('why', 'no prediction')}"
            else:
                why = f"validation error median {verdict['median'] * 100:.0f} %, largest {verdict['max'] * 100:.0f} %"
            kept[rec["run_id"]] = {"not_modelled": f"{case}: {why}"}
            continue
        p = record_prediction(cfg, (rec["environment"].get("network") or {}).get("measured_link"), cal)
        kept[rec["run_id"]] = {**p, "case": case} if p else {"not_modelled": f"{case}: the simulator has no program"}
    out.write_text(json.dumps(kept, indent=1) + "\n")
    return {k: v for k, v in kept.items() if "step_time" in v}


def calibration_run_ids(cal: Calibration) -> set[str]:
    """The run ids of the records ``cal`` was fitted on (its directory's calibration runs, kept or moved
    aside)."""
    ids: set[str] = set()
    for path in sorted(cal.directory.glob("calibration-runs*.jsonl")):
        if path.name.endswith("-loads.jsonl"):
            continue
        ids |= {r["run_id"] for r in read_records(path) if r.get("run_id")}
    return ids


def modelled_cases(cal: Calibration, directory: Path = CALIBRATIONS) -> dict[str, dict]:
    """The cases ``validate_records`` judged with ``cal`` (none where the validation kept in
    ``directory`` is of another calibration): {case: {"median", "max", "modelled", ...}}."""
    path = directory / "validation.json"
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if v.get("kind") != "predict.validation" or v.get("calibration") != cal.identity:
        return {}
    return v.get("cases") or {}


class NothingToValidate(ValueError):
    """Records that hold no ok CPU run: a validation of them would judge no case."""


def validate_records(paths: list[Path], directory: Path = CALIBRATIONS, log=print, name: str | None = "validation",
                     out: Path | None = None, warn=_warn) -> dict:
    """Every ok CPU run of ``paths`` but the calibration's own runs predicted with this host's and code
    version's calibration, against
    its measured median over repetitions (records of one run, its identity key, combined by
    ``contract.estimate``), the prediction the median of each repetition's (as it ran: ours' ``auto``
    with the slices that launch kept, over the link its probe measured); the errors grouped by case (``case_of``), each
    case modelled where its median absolute error is <= ``MODELLED_MEDIAN`` and every error within ``MODELLED_MAX``.
    Written to ``out``/``name``.json (default ``directory``: its ``validation.json`` is what ``predict_records`` reads)
    and .md, or only logged (``name`` None). FileNotFoundError without a calibration; NothingToValidate (nothing
    written) where ``paths`` hold no ok CPU run."""
    from contract.estimate import estimate

    ok = [rec for path in paths for rec in read_records(path, warn=warn) if _cpu_ok(rec)]
    if not ok:
        raise NothingToValidate(f"{', '.join(map(str, paths))}: no ok CPU run to validate")
    cal = load_calibration(directory, strict=True)
    moved = speed_moved(cal)
    if moved:
        log(f"warning: {moved}")
    calibrating = calibration_run_ids(cal)
    by_key: dict[str, list[dict]] = {}
    for rec in ok:
        if rec["run_id"] not in calibrating:  # what the calibration was fitted on is never scored
            by_key.setdefault(rec.get("key") or rec["run_id"], []).append(rec)
    skipped = len(ok) - sum(map(len, by_key.values()))
    if skipped:
        log(f"validation: {skipped} run(s) of the calibration itself left out (a prediction is scored only on "
            "runs it was not fitted on)")
    if not by_key:
        raise NothingToValidate(f"{', '.join(map(str, paths))}: every ok CPU run is one the calibration was fitted on")
    rows = []
    for recs in by_key.values():
        rec = recs[-1]
        measured = estimate([r["median_step_time"] for r in recs])
        try:  # each repetition as it ran (ours' auto may keep another K in each launch, its probe another link)
            predicted = statistics.median(
                predict_here(config_as_run(r), (r["environment"].get("network") or {}).get("measured_link"),
                             cal).step_time
                for r in recs)
        except (FileNotFoundError, NotModelled, ConfigError, KeyError, TypeError, ValueError) as exc:
            rows.append(dict(case=case_of(rec), network=(rec.get("network_setting") or {}).get("label", rec["network"]),
                             batch=rec["batch_size"], measured=measured.median, spread=measured.spread, runs=measured.n,
                             predicted=None, error=None, why=str(exc)))
            continue
        rows.append(dict(case=case_of(rec), network=(rec.get("network_setting") or {}).get("label", rec["network"]),
                         batch=rec["batch_size"], measured=measured.median, spread=measured.spread, runs=measured.n,
                         predicted=predicted, error=(predicted - measured.median) / measured.median,
                         details=rec.get("details") or "", run_ids=[r["run_id"] for r in recs]))
    cases: dict[str, dict] = {}
    for row in rows:
        cases.setdefault(row["case"], {"errors": [], "run_ids": []})
        if row["error"] is not None:
            cases[row["case"]]["errors"].append(row["error"])
            cases[row["case"]]["run_ids"] += row["run_ids"]
        else:
            cases[row["case"]].setdefault("why", row["why"])
    for case in cases.values():
        e = [abs(x) for x in case["errors"]]
        case.update(median=statistics.median(e) if e else None, max=max(e) if e else None,
                    modelled=bool(e) and statistics.median(e) <= MODELLED_MEDIAN and max(e) <= MODELLED_MAX)
    commits = sorted({str(c)[:12] if (c := (rec.get("environment") or {}).get("git_commit")) else "no commit recorded"
                      for rec in ok})
    result = dict(kind="predict.validation", calibration=cal.identity, records=[str(p) for p in paths],
                  commits=commits, bounds=dict(median=MODELLED_MEDIAN, max=MODELLED_MAX), rows=rows, cases=cases)
    text = validation_table(result, cal)
    if name is not None:
        out = out or directory
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(text + "\n")
    log(text)
    return result


def validation_table(result: dict, cal: Calibration) -> str:
    """The validation as markdown: every run predicted against measured, then the cases' verdicts."""
    pct = lambda x: "-" if x is None else f"{x * 100:+.1f} %"  # noqa: E731
    made = result.get("commits") or []
    by = f" (records of commit{'s' if len(made) != 1 else ''} {', '.join(made)})" if made else ""
    lines = [f"Validation of {cal.name} on {', '.join(result['records'])}{by}: every ok CPU run, the measured step "
             f"time the median over its repetitions (± the larger side of their min-max or bootstrap interval), the "
             "predicted one the median of each repetition's prediction as it ran (ours' auto: the K that launch "
             "kept).", "",
             "| case | network | batch | measured (s) | runs | predicted (s) | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(result["rows"], key=lambda r: (r["case"], r["network"], r["batch"])):
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.4f}"
        lines.append(f"| {r['case']} | {r['network']} | {r['batch']} | "
                     f"{r['measured']:.4f} ±{r['spread'] * 100:.0f} % | "
                     f"{r['runs']} | {pred} | {pct(r['error']) if r['error'] is not None else r.get('why', '-')} |")
    b = result["bounds"]
    lines += ["", f"A case is modelled (the report shows its predictions) where its median absolute error is <= "
              f"{b['median'] * 100:.0f} % and every error within {b['max'] * 100:.0f} %; elsewhere the report says "
              "\"not modelled\".", "", "| case | runs | median error | largest error | modelled |",
              "| --- | --- | --- | --- | --- |"]
    for case, c in sorted(result["cases"].items()):
        lines.append(f"| {case} | {len(c['errors'])} | {pct(c['median']).lstrip('+')} | {pct(c['max']).lstrip('+')} | "
                     f"{'yes' if c['modelled'] else 'no'} |")
    errs = [abs(r["error"]) for r in result["rows"] if r["error"] is not None]
    if errs:
        shown = [abs(r["error"]) for r in result["rows"]
                 if r["error"] is not None and result["cases"][r["case"]]["modelled"]]
        lines += ["", f"All runs: median absolute error {statistics.median(errs) * 100:.1f} %, largest "
                  f"{max(errs) * 100:.1f} % ({len(errs)} runs). Runs of modelled cases (what the report shows): "
                  + (f"median {statistics.median(shown) * 100:.1f} %, largest {max(shown) * 100:.1f} % "
                     f"({len(shown)} runs)." if shown else "none.")]
    return "\n".join(lines)


def local_link(network: str, loopback: tuple[float, float], probed: dict | None = None,
               stall_bytes: float | None = None, message_latency: float | None = None,
               matrix: dict | None = None) -> Link:
    """The link between two ranks of a local run: gloo over loopback for ``none``; under a network
    profile the probe's one-way delay and bandwidth (``probed``: a LinkMeasurement.describe() dict),
    or the profile's own values where there is no probe, plus gloo's own per-message latency over the
    emulated link (``message_latency``, from the message probe; None: the loopback latency);
    ``stall_bytes``: the emulator's per-message stall (``Link.stall``); ``matrix``: a per-link matrix's
    contents as the run read them (NotModelled where its links differ: ``single_link``)."""
    lat, bw = loopback
    if network == "none":
        return Link(lat, bw)
    spec = single_link(network, matrix)
    delay_ms, gbps = spec.delay_ms, spec.bandwidth_gbps
    if probed:
        delay_ms = probed.get("one_way_delay_ms") or delay_ms
        measured = probed.get("bandwidth_gbps")
        if measured and measured == measured and measured > 0:  # not NaN
            gbps = measured
    extra = lat if message_latency is None else message_latency
    return Link(delay_ms / 1e3 + extra, min(gbps * 1e9 / 8, bw), stall_bytes=stall_bytes)

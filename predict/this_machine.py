"""This machine: profiles, calibration from runs without emulated delay, and the validation against
emulated runs (predicted against measured).

    calibrate_here(): profile each model shape (cached), run the calibration set with ``--network none``
        and fit every system's overheads;
    validate(): probe each network profile of the validation set, predict every run, run it through
        the run command (``--network PROFILE``), print predicted against measured with the errors.

Runs go through ``python -m runners.run`` (a subprocess, an argument list), each appending its record
to a JSON-lines file; the record's median step time is the measurement. The host is shared: while a
run measures its steps, the other runnable threads on the host are counted (``predict.host_load``)
and the simulation can share the two cores with them.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from contract import ConfigError, RunConfig
from contract.records import predictions_path, read_records
from predict.fitting import fit_overheads
from predict.compute import CpuCompute, Overheads
from predict.from_config import NotModelled, config_of_record, single_link, spec_from_config, spec_from_record
from predict.step_time import predict
from predict.run_spec import Link, Prediction
from contract.registry import read_options
from workload.configs import ModelConfig, get_model_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results" / "predict"


@dataclass(frozen=True)
class LocalRun:
    """One run of the run command on this machine (fp32, no recompute)."""

    system: str
    model: str
    network: str = "none"
    pp: int = 2
    dp: int = 1
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
        layout = f"P-{self.pp}" + (f" D-{self.dp}" if self.dp > 1 else "")
        return f"{what} {self.model} s{self.seq} {layout} B={self.batch} b={self.micro}"

    def argv(self, out: Path, steps: int, warmup: int) -> list[str]:
        a = [sys.executable, "-m", "runners.run", "--system", self.system, "--model", self.model,
             "--seq-length", str(self.seq), "--pp", str(self.pp), "--dp", str(self.dp), "--batch-size",
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
    LocalRun("torch_pipe", "cpu-small", batch=2),
    LocalRun("ours", "tiny", n_slices=1),
    LocalRun("ours", "tiny", n_slices=4),
    LocalRun("ours", "cpu-small", n_slices=4),
    LocalRun("ours", "tiny", dp=2, n_slices=4, dp_mode="central_ps"),
)

# Emulated networks, none of them used in calibration.
VALIDATION_RUNS = (
    LocalRun("torch_pipe", "tiny", network="d5-2g"),
    LocalRun("torch_pipe", "tiny", network="d10-1g"),
    LocalRun("torch_pipe", "tiny", network="d50-1g"),
    LocalRun("ours", "tiny", network="d5-2g", n_slices=4),
    LocalRun("ours", "tiny", network="d10-1g", n_slices=4),
    LocalRun("ours", "tiny", network="d50-1g", n_slices=4),
    LocalRun("ours", "tiny", network="d10-1g", dp=2, n_slices=4, dp_mode="central_ps"),
    LocalRun("torch_pipe", "cpu-small", network="d10-1g"),
    LocalRun("ours", "cpu-small", network="d10-1g", n_slices=4),
)


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
    return f"h{m.n_embd}-a{m.n_head}-s{m.seq_len}-v{m.vocab_size}"


def find_profile(m: ModelConfig, directory: Path = RESULTS) -> dict:
    """A profile that covers shape ``m``: its own, else the shortest one of a longer sequence with the
    same hidden size, heads and vocabulary (its (b, l, c) points hold every shorter slice and context).
    FileNotFoundError if none."""
    import re

    pattern = re.compile(rf"^profile-h{m.n_embd}-a{m.n_head}-s(\d+)-v{m.vocab_size}\.json$")
    found = sorted((int(g.group(1)), p) for p in directory.glob("profile-*.json") if (g := pattern.match(p.name)))
    longer = [p for s, p in found if s >= m.seq_len]
    if not longer:
        raise FileNotFoundError(f"no profile covers {shape_key(m)} in {directory} (python -m predict calibrate)")
    return json.loads(longer[0].read_text())


def load_profile(m: ModelConfig, directory: Path = RESULTS, make: bool = True, p2p: bool = True,
                 batch_slices: tuple[int, ...] = (1, 2)) -> dict:
    """The profile of shape ``m`` (cached as profile-<shape>.json; measured if missing and ``make``)."""
    path = directory / f"profile-{shape_key(m)}.json"
    if path.exists():
        return json.loads(path.read_text())
    if not make:
        raise FileNotFoundError(f"no profile {path}")
    from predict.machine_profile import profile

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
    cores: tuple  # cores' worth 1, 2, ... computing ranks get (a quiet host: (1, 2))
    runs: tuple = ()
    stall_bytes: float | None = None
    message_latency: float | None = None

    def compute(self, m: ModelConfig, directory: Path = RESULTS) -> CpuCompute:
        return CpuCompute(load_profile(m, directory), dict(self.overhead))

    def to_json(self) -> dict:
        return dict(kind="predict.calibration", overhead={k: asdict(v) for k, v in self.overhead.items()},
                    loopback=list(self.loopback), cores=list(self.cores), stall_bytes=self.stall_bytes,
                    message_latency=self.message_latency, runs=list(self.runs))

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        return cls({k: Overheads(**v) for k, v in d["overhead"].items()}, tuple(d["loopback"]), tuple(d["cores"]),
                   tuple(d.get("runs") or ()), d.get("stall_bytes"), d.get("message_latency"))

    def link(self, network: str, probed: dict | None = None, matrix: dict | None = None):
        return local_link(network, self.loopback, probed, self.stall_bytes, self.message_latency, matrix)


def load_stall(directory: Path = RESULTS, make: bool = True, log=print) -> tuple[float | None, float | None]:
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


def calibrate_here(runs=CALIBRATION_RUNS, steps: int = 6, warmup: int = 1, directory: Path = RESULTS,
                   repeats: int = 2, log=print) -> Calibration:
    """Profile the shapes, run the calibration set without emulated delay (``repeats`` more times each),
    fit the overheads to every recorded repetition, each simulated with the background load measured
    while it ran (``predict.host_load``): two cores shared with that many other processes."""
    from predict.host_load import cores_with_background

    shapes = {shape_key(r.shape()): r.shape() for r in runs}
    profiles = {k: load_profile(m, directory) for k, m in shapes.items()}
    fits = [p["p2p_fit"] for p in profiles.values() if p.get("p2p_fit")]
    loopback = (statistics.median(f["latency"] for f in fits), statistics.median(f["bandwidth"] for f in fits)) \
        if fits else (50e-6, 2e9)
    log(f"calibration: loopback latency {loopback[0] * 1e6:.0f} us, {loopback[1] / 1e9:.2f} GB/s")
    out = directory / "calibration-runs.jsonl"
    for r in runs:
        for _ in range(repeats):
            rec, background, took = run_and_read(r, out, steps, warmup)
            bg = "-" if background is None else f"{background:.1f}"
            log(f"  {r.name}: {rec['median_step_time'] if rec else 'failed'} (background load {bg}; {took:.0f} s)")
    measured = recorded_runs(runs, out)
    cores = (1.0, QUIET_CORES)
    link = local_link("none", loopback)
    overhead: dict = {}
    report: list = []

    def rows(select):
        return [(spec_from_record(rec, link), rec["median_step_time"],
                 CpuCompute(profiles[shape_key(r.shape())], dict(overhead)), cores_with_background(QUIET_CORES, bg))
                for r, rec, bg in measured if select(r)]

    # torch_pipe's own kernels (plain blocks) run at a factor of the profiled ones (ours' kernels):
    # fitted with its overheads, the cpu-small run giving it leverage over the tiny ones
    for system, params in (("torch_pipe", ("step", "unit", "compute")), ("ours", ("step", "unit_layer"))):
        sel = rows(lambda r: r.system == system and r.dp == 1)
        if sel:
            overhead[system], rep = fit_overheads(system, sel, cores, params)
            report += rep
    sel = rows(lambda r: r.system == "ours" and r.dp > 1)
    if sel:
        overhead["ours"], rep = fit_overheads("ours", sel, cores, ("dp",))
        report += rep
    for row in report:
        log(f"  fitted {row['system']} {row['model']} P-{row['pp']} D-{row['dp']} B={row['batch']} K={row['slices']}: "
            f"measured {row['measured']:.4f} s, simulated {row['fitted']:.4f} s ({row['error'] * 100:+.1f} %; "
            f"{row['cores'][1]:.2f} cores for two)")
    for k, v in overhead.items():
        log(f"  overheads {k}: {v}")
    cal = Calibration(overhead, loopback, cores, tuple(report), *load_stall(directory, log=log))
    (directory / "calibration.json").write_text(json.dumps(cal.to_json(), indent=1))
    return cal


def load_calibration(directory: Path = RESULTS) -> Calibration:
    return Calibration.from_json(json.loads((directory / "calibration.json").read_text()))


def probe_links(networks, log=print) -> dict[str, dict]:
    """One probe per network profile between two hosts of a virtual cluster (root needed)."""
    from network_emulation import VirtualCluster

    out = {}
    for name in networks:
        with VirtualCluster(2, name, name="predict", log=None) as vc:
            out[name] = vc.probe(0, 1).describe()
        log(f"  probe {name}: one-way {out[name]['one_way_delay_ms']:.2f} ms, {out[name]['bandwidth_gbps']:.2f} Gbit/s")
    return out


def predict_here(cfg: RunConfig, probed: dict | None = None) -> Prediction:
    """The prediction of a run on this machine from its calibration (``results/predict``): the link is
    the probed one under emulation (``probed``: a LinkMeasurement.describe() dict), else the profile's.
    FileNotFoundError without a calibration or a profile that covers the shape; NotModelled."""
    cal = load_calibration()
    spec = spec_from_config(cfg, cal.link(cfg.network, probed, cfg.network_matrix))
    return predict(spec, CpuCompute(find_profile(cfg.model), dict(cal.overhead)), cal.cores)


def record_prediction(cfg: RunConfig, probed: dict | None = None) -> dict | None:
    """A run's predicted step time and its parts, or None where this machine has no calibration for
    the run (a GPU cluster, an unprofiled shape) or the simulator does not model it."""
    if cfg.device == "cuda":
        return None
    try:
        p = predict_here(cfg, probed)
    except (FileNotFoundError, NotModelled):
        return None
    except Exception as exc:  # the simulator's own fault: the run it annotates stands, without a prediction
        print(f"prediction not made: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return {"step_time": p.step_time, **p.parts(), "source": "predict, this machine's calibration"}


def predict_records(path: Path) -> dict[str, dict]:
    """The predictions of the ok CPU runs recorded in ``path`` by run id (``record_prediction``, over
    the link each run's probe measured), kept beside it (``contract.records.predictions_path``) for the
    report; an earlier file of predictions is replaced (removed when none could be made)."""
    predicted = {}
    for rec in read_records(path):
        env = rec.get("environment") or {}
        if rec.get("status") != "ok" or env.get("device_kind") != "cpu" or not rec.get("config"):
            continue
        try:
            cfg = config_of_record(rec)
        except (ConfigError, KeyError, TypeError, ValueError):  # a record of an unknown system or option
            continue
        try:
            single_link(cfg.network, cfg.network_matrix)
        except NotModelled as exc:  # a per-link matrix: said, not predicted as if it were uniform
            print(f"{path}: run {rec['run_id']} ({rec.get('label')}): not predicted: {exc}")
            continue
        p = record_prediction(cfg, (env.get("network") or {}).get("measured_link"))
        if p is not None:
            predicted[rec["run_id"]] = p
    out = predictions_path(path)
    if predicted:
        out.write_text(json.dumps(predicted, indent=1) + "\n")
    else:
        out.unlink(missing_ok=True)
    return predicted


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


def predict_local(run: LocalRun, cal: Calibration, probed: dict | None = None, directory: Path = RESULTS):
    """The prediction of a LocalRun (spec built from the run command's own config)."""
    from runners.request import parse_request

    cfg, _ = parse_request(run.argv(Path("/dev/null"), 3, 1)[3:])  # the run command's flags
    spec = spec_from_config(cfg, cal.link(run.network, probed))
    return predict(spec, cal.compute(run.shape(), directory), cal.cores)


def validate(runs=VALIDATION_RUNS, steps: int = 6, warmup: int = 1, directory: Path = RESULTS,
             cal: Calibration | None = None, repeats: int = 3, log=print) -> list[dict]:
    """Predict, then run (``repeats`` times), every run of ``runs``; print predicted against measured.

    The measurement of a run is the median of its repetitions' median step times. Two predictions
    per run: ``predicted`` for the host as calibrated (two quiet cores), made before the run;
    ``predicted_loaded`` the same model with the background load measured while its steps ran (the
    mean over the repetitions of the other runnable processes on the host, ``predict.host_load``)
    sharing the cores. Nothing measured about the run's own steps feeds either."""
    from predict.host_load import cores_with_background

    cal = cal or load_calibration(directory)
    probes = probe_links(sorted({r.network for r in runs if r.network != "none"}), log)
    out = directory / "validation-runs.jsonl"
    rows = []
    for r in runs:
        pred = predict_local(r, cal, probes.get(r.network), directory)
        times, loads, ids = [], [], []
        for _ in range(repeats):
            rec, background, took = run_and_read(r, out, steps, warmup)
            if rec:
                times.append(rec["median_step_time"])
                ids.append(rec["run_id"])
            loads.append(background or 0.0)
            got = f"{rec['median_step_time']:.4f} s" if rec else "failed"
            log(f"  {r.name} @ {r.network}: predicted {pred.step_time:.4f} s, measured {got} (background load "
                f"{loads[-1]:.1f}; {took:.0f} s)")
        m = statistics.median(times) if times else None
        bg = statistics.mean(loads) if loads else 0.0
        loaded = predict_local(r, replace(cal, cores=cores_with_background(QUIET_CORES, bg)),
                               probes.get(r.network), directory)
        rows.append(dict(run=r.name, network=r.network, background=bg, predicted=pred.step_time,
                         predicted_loaded=loaded.step_time, measured=m, repetitions=times, run_ids=ids,
                         error=(pred.step_time - m) / m if m else None,
                         error_loaded=(loaded.step_time - m) / m if m else None, parts=pred.parts()))
    log(table(rows))
    (directory / "validation.json").write_text(json.dumps(dict(probes=probes, repeats=repeats, steps=steps,
                                                               calibration=cal.to_json(), rows=rows), indent=1))
    (directory / "validation.md").write_text(table(rows) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | network | background load | predicted, quiet host (s) | predicted with the load (s) | "
             "measured (s): median (repetitions) | error | error with the load |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    errs, errs_l = [], []
    for r in rows:
        e, el = r.get("error"), r.get("error_loaded")
        if e is not None:
            errs.append(abs(e))
            errs_l.append(abs(el))
        got = "-" if r["measured"] is None else f"{r['measured']:.4f}"
        if len(r.get("repetitions") or ()) > 1:
            got += " (" + ", ".join(f"{t:.4f}" for t in r["repetitions"]) + ")"
        bg = "-" if r.get("background") is None else f"{r['background']:.1f}"
        pe = lambda x: "-" if x is None else f"{x * 100:+.1f} %"
        lines.append(f"| {r['run']} | {r['network']} | {bg} | {r['predicted']:.4f} | {r['predicted_loaded']:.4f} | "
                     f"{got} | {pe(e)} | {pe(el)} |")
    if errs:
        lines += ["", f"Median absolute error: quiet-host prediction {statistics.median(errs) * 100:.1f} % (largest "
                  f"{max(errs) * 100:.1f} %); with the measured background load {statistics.median(errs_l) * 100:.1f} % "
                  f"(largest {max(errs_l) * 100:.1f} %); {len(errs)} runs."]
    return "\n".join(lines)

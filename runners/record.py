"""RunRecord: one JSON line per run, the only thing report.py reads."""
from __future__ import annotations

import datetime
import fcntl
import functools
import json
import math
import os
import platform
import stat
import statistics
import subprocess
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contract import RunConfig, SystemSpec
from contract.faults import alive_per_step
from network_emulation.profiles import describe_setting
from runners.cores import oversubscription

STATUSES = ("ok", "oom", "error", "timeout", "unfit")  # unfit: not run, it does not fit the cluster (error says why)


@dataclass
class RunRecord:
    system: str
    label: str  # the run's column in reports (the system's spec makes it, e.g. "torch_pipe gpipe")
    role: str  # baseline | ours | reference (from the spec): reports compare ours with the best baseline
    model: str
    model_shape: dict[str, int]
    layout: dict[str, int]
    batch_size: int
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    precision: str
    recompute: bool
    network: str
    # the network setting in words and numbers, as the report shows it: label, delay_ms, bandwidth_gbps
    network_setting: dict[str, Any]
    status: str
    error: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the system's options, and the choices resolved at run time
    details: str = ""  # those choices in words (the system's spec makes it, e.g. ours' slicing)
    environment: dict[str, Any] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    # when each measured step began, seconds since the first step began (rank 0's clock): where the
    # steps fall in a run whose links change (--network-trace; its points count from the same time 0)
    step_starts: list[float] = field(default_factory=list)
    median_step_time: float | None = None
    min_step_time: float | None = None
    max_step_time: float | None = None
    # Throughput counts the work that ran: each measured step's tokens are those of the replicas that
    # ran it (every one, or where a replica was lost or rejoined, ``replicas_per_step``), at the median
    # step's pace: the mean tokens of a measured step over the median step time.
    tokens_per_s: float | None = None  # of the whole run (every pipeline)
    # over the devices that ran a step (environment.device_count: each GPU a device, on CPU each rank;
    # of a run that lost a replica, those of the replicas that ran it)
    tokens_per_s_per_device: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    # Memory, measured three ways that do not compare with each other. peak_memory_bytes: per device
    # (every GPU of every rank, in rank order; on CPU every rank), a GPU's peak allocated by tensors,
    # or on CPU the rank's peak resident set. peak_reserved_bytes: per GPU, the peak held by torch's
    # caching allocator (what the GPU had to have; empty on CPU). cpu_rss_bytes: per rank, its
    # process's peak resident set in host memory, on GPU runs too.
    peak_memory_bytes: list[int] = field(default_factory=list)
    peak_reserved_bytes: list[int] = field(default_factory=list)
    cpu_rss_bytes: list[int] = field(default_factory=list)
    # per rank, its process's CPU time over its measured step time (CPU devices only): the share it
    # was computing; the rest is waiting (bubbles, messages, the closing barrier). Above 1 where a
    # process computes in several threads at once.
    busy_fraction: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # where a data-parallel replica was lost (--kill-replica of a system that goes on) or rejoined: how
    # many replicas ran each measured step (environment.faults says which); empty: every one, every step
    replicas_per_step: list[int] = field(default_factory=list)
    dp_sync_time: float | None = None  # median over steps of the slowest rank's data-parallel sync
    barrier_time: float | None = None  # median over steps of the step's closing barrier on the last rank to arrive
    # ... and on the first rank to arrive: its wait for the last one, and the barrier's delays on the way
    # (at least one one-way delay under an emulated network, if the barrier blocks the host)
    barrier_time_first: float | None = None
    # under --eval-every: the eval points, the first before any step (contract.evaluation: step,
    # tokens, wall_time without the timing barriers and the evals, held-out loss, bytes_sent per rank)
    evals: list[dict[str, Any]] = field(default_factory=list)
    # where the ranks' threads outnumbered the cores of a machine they shared (runners.cores): the worst
    # machine's {"threads", "ranks", "cores", "machines"}; None where each had a core. Reports draw no
    # comparison from such a run: its times are of CPU contention, not of the system.
    oversubscribed: dict[str, int] | None = None
    verify: dict[str, Any] | None = None
    # what the run did not do as asked, in words (the run command also says it on stderr): a network
    # trace's point no measured step ran under
    warnings: list[str] = field(default_factory=list)
    # what of the ranks' and torchrun's output the terminal was spared (runners.output.Withheld): the
    # tracebacks of ranks that failed because another did, torchrun's report of a failed rank, a hang's
    # stacks, what ranks printed while they were stopped; at most its last lines
    withheld_output: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # the run's identity (RunConfig.key): a sweep skips it when recorded, a report cell keeps the newest
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    timestamp: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> str:
        """One line of strict JSON (a NaN or infinity, e.g. of a failed verification, becomes null)."""
        return json.dumps(_finite(asdict(self)), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def merged_losses(ranks: list[dict]) -> list[float]:
    """The global-batch loss per step: the mean over the data-parallel replicas that report one."""
    series = [r["losses"] for r in ranks if r.get("losses")]
    if not series:
        return []
    return [sum(values) / len(values) for values in zip(*series)]


def build_record(cfg: RunConfig, spec: SystemSpec, status: str, error: str | None, ranks: list[dict] | None,
                 environment: dict[str, Any], verify: dict[str, Any] | None = None) -> RunRecord:
    from workload.flops import flops_per_token
    from workload.configs import count_params

    assert status in STATUSES, status
    m = cfg.model
    options = cfg.options.to_dict()
    for r in ranks or []:  # choices a system resolved at run time (e.g. the planner's slicing)
        options.update(r.get("extra") or {})
    rec = RunRecord(
        system=cfg.system, label=spec.run_label(cfg), role=spec.role, model=m.name,
        model_shape={"n_layer": m.n_layer, "n_embd": m.n_embd, "n_head": m.n_head, "seq_len": m.seq_len,
                     "vocab_size": m.vocab_size, "params": count_params(m, include_embeddings=True)},
        layout={"pp": cfg.pp, "tp": cfg.tp, "dp": cfg.dp}, batch_size=cfg.batch_size,
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size, seq_len=m.seq_len,
        precision=cfg.precision, recompute=cfg.recompute, network=cfg.network,
        network_setting=network_setting(cfg), status=status, error=error,
        options=options, details=spec.run_details(options), environment={**provenance(), **environment}, verify=verify,
        config=cfg.to_dict(), key=cfg.key())
    if not ranks:
        return rec
    # the devices of a replica, from the replicas whose ranks reported (of a run that lost one, the others)
    per_replica_ranks = max(1, spec.processes(cfg) // cfg.dp)
    replica_devices = device_count(ranks) / len({r["rank"] // per_replica_ranks for r in ranks})
    rec.environment.update(
        device_kind=ranks[0]["device"].split(":")[0], device_name=ranks[0]["device_name"],
        device_count=round(replica_devices * cfg.dp), backend=ranks[0]["backend"],
        hostnames=sorted({r["hostname"] for r in ranks}))
    # A step takes as long as its slowest rank.
    per_step = [max(ts) for ts in zip(*(r["step_times"] for r in ranks))]
    rec.step_times = per_step
    rec.step_starts = ranks[0].get("step_starts") or []
    rec.losses = merged_losses(ranks)
    rec.evals = next((r["evals"] for r in ranks if r.get("evals")), [])
    rec.cpu_rss_bytes = [r["cpu_rss_bytes"] for r in ranks]
    gpus = [g for r in ranks for g in r["gpu_memory"]]
    rec.peak_memory_bytes = [g["allocated_bytes"] for g in gpus] if gpus else rec.cpu_rss_bytes
    rec.peak_reserved_bytes = [g["reserved_bytes"] for g in gpus]
    if all(r.get("busy_times") and sum(r["step_times"]) > 0 for r in ranks):
        rec.busy_fraction = [sum(r["busy_times"]) / sum(r["step_times"]) for r in ranks]
    if all(r["dp_sync_times"] for r in ranks):
        rec.dp_sync_time = statistics.median(max(s) for s in zip(*(r["dp_sync_times"] for r in ranks)))
    if all(r.get("barrier_times") for r in ranks):  # the last rank to arrive waits only for the barrier itself
        rec.barrier_time = statistics.median(min(b) for b in zip(*(r["barrier_times"] for r in ranks)))
        rec.barrier_time_first = statistics.median(max(b) for b in zip(*(r["barrier_times"] for r in ranks)))
    rec.oversubscribed = oversubscription(ranks)
    rec.peak_tflops = statistics.mean(r["peak_tflops"] for r in ranks)
    rec.peak_source = ranks[0]["peak_source"]
    if per_step:
        rec.replicas_per_step = alive_per_step(environment.get("faults"),
                                               range(cfg.warmup, cfg.warmup + len(per_step)))
        for name, value in throughput(per_step, rec.replicas_per_step or [cfg.dp] * len(per_step),
                                      cfg.batch_size * m.seq_len, replica_devices, flops_per_token(m),
                                      rec.peak_tflops).items():
            setattr(rec, name, value)
    trace = (environment.get("network") or {}).get("trace")
    if trace is not None and rec.step_starts:
        rec.warnings += trace_reach(trace, rec.step_starts, rec.step_times)
        if not any(p.get("measured_steps") for p in trace.get("applied") or []):  # the label claims no trace
            t = rec.network_setting["trace"]
            rec.network_setting.update(
                label=rec.network_setting["label"].partition(" + trace ")[0]
                + f" (trace {t['name']} [{t['digest'][:8]}] not reached: no measured step ran under it)",
                trace={**t, "reached": False})
    return rec


def throughput(step_times: list[float], replicas: list[int], replica_tokens: int, replica_devices: float,
               flops_per_token: float, peak_tflops: float | None) -> dict[str, float | None]:
    """The record's step-time statistics and throughput from its measured steps: ``replicas`` ran each
    step (of ``replica_tokens`` tokens and ``replica_devices`` devices each); tokens/s is the mean
    tokens of a measured step over the median step time, per device over the mean devices that ran a
    step, TFLOP/s per device and MFU from it."""
    med = statistics.median(step_times)
    work = statistics.fmean(replicas)  # replicas a measured step ran on, on average
    tokens = work * replica_tokens / med
    per_device = tokens / (work * replica_devices)
    tflops = per_device * flops_per_token / 1e12
    return {"median_step_time": med, "min_step_time": min(step_times), "max_step_time": max(step_times),
            "tokens_per_s": tokens, "tokens_per_s_per_device": per_device, "tflops_per_device": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None}


def trace_reach(trace: dict[str, Any], step_starts: list[float], step_times: list[float]) -> list[str]:
    """How many measured steps ran under each of a network trace's points (``measured_steps`` of each
    entry of ``trace["applied"]``: the steps that were running at some time from the point's taking
    effect to the next one's; both counted from the first step's start); the warnings of the points
    no measured step ran under, those never applied (the run ended first) included."""
    applied = [p for p in trace.get("applied") or [] if "applied_s" in p]
    ends = [a + t for a, t in zip(step_starts, step_times)]
    for i, p in enumerate(applied):
        until = applied[i + 1]["applied_s"] if i + 1 < len(applied) else math.inf
        p["measured_steps"] = sum(1 for a, e in zip(step_starts, ends) if e > p["applied_s"] and a < until)
    reached = {p["at_s"] for p in applied if p["measured_steps"]}
    missed = [p["at_s"] for p in trace.get("points") or [] if p["at_s"] not in reached]
    if not missed:
        return []
    return [f"--network-trace {trace['name']}: no measured step ran under its point(s) at "
            f"{', '.join(f'{a:g} s' for a in missed)} (the measured steps ran from {step_starts[0]:.2f} s to "
            f"{ends[-1]:.2f} s after the first step began): the run did not measure the links as they set them"]


def network_setting(cfg: RunConfig) -> dict[str, Any]:
    """The run's network setting as the report shows it (``describe_setting``); under a per-link
    matrix, of the contents the run read, with their digest (part of the run's identity) in the label;
    under a trace, its name and digest (``trace``) in the label too."""
    setting = describe_setting(cfg.network, cfg.network_matrix)
    digest = cfg.network_digest()
    if digest:
        setting.update(digest=digest, label=f"{setting['label']} [{digest[:8]}]")
    if cfg.network_trace is not None:  # the links change as the trace says: named, with its contents' digest
        trace = {"name": Path(cfg.network_trace).stem, "digest": cfg.identity()["network_trace"]}
        setting.update(trace=trace, label=f"{setting['label']} + trace {trace['name']} [{trace['digest'][:8]}]")
    return setting


def device_count(ranks: list[dict]) -> int:
    """The devices a run computed on: each rank's distinct devices (fairscale: its pipe's GPUs; on CPU
    one per rank), summed. Tokens/s, TFLOP/s and MFU per device divide by it."""
    return sum(len(set(r.get("devices") or [r["device"]])) for r in ranks)


def host_environment(hardware: str | None = None) -> dict[str, Any]:
    """The launching host's view, kept for failed runs; the ranks' own report replaces the device fields.
    ``hardware``: the run's (RunConfig.hardware), "cpu" or "cuda:<GPU model>"."""
    from importlib.metadata import version  # torch's own, without importing it

    kind, _, name = (hardware or "cpu").partition(":")
    return {"torch_version": version("torch"), "python": platform.python_version(), "platform": platform.platform(),
            "launcher_host": platform.node(), "device_kind": kind, "device_name": name or kind}


LIBRARIES = ("torch", "megatron-core", "fairscale", "torchft")  # the distributions the systems train with
_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def provenance() -> dict[str, Any]:
    """What produced a record: ``git_commit`` of the code (None outside a git checkout), ``git_dirty``
    (tracked files differ from it; ``results/``, what the suite writes, aside) and ``git_changed`` (those
    files, at most 20), ``versions`` of Python and of ``LIBRARIES`` (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results") if commit else None
    paths = [line[3:] for line in (changed or "").splitlines()]
    return {"git_commit": commit.strip() if commit else None, "git_dirty": bool(paths) if changed is not None else None,
            "git_changed": paths[:20],
            "versions": {"python": platform.python_version(), **{name: installed(name) for name in LIBRARIES}}}


def append_record(path: str | Path, record: RunRecord) -> None:
    append_line(path, record.to_json())


def _lock_path(path: Path) -> Path:
    """The lock file appending takes, beside the records file (which is replaced, not written in place)."""
    return path.with_name(path.name + ".lock")


def _writer_lock_path(path: Path) -> Path:
    """The lock a run command or a sweep holds while it writes to a records file (``hold_records``)."""
    path = Path(os.path.realpath(path))
    return path.with_name(path.name + ".writer.lock")


def remove_records(path: str | Path) -> None:
    """Delete a records file and any lock files beside it (e.g. a temporary one)."""
    path = Path(path)
    for p in (path, _lock_path(path), _writer_lock_path(path)):
        p.unlink(missing_ok=True)


def _lock(lock: Path, blocking: bool) -> int:
    """An exclusive flock on the file ``lock`` (made if missing), on a descriptor of its own. Whoever
    releases a lock removes its file (``_unlock``), so one that locked a file since removed locks the
    new one instead: the lock files do not outlive their holders (one killed outright leaves an empty
    file, which the next holder takes and removes). BlockingIOError if held (not ``blocking``)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _unlock(lock: Path, fd: int) -> None:
    """Release a lock ``_lock`` took: its file removed while still held, then the descriptor closed."""
    try:
        if os.path.samestat(os.fstat(fd), os.stat(lock)):
            lock.unlink()
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


HELD_LOCK_ENV = "PIPEBENCH_RECORDS_LOCK_FD"  # a sweep's run command: the descriptor of the lock it inherits
_HELD: dict[int, Path] = {}  # the writer locks this process took itself (not inherited): descriptor -> file


def hold_records(path: str | Path) -> int:
    """Hold a records file for one writer while it runs: an exclusive lock beside it that a second run
    command or sweep writing to the same file cannot take (two runs at once would each time the
    other's load). A run command started by a sweep that holds it inherits the sweep's descriptor
    (named by ``HELD_LOCK_ENV``) and holds the lock with it. Returns the descriptor, for
    ``release_records`` (else released when the process ends, however it ends); BlockingIOError if
    another writer holds it."""
    lock = _writer_lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = _inherited(lock)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the sweep's own lock: held already
        return fd
    fd = _lock(lock, blocking=False)
    _HELD[fd] = lock
    return fd


def release_records(fd: int) -> None:
    """Let go of a records file ``hold_records`` held: its lock file removed where this process took
    the lock itself (an inherited one is the sweep's to remove)."""
    lock = _HELD.pop(fd, None)
    if lock is None:
        os.close(fd)
    else:
        _unlock(lock, fd)


def _inherited(lock: Path) -> int | None:
    """The descriptor of ``lock`` this process inherited from the sweep that started it, or None."""
    try:
        fd = int(os.environ.get(HELD_LOCK_ENV, ""))
        held, target = os.fstat(fd), lock.stat()
    except (ValueError, OSError):
        return None
    return fd if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino) else None


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a record's JSON) atomically: under an exclusive lock the file is rewritten to a temporary and
    renamed over the old one, so a crash leaves the old file or the new one, never a torn line. A
    symlinked path is written through (its target is replaced); the file keeps its mode."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(_lock_path(path), blocking=True)
    try:
        old = path.read_bytes() if path.exists() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(old + line.encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        _unlock(_lock_path(path), lock)


def recount(rec: dict[str, Any]) -> bool:
    """Count again, from its own fields, the throughput of a record written before throughput counted
    only the work that ran (it has no ``replicas_per_step``) whose run lost a replica (its
    ``environment.faults`` has the replicas' lives): its step times, warm-up, batch, the survivors'
    devices (``environment.device_count`` then: the ranks that reported, every replica's but the
    killed one's), model and peak. Sets ``replicas_per_step``, the throughput fields and
    ``environment.device_count`` (the run's devices) as a record made now has them; False (and
    nothing changed) for any other record."""
    from workload.configs import ModelConfig
    from workload.flops import flops_per_token

    env, cfg = rec.get("environment") or {}, rec.get("config") or {}
    if "replicas_per_step" in rec or not rec.get("step_times") or not (env.get("faults") or {}).get("replicas"):
        return False
    dp, steps = cfg["dp"], rec["step_times"]
    alive = alive_per_step(env["faults"], range(cfg["warmup"], cfg["warmup"] + len(steps)))
    replica_devices = env["device_count"] / (dp - 1)
    rec.update(throughput(steps, alive, rec["batch_size"] * rec["seq_len"], replica_devices,
                          flops_per_token(ModelConfig(**cfg["model"])), rec.get("peak_tflops")),
               replicas_per_step=alive)
    env["device_count"] = round(replica_devices * dp)
    return True


def recount_file(path: str | Path) -> int:
    """``recount`` every record of a records file that needs it, in place (atomically, the other lines
    byte for byte as they were); how many were counted again."""
    path = Path(path)
    lines = path.read_bytes().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and recount(rec):
            lines[i] = json.dumps(_finite(rec), allow_nan=False).encode() + b"\n"
            changed += 1
    if changed:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(lines))
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    """python -m runners.record recount FILE...: count again the throughput of records written before
    it counted only the work that ran (``recount``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m runners.record", description=main.__doc__)
    p.add_argument("command", choices=["recount"])
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    for f in args.files:
        print(f"{f}: {recount_file(f)} record(s) counted again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

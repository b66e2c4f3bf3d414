"""Running a planned sweep: the runs one after another, each through the run command, skipping the
ones already recorded; a lock on the records file while it runs; progress, a summary and the report.

A sweep's ``repeats`` launches every run that many times, each launch its own record: the launches go
round-robin through the runs of each experiment (``repetitions``), so that a shared host's drifts hit
every system alike, and a resumed sweep runs only the launches a run's key still lacks. A run that
fails is not launched again in the same sweep (``--retry-failed`` retries it).

A failed run is recorded by the run command and the sweep goes on. Before the runs, each emulated
network profile is probed once; with ``speed_probes`` (a local sweep) this host's speed is probed
before each experiment and after the last (``speed_probes_path``: what ``predict records`` judges the
host's speed during the runs by). An executor runs one planned run: ``executor(run, out) -> (exit
status, last output lines)``; ``LocalExecutor`` on this machine, ``ClusterExecutor`` over ssh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from tqdm import tqdm

from contract import ConfigError
from contract.config import planned_key
from contract.records import read_records
from runners.invoke import run_command
from runners.record import HELD_LOCK_ENV, hold_records, release_records
from runners.sweep.hostfile import DoesNotFit
from runners.sweep.plan import REPO, PlannedRun, Sweep, SweepError

SAFETY_MARGIN_S = 300.0  # beyond a run's own --timeout before the sweep stops it
ALL_LAUNCHED = 1 << 30  # the launch count of a run recorded as failed: as many as any sweep repeats


class Executor(Protocol):
    cluster: bool

    def __call__(self, run: PlannedRun, out: Path) -> tuple[int, str]: ...


def recorded_keys(out: str | os.PathLike, retry_failed: bool = False) -> set[str]:
    """The planned runs' keys already recorded in ``out`` (on any hardware; only the ok ones with
    retry_failed; never unfit ones)."""
    return set(recorded_counts(out, retry_failed))


def _warn(why: str) -> None:
    """A line of the records file that is skipped or cut (``contract.records``), told on stderr."""
    print(f"sweep: {why}", file=sys.stderr)


def hardware_here(run: PlannedRun, gpus) -> str | None:
    """The hardware ``run`` gets on this machine (``runners.devices.judge_gpus``), None where it cannot run here."""
    from runners.devices import judge_gpus

    try:
        return judge_gpus(run.device, gpus, run.world, run.devices_per_process)
    except ConfigError:
        return None


def recorded_counts(out: str | os.PathLike, retry_failed: bool = False, warn=None) -> dict[str, Counter]:
    """How many launches of each run ``out`` already holds, for the sweep's repetitions: by its planned
    run's key (``contract.config.planned_key``), per hardware it was recorded on (None: not known), its
    ok records; a failed record counts as fully launched (``ALL_LAUNCHED``: a failure is not repeated),
    unless ``retry_failed``. Unfit records never count (whether a run fits depends on the hostfile). A line
    that is not a record is told to ``warn``."""
    counts: dict[str, Counter] = {}
    failed: set[tuple[str, str | None]] = set()
    for rec in read_records(out, warn):
        try:
            key, hardware = planned_key(rec["key"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if rec.get("status") == "unfit":
            continue
        if rec.get("status") == "ok":
            counts.setdefault(key, Counter())[hardware] += 1
        elif not retry_failed:
            failed.add((key, hardware))
    for key, hardware in failed:
        counts.setdefault(key, Counter())[hardware] = ALL_LAUNCHED
    return counts


def repetitions(runs: Sequence[PlannedRun], repeats: int, done: Counter) -> list[PlannedRun]:
    """The launches still to make, ``repeats`` per run less those ``done`` has: round-robin through
    each experiment's runs (every run's first launch, then every run's second, ...), the experiments
    one after another; each launch carries its repetition number."""
    todo: list[PlannedRun] = []
    experiments: dict[str, list[PlannedRun]] = {}
    for r in runs:
        experiments.setdefault(r.experiment, []).append(r)
    for runs_of in experiments.values():
        for i in range(repeats):
            todo += [dataclasses.replace(r, repetition=done[r.key] + i + 1) for r in runs_of
                     if done[r.key] + i < repeats]
    return todo


@contextlib.contextmanager
def records_lock(out: Path) -> Iterator[int]:
    """Held while a sweep writes to ``out`` (``runners.record.hold_records``), and by the run command
    it is running (which inherits the descriptor), so that a second sweep or a run command on the same
    file, or a resumed sweep while a run of the old one is still stopping, is refused. Yields the
    locked descriptor."""
    try:
        fd = hold_records(out)
    except BlockingIOError:
        raise SweepError(f"another sweep or run command is writing to {out}; wait for it to end or stop it") from None
    try:
        yield fd
    finally:
        release_records(fd)


def is_root() -> bool:
    return os.geteuid() == 0


def probe_lines(networks: Iterable[str], python: str = sys.executable) -> list[str]:
    """Run the probe once per emulated profile; its one-line measurement (or why it could not)."""
    lines = []
    for net in dict.fromkeys(networks):
        if net == "none":
            continue
        p = subprocess.run([python, "-m", "network_emulation", "probe", "--profile", net, "--samples", "10"],
                           cwd=REPO, capture_output=True, text=True)
        text = (p.stdout.strip() or p.stderr.strip() or f"exit status {p.returncode}").splitlines()
        lines.append(f"probe {net}: " + (text[-1] if p.returncode == 0 else f"unavailable ({text[-1]})"))
    return lines


def speed_probes_path(out: str | os.PathLike) -> Path:
    """Where a sweep keeps the host's speed probes taken between its experiments: ``X.jsonl`` ->
    ``X.jsonl.speed`` (JSON lines: when, speed_tflops, label)."""
    return Path(str(out) + ".speed")


def speed_probe_line(out: str | os.PathLike, label: str, python: str = sys.executable) -> str:
    """This host's speed now (``python -m predict probe``: the calibration's probe, a few seconds), kept
    in ``speed_probes_path(out)``; the line it printed, or why there is none."""
    try:
        p = subprocess.run([python, "-m", "predict", "probe", "--out", str(speed_probes_path(out)), "--label", label],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "speed probe: no answer within 120 s"
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else f"speed probe: exit status {p.returncode}"


def _fmt_elapsed(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


@dataclass
class LocalExecutor:
    """Runs one planned run on this machine through the run command (a child process)."""

    python: str = sys.executable
    log: IO | None = None
    pass_fds: tuple[int, ...] = ()  # the records lock (hold_records), held by the child too
    cluster = False

    def __call__(self, run: PlannedRun, out: Path) -> tuple[int, str]:
        inv = run_command(run.args, out=out, timeout=run.timeout + SAFETY_MARGIN_S, python=self.python,
                          sinks=[self.log] if self.log else [], pass_fds=self.pass_fds,
                          env={HELD_LOCK_ENV: str(self.pass_fds[0])} if self.pass_fds else None)
        return inv.returncode, inv.output


@dataclass
class Outcome:
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # launches already recorded
    invalid: int = 0  # bad combinations (judged before, or exit status 2)
    not_run: int = 0  # emulated runs without root, runs that do not fit the cluster, or --only
    failures: list[str] = field(default_factory=list)

    def line(self, name: str, elapsed: float) -> str:
        extra = f", {self.invalid} invalid" if self.invalid else ""
        extra += f", {self.not_run} not run" if self.not_run else ""
        return (f"sweep {name}: {self.ok} ok / {self.failed} failed / {self.skipped} skipped (already recorded)"
                f"{extra} in {_fmt_elapsed(elapsed)}")


def select_runs(sweep: Sweep, only: Sequence[str] = ()) -> list[PlannedRun]:
    return [r for r in sweep.runs if not only or r.system in only]


def run_sweep(sweep: Sweep, out: Path, *, executor: Executor | None = None, only: Sequence[str] = (),
              dry_run: bool = False, retry_failed: bool = False, need_root_for_network: bool = True,
              probe: bool = True, report: bool = True, plots: str | None = None, python: str = sys.executable,
              stream: IO | None = None, repeats: int | None = None, speed_probes: bool = False) -> Outcome:
    """Run (or with dry_run print) the sweep's runs, ``repeats`` launches each (default: the sweep's
    own); ``speed_probes``: this host's speed probed before each experiment and after the last (not in
    cluster mode); returns the counts."""
    repeats = sweep.repeats if repeats is None else repeats
    stream = stream or sys.stdout  # this process's stdout now (not the one when this module was imported)
    t0 = time.monotonic()
    outcome = Outcome()
    planned = select_runs(sweep, only)
    outcome.not_run += len(sweep.runs) - len(planned)

    def say(msg: str) -> None:
        print(msg, file=stream, flush=True)

    for r in planned:
        if not r.valid:
            say(f"skip (bad combination): {r.label()}\n    {r.error}")
            outcome.invalid += 1
    planned = [r for r in planned if r.valid]
    recorded = recorded_counts(out, retry_failed, warn=_warn) if out else {}
    # A run's launches are its records on the hardware it would run on: this machine's in a local sweep
    # (CPU and GPU records of one config are different runs); any in cluster mode (the nodes' hardware
    # is seen only by the run command on them).
    gpus = None
    if recorded and not getattr(executor, "cluster", False):
        from runners.devices import local_gpus

        with contextlib.suppress(ConfigError):  # GPUs that cannot be read: the run command says why
            gpus = local_gpus()
    done: Counter = Counter()
    for r in planned:  # each run planned once (``plan.refuse_bad_combinations``)
        by_hardware = recorded.get(r.key, Counter())
        hardware = {hardware_here(r, gpus), None} if gpus is not None else set(by_hardware)
        done[r.key] = min(sum(by_hardware[h] for h in hardware), ALL_LAUNCHED)
        outcome.skipped += min(done[r.key], repeats)
    todo = repetitions(planned, repeats, done)
    if need_root_for_network and not is_root():
        emulated = [r for r in todo if r.emulated]
        if emulated:
            say(f"NOTE: {len(emulated)} run(s) under an emulated network need root (network namespaces, tc); "
                f"not root, so they are skipped: {', '.join(sorted({r.network for r in emulated}))}")
            outcome.not_run += len(emulated)
            todo = [r for r in todo if not r.emulated]
    times = f" x {repeats} launches" if repeats > 1 else ""
    say(f"sweep {sweep.name}: {len(sweep.runs)} planned{times}, {len(todo)} to run, {outcome.skipped} already "
        f"recorded in {out}" + (f", {outcome.invalid} invalid" if outcome.invalid else ""))
    if dry_run:
        for r in todo:
            say(shlex.join(r.command(out, python)))
        return outcome
    with records_lock(out) as lock_fd:
        interrupted = _run_all(sweep, todo, out, executor, outcome, lock_fd, probe, python, say, stream,
                               speed_probes and not getattr(executor, "cluster", False))
    say(outcome.line(sweep.name, time.monotonic() - t0) + (" (interrupted)" if interrupted else ""))
    if report and Path(out).exists():
        md = Path(out).with_suffix(".md")
        argv = [python, str(REPO / "report.py"), str(out), "--out", str(md)]
        if plots:
            argv += ["--plots", plots]
        subprocess.run(argv, cwd=REPO)
        say(f"report: {md}")
    if interrupted:
        raise KeyboardInterrupt
    return outcome


def _run_all(sweep: Sweep, todo: list[PlannedRun], out: Path, executor: Executor | None, outcome: Outcome,
             lock_fd: int, probe: bool, python: str, say, stream: IO, speeds: bool = False) -> bool:
    """The runs, with a progress bar (``speeds``: the host's speed probed before each experiment and
    after the last); True if interrupted."""
    if probe and not getattr(executor, "cluster", False):
        for line in probe_lines((r.network for r in todo if r.emulated), python):
            say(line)
    with open(Path(str(out) + ".log"), "a") as log:
        execute = executor or LocalExecutor(python, log, (lock_fd,))
        if getattr(execute, "log", None) is None:
            execute.log = log
        bar = tqdm(total=len(todo), desc=f"sweep {sweep.name}", unit="run", file=sys.stderr, dynamic_ncols=True,
                   bar_format="{desc}: {n_fmt}/{total_fmt} runs |{bar}| elapsed {elapsed}, left ~{remaining}{postfix}")
        stopped: set[str] = set()  # runs that failed, did not fit or were refused: not launched again
        experiment = None
        try:
            for r in todo:
                if speeds and r.experiment != experiment:
                    experiment = r.experiment
                    bar.write(speed_probe_line(out, f"before {experiment}", python), file=stream)
                if r.key in stopped:
                    outcome.not_run += 1
                    bar.update(1)
                    continue
                bar.set_postfix_str(f"{r.system} {r.network}", refresh=True)
                log.write(f"\n=== {shlex.join(r.command(out, python))}\n")
                log.flush()
                try:
                    rc, tail = execute(r, out)
                except DoesNotFit as e:  # recorded by the executor as unfit
                    stopped.add(r.key)
                    outcome.not_run += 1
                    bar.write(f"unfit  {r.label()}\n       {e}", file=stream)
                    bar.update(1)
                    continue
                last = [l for l in tail.splitlines() if l.strip()]
                if rc != 0:
                    stopped.add(r.key)
                if rc == 0:
                    outcome.ok += 1
                    bar.write(f"ok     {r.label()}\n       {last[-1] if last else ''}", file=stream)
                elif rc == 2:
                    outcome.invalid += 1
                    bar.write(f"bad    {r.label()}\n       {last[-1] if last else 'exit status 2'}", file=stream)
                elif rc in (130, 143):  # the run was interrupted (and wrote no record): so is the sweep
                    raise KeyboardInterrupt
                else:
                    outcome.failed += 1
                    outcome.failures.append(r.label())
                    why = last[-1] if last else f"exit status {rc}"
                    bar.write(f"FAILED {r.label()}\n       {why[:300]}", file=stream)
                bar.update(1)
            if speeds and todo:
                bar.write(speed_probe_line(out, "after the runs", python), file=stream)
        except KeyboardInterrupt:
            return True
        finally:
            bar.close()
    return False

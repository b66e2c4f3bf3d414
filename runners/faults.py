"""The harness's side of a run's faults (``contract.faults``): a straggler's CPU quota or pause, a
replica killed after a step, and the mark of a run's time 0 (when its first step began, from which
a network trace's points count).

A standby of a replica that --kill-replica ends (--rejoin) waits for its turn in ``RankHooks.take_place``.

The run command sets a straggler up before launching (``Straggler``): a CPU cgroup capped at 1/F of
the share of a core each of the run's ranks here can have, and weighed 1/F of a process against
others, which rank R's process joins (under emulation its torchrun agent is started in it, since
``ip netns exec`` hides the cgroup file system from what it runs), or, where no quota can be set and
on a GPU, a pause after each step. The rank worker's ``RankHooks`` carry out the rest in each rank.
Nothing outlives the run: the cgroup is removed when the launch ends, and one whose run command
died is removed by the next run command (``reap_stale_cgroups``).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from contract import RunConfig
from contract.faults import StepHooks, killed, replica_ranks, straggler
from runners.cores import allowed_cores
from runners.lifetime import owner_alive, owner_tag

SLOW_ENV = "PIPEBENCH_SLOW"  # "pause:F", or "cgroup:<cgroup.procs path>" for a worker that joins it itself
REJOINED_ENV = "PIPEBENCH_REJOINED"  # set in the ranks of a replica's standby (--rejoin), which rejoins the others
REPLICA_ENV = "PIPEBENCH_REPLICA"  # the replica a world of its own holds (a fault-tolerant system's)
FIRST_STEP_ENV = "PIPEBENCH_FIRST_STEP"  # the step a rejoining replica's predecessor died at: it starts no earlier
STANDBY_ENV = "PIPEBENCH_STANDBY"  # a standby's gate (a file the launcher holds locked while the victim lives)
STANDBY_GATE = "standby.gate"  # in the run directory
STARTED = "started"  # the run directory's mark of the first step's start
CGROUP_PREFIX = "pipebench-slow-"
PERIOD_US = 2_000  # the quota's period: short, so that every burst of compute is slowed (not one below the quota)
MIN_QUOTA_US = 1_000  # the kernel's least quota


def _cpu_hierarchy() -> tuple[str, Path] | None:
    """("v1" or "v2", the directory of this process's own CPU cgroup) where a CPU quota can be set,
    else None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        mine = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        _, where, kind, opts, *_ = line.split()
        if kind == "cgroup" and "cpu" in opts.split(","):
            path = next((l.split(":", 2)[2] for l in mine if "cpu" in l.split(":", 2)[1].split(",")), "/")
            return "v1", Path(where) / path.lstrip("/")
    for line in mounts:
        _, where, kind, *_ = line.split()
        if kind == "cgroup2" and "cpu" in (Path(where) / "cgroup.controllers").read_text().split():
            path = next((l.split(":", 2)[2] for l in mine if l.startswith("0::")), "/")
            return "v2", Path(where) / path.lstrip("/")
    return None


def reap_stale_cgroups() -> None:
    """Remove the straggler cgroups of run commands that died before removing them."""
    found = _cpu_hierarchy()
    if found is None or not found[1].is_dir():
        return
    for d in found[1].glob(f"{CGROUP_PREFIX}*"):
        if d.is_dir() and not owner_alive(d.name.removeprefix(CGROUP_PREFIX)):
            _remove_cgroup(d)


def _remove_cgroup(d: Path) -> None:
    for _ in range(50):  # the processes in it may still be ending
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)


class Straggler:
    """A run's ``--slow-rank R:F`` as set up on this machine; a context manager. ``method`` says how
    (the record keeps it); ``procs`` is the cgroup.procs file a process joins to be slowed, None for
    the pause."""

    def __init__(self, cfg: RunConfig, local_ranks: int = 1):
        slow = straggler(cfg)
        assert slow is not None
        self.rank, self.factor = slow
        self.procs: Path | None = None
        self._dir: Path | None = None
        on_gpu = (cfg.hardware or "").startswith("cuda")
        self.method = ("pause after each step: (F - 1) x the rank's own step time" if on_gpu else
                       "pause after each step: (F - 1) x the CPU time of the rank's process in it")
        if not on_gpu:
            self._set_quota(min(1.0, allowed_cores() / max(1, local_ranks)))

    def _set_quota(self, share: float) -> None:
        """A cgroup that caps its processes at ``share``/F of a core (``share``: of a core each of the
        run's ranks here can have), and weighs them 1/F of a process against others when the machine
        is busier than that (the quota alone would then slow the rank less than F times)."""
        found = _cpu_hierarchy()
        if found is None:
            return
        version, parent = found
        period = max(PERIOD_US, int(MIN_QUOTA_US * self.factor / share))
        quota = int(period * share / self.factor)
        d = parent / f"{CGROUP_PREFIX}{owner_tag()}"
        try:
            reap_stale_cgroups()
            d.mkdir()
            if version == "v1":
                (d / "cpu.cfs_period_us").write_text(str(period))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
                (d / "cpu.shares").write_text(str(max(2, int(1024 / self.factor))))
                what = f"cgroup v1 cpu.cfs_quota_us {quota} per cpu.cfs_period_us {period} µs, cpu.shares 1024/F"
            else:
                (d / "cpu.max").write_text(f"{quota} {period}")
                (d / "cpu.weight").write_text(str(max(1, int(100 / self.factor))))
                what = f"cgroup v2 cpu.max {quota} {period} µs, cpu.weight 100/F"
        except OSError:
            if d.is_dir():
                _remove_cgroup(d)
            return
        self._dir, self.procs = d, d / "cgroup.procs"
        self.method = f"CPU quota: 1/{self.factor:g} of {share:.2g} core ({what})"

    def env(self) -> dict[str, str]:
        """The ranks' environment where the worker itself joins (or pauses): ``SLOW_ENV``."""
        return {SLOW_ENV: f"cgroup:{self.procs}" if self.procs else f"pause:{self.factor:g}"}

    def describe(self) -> dict:
        return {"rank": self.rank, "factor": self.factor, "method": self.method}

    def __enter__(self) -> Straggler:
        return self

    def __exit__(self, *exc) -> None:
        if self._dir is not None:
            _remove_cgroup(self._dir)
            self._dir = None


def join_cgroup(procs: str | os.PathLike) -> None:
    """Move this process (every thread) into the cgroup whose cgroup.procs file is ``procs``; safe in
    a preexec_fn."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


@dataclass
class RankHooks(StepHooks):
    """One rank's faults, carried out around its steps (``contract.rank.run_steps``)."""

    run_dir: Path
    rank: int  # the run's rank (in a replica's own world: replica x its size + the world's rank)
    pause_factor: float = 1.0  # a straggler without a quota: pauses F - 1 times its compute
    on_gpu: bool = False
    kill_after: int | None = None  # this rank ends when it has run this many steps
    replica: int | None = None
    world: int = 1  # the run's ranks (every replica's)
    timeout: float = 3600.0

    @classmethod
    def of(cls, cfg: RunConfig, run_dir: Path, rank: int, world: int, on_gpu: bool,
           replica: int | None = None) -> RankHooks:
        """The hooks of run rank ``rank`` of ``world`` ranks (its own replica's world or the whole one)."""
        hooks = cls(run_dir, rank, on_gpu=on_gpu, replica=replica, world=world, timeout=cfg.timeout)
        slow = straggler(cfg)
        how = os.environ.get(SLOW_ENV, "")
        if slow is not None and slow[0] == rank:
            if how.startswith("cgroup:"):
                join_cgroup(how.removeprefix("cgroup:"))
            elif how.startswith("pause:"):
                hooks.pause_factor = slow[1]
        kill = killed(cfg)
        if kill is not None and rank in replica_ranks(cfg, kill[0], world) and not os.environ.get(REJOINED_ENV):
            hooks.kill_after = kill[1]
        return hooks

    def started(self) -> None:
        try:
            os.close(os.open(self.run_dir / STARTED, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass

    def before_step(self, step: int) -> None:
        if self.replica is not None and os.environ.get(REJOINED_ENV) and self.first is None:  # it has rejoined
            self.first = step
            self._progress(None)
        if self.kill_after is not None and step >= self.kill_after:
            (self.run_dir / f"killed-rank{self.rank}.json").write_text(json.dumps(
                {"rank": self.rank, "replica": self.replica, "steps": step, "time": time.time()}))
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def start_together(self) -> None:
        """Every replica's ranks on this machine (replica worlds are one run command's) mark their
        start in the run directory and wait for all the marks."""
        if self.replica is None or os.environ.get(REJOINED_ENV):
            return
        (self.run_dir / f"ready-rank{self.rank}").touch()
        deadline = time.monotonic() + self.timeout
        while len(list(self.run_dir.glob("ready-rank*"))) < self.world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other replicas did not start within {self.timeout:g} s")
            time.sleep(0.05)

    def take_place(self) -> None:
        """A standby's rank: return once the replica it stands in for is gone (the launcher holds the
        gate ``STANDBY_ENV`` names locked until then: ``launcher.ReplicaFaults``), or the launcher is
        (its lock goes with it)."""
        gate = os.environ.get(STANDBY_ENV)
        if gate is None:
            return
        with open(gate) as f:
            fcntl.flock(f, fcntl.LOCK_SH)

    def after_step(self, step: int, own_s: float, busy_s: float) -> None:
        if self.pause_factor > 1:
            time.sleep((self.pause_factor - 1) * (own_s if self.on_gpu else busy_s))
        if self.replica is not None and os.environ.get(REJOINED_ENV):  # the steps it ran, should it be stopped
            self._progress(step)

    def _progress(self, last: int | None) -> None:
        """A rejoined replica's steps so far: [its first step, the last it finished (None: none yet)]."""
        (self.run_dir / f"progress-rank{self.rank}-rejoined.json").write_text(json.dumps([self.first, last]))

    first: int | None = None  # a rejoined replica's first step




def killed_ranks(run_dir: Path) -> list[dict]:
    """What the ranks killed by --kill-replica wrote before dying (rank, replica, steps, time)."""
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("killed-rank*.json"),
                                                      key=lambda p: int(re.sub(r"\D", "", p.stem)))]


"""Slurm mode of the sweep: every run inside a Slurm allocation, its ranks started by srun + torchrun.

Inside an allocation (a batch script, or salloc; ``runners/run_all.sh --slurm``) the sweep reads
its nodes from SLURM_JOB_NODELIST (``scontrol show hostnames``) and the GPUs per node from the
allocation (``read_allocation``), places each run as the cluster mode does (``hostfile.place``: as
few ranks per node as fit), and starts it with one srun over the run's nodes, one task per node,
torchtitan's ``multinode_trainer.slurm`` pattern::

    srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node01,node02 --overlap --label ... \\
        python -m runners.run RUN_ARGS --nnodes 2 --rdzv-endpoint node01:29500 --node-rank $SLURM_NODEID

The run command starts torchrun on each node with its rendezvous at node 0 (the step's first node,
SLURM_NODEID 0), as in the cluster mode. The run's network is shaped on each of its nodes through
srun (``SrunShapingSession``: netem, else tbf plus the delayer) and cleared afterwards; the link
between its first two nodes is probed once per network setting; node 0's record is fetched through
srun, with the shaping and the measured link in ``environment.network`` and the placement (launcher
``slurm``, the job id) in ``environment.cluster``.

A failed node is named from srun's own words: ``Node failure on nodeX`` (Slurm lost the node: its
slurmd stopped answering), ``nodeX: task i: Exited with exit code C`` or ``...: Killed``, ``Task
launch ... failed on node nodeX``. As in the cluster mode, once a node has failed the others get
``GRACE_S`` to stop on their own (node 0 then writes its own record), then the step is interrupted
(``scancel --signal=INT``) and cancelled ``STOP_S`` later. A node Slurm lost is left out of the
later runs' placement (a run that then does not fit is recorded ``unfit``). Every task runs under
the step guard (``network_emulation.slurm_step``): on a node whose slurmd died, the run's processes
and its shaping end once Slurm has given the step up.

The suite and its python must be at the same path on every node (a shared file system, where a
Slurm job's working directory lives): one srun starts the same command everywhere.
"""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from network_emulation import parse_profile
from network_emulation.signals import signals_deferred
from network_emulation.slurm_step import guarded, srun_argv
from network_emulation.srun_shaping import SrunShapingSession
from runners.output import Pump, is_peer_failure
from runners.sweep.cluster import GRACE_S, STOP_S, ClusterExecutor
from runners.sweep.execute import SAFETY_MARGIN_S
from runners.sweep.hostfile import Host, NodePlacement, place
from runners.sweep.plan import PlannedRun, SweepError

__all__ = ["Allocation", "SlurmExecutor", "StepWatch", "read_allocation"]

HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
# In each task: the results directory, then the command with this node's rank appended.
TASK = 'mkdir -p results && exec "$@" --node-rank "$SLURM_NODEID"'
# srun's words (Slurm 22.05 to 24.x) about a step's tasks and nodes.
_LABELLED = re.compile(r"^\s*(\d+): ?(.*)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")
_LAUNCH_FAILED = re.compile(r"^srun: error: Task launch for \S+ failed on node (\S+): (.*)$")
_TASK_ENDED = re.compile(r"^srun: error: (\S+): tasks? [\d,-]+: (.*)$")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation the sweep runs in."""

    job_id: str
    hosts: tuple[str, ...]  # SLURM_JOB_NODELIST expanded, in Slurm's order
    gpus_per_node: int  # GPUs on each node; an allocation without GPUs: its tasks per node
    gpus_from: str  # where that number came from (the variable), for messages

    def slots(self, nproc_per_node: int | None = None) -> list[Host]:
        """Every node with ``nproc_per_node`` GPU slots (default: all the allocation gives it). Asking for
        more than the allocation holds raises SweepError."""
        if nproc_per_node is None:
            return [Host(h, self.gpus_per_node) for h in self.hosts]
        if nproc_per_node < 1:
            raise SweepError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
        if nproc_per_node > self.gpus_per_node:
            raise SweepError(f"--nproc-per-node {nproc_per_node} asks for more GPUs per node than the allocation "
                             f"holds ({self.gpus_per_node}, from {self.gpus_from})")
        return [Host(h, nproc_per_node) for h in self.hosts]


def expand_nodelist(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: the host names, in order; SweepError when Slurm cannot
    expand it into host names."""
    if shutil.which("scontrol") is None:
        raise SweepError("scontrol not found: --slurm runs inside a Slurm allocation, on a node with Slurm's commands")
    try:
        p = subprocess.run(["scontrol", "show", "hostnames", nodelist], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise SweepError(f"scontrol show hostnames {nodelist!r} did not answer within 60 s") from None
    names, errors = p.stdout.split(), [l for l in p.stderr.strip().splitlines() if l.strip()]
    bad = [n for n in names if not HOST_NAME.fullmatch(n)]
    if p.returncode != 0 or errors or not names or bad:
        why = errors[-1] if errors else (f"it gives {' '.join(bad)!r}" if bad else "it gives no host")
        raise SweepError(f"SLURM_JOB_NODELIST={nodelist!r} cannot be expanded into host names "
                         f"(scontrol show hostnames: {why})")
    return names


def _count(variable: str, value: str) -> int:
    """A GPU count from SLURM_GPUS_ON_NODE ("4") or SLURM_GPUS_PER_NODE ("4", "a100:4", "gpu:a100:4")."""
    m = re.fullmatch(r"(?:[\w-]+:)*(\d+)", value.split(",")[0].strip())
    if not m:
        raise SweepError(f"cannot read a GPU count from {variable}={value!r}")
    return int(m.group(1))


def gpus_per_node(env: Mapping[str, str]) -> tuple[int, str]:
    """The allocation's GPUs per node and the variable that says so: SLURM_GPUS_ON_NODE (set on the
    batch node whenever it holds GPUs), SLURM_GPUS_PER_NODE (--gpus-per-node), SLURM_JOB_GPUS (their
    indices); an allocation without GPUs offers its tasks per node (SLURM_NTASKS_PER_NODE, the first of
    SLURM_TASKS_PER_NODE, else 1): on CPU a rank per task. Nodes are taken to hold the same count."""
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        if env.get(var, "").strip():
            count = _count(var, env[var])
            if count > 0:
                return count, var
    if env.get("SLURM_JOB_GPUS", "").strip():
        return len([g for g in env["SLURM_JOB_GPUS"].split(",") if g.strip()]), "SLURM_JOB_GPUS"
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        m = re.match(r"\s*(\d+)", env.get(var, ""))
        if m and int(m.group(1)) > 0:
            return int(m.group(1)), f"{var}, an allocation without GPUs"
    return 1, "one task per node, an allocation without GPUs"


def read_allocation(env: Mapping[str, str]) -> Allocation:
    """The allocation this process runs in, from Slurm's variables; SweepError (one line) when there is
    none or its node list cannot be expanded."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not nodelist:
        raise SweepError("--slurm: not inside a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST are not set): "
                         "submit it (runners/run_all.sh --slurm-submit [sbatch options]) or run it under salloc")
    gpus, source = gpus_per_node(env)
    return Allocation(job, tuple(expand_nodelist(nodelist)), gpus, source)


@dataclass(frozen=True)
class Failure:
    """A node's failure as srun reported it."""

    at: float  # time.monotonic() when the line came
    host: str
    kind: str  # "lost" (Slurm lost the node), "launch" (its task did not start), "ended" (its task ended badly)
    detail: str  # srun's words: the task's end ("Exited with exit code 1", "Killed") or why it did not start


class StepWatch:
    """Reads a step's output as it comes (``see``, a Pump intercept): every task's last line (``--label``
    prefixes them with the task number, task i on ``hosts[i]``) and srun's reports of failed tasks and
    nodes, until ``stopping`` is set (what the stop itself ends is not to blame)."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = tuple(hosts)
        self.failures: list[Failure] = []
        self.last: dict[str, str] = {}
        self.stopping = False
        self._lost: set[str] = set()
        self._lock = threading.Lock()

    def see(self, line: str) -> bool:
        text, now = line.rstrip("\n"), time.monotonic()
        with self._lock:
            if m := _LABELLED.match(text):
                task = int(m.group(1))
                if m.group(2).strip() and task < len(self.hosts):
                    self.last[self.hosts[task]] = m.group(2).strip()
            elif m := _NODE_FAILURE.match(text):
                self._lost.add(m.group(1))  # (left out of later runs even when the stop came first)
                if not self.stopping:
                    self.failures.append(Failure(now, m.group(1), "lost", ""))
            elif self.stopping:
                pass
            elif m := _LAUNCH_FAILED.match(text):
                self.failures.append(Failure(now, m.group(1), "launch", m.group(2).strip()))
            elif m := _TASK_ENDED.match(text):
                self.failures.append(Failure(now, m.group(1), "ended", m.group(2).strip()))
        return False  # every line is kept and logged

    @property
    def first_failure(self) -> float | None:
        with self._lock:
            return min((f.at for f in self.failures), default=None)

    @property
    def lost(self) -> set[str]:
        """The nodes srun said Slurm lost."""
        with self._lock:
            return set(self._lost)

    def blame(self) -> str | None:
        """Which node failed first, and how: a node Slurm lost before a task that did not start, before a
        task that ended with an error of its own, before one whose last words say a peer went away."""
        with self._lock:
            failures = list(self.failures)
        if not failures:
            return None

        def rank(f: Failure) -> tuple[int, float]:
            order = {"lost": 0, "launch": 1}.get(f.kind, 3 if is_peer_failure(self.last.get(f.host, "")) else 2)
            return order, f.at

        f = min(failures, key=rank)
        if f.kind == "lost":
            how = "Slurm lost the node (its slurmd stopped answering: the node went down or its slurmd died)"
        elif f.kind == "launch":
            how = f"its task did not start ({f.detail})"
        elif m := _EXIT_CODE.search(f.detail):
            how = f"its run command exited with status {m.group(1)}"
        else:
            how = f"its run command ended: {f.detail}"
        last = self.last.get(f.host, "")
        return f"{f.host} failed first: {how}" + (f": {last}" if last and f.kind == "ended" else "")


@dataclass
class SlurmExecutor(ClusterExecutor):
    """Runs one planned run on the nodes of the current Slurm allocation (``executor(run, out) -> (exit
    status, output tail)``; raises DoesNotFit, after recording it, for a run the allocation cannot hold)."""

    allocation: Allocation | None = None
    lost: set[str] = field(default_factory=set)  # nodes Slurm lost during this sweep

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.allocation is None:
            raise ValueError("SlurmExecutor needs the allocation")
        for what, value in (("--remote-dir", self.remote_dir), ("--remote-python", self.remote_python)):
            if "{host}" in (value or ""):
                raise SweepError(f"{what} with {{host}} is for hostfile clusters: one srun starts the same command "
                                 "on every node (the suite must be at the same path on every node)")

    # ------------------------------------------------------------------ commands
    def place(self, run: PlannedRun) -> NodePlacement:
        hosts = [h for h in self.hosts if h.name not in self.lost]
        source = "the allocation" + (f" (without {', '.join(sorted(self.lost))}, lost)" if self.lost else "")
        return place(run.world, hosts, devices_per_process=run.devices_per_process, ranks_per_node=run.nproc_per_node,
                     emulated=run.emulated, source=source)

    def remote(self, host: str, argv: list[str]) -> list[str]:
        """argv running ``argv`` on ``host`` as a step of its own (e.g. to fetch node 0's record)."""
        return srun_argv([host], argv, chdir=self.dir_on(host))

    def run_step_argv(self, run: PlannedRun, nodes: NodePlacement, remote_out: str, name: str) -> list[str]:
        """The srun that starts the run command on every node of the run, each with its node rank
        (SLURM_NODEID) and the interface for gloo and NCCL (and NCCL kept on it under a shaped network),
        under the step guard."""
        python = self.python_on(nodes.hosts[0])
        run_command = [python, "-m", "runners.run", *run.args, "--nnodes", str(nodes.nnodes),
                       "--rdzv-endpoint", f"{nodes.hosts[0]}:{self.port}", "--out", remote_out]
        env = {"GLOO_SOCKET_IFNAME": self.iface, **self.nccl_env(run)}
        task = ["sh", "-c", TASK, "task", "env", *(f"{k}={v}" for k, v in env.items()), *guarded(python, run_command)]
        return srun_argv(nodes.hosts, task, chdir=self.dir_on(nodes.hosts[0]), label=True, name=name)

    def launch_argvs(self, run: PlannedRun, nodes: NodePlacement, remote_out: str) -> list[list[str]]:
        return [self.run_step_argv(run, nodes, remote_out, "pipebench-RUN")]

    def shaping(self, run: PlannedRun, hosts: tuple[str, ...], out: IO = sys.stdout):
        if not run.emulated:
            return contextlib.nullcontext()
        assert self.remote_python is not None
        return SrunShapingSession(parse_profile(run.network), self.iface, list(hosts), dry_run=self.dry_run,
                                  sudo=self.sudo, out=out, remote_dir=self.remote_dir, remote_python=self.remote_python,
                                  backends=self.backends)

    def cluster_environment(self, run: PlannedRun, nodes: NodePlacement) -> dict[str, Any]:
        assert self.allocation is not None
        return {**super().cluster_environment(run, nodes), "launcher": "slurm", "job_id": self.allocation.job_id}

    # ------------------------------------------------------------------ one run
    def _launch(self, run: PlannedRun, nodes: NodePlacement, remote_out: str,
                tail: list[str]) -> tuple[str | None, bool]:
        """Start the run's step and watch it, its output into ``tail``: (which node failed first and how,
        or None; whether the run overran its timeout)."""
        name = f"pipebench-{uuid.uuid4().hex[:12]}"
        watch = StepWatch(nodes.hosts)
        deadline = time.monotonic() + run.timeout + SAFETY_MARGIN_S
        timed_out = False
        # Its own session: a Ctrl-C on the terminal reaches the sweep, which then stops the step in order.
        p = subprocess.Popen(self.run_step_argv(run, nodes, remote_out, name), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        pump = Pump(p.stdout, [self.log] if self.log else [], keep=200, intercept=watch.see)
        try:
            while p.poll() is None:
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    break
                first = watch.first_failure
                if first is not None and now - first > GRACE_S:
                    break
                time.sleep(0.2)
        finally:
            with signals_deferred():
                watch.stopping = True
                if p.poll() is None:
                    self._stop_step(p, name)
                pump.join(timeout=5)
        lines = [line.rstrip("\n") for line in pump.lines]
        first = [l for l in lines if not l.startswith("0: ")]
        tail.extend([*first, *(l for l in lines if l.startswith("0: "))])  # node 0's lines (its run's summary) last
        self.lost |= watch.lost
        if timed_out:
            return (f"slurm: the run exceeded its timeout ({run.timeout:g} s + {SAFETY_MARGIN_S:g} s); "
                    "its step was stopped"), True
        return watch.blame(), False

    def _step_id(self, name: str) -> str | None:
        """JOB.STEP of this job's step named ``name`` (None if Slurm has none running)."""
        assert self.allocation is not None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            p = subprocess.run(["squeue", f"--jobs={self.allocation.job_id}", "--steps", "--noheader",
                                "--format=%i %j"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
            for line in p.stdout.splitlines():
                words = line.split()
                if len(words) == 2 and words[1] == name:
                    return words[0]
        return None

    def _stop_step(self, p: subprocess.Popen, name: str) -> None:
        """Interrupt the step's tasks (SIGINT: each run command stops its ranks), cancel the step STOP_S
        later, and end srun if it still waits."""
        step = self._step_id(name)
        if step is None:  # not (or no longer) known to Slurm: srun forwards SIGTERM to whatever it started
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=STOP_S)
                return
        else:
            for argv, wait in ((["scancel", "--signal=INT", step], STOP_S), (["scancel", step], 30.0)):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=wait)
                    return
        p.kill()
        p.wait()

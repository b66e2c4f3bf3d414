"""A real Slurm on virtual nodes: munged and slurmd on every node, slurmctld on the first, so that the
suite's Slurm mode (srun, sbatch) can be rehearsed on one machine.

    with VirtualNodes(2, directory) as vn, SlurmOnNodes(vn, gpus_per_node=1) as slurm:
        subprocess.run(vn.ssh_argv("node01", ["sbatch", "--wait", "--nodes=2", "job.sh"]))

Debian's slurm-wlm (slurmctld, slurmd, slurm-client) and munge, which ``scripts/setup_env.sh``
installs as root. Everything lives under DIR/slurm (DIR: the nodes' directory): the configuration
(``etc/``: slurm.conf, gres.conf, cgroup.conf), the munge key, the controller's state and log, and
per node its slurmd spool, log and munge socket. Each node sees it where a cluster node has it: the
daemons are started over ssh, in the node's own mount namespace, after two bind mounts there:
DIR/slurm/etc on /etc/slurm (every srun, sbatch and scontrol on the node reads it) and the node's
own munge directory on the socket path of slurm.conf (each node has its own munged, as each machine
of a cluster has). Nothing of this machine's /etc/slurm or munge is used or changed.

- No cgroups (a node's /sys is its network namespace's): proctrack/linuxproc, task/none.
- The nodes' GPUs: ``gpus_per_node`` generic resources ``gpu`` per node, each backed by a device file
  under DIR/slurm/gpus that is a copy of /dev/null (Slurm drops a GPU without a file), so that an
  allocation carries GPUs as on a cluster (``--gpus-per-node``, SLURM_GPUS_ON_NODE); the ranks run
  on CPU all the same. The rehearsal's equivalent of the hostfile's ``slots=1``.
- SlurmdTimeout is 10 s: a node whose slurmd dies is DOWN ("Not responding") 10-30 s later.
- Every task gets its node's own temporary directory (TaskProlog: TMPDIR=DIR/<node>/tmp, the one its
  ssh sessions get), as each machine of a cluster has its own /tmp: a job's environment is the
  submitter's, and the nodes share one file system.

``close()`` cancels every job, stops the daemons by their pid files and removes the mounts, the key
and the configuration (logs stay). The daemons live in the nodes' pid namespaces: if this process is
killed outright, the nodes' own teardown ends them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from network_emulation import netem
from network_emulation.signals import Guarded, signals_deferred

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
INSTALL = "apt-get install -y slurmctld slurmd slurm-client munge (or run scripts/setup_env.sh as root)"
ETC_SLURM = Path("/etc/slurm")
SLURMD_TIMEOUT_S = 10
# In a node (over ssh): the two bind mounts, then its munged. Constant text; values are positional.
NODE_MOUNTS_AND_MUNGE = ('set -e; mount --bind "$1" /etc/slurm; mount --bind "$2" "$3"; '
                         'exec munged --force --key-file="$4" --socket="$3/munge.socket.2" --pid-file="$2/munged.pid" '
                         '--seed-file="$2/munged.seed" --log-file="$5"')
# In a node: TERM the daemons named by the pid files given, KILL them 5 s later, unmount.
NODE_DOWN = ('mounts="$1 $2"; shift 2; pids=""; for f in "$@"; do [ -s "$f" ] && pids="$pids $(cat "$f")"; done; '
             'alive=$pids; [ -n "$pids" ] && kill -TERM $pids 2>/dev/null; '
             'for i in $(seq 50); do alive=""; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done; '
             '[ -z "$alive" ] && break; sleep 0.1; done; [ -n "$alive" ] && kill -KILL $alive 2>/dev/null; '
             'for m in $mounts; do umount "$m" 2>/dev/null; done; true')


class SlurmError(RuntimeError):
    """Slurm did not come up on the nodes; the message names the node and its log."""


_UNREACHABLE = (OSError, subprocess.SubprocessError, SlurmError)  # teardown goes on past a node that does not answer


def slurm_conf(directory: Path, nodes: Sequence[tuple[str, str]], gpus_per_node: int, cpus: int) -> str:
    """slurm.conf for ``nodes`` ((name, address), the first runs slurmctld), everything under ``directory``."""
    controller, address = nodes[0]
    lines = [
        f"# Slurm on {len(nodes)} virtual node(s) (written by tools.slurm_nodes; removed when it stops)",
        "ClusterName=pipebench",
        f"SlurmctldHost={controller}({address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={directory / 'munge' / 'munge.socket.2'}",
        f"StateSaveLocation={directory / 'ctld'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdSpoolDir={directory / '%n' / 'spool'}",
        f"SlurmdPidFile={directory / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={directory / '%n' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        f"TaskProlog={directory / 'etc' / 'task_prolog.sh'}",
        "ReturnToService=2",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        "InactiveLimit=0",
        "KillWait=5",
        "GresTypes=gpu",
        *(f"NodeName={name} NodeAddr={addr} CPUs={cpus} Gres=gpu:{gpus_per_node} State=UNKNOWN"
          for name, addr in nodes),
        "PartitionName=rehearsal Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ]
    return "\n".join(lines)


def task_prolog(node_directory: Path) -> str:
    """The tasks' prolog: TMPDIR is the node's own (``node_directory``/<node>/tmp); slurmstepd reads the
    ``export`` lines it prints into the task's environment."""
    return f'#!/bin/sh\necho "export TMPDIR={node_directory}/$SLURMD_NODENAME/tmp"\n'


def gres_conf(directory: Path, gpus_per_node: int) -> str:
    """gres.conf: every node's GPUs are the device files DIR/gpus/gpu0..N-1 (copies of /dev/null)."""
    files = ",".join(str(directory / "gpus" / f"gpu{i}") for i in range(gpus_per_node))
    return f"Name=gpu File={files}\n"


class SlurmOnNodes(Guarded):
    """Slurm on the started virtual nodes ``vn`` (a ``tools.nodes.VirtualNodes``); a context
    manager. After ``start()``: ``controller`` (the first node's name), ``directory``, and
    ``submit_argv(argv)`` (runs ``argv`` on the controller, the cluster's login node)."""

    def __init__(self, vn, gpus_per_node: int = 1, log: TextIO | None = sys.stderr) -> None:
        if gpus_per_node < 1:
            raise ValueError(f"gpus per node must be >= 1, got {gpus_per_node}")
        self.vn, self.gpus_per_node, self.log = vn, gpus_per_node, log
        self.directory = Path(vn.directory) / "slurm"
        self.names = [n.name for n in vn.nodes]
        self.controller = self.names[0] if self.names else ""
        self._created_etc = False
        self._controller_started = False
        self._open = False

    def on(self, node: str, argv: Sequence[str]) -> list[str]:
        """ssh argv running ``argv`` on ``node``."""
        return self.vn.ssh_argv(node, list(argv))

    def submit_argv(self, argv: Sequence[str]) -> list[str]:
        return self.on(self.controller, argv)

    def node_dir(self, name: str) -> Path:
        return self.directory / name

    # ------------------------------------------------------------------ lifecycle (Guarded)
    def start(self) -> None:
        netem.require_root("Slurm on virtual nodes")
        missing = [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t) is None]
        if missing:
            raise FileNotFoundError(f"Slurm missing ({', '.join(missing)}): {INSTALL}")
        if not self.names:
            raise ValueError("Slurm needs started virtual nodes")
        self._open = True
        t0 = time.monotonic()
        self._write_files()
        if not ETC_SLURM.exists():
            ETC_SLURM.mkdir(mode=0o755)
            self._created_etc = True
        d = self.directory
        self._on_all(lambda n: [
            "sh", "-c", NODE_MOUNTS_AND_MUNGE, "slurm-up", str(d / "etc"), str(self.node_dir(n) / "munge"),
            str(d / "munge"), str(d / "munge.key"), str(self.node_dir(n) / "munged.log")], "munged")
        self._run(self.controller, ["slurmctld", "-c"], "slurmctld")
        self._controller_started = True
        self._on_all(lambda n: ["slurmd"], "slurmd")
        self._wait_idle(timeout_s=30 + len(self.names))
        if self.log:
            print(f"network_emulation: Slurm up in {time.monotonic() - t0:.1f} s: slurmctld on {self.controller}, "
                  f"slurmd and munged on {len(self.names)} node(s) with {self.gpus_per_node} GPU(s) each "
                  f"(config {d / 'etc' / 'slurm.conf'})", file=self.log, flush=True)

    def close(self) -> None:
        """Cancel every job, stop the daemons, remove the mounts and the generated files; safe to call twice."""
        if not self._open:
            return
        with signals_deferred():
            with contextlib.suppress(*_UNREACHABLE):
                if self._controller_started:
                    subprocess.run(self.on(self.controller, ["scancel", "--user=root"]), stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=30)
                end = time.monotonic() + 15
                while time.monotonic() < end and self._jobs_left():
                    time.sleep(0.2)

            def down(n: str) -> list[str]:
                pids = [self.node_dir(n) / "slurmd.pid", self.node_dir(n) / "munge" / "munged.pid"]
                if n == self.controller:
                    pids.insert(1, self.directory / "slurmctld.pid")
                return ["sh", "-c", NODE_DOWN, "slurm-down", str(ETC_SLURM), str(self.directory / "munge"),
                        *map(str, pids)]

            with contextlib.suppress(*_UNREACHABLE):
                self._on_all(down, "stopping Slurm", check=False)
            if self._created_etc:
                with contextlib.suppress(*_UNREACHABLE):
                    ETC_SLURM.rmdir()
            self._remove_files()
            self._open = False

    # ------------------------------------------------------------------ files
    def _write_files(self) -> None:
        d = self.directory
        for sub in ("etc", "ctld", "munge", "gpus"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        addresses = [(n.name, n.address) for n in self.vn.nodes]
        (d / "etc" / "slurm.conf").write_text(slurm_conf(d, addresses, self.gpus_per_node, os.cpu_count() or 1))
        (d / "etc" / "gres.conf").write_text(gres_conf(d, self.gpus_per_node))
        (d / "etc" / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # loaded, never mounted: no cgroup plugins
        prolog = d / "etc" / "task_prolog.sh"
        prolog.write_text(task_prolog(Path(self.vn.directory)))
        prolog.chmod(0o755)
        key = d / "munge.key"
        key.unlink(missing_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        for i in range(self.gpus_per_node):
            dev = d / "gpus" / f"gpu{i}"
            dev.unlink(missing_ok=True)
            os.mknod(dev, 0o644 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        for n in self.names:
            nd = self.node_dir(n)
            (nd / "spool").mkdir(parents=True, exist_ok=True)
            (nd / "munge").mkdir(mode=0o700, exist_ok=True)
            for stale in (nd / "slurmd.pid", nd / "munge" / "munged.pid"):
                stale.unlink(missing_ok=True)
        (d / "slurmctld.pid").unlink(missing_ok=True)

    def _remove_files(self) -> None:
        d = self.directory
        generated = ("munge.key", "slurmctld.pid", *(f"etc/{c}" for c in ("slurm.conf", "gres.conf", "cgroup.conf",
                                                                           "task_prolog.sh")))
        for f in (*generated, *(f"gpus/gpu{i}" for i in range(self.gpus_per_node))):
            (d / f).unlink(missing_ok=True)
        shutil.rmtree(d / "ctld", ignore_errors=True)

    # ------------------------------------------------------------------ nodes
    def _run(self, node: str, argv: list[str], what: str, check: bool = True) -> None:
        p = subprocess.run(self.on(node, argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            err = (p.stderr or p.stdout).strip().splitlines()
            raise SlurmError(f"{what} did not start on {node}: {err[-1] if err else f'exit {p.returncode}'} "
                             f"({self._log_tail(node, what)})")

    def _on_all(self, argv_of, what: str, check: bool = True) -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            for f in [pool.submit(self._run, n, argv_of(n), what, check) for n in self.names]:
                f.result()

    def _log_tail(self, node: str, what: str) -> str:
        log = {"slurmctld": self.directory / "slurmctld.log", "munged": self.node_dir(node) / "munged.log"}.get(
            what, self.node_dir(node) / "slurmd.log")
        try:
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"no log at {log}"
        return f"{log}: {lines[-1]}" if lines else f"{log} is empty"

    def states(self) -> dict[str, str]:
        """Node name -> its state as sinfo says it (idle, idle*, down*, ...); {} if the controller does not answer."""
        p = subprocess.run(self.on(self.controller, ["sinfo", "--noheader", "--Node", "--format=%N %T"]),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            return {}
        return dict(line.split()[:2] for line in p.stdout.splitlines() if len(line.split()) >= 2)

    def _wait_idle(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while True:
            states = self.states()
            waiting = [n for n in self.names if states.get(n) != "idle"]
            if not waiting:
                return
            if time.monotonic() > end:
                n = waiting[0]
                raise SlurmError(f"Slurm: {', '.join(waiting)} not idle after {timeout_s:.0f} s "
                                 f"({n}: {states.get(n, 'the controller does not answer')}; "
                                 f"{self._log_tail(n, 'slurmd' if states else 'slurmctld')})")
            time.sleep(0.3)

    def _jobs_left(self) -> bool:
        p = subprocess.run(self.on(self.controller, ["squeue", "--noheader", "--format=%i"]), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=30)
        return p.returncode == 0 and bool(p.stdout.strip())

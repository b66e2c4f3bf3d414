"""Cluster mode of the sweep: one run across real hosts over ssh, under netem.

For each run: pick the nodes (the first N of the hostfile), apply the run's network profile on
every node's interface (network_emulation's NetemSession over ssh), start the run command on every
node with ``--nnodes N --node-rank i --rdzv-endpoint node0:PORT``, copy node 0's record back into
the sweep's out file, and clear netem: always, also on errors and Ctrl-C.

Every command is an argument list; the one command line that crosses ssh is built with shlex
quoting (``network_emulation.netem.ssh_argv``), so no value from a sweep file or hostfile reaches a
shell unquoted. The run command does not apply netem itself when given multi-node flags.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from network_emulation import NetemSession, parse_profile
from network_emulation.netem import ssh_argv
from runners.output import Pump
from runners.record import append_line, append_record, build_record
from runners.registry import get_system
from runners.request import build_parser, config_from_args
from runners.sweep.execute import SAFETY_MARGIN_S
from runners.sweep.plan import PlannedRun, Sweep, SweepError

PID_MARK = "@@sweep-remote-pid="
GRACE_S = 20.0  # once a node has failed, how long the others get to stop on their own


def parse_hostfile(path: str | os.PathLike) -> list[str]:
    """One host per line (the first is node 0); blank lines and '#' comments are ignored.
    A line is taken whole as the host name: it is never split or interpreted."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SweepError(f"cannot read hostfile {path}: {e.strerror}") from None
    hosts = []
    for n, line in enumerate(text.splitlines(), 1):
        host = line.split("#", 1)[0].strip()
        if not host:
            continue
        if host.startswith("-"):
            raise SweepError(f"{path}:{n}: bad host name {host!r}")
        hosts.append(host)
    if not hosts:
        raise SweepError(f"hostfile {path} lists no hosts")
    return hosts


def placement(world: int, n_hosts: int, nproc_per_node: int | None = None) -> tuple[int, int]:
    """(nodes, ranks per node) for ``world`` ranks: the given ranks per node, or as few per node as
    spreads the run over at most ``n_hosts`` nodes evenly. ValueError if it does not fit."""
    if nproc_per_node is None:
        nproc_per_node = next(n for n in range(-(-world // n_hosts), world + 1) if world % n == 0)
    if world % nproc_per_node:
        raise ValueError(f"{world} ranks do not divide into nodes of {nproc_per_node}")
    nnodes = world // nproc_per_node
    if nnodes > n_hosts:
        raise ValueError(f"{world} ranks at {nproc_per_node} per node need {nnodes} nodes; the hostfile has {n_hosts}")
    return nnodes, nproc_per_node


@dataclass
class ClusterExecutor:
    hosts: list[str]
    iface: str = "eth0"
    nproc_per_node: int | None = None  # overrides the sweep file's hint
    ssh_user: str | None = None
    sudo: bool = False
    remote_dir: str = str(Path(__file__).resolve().parent.parent)
    remote_python: str = sys.executable
    port: int = 29500
    dry_run: bool = False
    log: object = None
    cluster = True

    def target(self, host: str) -> str:
        return f"{self.ssh_user}@{host}" if self.ssh_user else host

    def place(self, run: PlannedRun) -> tuple[int, int]:
        return placement(run.world, len(self.hosts), self.nproc_per_node or run.nproc_per_node)

    def run_argv(self, run: PlannedRun, node_rank: int, nnodes: int, remote_out: str) -> list[str]:
        """The run command on one node (an argument list)."""
        return [self.remote_python, "-m", "runners.run", *run.args, "--nnodes", str(nnodes),
                "--node-rank", str(node_rank), "--rdzv-endpoint", f"{self.hosts[0]}:{self.port}", "--out", remote_out]

    def node_argv(self, run: PlannedRun, node_rank: int, nnodes: int, remote_out: str) -> list[str]:
        """ssh argv that starts the run command on node ``node_rank``: it reports its pid first (so
        that an interrupted sweep can stop it), then becomes the run command in the suite's directory."""
        script = (f"echo {shlex.quote(PID_MARK)}$$ && cd {shlex.quote(self.remote_dir)} && exec "
                  + shlex.join(self.run_argv(run, node_rank, nnodes, remote_out)))
        return ssh_argv(self.target(self.hosts[node_rank]), ["sh", "-c", script])

    def remote_out(self) -> str:
        return posixpath.join(self.remote_dir, "results", f".cluster-{uuid.uuid4().hex[:12]}.jsonl")

    def netem(self, run: PlannedRun, hosts: Sequence[str], out=sys.stdout):
        if not run.emulated:
            return contextlib.nullcontext()
        return NetemSession(parse_profile(run.network), self.iface, hosts=[self.target(h) for h in hosts],
                            dry_run=self.dry_run, sudo=self.sudo, out=out)

    # ------------------------------------------------------------------ dry run

    def print_plan(self, sweep: Sweep, runs: list[PlannedRun], out: Path, stream=sys.stdout) -> int:
        print(f"sweep {sweep.name} on {len(self.hosts)} host(s): {len(runs)} run(s), records into {out}", file=stream)
        for run in runs:
            if not run.valid:
                print(f"\n# skip (bad combination): {run.label()}\n#   {run.error}", file=stream)
                continue
            try:
                nnodes, nproc = self.place(run)
            except ValueError as e:
                print(f"\n# skip (does not fit): {run.label()}\n#   {e}", file=stream)
                continue
            print(f"\n# {run.label()}  ({nnodes} node(s) x {nproc} rank(s), network {run.network})", file=stream)
            remote_out = self.remote_out()
            hosts = self.hosts[:nnodes]
            session = self.netem(run, hosts, out=stream)
            if run.emulated:
                session.__enter__()
            for i in range(nnodes):
                print(shlex.join(self.node_argv(run, i, nnodes, remote_out)), file=stream)
            if run.emulated:
                session.__exit__(None, None, None)
        return 0

    # ------------------------------------------------------------------ one run

    def __call__(self, run: PlannedRun, out: Path) -> tuple[int, str]:
        try:
            nnodes, _ = self.place(run)
        except ValueError as e:
            return 2, f"does not fit the cluster: {e}"
        hosts = self.hosts[:nnodes]
        remote_out = self.remote_out()
        tail: list[str] = []
        rc = 1
        try:
            with self.netem(run, hosts, out=self.log or sys.stdout):
                rc = self._launch(run, nnodes, remote_out, tail)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # netem or ssh trouble: the run did not happen
            tail.append(f"cluster: {type(e).__name__}: {e}")
            rc = 1
        finally:
            got = self._collect(hosts[0], remote_out, out)
        if not got and rc != 2:
            self._record_failure(run, out, hosts, tail[-1] if tail else f"no record from {hosts[0]}")
            rc = rc or 1
        return rc, "\n".join(tail)

    def _launch(self, run: PlannedRun, nnodes: int, remote_out: str, tail: list[str]) -> int:
        procs, pids, pumps = [], {}, []
        lock = threading.Lock()

        def pid_of(i: int):
            def intercept(line: str) -> bool:
                if line.startswith(PID_MARK):
                    pids[i] = line[len(PID_MARK):].strip()
                    return True
                return False
            return intercept

        deadline = time.monotonic() + run.timeout + SAFETY_MARGIN_S
        try:
            for i in range(nnodes):
                p = subprocess.Popen(self.node_argv(run, i, nnodes, remote_out), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                procs.append(p)
                pumps.append(Pump(p.stdout, [self.log] if self.log else [], prefix=f"[node {i}] ", keep=40,
                                  intercept=pid_of(i), lock=lock))
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    tail.append("cluster: run exceeded its timeout; stopping the nodes")
                    break
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > GRACE_S:
                    break
                time.sleep(0.2)
        finally:
            if any(p.poll() is None for p in procs):
                self._stop(procs, pids)
            for pump in pumps:
                pump.join(timeout=5)
            tail[:0] = [line.rstrip("\n") for pump in pumps for line in pump.lines]
        return procs[0].returncode if procs and procs[0].returncode is not None else 1

    def stop_argv(self, node_rank: int, pid: str) -> list[str]:
        """Interrupt the run command on a node (it then stops its own ranks)."""
        return ssh_argv(self.target(self.hosts[node_rank]), ["kill", "-INT", pid])

    def _stop(self, procs: list[subprocess.Popen], pids: dict[int, str]) -> None:
        for i, pid in pids.items():
            if procs[i].poll() is None and pid.isdigit():
                subprocess.run(self.stop_argv(i, pid), capture_output=True, timeout=30)
        end = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _collect(self, host0: str, remote_out: str, out: Path) -> bool:
        """Copy node 0's record into ``out`` (then delete the remote file)."""
        try:
            p = subprocess.run(ssh_argv(self.target(host0), ["cat", remote_out]), capture_output=True, text=True,
                               timeout=60)
            subprocess.run(ssh_argv(self.target(host0), ["rm", "-f", remote_out]), capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        lines = [l for l in p.stdout.splitlines() if l.strip()] if p.returncode == 0 else []
        for line in lines:
            append_line(out, line)
        return bool(lines)

    def _record_failure(self, run: PlannedRun, out: Path, hosts: Sequence[str], error: str) -> None:
        """No record came back (ssh or netem failed): record the failure so the report shows it."""
        cfg = config_from_args(build_parser().parse_args([*run.args, "--out", os.devnull]))
        env = {"launcher_host": os.uname().nodename, "cluster_hosts": list(hosts), "device_count": run.world}
        append_record(out, build_record(cfg, get_system(cfg.system), "error", error[:2000], None, env))


"""Cluster mode of the sweep: one run across hosts over ssh, with the run's network emulated on them.

For each run: place its ranks on the hostfile's hosts (``hostfile.place``: GPU slots, as few ranks
per node as fit; a run that does not fit is recorded with status ``unfit`` and skipped), shape the
run's network on every node it uses (``SshShapingSession``: netem where the node has it, else tbf
plus the delayer), probe the link between its first two nodes once per network setting, start the
run command on every node with ``--nnodes N --node-rank i --rdzv-endpoint node0:PORT`` and the
interface in ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (under shaping NCCL also kept off
InfiniBand and network plugins: ``SHAPED_NCCL_ENV``), copy node 0's record back into the
sweep's out file (with the shaping and the measured link in its environment), and clear the shaping:
always, also on errors and Ctrl-C.

When a node fails (its ssh connection ends because the node or its sshd died, it never answers, or
its run command exits with an error) the others get ``GRACE_S`` to stop on their own, then are
interrupted; the record's error names the node that failed first. ``{host}`` in the remote
directory and python stands for each host's name (nodes that keep the suite in a directory each).

Every command is an argument list; the one command line that crosses ssh is built with shlex
quoting (``network_emulation.netem.ssh_argv``), so no value from a sweep file or hostfile reaches a
shell unquoted. The run command does not shape the network itself when given multi-node flags.
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shlex
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from contract.records import newest, parse_records, read_records
from network_emulation import SshShapingSession, parse_profile
from network_emulation.netem import ssh_argv, ssh_base
from network_emulation.signals import signals_deferred, stop_process
from network_emulation.ssh_shaping import for_host
from runners.output import Pump, is_peer_failure
from runners.record import append_line, append_record, build_record
from runners.request import parse_request
from runners.sweep.execute import SAFETY_MARGIN_S
from runners.sweep.hostfile import DoesNotFit, Host, NodePlacement, parse_hostfile, place
from runners.sweep.plan import REPO, PlannedRun, Sweep

__all__ = ["ClusterExecutor", "DoesNotFit", "Host", "parse_hostfile"]

PID_MARK = "@@sweep-remote-pid="
GRACE_S = 20.0  # once a node has failed, how long the others get to stop on their own
STOP_S = 20.0  # after the interruption, how long a node's run command gets before SIGKILL
PID_WAIT_S = 15.0  # how long a node being stopped gets to say its run command's pid (ssh's connection time)
SSH_LOST = 255  # ssh's exit status when the connection fails or ends
BAD_REQUEST = 2  # the run command's exit status for a request it refused (it started nothing)
# Under a shaped network, NCCL forced onto the shaped interface's sockets: on InfiniBand or EFA it
# would bypass the kernel (and tc) through its own transport or a network plugin, and the record
# would claim a link the run never used. Recorded in the run's environment (cluster.nccl_env).
SHAPED_NCCL_ENV = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}


@dataclass
class ClusterExecutor:
    """Runs one planned run across ``hosts`` (``executor(run, out) -> (exit status, output tail)``;
    raises DoesNotFit, after recording it, for a run the hosts cannot hold)."""

    hosts: list[Host]
    iface: str = "eth0"
    ssh_config: str | None = None  # ssh -F FILE (e.g. virtual nodes' DIR/ssh_config)
    ssh_user: str | None = None
    sudo: bool = False
    remote_dir: str = str(REPO)  # the suite on the nodes ({host}: the host's name)
    remote_python: str | None = None  # default: this interpreter, or REMOTE_DIR/.venv/bin/python
    port: int = 29500
    dry_run: bool = False
    log: IO | None = None
    measured: dict[tuple[str, tuple[str, ...]],
                   dict[str, Any]] = field(default_factory=dict)  # (network, nodes) -> links
    backends: dict[str, str] = field(default_factory=dict)  # host -> shaping backend found (skips re-probing netem)
    cluster = True

    def __post_init__(self) -> None:
        if self.remote_python is None:
            same = os.path.realpath(self.remote_dir) == os.path.realpath(REPO)
            self.remote_python = sys.executable if same else posixpath.join(self.remote_dir, ".venv", "bin", "python")

    # ------------------------------------------------------------------ commands
    def target(self, host: str) -> str:
        return f"{self.ssh_user}@{host}" if self.ssh_user else host

    def ssh(self, host: str, argv: list[str]) -> list[str]:
        """ssh argv running ``argv`` on ``host`` (quoted), through the ssh config when given."""
        return ssh_argv(self.target(host), argv, ssh_base(self.ssh_config))

    def remote(self, host: str, argv: list[str]) -> list[str]:
        """argv running ``argv`` on ``host`` (here over ssh), e.g. to fetch node 0's record."""
        return self.ssh(host, argv)

    def dir_on(self, host: str) -> str:
        return for_host(self.remote_dir, host)

    def python_on(self, host: str) -> str:
        assert self.remote_python is not None
        return for_host(self.remote_python, host)

    def place(self, run: PlannedRun) -> NodePlacement:
        return place(run.world, self.hosts, devices_per_process=run.devices_per_process,
                     ranks_per_node=run.nproc_per_node, emulated=run.emulated)

    def nccl_env(self, run: PlannedRun) -> dict[str, str]:
        """NCCL's environment on the nodes: its interface, and under a shaped network its sockets only."""
        return {"NCCL_SOCKET_IFNAME": self.iface, **(SHAPED_NCCL_ENV if run.emulated else {})}

    def run_argv(self, run: PlannedRun, nodes: NodePlacement, node_rank: int, remote_out: str) -> list[str]:
        """The run command on one node (an argument list), with the interface for gloo and NCCL (and
        NCCL kept on it under a shaped network)."""
        host = nodes.hosts[node_rank]
        env = {"GLOO_SOCKET_IFNAME": self.iface, **self.nccl_env(run)}
        return ["env", *(f"{k}={v}" for k, v in env.items()), self.python_on(host), "-m", "runners.run",
                *run.args, "--nnodes", str(nodes.nnodes), "--node-rank", str(node_rank),
                "--rdzv-endpoint", f"{nodes.hosts[0]}:{self.port}", "--out", remote_out]

    def node_argv(self, run: PlannedRun, nodes: NodePlacement, node_rank: int, remote_out: str) -> list[str]:
        """ssh argv that starts the run command on node ``node_rank``: it reports its pid first (so
        that an interrupted sweep can stop it), then becomes the run command in the suite's directory."""
        host = nodes.hosts[node_rank]
        script = (f"echo {shlex.quote(PID_MARK)}$$ && cd {shlex.quote(self.dir_on(host))} && mkdir -p results "
                  f"&& exec {shlex.join(self.run_argv(run, nodes, node_rank, remote_out))}")
        return self.ssh(host, ["sh", "-c", script])

    def stop_argv(self, host: str, pid: str, signal: str = "INT") -> list[str]:
        """Interrupt the run command on a node (it then stops its own ranks); KILL if it does not stop
        (its torchrun agent and ranks die with it)."""
        return self.ssh(host, ["kill", f"-{signal}", pid])

    def remote_out(self, host0: str) -> str:
        return posixpath.join(self.dir_on(host0), "results", f".cluster-{uuid.uuid4().hex[:12]}.jsonl")

    def shaping(self, run: PlannedRun, hosts: tuple[str, ...], out: IO = sys.stdout):
        if not run.emulated:
            return contextlib.nullcontext()
        assert self.remote_python is not None
        return SshShapingSession(parse_profile(run.network), self.iface, [self.target(h) for h in hosts],
                                 dry_run=self.dry_run, sudo=self.sudo, out=out, ssh_config=self.ssh_config,
                                 remote_dir=self.remote_dir, remote_python=self.remote_python, backends=self.backends)

    # ------------------------------------------------------------------ dry run

    def print_plan(self, sweep: Sweep, runs: list[PlannedRun], out: Path, stream: IO = sys.stdout) -> int:
        slots = sum(h.slots for h in self.hosts)
        print(f"sweep {sweep.name} on {len(self.hosts)} host(s) ({slots} GPU slots): {len(runs)} run(s), "
              f"records into {out}", file=stream)
        for run in runs:
            if not run.valid:
                print(f"\n# skip (bad combination): {run.label()}\n#   {run.error}", file=stream)
                continue
            try:
                nodes = self.place(run)
            except DoesNotFit as e:
                print(f"\n# skip (unfit): {run.label()}\n#   {e}", file=stream)
                continue
            print(f"\n# {run.label()}  ({nodes.nnodes} node(s) x {nodes.ranks_per_node} rank(s): "
                  f"{' '.join(nodes.hosts)}; network {run.network})", file=stream)
            remote_out = self.remote_out(nodes.hosts[0])
            with self.shaping(run, nodes.hosts, out=stream):
                for argv in self.launch_argvs(run, nodes, remote_out):
                    print(shlex.join(argv), file=stream)
        return 0

    def launch_argvs(self, run: PlannedRun, nodes: NodePlacement, remote_out: str) -> list[list[str]]:
        """The commands that start the run (here one ssh per node)."""
        return [self.node_argv(run, nodes, i, remote_out) for i in range(nodes.nnodes)]

    # ------------------------------------------------------------------ one run

    def __call__(self, run: PlannedRun, out: Path) -> tuple[int, str]:
        try:
            nodes = self.place(run)
        except DoesNotFit as e:
            self._record_unfit(run, out, str(e))
            raise
        remote_out = self.remote_out(nodes.hosts[0])
        tail: list[str] = []
        network: dict[str, Any] | None = None
        blame: str | None = None
        timed_out = False
        t0 = time.monotonic()
        try:
            with self.shaping(run, nodes.hosts, out=self.log or sys.stdout) as session:
                if session is not None:
                    network = {**session.describe(), **self._measure(run, nodes.hosts, session)}
                    self._note(f"cluster: {run.network} shaped on {nodes.nnodes} node(s) "
                               f"({network['backend']}) in {time.monotonic() - t0:.1f} s")
                t1 = time.monotonic()
                blame, timed_out = self._launch(run, nodes, remote_out, tail)
                self._note(f"cluster: the run took {time.monotonic() - t1:.1f} s on {nodes.nnodes} node(s)")
        except Exception as e:  # shaping, probe or ssh trouble: the run did not happen
            tail.append(f"cluster: {e}")
        cluster_env = self.cluster_environment(run, nodes)
        status = self._collect(nodes.hosts[0], remote_out, out, network, cluster_env, blame)
        if status is None:
            status = "timeout" if timed_out else "error"
            error = blame or (tail[-1] if tail else f"no record from {nodes.hosts[0]}")
            self._record(run, out, status, error, {"cluster": cluster_env, **({"network": network} if network else {})})
        if blame:
            tail.append(blame)
        return (0 if status == "ok" else 1), "\n".join(tail)

    def cluster_environment(self, run: PlannedRun, nodes: NodePlacement) -> dict[str, Any]:
        """The placement and NCCL's environment, for the record's ``environment.cluster``."""
        return {"hosts": list(nodes.hosts), "ranks_per_node": nodes.ranks_per_node, "iface": self.iface,
                "nccl_env": self.nccl_env(run)}

    def _measure(self, run: PlannedRun, hosts: tuple[str, ...], session: SshShapingSession) -> dict[str, Any]:
        """The links between the run's nodes, measured once per network setting (and nodes): every
        kind of link of the profile on the first pair of nodes that has it (``LinkProbing.probe_links``;
        one for a uniform profile), the slowest one's as ``measured_link`` between the nodes it names;
        nothing for a run on one node (it has no link between nodes)."""
        if len(hosts) < 2:
            return {"measured_link": None}
        key = (run.network, hosts)
        if key not in self.measured:
            try:
                measured = session.probe_links()
            except Exception as e:
                raise RuntimeError(f"probing the links between {', '.join(hosts)} under {run.network} "
                                   f"failed: {e}") from None
            self.measured[key] = measured
            for m in measured["measured_links"]:
                self._note(f"cluster: {run.network}: {hosts[m['src']]} -> {hosts[m['dst']]}: "
                           f"{m['one_way_delay_ms']:.3f} ms, {m['bandwidth_gbps']:.3f} Gbit/s")
        measured = self.measured[key]
        slow = measured["measured_link"]
        return {**measured, "measured_between": [hosts[slow["src"]], hosts[slow["dst"]]]}

    def _note(self, line: str) -> None:
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()

    def _launch(self, run: PlannedRun, nodes: NodePlacement, remote_out: str,
                tail: list[str]) -> tuple[str | None, bool]:
        """Start the run command on every node and watch them, their output into ``tail``: (which
        node failed first and how, or None; whether the run overran its timeout)."""
        procs: list[subprocess.Popen] = []
        pids: dict[int, str] = {}
        pumps: list[Pump] = []
        failed_at: dict[int, float] = {}
        lock = threading.Lock()

        def pid_of(i: int):
            def intercept(line: str) -> bool:
                if line.startswith(PID_MARK):
                    pids[i] = line[len(PID_MARK):].strip()
                    return True
                return False
            return intercept

        deadline = time.monotonic() + run.timeout + SAFETY_MARGIN_S
        timed_out = False
        try:
            for i in range(nodes.nnodes):
                # Its own session: a Ctrl-C on the terminal reaches the sweep, which then stops the
                # nodes' run commands in order, not the ssh clients (whose death would orphan them).
                p = subprocess.Popen(self.node_argv(run, nodes, i, remote_out), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
                procs.append(p)
                pumps.append(Pump(p.stdout, [self.log] if self.log else [], prefix=f"[{nodes.hosts[i]}] ", keep=40,
                                  intercept=pid_of(i), lock=lock))
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                for i, p in enumerate(procs):
                    if p.poll() not in (None, 0) and i not in failed_at:
                        failed_at[i] = now
                if now > deadline:
                    timed_out = True
                    break
                if failed_at and (now - min(failed_at.values()) > GRACE_S or any(
                        procs[i].returncode == BAD_REQUEST or (procs[i].returncode == SSH_LOST and i not in pids)
                        for i in failed_at)):
                    break  # the grace is over, or a node never started its ranks: the others cannot complete
                time.sleep(0.2)
        finally:
            with signals_deferred():
                now = time.monotonic()
                for i, p in enumerate(procs):  # failed on their own (what the stop ends is not to blame)
                    if p.poll() not in (None, 0) and not timed_out:
                        failed_at.setdefault(i, now)
                if any(p.poll() is None for p in procs):
                    self._stop(procs, pids, nodes.hosts)
                for pump in pumps:
                    pump.join(timeout=5)
        for pump in [*pumps[1:], *pumps[:1]]:  # node 0's lines (its run's summary) last
            tail.extend(line.rstrip("\n") for line in pump.lines)
        blame = None
        if timed_out:
            blame = f"cluster: the run exceeded its timeout ({run.timeout:g} s + {SAFETY_MARGIN_S:g} s); nodes stopped"
        elif failed_at:
            blame = self._blame(nodes.hosts, procs, pumps, failed_at, pids)
        return blame, timed_out

    @staticmethod
    def _blame(hosts: tuple[str, ...], procs: list[subprocess.Popen], pumps: list[Pump], failed_at: dict[int, float],
               pids: dict[int, str]) -> str:
        """Which node failed first, and how: a lost ssh connection (the node or its sshd died, or it
        never answered) before an error of its own, before an error that only says a peer went away."""
        def last(i: int) -> str:
            lines = [l.strip() for l in pumps[i].lines if l.strip()]
            return lines[-1].removeprefix(f"[{hosts[i]}] ") if lines else ""

        def rank(i: int) -> tuple[int, int, float]:
            return (procs[i].returncode != SSH_LOST, is_peer_failure(last(i)), failed_at[i])

        i = min(failed_at, key=rank)
        if procs[i].returncode == SSH_LOST:
            how = ("it did not answer ssh" if i not in pids
                   else "its ssh connection ended (the node went down or its sshd died)")
        else:
            how = f"its run command exited with status {procs[i].returncode}"
        return f"{hosts[i]} failed first: {how}" + (f": {last(i)}" if last(i) else "")

    def _stop(self, procs: list[subprocess.Popen], pids: dict[int, str], hosts: tuple[str, ...]) -> None:
        """Interrupt every node's run command still running (SIGINT, then SIGKILL after STOP_S), then
        the ssh clients. A node whose ssh has not yet said its run command's pid gets PID_WAIT_S."""
        end = time.monotonic() + PID_WAIT_S
        while any(p.poll() is None and i not in pids for i, p in enumerate(procs)) and time.monotonic() < end:
            time.sleep(0.1)

        def signal_all(sig: str) -> None:  # over ssh, to every node at once
            kills = [subprocess.Popen(self.stop_argv(hosts[i], pid, sig), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for i, pid in pids.items() if procs[i].poll() is None and pid.isdigit()]
            for k in kills:
                try:
                    k.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    k.kill()
                    k.wait()

        signal_all("INT")
        end = time.monotonic() + STOP_S
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.2)
        signal_all("KILL")
        for p in procs:  # the ssh clients end with their remote commands
            stop_process(p, None, 5.0)

    def _collect(self, host0: str, remote_out: str, out: Path, network: dict[str, Any] | None,
                 cluster_env: dict[str, Any], blame: str | None) -> str | None:
        """Copy node 0's record into ``out`` (then delete the remote file), with the emulated network
        (backend, hosts, measured link) and the placement in its environment, and the node that
        failed first named in its error. Returns the record's status (None: no record came)."""
        try:
            p = subprocess.run(self.remote(host0, ["cat", remote_out]), stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=60)
            subprocess.run(self.remote(host0, ["rm", "-f", remote_out]), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        status = None
        for rec in parse_records(p.stdout if p.returncode == 0 else "", f"{host0}:{remote_out}"):
            status = rec.get("status")
            env = rec.setdefault("environment", {})
            env["cluster"] = cluster_env
            if network is not None:
                env["network"] = network
            if blame and rec.get("status") != "ok":
                rec["error"] = f"{blame}; node 0: {rec.get('error')}"
            append_line(out, json.dumps(rec, allow_nan=False))
        return status

    def _record(self, run: PlannedRun, out: Path, status: str, error: str, environment: dict[str, Any]) -> None:
        """A record for a run that produced none (it did not fit, or ssh / shaping failed), so that
        the report shows it."""
        cfg, spec = parse_request(run.args)
        env = {"launcher_host": os.uname().nodename, "device_count": run.devices, **environment}
        append_record(out, build_record(cfg, spec, status, error[:2000], None, env))

    def _record_unfit(self, run: PlannedRun, out: Path, error: str) -> None:
        """Record an unfit run, unless the newest record of the run already says the same."""
        last = newest(read_records(out), run.key) if run.key else None
        if last and last.get("status") == "unfit" and last.get("error") == error:
            return
        slots = [f"{h.name} slots={h.slots}" for h in self.hosts]
        self._record(run, out, "unfit", error, {"cluster": {"hostfile": slots}})

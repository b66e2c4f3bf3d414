"""Start a run's ranks through torchrun, watch them, and collect what they measured.

torchrun and its workers run in a session of their own, so that on a timeout, Ctrl-C or a failed
rank the whole group is stopped: no orphan process outlives a run.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runners.config import RunConfig


@dataclass(frozen=True)
class LaunchOptions:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0


@dataclass
class LaunchResult:
    status: str  # ok | oom | error | timeout
    error: str | None
    ranks: list[dict] | None  # what every rank measured (on node 0)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # under --verify
    run_dir: Path | None = None
    network: dict | None = None  # the emulated network: backend, profile, links, the measured link


@dataclass(frozen=True)
class Agent:
    """One torchrun agent: its command and environment (a virtual host's, under emulation)."""

    argv: list[str]
    env: dict[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(nproc: int, nnodes: int, node_rank: int, master: str | None, run_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
            "--max-restarts=0"]
    if nnodes == 1 and master is None:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        host, _, port = (master or "").rpartition(":")
        argv += [f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}", "--rdzv-backend=static"]
    return argv + ["-m", "runners.worker", str(run_dir)]


def local_agents(cfg: RunConfig, world: int, opts: LaunchOptions, run_dir: Path) -> list[Agent]:
    if world % opts.nnodes:
        raise ValueError(f"world size {world} does not divide over {opts.nnodes} nodes")
    argv = torchrun_argv(world // opts.nnodes, opts.nnodes, opts.node_rank, opts.rdzv_endpoint, run_dir)
    return [Agent(argv, {})]


def _pump(stream, tail: collections.deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        sys.stderr.write(line)
        sys.stderr.flush()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    # The leader may be gone while workers of its group linger: make sure of them too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_agents(agents: list[Agent], timeout: float, run_dir: Path, expect_result: bool = True) -> LaunchResult:
    tail: collections.deque = collections.deque(maxlen=60)
    procs: list[subprocess.Popen] = []
    pumps = []
    env_base = dict(os.environ, PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parent.parent)
    env_base["PYTHONPATH"] = repo + (os.pathsep + env_base["PYTHONPATH"] if env_base.get("PYTHONPATH") else "")
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for agent in agents:
            p = subprocess.Popen(agent.argv, env={**env_base, **agent.env}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=repo)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, tail), daemon=True)
            t.start()
            pumps.append(t)
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):  # one agent failed: stop the others
                time.sleep(2.0)  # torchrun stops its own workers first, writing their error files
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_group(p)
        for t in pumps:
            t.join(timeout=2)
    return collect(run_dir, [p.returncode for p in procs], timed_out, timeout, "".join(tail), expect_result)


def collect(run_dir: Path, returncodes: list[int | None], timed_out: bool, timeout: float, log_tail: str,
            expect_result: bool = True) -> LaunchResult:
    """The outcome of a run from its files. ``expect_result`` is False on the nodes of a multi-node run
    other than node 0: rank 0 (on node 0) gathers the measurements."""
    errors = [json.loads(p.read_text()) for p in sorted(run_dir.glob("error-rank*.json"))]
    result_path = run_dir / "result.json"
    ranks = json.loads(result_path.read_text())["ranks"] if result_path.exists() else None
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(run_dir.glob("grads-rank*.pt"), key=lambda p: int(p.stem.removeprefix("grads-rank"))):
        for name, g in torch.load(path).items():
            grads.setdefault(name, g)
    if timed_out:
        return LaunchResult("timeout", f"timed out after {timeout:g} s", ranks, grads, run_dir)
    if errors:
        first = next((e for e in errors if e["status"] == "oom"), errors[0])
        return LaunchResult(first["status"], f"rank {first['rank']}: {first['error']}", ranks, grads, run_dir)
    if (ranks is not None or not expect_result) and all(rc == 0 for rc in returncodes):
        return LaunchResult("ok", None, ranks, grads, run_dir)
    last = [l for l in log_tail.splitlines() if l.strip()][-3:]
    msg = f"a rank failed (exit codes {returncodes})" + (": " + " | ".join(l.strip() for l in last) if last else "")
    return LaunchResult("error", msg[:2000], ranks, grads, run_dir)


def launch_emulated(cfg: RunConfig, world: int, run_dir: Path) -> LaunchResult:
    """Every rank on a virtual host of its own (a network namespace), links shaped by the profile:
    one torchrun agent per virtual node, rendezvous at virtual host 0."""
    from network_emulation import VirtualCluster, parse_profile

    profile = parse_profile(cfg.network)
    with VirtualCluster(world, profile, name="run") as vc:
        measured = vc.probe(0, 1).describe() if world > 1 and profile.emulated else None
        if measured:
            print(f"network: {profile.name}: measured one-way delay {measured.get('one_way_delay_ms', float('nan')):.2f} ms, "
                  f"bandwidth {measured.get('bandwidth_gbps', float('nan')):.2f} Gbit/s ({vc.backend})", file=sys.stderr)
        master = f"{vc.hosts[0].address}:29500"
        agents = [Agent(h.command_prefix() + torchrun_argv(1, world, h.index, master, run_dir), h.env()) for h in vc.hosts]
        result = run_agents(agents, cfg.timeout, run_dir)
        result.network = {**vc.describe(), "measured_link": measured}
    return result


def launch(cfg: RunConfig, world: int, opts: LaunchOptions) -> LaunchResult:
    """Launch ``world`` ranks for ``cfg`` on this node (or this node's share of a multi-node run).

    Under ``--network`` on one node the ranks run in a local virtual cluster; on a real cluster the
    network is shaped by the cluster runner (netem on each node), not here."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-"))
    (run_dir / "config.json").write_text(cfg.to_json())
    if cfg.network != "none" and opts.nnodes == 1:
        return launch_emulated(cfg, world, run_dir)
    return run_agents(local_agents(cfg, world, opts, run_dir), cfg.timeout, run_dir, expect_result=opts.node_rank == 0)

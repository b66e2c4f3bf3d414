"""Start a run's ranks through torchrun, watch them, and collect what they measured.

torchrun and its workers run in a session of their own, so that on a timeout, Ctrl-C or a failed
rank the whole group is stopped; the agents and the ranks also die with their parent
(``runners.lifetime``), so that nothing outlives a run command killed any other way.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from contract import RunConfig
from contract.registry import get_system
from network_emulation import VirtualCluster, parse_profile
from network_emulation.signals import stop_process
from runners import services
from runners.devices import agent_devices, visible_entries
from runners.lifetime import DirectoryWatchdog, die_with_parent, oom_kills, owner_alive, owner_tag
from runners.output import Pump
from runners.request import Placement

if TYPE_CHECKING:  # the run command imports torch only where it needs it: a run's gradients, its GPUs
    import torch

REPO = Path(__file__).resolve().parent.parent
RUN_DIR_PREFIX = "pipebench-run-"  # + the run command's owner tag: a directory whose owner died is removed
# torchrun's failure summary: "rank : 1 (local_rank: 1)" followed by "exitcode : -9 (pid: 123)"
_TORCHRUN_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class LaunchResult:
    status: str  # ok | oom | error | timeout
    error: str | None
    ranks: list[dict] | None  # what every rank measured (on node 0)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # under --verify
    run_dir: Path | None = None
    network: dict | None = None  # the emulated network: backend, profile, links, the measured links
    watchdog: DirectoryWatchdog | None = None  # removes run_dir if the run command ends before it does

    def remove_run_dir(self) -> None:
        """Remove the run directory (what the ranks wrote: their results, gradients, logs) and end its
        watchdog."""
        if self.watchdog is not None:
            self.watchdog.remove()
        elif self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


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
            "--max-restarts=0", f"--log-dir={run_dir / 'torchrun'}"]
    if nnodes == 1 and master is None:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        host, _, port = (master or "").rpartition(":")
        argv += [f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}", "--rdzv-backend=static"]
    return argv + ["-m", "runners.worker", str(run_dir)]


def single_rank_agent(run_dir: Path, env: dict[str, str] | None = None) -> Agent:
    """One rank of one, started as torchrun starts a rank (the same worker and rendezvous variables)
    but without torchrun, whose agent costs a second torch import and a rendezvous: ``--verify``'s
    single-process reference."""
    ranks = dict(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return Agent([sys.executable, "-m", "runners.worker", str(run_dir)], {**ranks, **(env or {})})


def local_agents(world: int, placement: Placement, run_dir: Path, env: dict[str, str] | None = None) -> list[Agent]:
    if world % placement.nnodes:
        raise ValueError(f"world size {world} does not divide over {placement.nnodes} nodes")
    argv = torchrun_argv(world // placement.nnodes, placement.nnodes, placement.node_rank, placement.rdzv_endpoint,
                         run_dir)
    return [Agent(argv, dict(env or {}))]


def local_services(placement: Placement) -> services.Placing:
    """Where a run's services go outside emulation: this machine on a free port, or node 0 of a
    cluster (the rendezvous host) on the lighthouse's port."""
    if placement.nnodes == 1:
        return services.Placing(bind="127.0.0.1", advertise="127.0.0.1", port=free_port())
    host = (placement.rdzv_endpoint or "").rpartition(":")[0]
    return services.Placing(bind="0.0.0.0", advertise=host, port=services.LIGHTHOUSE_PORT,
                            start=placement.node_rank == 0)


def run_agents(agents: list[Agent], timeout: float, run_dir: Path, expect_result: bool = True) -> LaunchResult:
    procs: list[subprocess.Popen] = []
    pumps: list[Pump] = []
    env_base = dict(os.environ, PYTHONUNBUFFERED="1")
    env_base["PYTHONPATH"] = str(REPO) + (os.pathsep + env_base["PYTHONPATH"] if env_base.get("PYTHONPATH") else "")
    deadline = time.monotonic() + timeout
    timed_out = False
    oom_before = oom_kills()
    try:
        for agent in agents:
            p = subprocess.Popen(agent.argv, env={**env_base, **agent.env}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                 preexec_fn=die_with_parent)
            procs.append(p)
            pumps.append(Pump(p.stdout, [sys.stderr]))
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):  # one agent failed: stop the others
                time.sleep(2.0)  # torchrun stops its own workers first, writing their error files
                break
            time.sleep(0.1)
    except BaseException:  # interrupted: what the stopping agents and ranks print is noise
        for pump in pumps:
            pump.mute()
        raise
    finally:
        for p in procs:  # torchrun and its workers: a session each
            stop_process(p, signal.SIGTERM, 5.0, group=True)
        for pump in pumps:
            pump.join(timeout=2)
    oom_after = oom_kills()
    oom_killed = oom_before is not None and oom_after is not None and oom_after > oom_before
    tail = "".join(pump.tail for pump in pumps)
    return collect(run_dir, [p.returncode for p in procs], timed_out, timeout, tail, expect_result, oom_killed)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def nccl_watchdog(log_tail: str) -> str:
    """'; NCCL's watchdog: <its line>' where a rank's NCCL watchdog ended it for an operation that
    waited past the process group's timeout (``contract.groups.op_timeout``), else ''."""
    line = next((l for l in log_tail.splitlines() if "Watchdog caught collective operation timeout" in l), None)
    return f"; NCCL's watchdog: {line.strip()[:600]}" if line else ""


def collect(run_dir: Path, returncodes: list[int | None], timed_out: bool, timeout: float, log_tail: str,
            expect_result: bool = True, oom_killed: bool = False) -> LaunchResult:
    """The outcome of a run from its files. ``expect_result`` is False on the nodes of a multi-node run
    other than node 0: rank 0 (on node 0) gathers the measurements. The error names the rank that
    failed first and how: its own error (an exception, OOM), else a rank killed by a signal, else a
    rank that lost its peers."""
    errors = [json.loads(p.read_text()) for p in sorted(run_dir.glob("error-rank*.json"))]
    result_path = run_dir / "result.json"
    ranks = json.loads(result_path.read_text())["ranks"] if result_path.exists() else None
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(run_dir.glob("grads-rank*.pt"), key=lambda p: int(p.stem.removeprefix("grads-rank"))):
        import torch

        for name, g in torch.load(path).items():
            grads.setdefault(name, g)
    if timed_out:
        from runners.nccl_rules import pending_summary

        pending = pending_summary(run_dir)  # what each rank waited for, where NCCL's rules were followed
        error = f"timed out after {timeout:g} s" + (f"; pending operations: {pending}" if pending else "")
        return LaunchResult("timeout", error, ranks, grads, run_dir)
    own = sorted((e for e in errors if not e.get("peer_failure")), key=lambda e: (e["status"] != "oom", e["time"]))
    if own:
        first = own[0]
        return LaunchResult(first["status"], f"rank {first['rank']}: {first['error']}", ranks, grads, run_dir)
    # torchrun lists the failures, the first observed one under "Root Cause"; it stops the others itself
    # (SIGTERM), so a rank killed by a signal of its own comes first
    root = log_tail.rpartition("Root Cause")[2] if "Root Cause" in log_tail else ""
    killed = {int(r): -int(code) for r, code in _TORCHRUN_EXIT.findall(log_tail) if int(code) < 0}
    first = [int(r) for r, code in _TORCHRUN_EXIT.findall(root) if int(code) < 0]
    if killed:
        rank = first[0] if first else min(killed, key=lambda r: (killed[r] == signal.SIGTERM, r))
        how = f"rank {rank} was killed by {_signal_name(killed[rank])}" + nccl_watchdog(log_tail)
        if oom_killed:
            return LaunchResult("oom", how + " (the kernel's OOM killer)", ranks, grads, run_dir)
        return LaunchResult("error", how, ranks, grads, run_dir)
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return LaunchResult(first["status"], f"rank {first['rank']}: {first['error']}", ranks, grads, run_dir)
    if (ranks is not None or not expect_result) and all(rc == 0 for rc in returncodes):
        return LaunchResult("ok", None, ranks, grads, run_dir)
    last = [l for l in log_tail.splitlines() if l.strip()][-3:]
    msg = (f"a rank failed (exit codes {returncodes})" + (nccl_watchdog(log_tail) or
                                                          (": " + " | ".join(l.strip() for l in last) if last else "")))
    return LaunchResult("oom" if oom_killed else "error", msg[:2000], ranks, grads, run_dir)


def launch_emulated(cfg: RunConfig, world: int, run_dir: Path) -> LaunchResult:
    """Every rank on a virtual host of its own (a network namespace), links shaped by the profile:
    one torchrun agent per virtual node, rendezvous at virtual host 0."""
    profile = parse_profile(cfg.network, cfg.network_matrix)
    with VirtualCluster(world, profile, name="run") as vc:
        probe = world > 1 and profile.emulated and not cfg.no_link_probe
        measured = vc.probe_links() if probe else {"measured_link": None}
        for m in measured.get("measured_links") or []:
            print(f"network: {profile.name}: host {m['src']} -> {m['dst']} (set {m['set']['delay_ms']:g} ms, "
                  f"{m['set']['bandwidth_gbps']:g} Gbit/s): measured one-way delay {m['one_way_delay_ms']:.2f} ms, "
                  f"bandwidth {m['bandwidth_gbps']:.2f} Gbit/s ({vc.backend})", file=sys.stderr)
        master = f"{vc.hosts[0].address}:29500"
        gpus = emulated_gpus(cfg, world)
        host0 = vc.hosts[0]
        where = services.Placing(bind=host0.address, advertise=host0.address, port=services.LIGHTHOUSE_PORT,
                                 prefix=tuple(host0.command_prefix()))
        with services.started(get_system(cfg.system).services, cfg, run_dir, where) as env:
            agents = [Agent(h.command_prefix() + torchrun_argv(1, world, h.index, master, run_dir),
                            {**h.env(), **gpu, **env}) for h, gpu in zip(vc.hosts, gpus)]
            result = run_agents(agents, cfg.timeout, run_dir)
        result.network = {**vc.describe(), **measured}
        if any(gpus):  # NCCL kept off the paths the emulation cannot shape, as the hosts' environment says
            result.network["nccl_env"] = {k: v for k, v in vc.hosts[0].env().items() if k.startswith("NCCL_")}
    return result


def emulated_gpus(cfg: RunConfig, world: int) -> list[dict[str, str]]:
    """The environment that gives each virtual host's agent GPUs of its own on CUDA (its
    CUDA_VISIBLE_DEVICES): every agent runs one rank with LOCAL_RANK 0, which would otherwise put
    all of them on cuda:0 (NCCL: "Duplicate GPU detected")."""
    if not (cfg.hardware or "").startswith("cuda"):
        return [{} for _ in range(world)]
    import torch

    per = get_system(cfg.system).devices_per_process(cfg)
    visible = visible_entries(torch.cuda.device_count())
    return [{"CUDA_VISIBLE_DEVICES": v} for v in agent_devices(visible, world, per)]


def reap_stale_run_dirs() -> None:
    """Remove the run directories of run commands that died without removing them, where their
    watchdog (``lifetime.DirectoryWatchdog``) could not either (it was killed too)."""
    for d in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        tag = d.name.removeprefix(RUN_DIR_PREFIX).rpartition("-")[0]
        if d.is_dir() and not owner_alive(tag):
            shutil.rmtree(d, ignore_errors=True)


def launch(cfg: RunConfig, world: int, placement: Placement, single: bool = False) -> LaunchResult:
    """Launch ``world`` ranks for ``cfg`` on this node (or this node's share of a multi-node run).

    Under ``--network`` on one node the ranks run in a local virtual cluster; on a real cluster the
    network is shaped by the cluster runner (on each node), not here. ``single``: one rank on this
    machine without torchrun (``single_rank_agent``). If the launch is interrupted, its run directory
    is removed before the interruption goes on."""
    reap_stale_run_dirs()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{owner_tag()}-"))
    watchdog = DirectoryWatchdog(run_dir)  # removes it whatever way this process ends
    try:
        (run_dir / "config.json").write_text(cfg.to_json())
        try:
            if cfg.network != "none" and placement.nnodes == 1:
                result = launch_emulated(cfg, world, run_dir)
            else:
                with services.started(get_system(cfg.system).services, cfg, run_dir,
                                      local_services(placement)) as env:
                    agents = ([single_rank_agent(run_dir, env)] if single and world == 1 and placement.nnodes == 1
                              else local_agents(world, placement, run_dir, env))
                    result = run_agents(agents, cfg.timeout, run_dir, expect_result=placement.node_rank == 0)
        except services.ServiceError as exc:
            result = LaunchResult("error", str(exc), None, run_dir=run_dir)
    except BaseException:
        watchdog.remove()
        raise
    result.watchdog = watchdog
    return result

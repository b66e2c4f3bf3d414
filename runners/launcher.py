"""Start a run's ranks through torchrun, watch them, and collect what they measured.

torchrun and its workers run in a session of their own, so that on a timeout, Ctrl-C or a failed
rank the whole group is stopped; the agents and the ranks also die with their parent
(``runners.lifetime``), so that nothing outlives a run command killed any other way.
"""
from __future__ import annotations

import contextlib
import fcntl
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
from typing import TYPE_CHECKING, Callable

from contract import RunConfig
from contract.registry import get_system
from network_emulation import LinkSpec, VirtualCluster, parse_profile
from network_emulation.signals import stop_process
from network_emulation.traces import TracePlayer, trace_from
from runners import services
from runners.devices import agent_devices, visible_entries
from contract.faults import killed
from runners.faults import (FIRST_STEP_ENV, REJOINED_ENV, REPLICA_ENV, STANDBY_ENV, STANDBY_GATE, STARTED,
                            Straggler, join_cgroup, killed_ranks)
from runners.lifetime import DirectoryWatchdog, die_with_parent, oom_kills, owner_alive, owner_tag
from runners.output import Pump, Withheld
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
    faults: dict | None = None  # the run's faults as they happened: the straggler, each replica's lives
    watchdog: DirectoryWatchdog | None = None  # removes run_dir if the run command ends before it does
    withheld: str = ""  # what of the ranks' and torchrun's output the terminal was spared (runners.output.Withheld)

    def remove_run_dir(self) -> None:
        """Remove the run directory (what the ranks wrote: their results, gradients, logs) and end its
        watchdog."""
        if self.watchdog is not None:
            self.watchdog.remove()
        elif self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass(frozen=True)
class Agent:
    """One torchrun agent: its command and environment (a virtual host's, under emulation); the CPU
    cgroup it starts in (a straggler's quota, ``runners.faults``), and the replica whose world it
    belongs to (a fault-tolerant system's replicas are worlds of their own under --kill-replica; a
    standby's takes a killed replica's place, ``ReplicaFaults``)."""

    argv: list[str]
    env: dict[str, str]
    cgroup: Path | None = None
    replica: int | None = None
    standby: bool = False


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


def _preexec(cgroup: Path | None):
    """The agent's preexec_fn: die with the run command; start in ``cgroup`` (its cgroup.procs) if given."""
    def preexec() -> None:
        die_with_parent()
        if cgroup is not None:
            join_cgroup(cgroup)
    return preexec


class Agents:
    """The agents of one launch, started and stopped together; their output goes to stderr, but for
    what the terminal is spared (``withheld``: peers' tracebacks, torchrun's reports of a failed
    rank, a hang's stacks, and all that comes once ``mute``d), which the run's record keeps. They run
    in the run command's directory (a relative --data or --trace means what it meant when the request
    was judged) and import the suite from where this module lies (a checkout or an installed copy)."""

    def __init__(self) -> None:
        self.procs: list[tuple[Agent, subprocess.Popen]] = []
        self.pumps: list[Pump] = []
        self.withheld = Withheld(sys.stderr)
        # PYTHONSAFEPATH: the directory they run in never shadows the suite on PYTHONPATH
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
        self.env["PYTHONPATH"] = str(REPO) + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")

    def start(self, agent: Agent, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(agent.argv, env={**self.env, **agent.env, **(extra_env or {})}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_preexec(agent.cgroup))
        self.procs.append((agent, p))
        self.pumps.append(Pump(p.stdout, [self.withheld.sink()]))
        return p

    def mute(self) -> None:
        """What the agents print from now on goes to the record, not the terminal (they are being
        stopped); the output of those that have ended is read to its end first (it is the run's)."""
        for (_, p), pump in zip(self.procs, self.pumps):
            if p.poll() is not None:
                pump.join(timeout=2)
        self.withheld.mute()

    def stop(self, procs: list[subprocess.Popen] | None = None) -> None:
        """Stop ``procs`` (default: every agent): torchrun and its workers, a session each."""
        for p in procs if procs is not None else [p for _, p in self.procs]:
            stop_process(p, signal.SIGTERM, 5.0, group=True)

    def tail(self, skip_replica: int | None = None) -> str:
        """The last lines of the agents' output (but replica ``skip_replica``'s)."""
        for pump in self.pumps:
            pump.join(timeout=2)
        return "".join(pump.tail for (agent, _), pump in zip(self.procs, self.pumps)
                       if skip_replica is None or agent.replica != skip_replica)


def run_agents(agents: list[Agent], timeout: float, run_dir: Path, expect_result: bool = True,
               replicas: ReplicaFaults | None = None) -> LaunchResult:
    """Start ``agents``, wait for them, stop them all once one fails or the run times out, and collect
    the result. ``replicas``: the agents are replicas' worlds of a fault-tolerant run, one of which is
    killed (and perhaps restarted): its end does not stop the others (``ReplicaFaults``)."""
    started = Agents()
    deadline = time.monotonic() + timeout
    timed_out = False
    oom_before = oom_kills()
    try:
        for agent in agents:
            started.start(agent)
        while any(p.poll() is None for _, p in started.procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if replicas is not None:
                if replicas.watch(started):
                    break
            elif any(p.poll() not in (None, 0) for _, p in started.procs):  # one agent failed: stop the others
                time.sleep(2.0)  # torchrun stops its own workers first, writing their error files
                break
            time.sleep(0.1)
    finally:  # what agents being stopped print (an interruption's too) is noise: the record keeps it
        if any(p.poll() is None for _, p in started.procs):
            started.mute()
        started.stop()
        if replicas is not None:
            replicas.close()
    oom_after = oom_kills()
    oom_killed = oom_before is not None and oom_after is not None and oom_after > oom_before
    tail = started.tail(replicas.victim if replicas is not None else None)
    if replicas is not None:
        result = replicas.collect(run_dir, started, timed_out, timeout, tail, oom_killed)
    else:
        result = collect(run_dir, [p.returncode for _, p in started.procs], timed_out, timeout, tail, expect_result,
                         oom_killed)
    for pump in started.pumps:
        pump.join(timeout=2)
    result.withheld = started.withheld.text()
    return result


class ReplicaFaults:
    """A fault-tolerant run (``SystemSpec.fault_tolerant``) under --kill-replica: each replica a world
    of its own (its own torchrun, as torchft runs replicas), replica ``victim`` killed after its step;
    the others go on. With --rejoin a standby of the victim's replica is started with the run (its
    ranks start as any, build their model, then wait: ``runners.faults.RankHooks.take_place``) and
    takes its place once the victim's ranks are gone, so that what its rejoining costs is the
    system's (a quorum, healing from a peer), not the start of its processes. ``group(d, extra_env, standby)``
    makes replica d's agents. The run ends when every other replica has ended, and a standby that
    has rejoined has ended too (it syncs with the others, so it ends with them); one that has not
    rejoined by then is stopped, and its life says so."""

    def __init__(self, cfg: RunConfig, world: int, run_dir: Path,
                 group: Callable[[int, dict[str, str], bool], list[Agent]]):
        self.run_dir = run_dir
        kill = killed(cfg)
        assert kill is not None
        self.victim, self.step = kill
        self.rejoin, self.dp = cfg.rejoin, cfg.dp
        self.size = world // cfg.dp
        self.group = group
        self.ended: list[str] = []  # how each life of the victim's replica ended (or "running")
        self.failed = False
        self.gate = None  # held while the victim lives: its standby waits for it (RankHooks.take_place)
        if self.rejoin:
            self.gate = open(run_dir / STANDBY_GATE, "w")
            fcntl.flock(self.gate, fcntl.LOCK_EX)

    def agents(self) -> list[Agent]:
        agents = [a for d in range(self.dp) for a in self.group(d, {REPLICA_ENV: str(d)}, False)]
        if self.rejoin:
            env = {REPLICA_ENV: str(self.victim), REJOINED_ENV: "1", FIRST_STEP_ENV: str(self.step),
                   STANDBY_ENV: str(self.run_dir / STANDBY_GATE)}
            agents += self.group(self.victim, env, True)
        return agents

    def close(self) -> None:
        """Let go of the standby's gate (the run is over: a standby still waiting is being stopped)."""
        if self.gate is not None:
            self.gate.close()
            self.gate = None

    @staticmethod
    def _procs(started: Agents, d: int, standby: bool = False) -> list[subprocess.Popen]:
        return [p for a, p in started.procs if a.replica == d and a.standby == standby]

    def _victim_ranks(self) -> range:
        return range(self.victim * self.size, (self.victim + 1) * self.size)

    def _joined(self) -> bool:
        """The standby has rejoined: it began a step of its own."""
        return any((self.run_dir / f"progress-rank{r}-rejoined.json").exists() for r in self._victim_ranks())

    def watch(self, started: Agents) -> bool:
        """One look at the agents; True: the run is over (stop what still runs)."""
        others = [p for d in range(self.dp) if d != self.victim for p in self._procs(started, d)]
        victim, standby = self._procs(started, self.victim), self._procs(started, self.victim, standby=True)
        marks = [(self.run_dir / f"killed-rank{r}.json").exists() for r in self._victim_ranks()]
        if all(marks):  # each of its ranks killed itself right after its mark: the standby takes its place
            self.close()
        if not self.ended and any(p.poll() not in (None, 0) for p in victim):
            if not any(marks):
                return self._fail()  # it failed of itself, before it was killed
            if any(p.poll() is None for p in victim):
                return False  # its other ranks are still ending
            self.ended.append(f"killed after {self.step} steps")
            if self.rejoin:
                self.ended.append("running")
        if self.ended[-1:] == ["running"] and any(p.poll() not in (None, 0) for p in standby):
            self.ended[-1] = "failed after rejoining" if self._joined() else "failed before it rejoined"
        if any(p.poll() not in (None, 0) for p in others):
            return self._fail()
        if not all(p.poll() == 0 for p in others):
            return False
        if self.ended[-1:] == ["running"]:
            if self._joined() and any(p.poll() is None for p in standby):
                return False  # it syncs with the others: it ends with them
            if not self._joined():
                self.ended[-1] = "did not rejoin: the others had finished before it joined them"
        return True

    def _fail(self) -> bool:
        time.sleep(2.0)  # torchrun stops its own workers first, writing their error files
        self.failed = True
        return True

    def collect(self, run_dir: Path, started: Agents, timed_out: bool, timeout: float, tail: str,
                oom_killed: bool) -> LaunchResult:
        """The run's result: the ranks of the replicas that ran it from start to end, and per replica
        the steps each of its lives ran and how each ended (``faults`` of the result)."""
        codes = [p.returncode for d in range(self.dp) if d != self.victim for p in self._procs(started, d)]
        base = collect(run_dir, codes, timed_out, timeout, tail, expect_result=False, oom_killed=oom_killed,
                       ignore=set(self._victim_ranks()))
        results = {d: json.loads(f.read_text())["ranks"] for d in range(self.dp)
                   if (f := run_dir / f"result-replica{d}.json").exists()}
        whole = [r for d in sorted(results) if d != self.victim for r in results[d]]
        status, error = base.status, base.error
        if status == "ok" and len(whole) != (self.dp - 1) * self.size:
            missing = sorted(set(range(self.dp)) - set(results) - {self.victim})
            status, error = "error", f"replicas {missing} left no result"
        replicas = [self._describe(d, results.get(d), run_dir) for d in range(self.dp)]
        result = LaunchResult(status, error, sorted(whole, key=lambda r: r["rank"]) if whole else None, {}, run_dir)
        result.faults = {"replicas": replicas}
        return result

    def _describe(self, d: int, ranks: list[dict] | None, run_dir: Path) -> dict:
        """Replica d's lives: the steps each ran (first, last) and how it ended; the victim's second
        life (the standby's) also whether it rejoined and the outer steps it ended at."""
        if d != self.victim:
            steps = ranks[0]["steps_run"] if ranks else []
            return {"replica": d, "lives": [{"steps": [steps[0], steps[-1]] if steps else None,
                                            "ended": "finished" if ranks else "failed"}]}
        lives = [{"steps": [0, self.step - 1], "ended": self.ended[0] if self.ended else "not killed"}]
        if len(self.ended) > 1:
            progress = [json.loads(p.read_text()) for r in self._victim_ranks()
                        if (p := run_dir / f"progress-rank{r}-rejoined.json").exists()]
            last = [l for _, l in progress if l is not None]
            ran = [min(f for f, _ in progress), min(last)] if progress and len(last) == len(progress) else None
            ended = "finished" if ranks and self.ended[1] == "running" else self.ended[1]
            if ended == "running":
                ended = "stopped when the run ended"
            lives.append({"steps": ran, "ended": ended, "rejoined": bool(progress),
                          "outer_steps": (ranks[0].get("extra") or {}).get("outer_steps") if ranks else None})
        return {"replica": d, "lives": lives}


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
            expect_result: bool = True, oom_killed: bool = False, ignore: set[int] = frozenset()) -> LaunchResult:
    """The outcome of a run from its files. ``expect_result`` is False on the nodes of a multi-node run
    other than node 0: rank 0 (on node 0) gathers the measurements. The error names the rank that
    failed first and how: its own error (an exception, OOM), else a rank killed by a signal, else a
    rank that lost its peers. ``ignore``: ranks whose errors are not the run's (a replica killed on
    purpose, whose agents' output is not in ``log_tail`` either)."""
    errors = [e for p in sorted(run_dir.glob("error-rank*.json"))
              if (e := json.loads(p.read_text()))["rank"] not in ignore]
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


def launch_emulated(cfg: RunConfig, world: int, run_dir: Path, slow: Straggler | None) -> LaunchResult:
    """Every rank on a virtual host of its own (a network namespace), links shaped by the profile
    (and changed as the run's trace says, from its first step on): one torchrun agent per virtual
    node, rendezvous at virtual host 0 (at each replica's first host, where replicas are worlds of
    their own)."""
    profile = parse_profile(cfg.network, cfg.network_matrix)
    trace = trace_from(cfg.network_trace_contents, Path(cfg.network_trace).stem) if cfg.network_trace else None
    timeline = trace.timeline(profile, world) if trace else []
    start = trace.start(profile, world) if trace else profile
    with VirtualCluster(world, start, name="run", changing=trace is not None) as vc:
        probe = world > 1 and start.emulated and not cfg.no_link_probe
        measured = vc.probe_links() if probe else {"measured_link": None}
        for m in measured.get("measured_links") or []:
            print(f"network: {profile.name}: host {m['src']} -> {m['dst']} (set {LinkSpec(**m['set']).words()}): "
                  f"measured one-way delay {m['one_way_delay_ms']:.2f} ms (jitter {m['jitter_ms']:.2f}), "
                  f"loss {m['loss_pct']:.2f} %, bandwidth {m['bandwidth_gbps']:.2f} Gbit/s ({vc.backend})",
                  file=sys.stderr)
        gpus = emulated_gpus(cfg, world)
        host0 = vc.hosts[0]
        where = services.Placing(bind=host0.address, advertise=host0.address, port=services.LIGHTHOUSE_PORT,
                                 prefix=tuple(host0.command_prefix()))
        before = vc.delayer_counts()
        with services.started(get_system(cfg.system).services, cfg, run_dir, where) as env:
            cgroup = slow.procs if slow is not None else None
            slow_env = slow.env() if slow is not None and cgroup is None else {}

            def agent(h, size: int, first: int, extra: dict[str, str], replica: int | None = None,
                      standby: bool = False) -> Agent:
                master = f"{vc.hosts[first].address}:{29501 if standby else 29500}"  # a standby beside its replica
                return Agent(h.command_prefix() + torchrun_argv(1, size, h.index - first, master, run_dir),
                             {**h.env(), **gpus[h.index], **env, **slow_env, **extra},
                             cgroup if slow is not None and h.index == slow.rank else None, replica, standby)

            player = TracePlayer(vc, timeline, run_dir / STARTED).start() if timeline else None
            try:
                if fault_tolerant_kill(cfg):
                    per = world // cfg.dp

                    def group(d: int, extra: dict[str, str], standby: bool) -> list[Agent]:
                        return [agent(h, per, d * per, extra, d, standby) for h in vc.hosts[d * per:(d + 1) * per]]

                    replicas = ReplicaFaults(cfg, world, run_dir, group)
                    result = run_agents(replicas.agents(), cfg.timeout, run_dir, replicas=replicas)
                else:
                    result = run_agents([agent(h, world, 0, {}) for h in vc.hosts], cfg.timeout, run_dir)
            finally:
                applied = player.stop() if player is not None else None
        result.network = {**vc.describe(), **measured}
        after = vc.delayer_counts()
        if before is not None and after is not None:  # the packets of the run itself (the probe's left out)
            seen, dropped = after["seen"] - before["seen"], after["dropped"] - before["dropped"]
            result.network["delayer_counts"] = {"seen": seen, "dropped": dropped,
                                                "dropped_pct": round(100 * dropped / seen, 4) if seen else None}
        if trace is not None:
            result.network["trace"] = {"name": trace.name, **trace.contents(), "applied": applied}
        if any(gpus):  # NCCL kept off the paths the emulation cannot shape, as the hosts' environment says
            result.network["nccl_env"] = {k: v for k, v in vc.hosts[0].env().items() if k.startswith("NCCL_")}
    return result


def fault_tolerant_kill(cfg: RunConfig) -> bool:
    """The run kills a replica of a system that goes on without it: its replicas are worlds of their own."""
    return cfg.kill_replica is not None and get_system(cfg.system).fault_tolerant


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
        slowed = Straggler(cfg, world // placement.nnodes) if cfg.slow_rank is not None else contextlib.nullcontext()
        with slowed as slow:
            try:
                if cfg.network != "none" and placement.nnodes == 1:
                    result = launch_emulated(cfg, world, run_dir, slow)
                else:
                    result = launch_local(cfg, world, placement, run_dir, slow, single)
            except services.ServiceError as exc:
                result = LaunchResult("error", str(exc), None, run_dir=run_dir)
        faults = dict(result.faults or {})
        if slow is not None:
            faults["straggler"] = slow.describe()
        if cfg.kill_replica is not None:
            faults["killed"] = killed_ranks(run_dir)
            if result.status != "ok" and faults["killed"] and not fault_tolerant_kill(cfg):
                first = faults["killed"][0]
                result.error = (f"rank {first['rank']} was killed after {first['steps']} steps (--kill-replica "
                                f"{cfg.kill_replica}), and {cfg.system} cannot go on without it"
                                + (f" ({result.error})" if result.error else ""))[:2000]
                result.status = "error"
        result.faults = faults or None
    except BaseException:
        watchdog.remove()
        raise
    result.watchdog = watchdog
    return result


def launch_local(cfg: RunConfig, world: int, placement: Placement, run_dir: Path,
                 slow: Straggler | None, single: bool = False) -> LaunchResult:
    """The ranks on this node without emulation: one torchrun agent (or, for a fault-tolerant run that
    loses a replica, one per replica; ``single``: one rank without torchrun, ``single_rank_agent``)."""
    env_slow = slow.env() if slow is not None else {}
    with services.started(get_system(cfg.system).services, cfg, run_dir, local_services(placement)) as env:
        if fault_tolerant_kill(cfg) and placement.nnodes == 1:
            def group(d: int, extra: dict[str, str], standby: bool) -> list[Agent]:
                return [Agent(torchrun_argv(world // cfg.dp, 1, 0, None, run_dir), {**env, **env_slow, **extra},
                              replica=d, standby=standby)]

            replicas = ReplicaFaults(cfg, world, run_dir, group)
            return run_agents(replicas.agents(), cfg.timeout, run_dir, replicas=replicas)
        agents = ([single_rank_agent(run_dir, {**env, **env_slow})] if single and world == 1 and placement.nnodes == 1
                  else local_agents(world, placement, run_dir, {**env, **env_slow}))
        return run_agents(agents, cfg.timeout, run_dir, expect_result=placement.node_rank == 0)

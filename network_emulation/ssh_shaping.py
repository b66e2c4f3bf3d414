"""Shaping a set of hosts over ssh, each with the best backend it has, and probing links between them.

``SshShapingSession`` is the cluster mode's network emulation: like ``netem.NetemSession`` (same
arguments, plus ``ssh_config``) but it works on nodes without sch_netem too. On every host it starts
the shaping agent (shaping_agent.py) over one ssh connection whose stdin it keeps open for the
session; the agent

- uses netem where ``tc qdisc ... netem`` works on that node (probed once; ``backends`` carries a
  result to the next session so that it is not probed again),
- otherwise tbf (rate) on the node's interface and the NFQUEUE delayer (delayer.py) on the node's
  ingress, raw PREROUTING (the sender's OUTPUT chain does not work: TCP small queues),
- clears when its stdin reaches EOF: at the end of the session, on an exception, Ctrl-C or SIGTERM
  here, and also when this process is killed outright (its end of the pipe closes, ssh forwards
  the EOF). A session that starts on a node where an earlier one was killed mid-way (agent and all)
  first removes that one's rules and qdisc.

With a uniform profile every host's egress is rate-limited and every packet arriving on a host is
held for the delay, so each direction between two hosts pays the delay once, as with netem on each
sender. Matrix profiles need each host's address (``addresses``, in rank order): rates per
destination (htb) on the sender, delays per source on the receiver. The delayer leaves the sshd port
out (control traffic only), so that a node whose delayer died is still reachable to be cleared.

Each host needs the suite at ``remote_dir`` with ``remote_python`` (as for the cluster mode's runs;
``{host}`` in either stands for the host's name, for nodes that keep the suite in a directory each),
iproute2, iptables for the fallback, and GNU env with ``-C`` (coreutils 8.28 or later).

``probe`` measures a link between two hosts of the session over ssh with probe.py (server on one,
client on the other, the nodes' own python). Hosts that share a kernel (virtual nodes) share a
clock, so the one-way delay is measured directly; between real hosts it is RTT/2
(``LinkMeasurement.one_way_method`` says which).
"""

from __future__ import annotations

import json
import os
import posixpath
import select
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TextIO

from . import netem
from .probe import DEFAULT_PORT, LinkMeasurement, LinkProbing, measure_with
from .profiles import Profile, ProfileError
from .signals import Guarded, signals_deferred, stop_process

REPO = Path(__file__).resolve().parent.parent
QUEUE_BASE = 4700  # NFQUEUE numbers of the delayer: QUEUE_BASE (uniform) or QUEUE_BASE + source rank
START_TIMEOUT_S = 60.0
CLEAR_TIMEOUT_S = 20.0


def for_host(template: str, host: str | None) -> str:
    """``template`` with ``{host}`` replaced by the host's name (without ``user@``); "localhost" for None."""
    return template.replace("{host}", (host or "localhost").rpartition("@")[2])


def delays_for(profile: Profile, index: int, addresses: Sequence[str]) -> list[list[Any]]:
    """The delayer's queues on host ``index``: ``[queue, delay_ms, source or None, jitter_ms,
    loss_pct]``. Uniform: one queue for everything that arrives; matrix: one queue per source host
    whose link towards us delays, jitters or drops."""
    if not profile.emulated:
        return []
    if profile.uniform:
        link = profile.link(index, index)
        return [[QUEUE_BASE, link.delay_ms, None, link.jitter_ms, link.loss_pct]] if link and link.held else []
    out = []
    for src, address in enumerate(addresses):
        link = profile.link(src, index)
        if link and link.held:
            out.append([QUEUE_BASE + src, link.delay_ms, f"{address}/32", link.jitter_ms, link.loss_pct])
    return out


def plan_for(profile: Profile, iface: str, index: int, addresses: Sequence[str],
             backend: str = "auto") -> dict[str, Any]:
    """What the agent on host ``index`` is asked to do (both backends' commands; it picks one)."""
    return {
        "iface": iface,
        "backend": backend,
        "netem": netem.host_shaping_argv(profile, index, iface, addresses, "netem"),
        "tbf": netem.host_shaping_argv(profile, index, iface, addresses, "tbf"),
        "delays": delays_for(profile, index, addresses),
    }


class _Agent:
    """One host's agent process (ssh, or local), and what it answered."""

    def __init__(self, host: str | None, argv: list[str]) -> None:
        self.host, self.argv = host, argv
        self.name = host or "localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self.errors: IO[bytes] | None = None
        self.buffer = b""
        self.started: dict[str, Any] | None = None

    def start(self, plan: dict[str, Any]) -> None:
        self.errors = tempfile.TemporaryFile()
        # Its own session: a Ctrl-C on the terminal reaches this process, which then ends the
        # agents in order, and not the ssh clients (whose death would skip the answer).
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(plan) + "\n").encode())
        self.proc.stdin.flush()

    def read(self, deadline: float) -> dict[str, Any] | None:
        """The agent's next answer, or None (it ended or the deadline passed)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"ok": False, "error": f"unexpected answer {line[:200]!r}"}

    def stderr_tail(self) -> str:
        if self.errors is None:
            return ""
        self.errors.seek(0)
        lines = self.errors.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def end(self, deadline: float) -> str | None:
        """Close the lifeline and wait for the agent's clearing; returns an error, or None."""
        if self.proc is None:
            return None
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        answer = self.read(deadline) if self.proc.stdout else None
        while answer is not None and "cleared" not in answer:
            answer = self.read(deadline)
        stop_process(self.proc, None, max(0.1, deadline - time.monotonic()))
        if self.proc.stdout:
            self.proc.stdout.close()
        error = None
        if answer is None:
            error = f"no answer from its agent ({self.stderr_tail() or f'exit {self.proc.returncode}'})"
        elif answer.get("errors"):
            error = "; ".join(answer["errors"])
        if self.errors:
            self.errors.close()
        self.proc = None
        return error


class SshShapingSession(Guarded, LinkProbing):
    """Shape ``hosts`` (ssh names; empty = this host) for ``profile`` on ``iface``, each with the best
    backend it has, and always clear afterwards (exception, Ctrl-C, SIGTERM, SIGHUP; SIGKILL of this
    process through the agents' EOF).

    >>> with SshShapingSession(parse_profile("d10-1g"), "eth0", ["node01", "node02"],
    ...                        ssh_config="/tmp/pipebench-nodes/ssh_config") as s:   # doctest: +SKIP
    ...     print(s.backends, s.probe(0, 1))

    ``remote_dir`` / ``remote_python``: the suite and its python on the hosts (default: this
    machine's, as for the cluster mode). ``backends``: host -> backend found by an earlier session
    (skips the netem probe). After entering: ``backends``, ``iface_addresses`` (host -> IPv4 address
    of ``iface``), ``hostnames``, ``leftovers`` (host -> what an earlier killed session left, removed).
    """

    def __init__(self, profile: Profile, iface: str, hosts: Sequence[str] = (), addresses: Sequence[str] = (),
                 dry_run: bool = False, sudo: bool = False, out: TextIO = sys.stdout,
                 ssh_config: str | os.PathLike[str] | None = None, remote_dir: str = str(REPO),
                 remote_python: str = sys.executable, backends: Mapping[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        if not profile.uniform and len(addresses) != max(1, len(hosts)):
            raise ProfileError("a matrix profile on real hosts needs one --address per --host, in rank order")
        for h in hosts:
            if not h or h.startswith("-"):
                raise ValueError(f"bad host name {h!r}")
        self.profile, self.iface, self.addresses = profile, iface, tuple(addresses)
        self.hosts: tuple[str | None, ...] = tuple(hosts) or (None,)
        self.dry_run, self.sudo, self.out, self.timeout_s = dry_run, sudo, out, timeout_s
        self.ssh_config = os.fspath(ssh_config) if ssh_config else None
        self.remote_dir, self.remote_python = remote_dir, remote_python
        self.backends: dict[str, str] = dict(backends or {})
        self.iface_addresses: dict[str, str] = {}
        self.hostnames: dict[str, str] = {}
        self.boot_ids: dict[str, str] = {}
        self.leftovers: dict[str, list[str]] = {}
        self._agents: list[_Agent] = []
        if not dry_run and not hosts and not sudo:
            netem.require_root("shaping")

    # ------------------------------------------------------------------ commands
    def _on(self, host: str | None, argv: list[str]) -> list[str]:
        return netem.ssh_argv(host, argv, netem.ssh_base(self.ssh_config)) if host else argv

    def agent_argv(self, host: str | None) -> list[str]:
        """The command that starts the agent on ``host`` (in the suite's directory there)."""
        argv = ["env", "-C", for_host(self.remote_dir, host), for_host(self.remote_python, host), "-m",
                "network_emulation.shaping_agent"]
        return self._on(host, ["sudo", "-n", *argv] if self.sudo else argv)

    def plan(self, index: int) -> dict[str, Any]:
        host = self.hosts[index]
        return plan_for(self.profile, self.iface, index, self.addresses, self.backends.get(host or "localhost", "auto"))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.dry_run:
            self._print_plan()
        else:
            self._start()

    def close(self) -> None:
        self._clear()

    def _print_plan(self) -> None:
        for i, host in enumerate(self.hosts):
            plan = self.plan(i)
            name = host or "localhost"
            print(f"# {name}: shaping agent, stdin held open for the session:", file=self.out)
            print(shlex.join(self.agent_argv(host)), file=self.out)
            print("#   netem where the node has it:", file=self.out)
            for argv in plan["netem"]:
                print(f"#     {shlex.join(argv)}", file=self.out)
            queues = " ".join(f"{q}:{d:g}:{src or 'any'}" for q, d, src, *_ in plan["delays"]) or "none"
            print(f"#   else tbf + delayer (raw PREROUTING on {self.iface}, queue:delay_ms:source {queues}):",
                  file=self.out)
            for argv in plan["tbf"]:
                print(f"#     {shlex.join(argv)}", file=self.out)

    def _start(self) -> None:
        self._agents = [_Agent(h, self.agent_argv(h)) for h in self.hosts]
        for i, a in enumerate(self._agents):
            a.start(self.plan(i))
        deadline = time.monotonic() + self.timeout_s
        failed = []
        for a in self._agents:
            answer = a.read(deadline)
            if not answer or not answer.get("ok"):
                why = answer.get("error") if answer else (a.stderr_tail() or "no answer from its agent")
                failed.append(f"{a.name}: {why}")
                continue
            a.started = answer
            self.backends[a.name] = answer["backend"]
            self.iface_addresses[a.name] = answer.get("address") or ""
            self.hostnames[a.name] = answer.get("hostname", "")
            self.boot_ids[a.name] = answer.get("boot_id", "")
            if answer.get("leftovers"):
                self.leftovers[a.name] = answer["leftovers"]
                rules = sum(x.startswith("iptables rule") for x in answer["leftovers"])
                rest = [x for x in answer["leftovers"] if not x.startswith("iptables rule")]
                print(f"network_emulation: {a.name}: removed what an earlier, killed session left: "
                      + ", ".join([f"{rules} iptables rule(s)"] * bool(rules) + rest), file=sys.stderr)
        if failed:
            raise RuntimeError(f"shaping {self.profile.name} failed on " + " | ".join(failed))

    def _clear(self) -> None:
        with signals_deferred():
            deadline = time.monotonic() + CLEAR_TIMEOUT_S
            for a in self._agents:  # every lifeline first: the agents clear in parallel
                if a.proc and a.proc.stdin and not a.proc.stdin.closed:
                    try:
                        a.proc.stdin.close()
                    except BrokenPipeError:
                        pass
            for a in self._agents:
                error = a.end(deadline)
                if error:
                    print(f"network_emulation: clearing {a.name} failed: {error}", file=sys.stderr)
            self._agents = []

    # ------------------------------------------------------------------ use
    def describe(self) -> dict[str, Any]:
        """For the run record: the backend ("netem", "tbf+delayer", "none", or several joined by
        commas when the hosts differ), the profile and, per host, its backend and address."""
        return {
            "backend": ",".join(sorted(set(self.backends.values()))) or None,
            "profile": self.profile.describe(),
            "hosts": [{"host": h or "localhost", "hostname": self.hostnames.get(h or "localhost"),
                       "iface": self.iface, "address": self.iface_addresses.get(h or "localhost"),
                       "backend": self.backends.get(h or "localhost")} for h in self.hosts],
        }

    def _measure(self, src: int, dst: int, *, samples: int, duration_s: float, train: int,
                 port: int) -> LinkMeasurement:
        """The probe's two ends on the hosts (indices into ``hosts``), over ssh (``LinkProbing.probe``)."""
        server, client = self.hosts[dst], self.hosts[src]
        address = self.iface_addresses.get(server or "localhost") or server
        if not address:
            raise ValueError("probe: the destination's address is unknown (enter the session first)")
        # The delayer holds packets after the receiver's kernel has time-stamped them.
        stamp = "socket" if self.backends.get(server or "localhost") == "tbf+delayer" else "kernel"
        return probe_over_ssh(server, client, address, ssh_config=self.ssh_config, remote_dir=self.remote_dir,
                              remote_python=self.remote_python, samples=samples, duration_s=duration_s,
                              train=train, port=port, stamp=stamp)


def probe_over_ssh(server: str | None, client: str | None, address: str, *,
                   ssh_config: str | os.PathLike[str] | None = None, remote_dir: str = str(REPO),
                   remote_python: str = sys.executable, samples: int = 20, duration_s: float = 1.0,
                   train: int = 0, port: int = DEFAULT_PORT, stamp: str = "kernel") -> LinkMeasurement:
    """Run probe.py's server on ``server`` and its client on ``client`` (ssh names; None = here),
    the client sending to ``address`` (the server's address on the shaped interface). ``stamp``
    "socket" when the server's node delays on its ingress (see probe.serve). ``{host}`` in
    ``remote_dir`` and ``remote_python`` stands for each side's host name."""
    base = netem.ssh_base(ssh_config)

    def on(host: str | None):
        def wrap(args: list[str]) -> list[str]:
            script = posixpath.join(for_host(remote_dir, host), "network_emulation", "probe.py")
            argv = [for_host(remote_python, host), "-I", script, *args]
            return netem.ssh_argv(host, argv, base) if host else argv
        return wrap

    return measure_with(on(server), on(client), address, port=port, samples=samples, duration_s=duration_s,
                        train=train, stamp=stamp)

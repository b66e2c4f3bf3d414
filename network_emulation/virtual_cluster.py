"""A local virtual cluster: one network namespace per host, a bridge in a "switch" namespace.

    host k (netns nemu-<pid>.<start>-<name>-h<k>)   eth0 10.77.0.<k+1>/24
        └── veth ── p<k> ── br0 in the switch netns (nemu-<pid>.<start>-<name>-sw)

Shaping, per the kernel's abilities:
- ``netem``: netem on each host's eth0 (delay + rate; htb + netem per destination for a matrix);
- ``tbf+delayer``: tbf (uniform) or htb per destination (matrix) on each host's eth0 for the rate,
  and the nfnetlink_queue delayer (delayer.py) in the switch namespace for the delay, jitter and
  loss: every packet entering the bridge from host A towards host B is held delay(A->B) ms (± the
  jitter), or dropped with the link's loss probability;
- ``none``: plain bridge.

TCP of every virtual host, set for a training job's connections (long-lived, idle between bursts: a
pipeline's messages, a data-parallel sync once a step): TCP buffers up to 64 MB (a 1 Gbit/s x 100 ms
path), no slow start after idle (``tcp_slow_start_after_idle=0``, else every burst after a pause
longer than the retransmission timeout starts again from 10 segments), no metrics kept between
connections (``tcp_no_metrics_save=1``: Linux otherwise caches the slow-start threshold per
destination, and after one connection saw a loss every later one to that host starts in congestion
avoidance: the likely reason a probe once measured 0.049 of 1 Gbit/s at 10 ms four times in a row), and CUBIC, Linux's
default congestion control, where the host's default is a pacing one (BBR paces a burst at the delivery rate it has
measured, which for bursts of a few MB separated by idle time is far below the link's: on this machine kind, at 40 ms
one-way and 10 Gbit/s, a 2 MB gloo message pre-posted a step ahead took 83 ms with BBR, 42 ms with CUBIC and no slow
start after idle). ``describe()`` records what was set.

Everything lives inside the cluster's namespaces, so deleting them removes links, bridge, qdiscs and
iptables rules at once. A watchdog process (``watchdog.py``) deletes them when its pipe from the
owner closes, so a cluster whose owner died (even by SIGKILL) is gone within a second or two; as a
second line, namespace names carry the owner's pid and start time, and the next VirtualCluster start
or ``cleanup_stale()`` removes any whose owner is gone. The
delayer exits when its stdin pipe from the owner closes, i.e. when the owner dies.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from . import netem
from .probe import LinkMeasurement, LinkProbing, measure
from .delayer import queue_arg
from .profiles import LinkSpec, Profile, parse_profile
from .signals import Guarded, signals_deferred, stop_process

PREFIX = "nemu-"
_NS_RE = re.compile(rf"^{PREFIX}(\d+)\.([0-9a-f]+)-")
BACKENDS = ("netem", "tbf+delayer", "none")
TCP_MEM_MAX = 64 << 20
TCP_CONGESTION = "cubic"  # per route on each host's subnet (a namespace may only default to "allowed" ones)
DELAYER = Path(__file__).with_name("delayer.py")


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot (field 22 of /proc/<pid>/stat), None if gone
    or a zombie (ended, not yet reaped: where PID 1 does not reap orphans it stays one for good)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _run(argv: list[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise RuntimeError(f"{' '.join(argv)} failed: {msg[0] if msg else p.returncode}")
    return p


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str, grace_s: float = 1.0) -> None:
    def pids() -> list[int]:
        return [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        left = pids()
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and pids():
            time.sleep(0.02)


def destroy_namespace(ns: str) -> None:
    """Kill what runs inside ``ns`` and delete it (links, qdiscs, iptables rules go with it)."""
    _kill_namespace_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)


def cleanup_stale(log: TextIO | None = sys.stderr) -> list[str]:
    """Remove every virtual-cluster namespace whose owner process is gone. Returns their names."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and _start_time(int(m.group(1))) != int(m.group(2), 16):
            destroy_namespace(ns)
            removed.append(ns)
    if removed and log:
        print(f"network_emulation: removed {len(removed)} stale namespace(s) of dead owners", file=log)
    return removed


@dataclass(frozen=True)
class VirtualHost:
    """A host in a network namespace of its own: a virtual cluster's, or a virtual node
    (``tools.nodes``, which also has a host name: its ssh name)."""

    index: int
    namespace: str
    address: str
    iface: str = "eth0"
    name: str = ""  # a virtual node's host name (node01, ...); empty for a virtual cluster's host

    def command_prefix(self) -> list[str]:
        """Prefix an argv with this to run it inside the host."""
        return ["ip", "netns", "exec", self.namespace]

    def env(self) -> dict[str, str]:
        """Environment for torch.distributed ranks on this host (gloo/NCCL over eth0 sockets): NCCL
        kept off every path the emulation cannot shape (GPU peer-to-peer, shared memory, InfiniBand
        and network plugins such as EFA's)."""
        return {
            "GLOO_SOCKET_IFNAME": self.iface,
            "NCCL_SOCKET_IFNAME": self.iface,
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1",
            "NCCL_NET": "Socket",
        }


class VirtualCluster(Guarded, LinkProbing):
    """``n_hosts`` network namespaces on one bridge, shaped by ``profile``; a context manager.

    backend="auto" picks netem when the kernel has it, else tbf+delayer ("none" for the none profile).
    ``changing``: the links will change while the cluster runs (``reshape``).
    """

    def __init__(self, n_hosts: int, profile: Profile | str = "none", name: str = "vc", *,
                 backend: str = "auto", subnet: str = "10.77.0", realtime: bool = True, changing: bool = False,
                 log: TextIO | None = sys.stderr) -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be in 1..250, got {n_hosts}")
        if not re.fullmatch(r"[a-z0-9]{1,16}", name):
            raise ValueError(f"cluster name must be 1-16 characters a-z0-9, got {name!r}")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend must be auto or one of {BACKENDS}, got {backend!r}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets of a /24, got {subnet!r}")
        self.profile: Profile = parse_profile(profile) if isinstance(profile, str) else profile
        self.profile.check_hosts(n_hosts)
        self.name, self.subnet, self.realtime, self.log = name, subnet, realtime, log
        self.changing = changing  # links may change during the run (``reshape``): a delayer queue for each
        self._requested_backend = backend
        pid = os.getpid()
        tag = f"{PREFIX}{pid}.{_start_time(pid):x}-{name}"
        self.tag = tag + "-"
        self.switch_namespace = f"{tag}-sw"
        self.hosts: tuple[VirtualHost, ...] = tuple(
            VirtualHost(k, f"{tag}-h{k}", f"{subnet}.{k + 1}") for k in range(n_hosts))
        self.backend = "none"
        self.delayer: subprocess.Popen[str] | None = None
        self.delayer_queues: dict[int, LinkSpec] = {}
        self.delayer_realtime = False
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.tcp_congestion: str | None = None
        self._open = False

    # ------------------------------------------------------------------ lifecycle (Guarded)
    def start(self) -> None:
        netem.require_root("the virtual cluster")
        netem.require_tools("ip", "tc")
        cleanup_stale(self.log)
        existing = set(list_namespaces())
        if self.switch_namespace in existing:
            raise RuntimeError(f"a virtual cluster named {self.name!r} is already running in this process")
        self._open = True
        # Whatever way this process ends, the watchdog deletes the cluster's namespaces.
        self.watchdog = subprocess.Popen([sys.executable, "-m", "network_emulation.watchdog", "--tag", self.tag],
                                         stdin=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1],
                                         start_new_session=True)
        self._build_topology()
        self.backend = self._choose_backend()
        if self.log:
            why = {"netem": "kernel has sch_netem", "tbf+delayer": "no sch_netem: tbf rate + nfqueue delayer",
                   "none": "no shaping"}[self.backend]
            print(f"network_emulation: cluster {self.name!r}: {len(self.hosts)} hosts on {self.subnet}.0/24, "
                  f"profile {self.profile.name}, backend {self.backend} ({why})", file=self.log)
        if self.backend != "none":
            self._shape()

    def close(self) -> None:
        """Tear everything down; safe to call twice."""
        if not self._open:
            return
        with signals_deferred():
            if self.delayer is not None:
                if self.delayer.stdin:
                    self.delayer.stdin.close()  # its cue to stop
                stop_process(self.delayer, None, 2.0)
                if self.delayer.stdout:
                    self.delayer.stdout.close()
                self.delayer = None
            for h in self.hosts:
                destroy_namespace(h.namespace)
            destroy_namespace(self.switch_namespace)
            if self.watchdog is not None:  # nothing left for it to delete
                self.watchdog.stdin.close()
                self.watchdog.wait()
                self.watchdog = None
            self._open = False

    # ------------------------------------------------------------------ building
    def _build_topology(self) -> None:
        sw = self.switch_namespace
        _run(["ip", "netns", "add", sw])
        no_v6 = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        _run(["ip", "netns", "exec", sw, "sysctl", "-q", "-w", *no_v6], check=False)
        _run(["ip", "-n", sw, "-batch", "-"], input="link set lo up\nlink add br0 type bridge\nlink set br0 up\n")
        tcp = [f"net.ipv4.tcp_rmem=4096 131072 {TCP_MEM_MAX}", f"net.ipv4.tcp_wmem=4096 16384 {TCP_MEM_MAX}",
               "net.ipv4.tcp_slow_start_after_idle=0", "net.ipv4.tcp_no_metrics_save=1"]
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
        self.tcp_congestion = TCP_CONGESTION if TCP_CONGESTION in available else None  # None: the host's default
        congctl = f" congctl {self.tcp_congestion}" if self.tcp_congestion else ""
        for h in self.hosts:
            _run(["ip", "netns", "add", h.namespace])
            _run(["ip", "-n", sw, "link", "add", f"p{h.index}", "type", "veth", "peer", "name", h.iface,
                  "netns", h.namespace])
            _run(["ip", "-n", sw, "link", "set", f"p{h.index}", "master", "br0", "up"])
            _run(["ip", "netns", "exec", h.namespace, "sysctl", "-q", "-w", *tcp, *no_v6])
            _run(["ip", "-n", h.namespace, "-batch", "-"],
                 input=f"link set lo up\naddr add {h.address}/24 dev {h.iface}\nlink set {h.iface} up\n"
                       f"route replace {self.subnet}.0/24 dev {h.iface} proto kernel scope link src "
                       f"{h.address}{congctl}\n")

    def _choose_backend(self) -> str:
        if not self.profile.emulated:
            return "none"
        if self._requested_backend != "auto":
            return self._requested_backend
        h = self.hosts[0]
        probe = _run(["tc", "-n", h.namespace, "qdisc", "replace", "dev", h.iface, "root", "netem", "delay", "1ms"],
                     check=False)
        if probe.returncode == 0:
            _run(["tc", "-n", h.namespace, "qdisc", "del", "dev", h.iface, "root"], check=False)
            return "netem"
        return "tbf+delayer"

    def shaping_commands(self, change: bool = False) -> dict[str, list[list[str]]]:
        """The tc commands per host namespace for the chosen backend (without the ``-n ns`` part);
        ``change``: those that change the shaping already there (``reshape``)."""
        kind: netem.Kind = "netem" if self.backend == "netem" else "tbf"
        addrs = [h.address for h in self.hosts]
        return {h.namespace: netem.host_shaping_argv(self.profile, h.index, h.iface, addrs, kind, change)
                for h in self.hosts}

    def delayer_rules(self) -> tuple[dict[int, LinkSpec], list[str]]:
        """Queue number -> the link whose packets it holds, and the iptables FORWARD rules of the switch
        namespace: a queue per link that delays, jitters or drops (every link, where they may change
        during the run: ``changing``)."""
        queues: dict[int, LinkSpec] = {}
        rules: list[str] = []
        n = len(self.hosts)
        for h in self.hosts:
            if self.profile.uniform:
                link = self.profile.link(h.index, h.index)
                if link and (link.held or self.changing):
                    queues[h.index] = link
                    rules.append(f"-A FORWARD -m physdev --physdev-in p{h.index} -j NFQUEUE --queue-num {h.index}")
                continue
            for d in self.hosts:
                link = self.profile.link(h.index, d.index)
                if link and (link.held or self.changing):
                    q = h.index * n + d.index
                    queues[q] = link
                    rules.append(f"-A FORWARD -m physdev --physdev-in p{h.index} -d {d.address}/32 "
                                 f"-j NFQUEUE --queue-num {q}")
        return queues, rules

    def _shape(self) -> None:
        for ns, cmds in self.shaping_commands().items():
            for argv in cmds:
                _run([argv[0], "-n", ns, *argv[1:]])
        if self.backend != "tbf+delayer":
            return
        queues, rules = self.delayer_rules()
        if not queues:
            return
        netem.require_tools("iptables-restore")
        sw = self.switch_namespace
        if not Path("/proc/sys/net/bridge").exists():
            _run(["modprobe", "br_netfilter"], check=False)
        _run(["ip", "netns", "exec", sw, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"])
        self._start_delayer(queues)
        # No --queue-bypass: if the delayer dies, traffic stops rather than flowing undelayed.
        _run(["ip", "netns", "exec", sw, "iptables-restore", "--noflush"],
             input="*filter\n" + "\n".join(rules) + "\nCOMMIT\n")
        self.delayer_queues = queues

    def _start_delayer(self, queues: dict[int, LinkSpec]) -> None:
        base = [sys.executable, "-I", str(DELAYER), "--owner", str(os.getpid())]
        for q, link in sorted(queues.items()):
            base += ["--queue", queue_arg(q, link.delay_ms, link.jitter_ms, link.loss_pct)]
        attempts = [["chrt", "-f", "20", *base]] if self.realtime and shutil.which("chrt") else []
        attempts.append(base)
        for argv in attempts:
            p = subprocess.Popen(["ip", "netns", "exec", self.switch_namespace, *argv],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 15)
            if ready and p.stdout.readline().strip() == "ready":
                self.delayer = p
                self.delayer_realtime = argv[0] == "chrt"
                return
            stop_process(p, signal.SIGKILL, 5.0)
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()
        raise RuntimeError("the packet delayer did not start (see its error above)")

    def reshape(self, profile: Profile) -> None:
        """Shape the running cluster's links as ``profile`` says from now on (a link that changes
        during the run, ``network_emulation.traces``): the rate in each host's qdisc (tc ... replace
        changes it in place), the delay, jitter and loss in netem or in the delayer (for packets
        arriving from now on). Needs a cluster started with ``changing=True`` and a profile of the
        same kind (uniform or per-link) and size."""
        if not self.changing:
            raise RuntimeError("reshape needs a cluster started with changing=True")
        if profile.uniform != self.profile.uniform:
            raise ValueError("reshape: the new profile must be of the same kind (uniform or per-link) as the old")
        profile.check_hosts(len(self.hosts))
        self.profile = profile
        if self.backend == "none":
            return
        for ns, cmds in self.shaping_commands(change=True).items():
            for argv in cmds:
                _run([argv[0], "-n", ns, *argv[1:]])
        if self.delayer is not None and self.delayer.stdin:
            queues, _ = self.delayer_rules()
            for q, link in sorted(queues.items()):
                if self.delayer_queues.get(q) != link:
                    self.delayer.stdin.write(f"set {q} {link.delay_ms:.6g} {link.jitter_ms:.6g} {link.loss_pct:.6g}\n")
            self.delayer.stdin.flush()
            self.delayer_queues = queues

    def delayer_counts(self) -> dict[str, int] | None:
        """The packets the delayer has held and dropped so far, over every link ({"seen", "dropped"}),
        or None without a delayer."""
        p = self.delayer
        if p is None or p.stdin is None or p.stdout is None:
            return None
        p.stdin.write("stats\n")
        p.stdin.flush()
        ready, _, _ = select.select([p.stdout], [], [], 5)
        if not ready:
            return None
        counts = json.loads(p.stdout.readline())
        return {k: sum(c[k] for c in counts.values()) for k in ("seen", "dropped")}

    # ------------------------------------------------------------------ use
    def describe(self) -> dict[str, Any]:
        """For the run record: backend, profile, hosts and the per-link settings."""
        links = []
        for a in self.hosts:
            for b in self.hosts:
                link = self.profile.link(a.index, b.index) if a.index != b.index else None
                if link:
                    links.append({"src": a.index, "dst": b.index, **link.describe()})
        return {
            "backend": self.backend,
            "profile": self.profile.describe(),
            "hosts": [{"namespace": h.namespace, "address": h.address, "iface": h.iface} for h in self.hosts],
            "links": links,
            "delayer": {"queues": len(self.delayer_queues),
                        "realtime": self.delayer_realtime} if self.delayer else None,
            "tcp": {"congestion_control": self.tcp_congestion or "host default", "slow_start_after_idle": 0,
                    "no_metrics_save": 1},
        }

    def _measure(self, src: int, dst: int, *, samples: int, duration_s: float, train: int,
                 port: int) -> LinkMeasurement:
        """The probe's two ends in the hosts' namespaces (``LinkProbing.probe``)."""
        a, b = self.hosts[src], self.hosts[dst]
        return measure(b.command_prefix(), a.command_prefix(), b.address, port=port, samples=samples,
                       duration_s=duration_s, train=train)

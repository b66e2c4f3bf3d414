"""Virtual nodes on one machine: N network namespaces on one bridge, each with its own sshd.

The suite's cluster mode runs over real ssh on them.

    node k   netns nemu-<pid>.<start>-vnodes-nodeKK   eth0 <subnet>.k/24, host name nodeKK, sshd :22
        └── veth ── pk ── br0 in the switch netns nemu-<pid>.<start>-vnodes-switch
    this machine: vn<pid> <subnet>.254/24 ── veth ── host ── br0

Each node's sshd runs in the node's network namespace and in new UTS, mount and pid namespaces:
``hostname`` answers nodeKK, /etc/hosts (bind-mounted from DIR/hosts, only inside the node) names
every node, and sshd is the node's pid 1, so stopping it stops, and reaps, every process of the
node, as a crashed node would lose them. The nodes see the machine's file system (the suite and its
.venv are at the same path, as on a cluster with a shared file system).

Keys, configs, known_hosts and logs live under DIR (see node_ssh.py); DIR/hostfile and
DIR/ssh_config are what the cluster mode uses. Nothing of the machine's ssh setup is touched.

Lifetime: the namespace names carry the owner's pid and start time, like the virtual cluster's
(virtual_cluster.py), so nodes whose owner died, even by SIGKILL, are removed by the next ``up``,
by ``down``, by any VirtualCluster start and by ``python -m network_emulation cleanup``. In-process
use: ``with VirtualNodes(n, directory) as nodes:`` (owned by the current process). From the
command line, ``up`` starts a small keeper process that owns the nodes until ``down`` (SIGTERM).

    python -m tools.nodes up --nodes 4 [--dir DIR] [--subnet 10.88.0]
    python -m tools.nodes status [--dir DIR]
    python -m tools.nodes down [--dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import ipaddress
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from network_emulation import netem
from network_emulation.signals import (Guarded, Terminated, cli_status, processes_where, signals_deferred,
                                      signals_raise, stop_process)
from network_emulation.virtual_cluster import (PREFIX, TCP_MEM_MAX, VirtualHost, _run, _start_time, cleanup_stale,
                                              destroy_namespace, list_namespaces)
from tools import node_ssh

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(tempfile.gettempdir()) / "pipebench-nodes"
STATE = "nodes.json"
MAX_NODES = 250
HOST_OCTET = 254  # this machine's address on the bridge: <subnet>.254
SSH_PORT = 22
# In the node: set the host name, give it its own /etc/hosts, hide this machine's ~/.bashrc (a fresh
# node's shells start without this user's set-up: bash reads ~/.bashrc for every command ssh runs, and
# one that runs `pyenv init` takes a lock that a session killed at the wrong moment leaves behind, after
# which every later command waits a minute for it), become sshd (the node's pid 1). The script is
# constant; every value arrives as a positional argument, never inside the script text.
NODE_INIT = ('hostname "$1" && mount --bind "$2" /etc/hosts && { [ ! -f "$6" ] || mount --bind /dev/null "$6"; } '
             '&& exec "$3" -D -f "$4" -E "$5"')
PR_SET_CHILD_SUBREAPER = 36


class NodesError(ValueError):
    """A request that cannot be served (bad argument, nodes already up, not root): one line."""


def _alive(pid: int, start: int) -> bool:
    """The process ``pid`` that started at ``start`` still runs (a zombie has ended)."""
    return _start_time(pid) == start


def _sshd() -> str:
    path = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
                                         if os.access(p, os.X_OK)), None)
    if path is None:
        raise FileNotFoundError("sshd missing: apt-get install -y openssh-server (or run scripts/setup_env.sh as root)")
    return path


def subnets_in_use() -> set[str]:
    """First three octets of every IPv4 address and /24-or-narrower route of this namespace."""
    used = set()
    for line in _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.add(words[words.index("inet") + 1].rsplit(".", 1)[0])
    for line in _run(["ip", "-4", "route", "show"], check=False).stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if "/" in dest and int(dest.split("/")[1]) >= 24:
            used.add(dest.rsplit(".", 1)[0])
    return used


def free_subnet(used: set[str]) -> str:
    """The first /24 in 10.88.0.0/16 not in ``used`` (virtual clusters use 10.77.0.0/24, inside their
    own namespaces)."""
    for k in range(256):
        if f"10.88.{k}" not in used:
            return f"10.88.{k}"
    raise RuntimeError("no free /24 in 10.88.0.0/16 for virtual nodes; pass --subnet")


def check_subnet(subnet: str) -> None:
    try:
        ipaddress.IPv4Network(f"{subnet}.0/24")
    except ValueError:
        raise NodesError(f"subnet must be the first three octets of a /24, e.g. 10.88.0, got {subnet!r}") from None


class VirtualNodes(Guarded):
    """``n_nodes`` virtual nodes with sshd, owned by the current process; a context manager.

    After ``start()``: ``nodes`` (a VirtualHost per node, with its host name), ``hostfile`` and ``ssh_config`` (paths),
    ``host_address`` (this machine's address on the bridge). ``close()`` stops every process in
    the nodes, deletes the namespaces (bridge and host-side link go with them) and removes the
    generated files; logs stay in the directory.
    """

    def __init__(self, n_nodes: int, directory: str | os.PathLike[str] = DEFAULT_DIR, *, subnet: str | None = None,
                 log: TextIO | None = sys.stderr) -> None:
        if not 1 <= n_nodes <= MAX_NODES:
            raise NodesError(f"the number of nodes must be in 1..{MAX_NODES}, got {n_nodes}")
        self.directory = Path(directory).absolute()
        try:
            node_ssh.check_directory(self.directory)
        except ValueError as e:
            raise NodesError(str(e)) from None
        if subnet is not None:
            check_subnet(subnet)
        self.n_nodes, self.requested_subnet, self.log = n_nodes, subnet, log
        pid = os.getpid()
        self.owner = (pid, _start_time(pid) or 0)
        self.tag = f"{PREFIX}{pid}.{self.owner[1]:x}-vnodes"
        self.switch_namespace = f"{self.tag}-switch"
        self.host_link = f"vn{pid}"
        self.subnet = ""
        self.nodes: tuple[VirtualHost, ...] = ()
        self.node_inits: list[subprocess.Popen[bytes]] = []  # per node: unshare, whose child sshd is the node's pid 1
        self._open = False

    # ------------------------------------------------------------------ paths
    @property
    def hostfile(self) -> Path:
        return self.directory / "hostfile"

    @property
    def ssh_config(self) -> Path:
        return self.directory / "ssh_config"

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.{HOST_OCTET}"

    # ------------------------------------------------------------------ lifecycle (Guarded)
    def start(self) -> None:
        netem.require_root("virtual nodes")
        netem.require_tools("ip", "unshare", "mount")
        if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
            raise FileNotFoundError("ssh client missing: apt-get install -y openssh-client")
        sshd = _sshd()
        cleanup_stale(self.log)
        previous = read_state(self.directory)
        if previous and _alive(previous["owner"]["pid"], previous["owner"]["start"]):
            raise NodesError(f"virtual nodes are already up in {self.directory} (owner pid "
                             f"{previous['owner']['pid']}): "
                             f"run 'python -m tools.nodes down --dir {self.directory}' first")
        if self.switch_namespace in list_namespaces():
            raise NodesError("this process already owns a set of virtual nodes")
        used = subnets_in_use()
        if self.requested_subnet in used:
            raise NodesError(f"subnet {self.requested_subnet}.0/24 is in use on this machine; pick another --subnet")
        self.subnet = self.requested_subnet or free_subnet(used)
        width = max(2, len(str(self.n_nodes)))
        self.nodes = tuple(VirtualHost(k, f"{self.tag}-node{k + 1:0{width}d}", f"{self.subnet}.{k + 1}",
                                       name=f"node{k + 1:0{width}d}")
                           for k in range(self.n_nodes))
        self._open = True
        node_ssh.write_all(self.directory, [node_ssh.NodeAddress(n.name, n.address, n.iface) for n in self.nodes])
        self._build_topology()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        for n in self.nodes:
            self.node_inits.append(self._start_sshd(sshd, n))
        self._wait_listening(timeout_s=20 + 0.5 * self.n_nodes)
        write_state(self.directory, self.describe())
        if self.log:
            print(f"network_emulation: {self.n_nodes} virtual node(s) on {self.subnet}.0/24 "
                  f"(this machine {self.host_address}), ssh -F {self.ssh_config}", file=self.log)

    def close(self) -> None:
        """Stop every node (sshd and all it started), delete the namespaces, remove the generated
        files; safe to call twice."""
        if not self._open:
            return
        with signals_deferred():
            for p in self.node_inits:
                _stop_node_init(p)
            self.node_inits = []
            # The host-side link would go with the switch namespace, but only once the kernel has
            # finished dismantling it (asynchronously): delete it now.
            _run(["ip", "link", "del", self.host_link], check=False)
            for n in self.nodes:
                destroy_namespace(n.namespace)
            destroy_namespace(self.switch_namespace)
            node_ssh.remove_all(self.directory, [n.name for n in self.nodes])
            (self.directory / STATE).unlink(missing_ok=True)
            self._open = False

    # ------------------------------------------------------------------ building
    def _build_topology(self) -> None:
        sw = self.switch_namespace
        root = [f"netns add {sw}", *(f"netns add {n.namespace}" for n in self.nodes),
                f"link add {self.host_link} type veth peer name host netns {sw}",
                *(f"link add p{n.index + 1} netns {sw} type veth peer name {n.iface} netns {n.namespace}"
                  for n in self.nodes)]
        _run(["ip", "-batch", "-"], input="\n".join(root) + "\n")
        no_v6 = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        _run(["ip", "netns", "exec", sw, "sysctl", "-q", "-w", *no_v6], check=False)
        # Plain bridging: the switch does not run bridged frames through iptables (br_netfilter,
        # if a virtual cluster loaded it); shaping happens on the nodes themselves.
        _run(["ip", "netns", "exec", sw, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=0"], check=False)
        ports = "".join(f"link set p{n.index + 1} master br0 up\n" for n in self.nodes)
        _run(["ip", "-n", sw, "-batch", "-"],
             input=f"link set lo up\nlink add br0 type bridge\nlink set br0 up\nlink set host master br0 up\n{ports}")
        tcp = [f"net.ipv4.tcp_rmem=4096 131072 {TCP_MEM_MAX}", f"net.ipv4.tcp_wmem=4096 16384 {TCP_MEM_MAX}"]
        for n in self.nodes:
            _run(["ip", "netns", "exec", n.namespace, "sysctl", "-q", "-w", *tcp, *no_v6])
            _run(["ip", "-n", n.namespace, "-batch", "-"],
                 input=f"link set lo up\naddr add {n.address}/24 dev {n.iface}\nlink set {n.iface} up\n")
        _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{self.host_link}.disable_ipv6=1"], check=False)
        _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_link])
        _run(["ip", "link", "set", self.host_link, "up"])

    def _start_sshd(self, sshd: str, n: VirtualHost) -> subprocess.Popen[bytes]:
        d = node_ssh.node_dir(self.directory, n.name)
        with open(d / "sshd.log", "ab") as log:
            return subprocess.Popen(
                ["ip", "netns", "exec", n.namespace, "unshare", "--fork", "--pid", "--mount-proc", "--kill-child",
                 "--uts", "--mount", "--", "sh", "-c", NODE_INIT, "node-init", n.name, str(self.directory / "hosts"),
                 sshd, str(d / "sshd_config"), str(d / "sshd.log"), str(Path.home() / ".bashrc")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_listening(self, timeout_s: float) -> None:
        """Until every node's sshd sends its banner to this machine (or raise, naming the node)."""
        waiting = {n.name: n for n in self.nodes}
        end = time.monotonic() + timeout_s
        while waiting:
            for name, n in list(waiting.items()):
                p = self.node_inits[n.index]
                if p.poll() is not None:
                    log = node_ssh.node_dir(self.directory, name) / "sshd.log"
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                    raise RuntimeError(f"sshd of {name} exited ({p.returncode}): "
                                       f"{tail[0] if tail else 'see ' + str(log)}")
                if _banner(n.address, SSH_PORT):
                    del waiting[name]
            if waiting and time.monotonic() > end:
                raise RuntimeError(f"sshd of {', '.join(sorted(waiting))} did not answer within {timeout_s:.0f} s")
            if waiting:
                time.sleep(0.05)

    # ------------------------------------------------------------------ use
    def ssh_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """ssh argv running ``argv`` on ``node`` (a name) through the set's ssh_config."""
        return netem.ssh_argv(node, argv, netem.ssh_base(self.ssh_config))

    def check(self, timeout_s: float = 20.0) -> dict[str, str | None]:
        """ssh to every node (in parallel) and ask its host name: name -> answer (None if no answer)."""
        return check_nodes(self.ssh_config, [n.name for n in self.nodes], timeout_s)

    def describe(self) -> dict[str, Any]:
        return {
            "owner": {"pid": self.owner[0], "start": self.owner[1]},
            "directory": str(self.directory),
            "subnet": self.subnet,
            "host_address": self.host_address,
            "host_link": self.host_link,
            "switch_namespace": self.switch_namespace,
            "hostfile": str(self.hostfile),
            "ssh_config": str(self.ssh_config),
            "nodes": [asdict(n) for n in self.nodes],
        }


def _banner(address: str, port: int) -> bool:
    """An sshd answers on address:port (it sends its version line first)."""
    try:
        with socket.create_connection((address, port), timeout=0.5) as s:
            s.settimeout(1.0)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _stop_node_init(p: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """Stop one node: SIGTERM its sshd (the node's pid 1, the child of ``unshare``): the kernel then
    kills every process of the node, and unshare exits; SIGKILL if that takes too long."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        if p.poll() is not None:
            return
        for child in _children(p.pid):
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
    p.kill()  # unshare itself (it blocks SIGTERM while it waits for its child)
    p.wait()


def check_nodes(ssh_config: str | os.PathLike[str], names: Sequence[str],
                timeout_s: float = 20.0) -> dict[str, str | None]:
    """ssh to every node in parallel and ask ``hostname``: name -> answer, None when there is none."""
    def ask(name: str) -> str | None:
        try:
            p = subprocess.run(netem.ssh_argv(name, ["hostname"], netem.ssh_base(ssh_config)), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(names, pool.map(ask, names)))


# ---------------------------------------------------------------------- state in DIR
def write_state(directory: Path, state: dict[str, Any]) -> None:
    tmp = directory / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(directory / STATE)


def read_state(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, ValueError):
        return None


def _is_keeper(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"tools.nodes" in argv and b"keep" in argv


# ---------------------------------------------------------------------- the keeper
def keep(n_nodes: int, directory: Path, subnet: str | None) -> int:
    """Own the nodes until SIGTERM/SIGINT/SIGHUP: print ``ready`` when they answer, then reap
    children (as a subreaper, also orphans of the nodes) until told to stop."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with signals_raise():
        try:
            with VirtualNodes(n_nodes, directory, subnet=subnet) as vn:
                print("ready", flush=True)
                os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the up command has stopped reading
                _reap_until_signal({p.pid: p for p in vn.node_inits})
        except (Terminated, KeyboardInterrupt):
            pass
        finally:
            _reap_all()
    return 0


def _reap_until_signal(tracked: dict[int, subprocess.Popen[bytes]]) -> None:
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            signal.pause()
            continue
        if info is None:
            continue
        if info.si_pid in tracked:
            tracked.pop(info.si_pid).poll()
            print(f"network_emulation: a node's sshd ended (unshare pid {info.si_pid}, status {info.si_status})",
                  file=sys.stderr, flush=True)
        else:
            os.waitpid(info.si_pid, 0)


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---------------------------------------------------------------------- commands
def up(n_nodes: int, directory: Path, subnet: str | None, out: TextIO = sys.stdout) -> int:
    """Start a keeper that brings ``n_nodes`` up and holds them; return when they answer ssh. Interrupted
    (Ctrl-C, SIGTERM) or failing before that, it stops the keeper again, which removes its nodes."""
    VirtualNodes(n_nodes, directory, subnet=subnet)  # judge the arguments here, in one line
    netem.require_root("virtual nodes")
    _sshd()
    cleanup_stale(None)
    state = read_state(directory)
    if state and _alive(state["owner"]["pid"], state["owner"]["start"]):
        raise NodesError(f"virtual nodes are already up in {directory} (owner pid {state['owner']['pid']}): "
                         "run down first")
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with signals_raise():
        with open(directory / "keeper.log", "ab") as log:
            keeper = subprocess.Popen(
                [sys.executable, "-m", "tools.nodes", "keep", "--nodes", str(n_nodes),
                 "--dir", str(directory), *(["--subnet", subnet] if subnet else [])],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            names = _await_keeper(keeper, directory, timeout_s=60 + n_nodes)
        except BaseException:
            with signals_deferred():
                _stop_keeper(keeper)
                cleanup_stale(None)
            raise
    state = read_state(directory) or {}
    print(f"{len(names)} virtual node(s) up in {time.monotonic() - t0:.1f} s on {state['subnet']}.0/24 "
          f"(this machine is {state['host_address']}; keeper pid {state['owner']['pid']})\n"
          f"  hostfile:   {directory / 'hostfile'}\n"
          f"  ssh config: {directory / 'ssh_config'}\n"
          f"  try:        ssh -F {directory / 'ssh_config'} {names[0]} hostname\n"
          f"  cluster:    runners/run_all.sh --hostfile {directory / 'hostfile'} "
          f"--ssh-config {directory / 'ssh_config'} ...\n"
          f"  stop:       python -m tools.nodes down --dir {directory}", file=out)
    return 0


def _await_keeper(keeper: subprocess.Popen[bytes], directory: Path, timeout_s: float) -> list[str]:
    """Until the keeper says ``ready`` and every node answers ssh with its own name; their names."""
    assert keeper.stdout is not None
    ready, _, _ = select.select([keeper.stdout], [], [], timeout_s)
    line = keeper.stdout.readline().decode().strip() if ready else ""
    keeper.stdout.close()
    if line != "ready":
        tail = (directory / "keeper.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError("virtual nodes did not come up: " + (" | ".join(tail) or "no output"))
    names = [n["name"] for n in (read_state(directory) or {}).get("nodes", [])]
    answers = check_nodes(directory / "ssh_config", names)
    bad = [name for name, a in answers.items() if a != name]
    if bad or not names:
        raise RuntimeError(f"ssh to {', '.join(bad) or 'the nodes'} did not answer with its host name "
                           f"(see {directory}/*/sshd.log)")
    return names


def _stop_keeper(keeper: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the keeper removes its nodes), SIGKILL if that takes more than 30 s."""
    stop_process(keeper, signal.SIGTERM, 30.0)


def down(directory: Path, out: TextIO = sys.stdout, timeout_s: float = 30.0) -> int:
    """Stop the keeper of ``directory`` (SIGTERM: it removes its nodes; found by the state file, or by
    its command line if the file is gone), then reap what a dead owner left (namespaces and what runs
    in them) and the generated files."""
    t0 = time.monotonic()
    state = read_state(directory)
    owners = [(state["owner"]["pid"], state["owner"]["start"])] if state else []
    owners += [o for o in _keepers_of(directory) if o not in owners]
    for pid, start in owners:
        if not _alive(pid, start):
            continue
        if not _is_keeper(pid):
            raise NodesError(f"the virtual nodes in {directory} belong to process {pid}, not to a keeper: "
                             "end that process (its nodes go with it)")
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + timeout_s
        while _alive(pid, start) and time.monotonic() < end:
            time.sleep(0.05)
        if _alive(pid, start):
            os.kill(pid, signal.SIGKILL)
    removed = cleanup_stale(None)
    if state:
        node_ssh.remove_all(directory, [n["name"] for n in state["nodes"]])
        (directory / STATE).unlink(missing_ok=True)
    what = f"{len(state['nodes'])} virtual node(s) down" if state else f"no virtual nodes in {directory}"
    if owners and not state:
        what += f"; stopped {len(owners)} keeper(s) of it"
    reaped = f" ({len(removed)} stale namespace(s) reaped)" if removed else ""
    print(f"{what} in {time.monotonic() - t0:.1f} s{reaped}", file=out)
    return 0


def _keepers_of(directory: Path) -> list[tuple[int, int]]:
    """(pid, start time) of live keepers started for ``directory``."""
    def keeper(argv: list[bytes]) -> bool:
        return (b"tools.nodes" in argv and b"keep" in argv and b"--dir" in argv
                and argv[argv.index(b"--dir") + 1] == os.fsencode(directory))

    started = [(pid, _start_time(pid)) for pid in processes_where(keeper)]
    return [(pid, start) for pid, start in started if start is not None]


def status(directory: Path, out: TextIO = sys.stdout) -> int:
    """List the nodes and whether their sshd answers; 0 when every one does."""
    state = read_state(directory)
    if not state:
        print(f"no virtual nodes in {directory}", file=out)
        return 1
    pid, start = state["owner"]["pid"], state["owner"]["start"]
    alive = _alive(pid, start)
    namespaces = set(list_namespaces())
    names = [n["name"] for n in state["nodes"]]
    answers = check_nodes(state["ssh_config"], names) if alive else {}
    print(f"{len(names)} virtual node(s) in {directory} on {state['subnet']}.0/24, owner pid {pid} "
          f"({'running' if alive else 'gone: run down or up to reap'})", file=out)
    for n in state["nodes"]:
        answer = answers.get(n["name"])
        ns = "namespace" if n["namespace"] in namespaces else "no namespace"
        ssh = f"sshd answers ({answer})" if answer else "sshd does not answer"
        print(f"  {n['name']}  {n['address']:15s}  {ns}, {ssh}", file=out)
    return 0 if alive and all(answers.get(n) == n for n in names) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.nodes", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                       help=f"where keys, configs, hostfile and logs live (default {DEFAULT_DIR})")

    p = sub.add_parser("up", help="start N virtual nodes with sshd; writes DIR/hostfile and DIR/ssh_config")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--subnet", default=None, help="first three octets of a /24 (default: the first free 10.88.k)")
    dir_arg(p)
    p = sub.add_parser("down", help="remove the nodes of DIR (and any whose owner died)")
    dir_arg(p)
    p = sub.add_parser("status", help="list the nodes of DIR and whether sshd answers")
    dir_arg(p)
    p = sub.add_parser("keep", help="(started by up) own the nodes until SIGTERM")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--subnet", default=None)
    dir_arg(p)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    directory = args.dir.absolute()

    def command() -> int:
        if args.command == "up":
            return up(args.nodes, directory, args.subnet)
        if args.command == "down":
            netem.require_root("virtual nodes")
            return down(directory)
        if args.command == "status":
            return status(directory)
        return keep(args.nodes, directory, args.subnet)

    return cli_status("tools.nodes", command, (NodesError, netem.NotRootError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())

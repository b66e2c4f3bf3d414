"""The ssh side of virtual nodes: keys, sshd configs, the client's ssh_config, known_hosts, hostfile.

Everything is written under the node set's own directory; the machine's /etc/ssh and ~/.ssh are
never read or written (the client is always run as ``ssh -F DIR/ssh_config``, which also skips
/etc/ssh/ssh_config). The text builders are pure functions of the node list, so their output is
tested without root.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Environment a cluster launcher passes to ranks over ssh: which interface gloo / NCCL / tensorpipe
# bind to (inside a node gloo otherwise resolves the host name and may pick the loopback), and
# the usual thread and NCCL switches.
ACCEPT_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "GLOO_*", "NCCL_*",
              "OMP_NUM_THREADS", "PIPEBENCH_*")
SET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
CLIENT_KEY = "id_ed25519"
# Characters a directory may have: ssh_config and sshd_config would need quoting (and expand %
# tokens) for anything else.
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@-]+")


@dataclass(frozen=True)
class NodeAddress:
    """What the ssh files need to know of one node."""

    name: str  # host name, as in the hostfile and ssh_config: node01, node02, ...
    address: str  # IPv4 address on the node's interface
    iface: str = "eth0"


def check_directory(path: Path) -> None:
    """ValueError unless ``path`` is absolute and has only characters ssh configs take unquoted."""
    if not path.is_absolute() or not _SAFE_PATH.fullmatch(str(path)):
        raise ValueError("node directory must be an absolute path of characters A-Z a-z 0-9 _ . / + @ -, got "
                         f"{str(path)!r}")


def node_dir(directory: Path, name: str) -> Path:
    return directory / name


def tmp_dir(directory: Path, name: str) -> Path:
    """The node's temporary directory (its sessions' TMPDIR)."""
    return node_dir(directory, name) / "tmp"


def sshd_config(directory: Path, node: NodeAddress, port: int = 22) -> str:
    """One node's sshd configuration: its own host key, the set's authorized key, no PAM, keys only."""
    d = node_dir(directory, node.name)
    return "\n".join([
        f"# sshd of virtual node {node.name} (written by tools.nodes; removed by down)",
        f"ListenAddress {node.address}:{port}",
        f"HostKey {d / 'ssh_host_ed25519_key'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "PidFile none",  # sshd is the node's pid 1; its pid outside is known to the owner
        "UsePAM no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "StrictModes no",
        "UseDNS no",
        "PrintMotd no",
        "MaxStartups 64:30:128",
        "MaxSessions 64",
        f"AcceptEnv {' '.join(ACCEPT_ENV)}",
        # A temporary directory of its own, as a machine has: run directories are reaped by their
        # owner's pid, which only the node's own pid namespace can judge. And a host of its own to
        # NCCL, which tells hosts apart by host name and boot id (the nodes share the boot id): ranks
        # of several nodes may share one GPU of this machine, as the one-GPU rehearsal has them,
        # where NCCL would refuse two ranks of one host on one GPU ("Duplicate GPU detected").
        f"SetEnv TMPDIR={tmp_dir(directory, node.name)} NCCL_HOSTID={node.name}",
        "Subsystem sftp internal-sftp",
        "",
    ])


def ssh_config(directory: Path, nodes: Sequence[NodeAddress]) -> str:
    """The client configuration: one Host block per node (address, interface environment), then the
    identity and known_hosts under ``directory``, batch mode, no host key prompts."""
    lines = [f"# ssh client configuration for {len(nodes)} virtual node(s): ssh -F {directory / 'ssh_config'} node01"]
    for n in nodes:
        env = " ".join(f"{k}={n.iface}" for k in SET_ENV)
        lines += [f"Host {n.name}", f"  HostName {n.address}", f"  SetEnv {env}", ""]
    lines += [
        "Host *",
        "  User root",
        f"  IdentityFile {directory / CLIENT_KEY}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {directory / 'known_hosts'}",
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking no",
        "  BatchMode yes",
        "  LogLevel ERROR",
        "  ConnectTimeout 10",
        "  ServerAliveInterval 5",
        "  ServerAliveCountMax 4",
        "",
    ]
    return "\n".join(lines)


def hostfile(nodes: Sequence[NodeAddress], slots: int = 1) -> str:
    """DeepSpeed / Open MPI style: ``node01 slots=1``, one line per node, node 0 first."""
    return "".join(f"{n.name} slots={slots}\n" for n in nodes)


def etc_hosts(nodes: Sequence[NodeAddress]) -> str:
    """/etc/hosts inside every node: loopback, then every node's name (so torchrun's rendezvous
    endpoint ``node01:PORT`` resolves on every node, and each node's own name to its interface)."""
    return "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in nodes)


def known_hosts(nodes: Sequence[NodeAddress], host_keys: Sequence[str]) -> str:
    """Each node's host key under its name and its address (ssh looks the HostName up)."""
    return "".join(f"{n.name},{n.address} {' '.join(k.split()[:2])}\n" for n, k in zip(nodes, host_keys))


def keygen(path: Path, comment: str) -> str:
    """A fresh ed25519 key pair at ``path`` (+ .pub); returns the public key line."""
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, text=True)
    return path.with_name(path.name + ".pub").read_text().strip()


def write_all(directory: Path, nodes: Sequence[NodeAddress]) -> None:
    """Keys (one client key, one host key per node), sshd configs, ssh_config, known_hosts,
    authorized_keys, hosts and hostfile, all under ``directory`` (made private to root)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    client = keygen(directory / CLIENT_KEY, "pipebench-virtual-nodes")
    (directory / "authorized_keys").write_text(client + "\n")
    host_keys = []
    for n in nodes:
        d = node_dir(directory, n.name)
        d.mkdir(exist_ok=True)
        tmp_dir(directory, n.name).mkdir(mode=0o1777, exist_ok=True)
        host_keys.append(keygen(d / "ssh_host_ed25519_key", n.name))
        (d / "sshd_config").write_text(sshd_config(directory, n))
    (directory / "known_hosts").write_text(known_hosts(nodes, host_keys))
    (directory / "hosts").write_text(etc_hosts(nodes))
    (directory / "ssh_config").write_text(ssh_config(directory, nodes))
    (directory / "hostfile").write_text(hostfile(nodes))


GENERATED = ("ssh_config", "hostfile", "hosts", "known_hosts", "authorized_keys", CLIENT_KEY, CLIENT_KEY + ".pub")
NODE_GENERATED = ("sshd_config", "ssh_host_ed25519_key", "ssh_host_ed25519_key.pub")


def remove_all(directory: Path, names: Sequence[str]) -> None:
    """Remove what ``write_all`` wrote (logs are kept for a post-mortem)."""
    for f in GENERATED:
        (directory / f).unlink(missing_ok=True)
    for name in names:
        for f in NODE_GENERATED:
            (node_dir(directory, name) / f).unlink(missing_ok=True)

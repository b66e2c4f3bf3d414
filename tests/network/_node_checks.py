"""What the virtual-node tests inspect: live processes, namespaces of an owner, and what runs in them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)
needs_sshd = pytest.mark.skipif(SSHD is None, reason="sshd missing: apt-get install -y openssh-server")
SLURM = all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol"))
needs_slurm = pytest.mark.skipif(not SLURM, reason="Slurm missing: apt-get install -y slurmctld slurmd slurm-client "
                                                    "munge (scripts/setup_env.sh installs them as root)")


def _live(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def live_processes(word: str) -> list[int]:
    """pids of live (not zombie) processes whose command line contains ``word``."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and word.encode() in (d / "cmdline").read_bytes() and _live(d.name):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def commands(pids: list[int]) -> dict[int, str]:
    """pid -> command line, for a failure's message (what was left running)."""
    found = {}
    for pid in pids:
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            found[pid] = "(ended)"
    return found


def namespaces_of(owner: int) -> list[str]:
    """The virtual-node namespaces of ``owner`` (switch and nodes)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"nemu-{owner}.") and "-vnodes-" in line]


def netns_inodes(owner: int) -> set[int]:
    """Identity of the owner's namespaces, to find processes left in them after they are deleted."""
    return {os.stat(f"/run/netns/{ns}").st_ino for ns in namespaces_of(owner)}


def processes_in(inodes: set[int]) -> list[int]:
    """Live processes whose network namespace is one of ``inodes`` (sshd, agents, delayers, ranks)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.stat(d / "ns" / "net").st_ino in inodes and _live(d.name):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def in_node(node_namespace: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", node_namespace, *argv], capture_output=True, text=True,
                          timeout=30).stdout


def shaping_left(node_namespace: str) -> list[str]:
    """What shaping left in a node: a root qdisc of ours, tagged iptables rules, agents, delayers."""
    left = []
    qdisc = in_node(node_namespace, "tc", "qdisc", "show", "dev", "eth0", "root").split()
    if len(qdisc) > 1 and qdisc[1] in ("netem", "tbf", "htb"):
        left.append(f"qdisc {qdisc[1]}")
    left += [r for r in in_node(node_namespace, "iptables", "-t", "raw", "-S", "PREROUTING").splitlines()
             if "pipebench-shaping" in r]
    pids = subprocess.run(["ip", "netns", "pids", node_namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"delayer.py" in argv or b"shaping_agent" in argv) and _live(pid):
            left.append(argv.replace(b"\0", b" ").decode(errors="replace")[:120])
    return left

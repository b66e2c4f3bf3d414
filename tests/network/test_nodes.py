"""Virtual nodes with real sshd: up, ssh between them, down, and reaping after the keeper's SIGKILL.

Needs root, iproute2 and openssh-server (scripts/setup_env.sh installs it as root).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.nodes import VirtualNodes

from ._node_checks import live_processes, namespaces_of, needs_sshd, netns_inodes, processes_in
from .conftest import REPO, needs_root, root_links

pytestmark = [pytest.mark.network, needs_root, needs_sshd]


def nodes_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.nodes", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def ssh(config: Path, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(config), node, "--", *argv], capture_output=True, text=True, timeout=30)


def nothing_left(directory: Path, owner: int, inodes: set[int], links_before: set[str]) -> None:
    """No namespace, no process in the nodes (sshd, delayer, anything), no sshd of this directory,
    no host-side link, no generated file."""
    assert namespaces_of(owner) == []
    assert processes_in(inodes) == []
    assert live_processes(str(directory)) == []
    assert root_links() == links_before
    assert not (directory / "nodes.json").exists() and not (directory / "ssh_config").exists()


def test_up_ssh_between_nodes_status_down(tmp_path: Path) -> None:
    d = tmp_path / "nodes"
    before = root_links()
    t0 = time.monotonic()
    p = nodes_cli("up", "--nodes", "3", "--dir", str(d))
    up_s = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    state = json.loads((d / "nodes.json").read_text())
    keeper = state["owner"]["pid"]
    inodes = netns_inodes(keeper)
    try:
        assert (d / "hostfile").read_text() == "node01 slots=1\nnode02 slots=1\nnode03 slots=1\n"
        cfg = (d / "ssh_config").read_text()
        for n in state["nodes"]:
            assert f"Host {n['name']}\n  HostName {n['address']}\n" in cfg
        assert f"IdentityFile {d}/id_ed25519" in cfg and f"UserKnownHostsFile {d}/known_hosts" in cfg
        assert "StrictHostKeyChecking no" in cfg and "BatchMode yes" in cfg
        for name in ("node01", "node02", "node03"):
            r = ssh(d / "ssh_config", name, "hostname")
            assert r.returncode == 0 and r.stdout.strip() == name, r.stderr
        # node01 reaches node02 with the same config; the interface variable arrives; names resolve
        r = ssh(d / "ssh_config", "node01", "ssh", "-F", str(d / "ssh_config"), "node02",
                shlex.quote("echo $(hostname) $GLOO_SOCKET_IFNAME $(getent hosts node03) $TMPDIR $NCCL_HOSTID"))
        assert r.returncode == 0 and r.stdout.split() == ["node02", "eth0", state["nodes"][2]["address"], "node03",
                                                          str(d / "node02" / "tmp"), "node02"], r
        s = nodes_cli("status", "--dir", str(d))
        assert s.returncode == 0 and s.stdout.count("sshd answers") == 3, s.stdout
        again = nodes_cli("up", "--nodes", "2", "--dir", str(d))
        assert again.returncode == 2 and "already up" in again.stderr
    finally:
        t1 = time.monotonic()
        down = nodes_cli("down", "--dir", str(d))
        down_s = time.monotonic() - t1
    assert down.returncode == 0, down.stderr
    print(f"up 3 nodes {up_s:.1f} s, down {down_s:.1f} s")
    nothing_left(d, keeper, inodes, before)
    assert nodes_cli("status", "--dir", str(d)).returncode == 1
    assert not Path("/root/.ssh/known_hosts").exists() or "10.88." not in Path("/root/.ssh/known_hosts").read_text()


def test_keeper_killed_nodes_reaped_by_next_up_and_cleanup(tmp_path: Path) -> None:
    d = tmp_path / "nodes"
    before = root_links()
    try:
        assert nodes_cli("up", "--nodes", "2", "--dir", str(d)).returncode == 0
        first = json.loads((d / "nodes.json").read_text())["owner"]["pid"]
        first_processes = processes_in(netns_inodes(first))   # sshd and unshare of each node
        os.kill(first, signal.SIGKILL)
        time.sleep(0.2)
        assert len(namespaces_of(first)) == 3 and live_processes(str(d))  # a killed keeper cannot clean up
        assert nodes_cli("status", "--dir", str(d)).returncode == 1
        p = nodes_cli("up", "--nodes", "2", "--dir", str(d))               # the next up reaps them
        assert p.returncode == 0, p.stderr
        second = json.loads((d / "nodes.json").read_text())["owner"]["pid"]
        assert namespaces_of(first) == [] and len(namespaces_of(second)) == 3
        assert not any(Path(f"/proc/{pid}").exists() and pid in live_processes("") for pid in first_processes)
        second_inodes = netns_inodes(second)
        os.kill(second, signal.SIGKILL)
        time.sleep(0.2)
        c = subprocess.run([sys.executable, "-m", "network_emulation", "cleanup"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert c.returncode == 0 and c.stdout.startswith("removed 3"), c.stdout
        assert namespaces_of(second) == [] and processes_in(second_inodes) == [] and live_processes(str(d)) == []
    finally:
        down = nodes_cli("down", "--dir", str(d))                           # also removes the files left behind
    assert down.returncode == 0, down.stderr
    nothing_left(d, second, second_inodes, before)


def test_in_process_nodes_end_with_an_exception(tmp_path: Path) -> None:
    d = tmp_path / "nodes"
    before = root_links()
    with pytest.raises(ZeroDivisionError):
        with VirtualNodes(2, d, log=None) as vn:
            inodes = netns_inodes(os.getpid())
            assert vn.check() == {"node01": "node01", "node02": "node02"}
            assert vn.host_address.endswith(".254") and not vn.subnet.startswith("10.77.")
            # a process started over ssh lives in the node's pid namespace: it goes with the node
            r = subprocess.run(vn.ssh_argv("node02", ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]),
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0 and live_processes("sleep\x00300")
            raise ZeroDivisionError  # an exception inside the block
    nothing_left(d, os.getpid(), inodes, before)

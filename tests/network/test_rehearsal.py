"""The cluster rehearsal end to end: runners/run_all.sh --rehearse 4 on virtual nodes over real ssh
(set-up, shaping on every node, the measured link, records copied back, the report), then nothing left.

Needs root, iproute2, iptables and openssh-server; starts 12 python processes per run (the run
command, torchrun and a rank on each of 4 nodes).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ._node_checks import commands, live_processes, needs_sshd
from .conftest import REPO, needs_root, root_links

pytestmark = [pytest.mark.network, pytest.mark.multiprocess, needs_root, needs_sshd]

P = 4
D10_ONE_WAY_S = 0.010


def vnode_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if "-vnodes-" in line}


def rehearse(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "runners/run_all.sh", "--rehearse", "4", "--sweep", "rehearsal-4.toml",
                           "--out", str(tmp_path / "r.jsonl"), "--dir", str(tmp_path / "nodes"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHON=sys.executable))


def test_four_node_rehearsal_then_nothing_left(tmp_path: Path) -> None:
    namespaces, links = vnode_namespaces(), root_links()
    p = rehearse(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("environment ready (.venv linked to") == 4            # one line per node
    records = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok"] * 3, [r.get("error") for r in records]
    for r in records:
        env = r["environment"]
        assert sorted(env["hostnames"]) == ["node01", "node02", "node03", "node04"], env
        shaped = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"} if r["network"] != "none" else {}
        assert env["cluster"] == {"hosts": ["node01", "node02", "node03", "node04"], "ranks_per_node": 1,
                                  "iface": "eth0", "nccl_env": {"NCCL_SOCKET_IFNAME": "eth0", **shaped}}
        link = env["network"]["measured_link"]
        assert env["network"]["measured_between"] == ["node01", "node02"]
        assert env["network"]["backend"] in ("netem", "tbf+delayer") and link["samples"] > 0
    by_net = {(r["system"], r["network"]): r for r in records}
    default, d10 = by_net[("torch_pipe", "default")], by_net[("torch_pipe", "d10-1g")]
    assert d10["environment"]["network"]["measured_link"]["one_way_delay_ms"] > 9.5
    # GPipe pays at least the fill and drain of the pipeline: 2 (P - 1) one-way delays per step.
    paid = d10["median_step_time"] - default["median_step_time"]
    print(f"P-{P} GPipe median step: default {default['median_step_time']:.3f} s, d10-1g "
          f"{d10['median_step_time']:.3f} s (+{paid:.3f} s; floor {2 * (P - 1) * D10_ONE_WAY_S:.3f} s)")
    assert paid >= 2 * (P - 1) * D10_ONE_WAY_S
    assert "| delay 10ms  bandwidth 1Gbps" in p.stdout                          # the report
    # nothing left: no namespace, no host-side link, no process of the rehearsal (sshd, agents,
    # delayers, torchrun, ranks: all run from the nodes' directory)
    assert vnode_namespaces() <= namespaces
    assert {l for l in root_links() - links if l.startswith("vn")} == set()
    assert live_processes(str(tmp_path / "nodes")) == []
    assert sorted((tmp_path / "nodes").glob("*/suite")) == []  # the nodes' copies of the suite are gone too
    # again: every run is recorded (nothing run)
    again = rehearse(tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "0 ok / 0 failed / 3 skipped" in again.stdout
    assert live_processes(str(tmp_path / "nodes")) == [] and vnode_namespaces() <= namespaces
    assert sorted((tmp_path / "nodes").glob("*/suite")) == []


def _triggered(moment: str, lines: list[str], directory: Path, namespaces: set[str]) -> bool:
    if moment == "start":  # the nodes are coming up
        return any("virtual node(s) on" in l for l in lines) or bool(vnode_namespaces() - namespaces)
    if moment == "setup":
        return any(l.startswith("setup: ") for l in lines)
    word = {"shaping": "shaping_agent", "run": "runners.worker"}[moment]
    return any(word.encode() in _cmdline(pid) for pid in live_processes(str(directory)))


def _cmdline(pid: int) -> bytes:
    """A process's command line, empty once it has ended (it may end while being read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


@pytest.mark.faults
@pytest.mark.parametrize("moment", ["start", "setup", "shaping", "run"])
def test_ctrl_c_at_any_moment_leaves_nothing(tmp_path: Path, moment: str) -> None:
    """SIGINT to the rehearsal's process group (a Ctrl-C on the terminal) at a moment of its life:
    exit 130 and nothing left, wherever it was."""
    namespaces, links = vnode_namespaces(), root_links()
    directory = tmp_path / "nodes"
    p = subprocess.Popen(["bash", "runners/run_all.sh", "--rehearse", "4", "--sweep", "rehearsal-4.toml", "--out",
                          str(tmp_path / "r.jsonl"), "--dir", str(directory)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=dict(os.environ, PYTHON=sys.executable))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        end = time.monotonic() + 300
        while not _triggered(moment, lines, directory, namespaces):
            assert p.poll() is None and time.monotonic() < end, "".join(lines)[-3000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=180)
        print(f"Ctrl-C at {moment}: ended {time.monotonic() - t0:.1f} s later")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(timeout=10)
    # interrupted: 130, or killed by the signal when it came before python had started
    assert p.returncode in (130, -signal.SIGINT), "".join(lines)[-3000:]
    left = live_processes(str(directory))
    assert left == [], f"left running: {commands(left)}\n" + "".join(lines)[-3000:]
    assert vnode_namespaces() <= namespaces
    assert {l for l in root_links() - links if l.startswith("vn")} == set()
    assert not (tmp_path / "r.jsonl").exists() or all(
        json.loads(l)["status"] == "ok" for l in (tmp_path / "r.jsonl").read_text().splitlines())

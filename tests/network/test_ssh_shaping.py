"""Shaping over ssh on two virtual nodes: measured delay and rate, and nothing left afterwards, also
when the session's process or a node's agent is killed.

Needs root, iproute2, iptables and openssh-server. On this kernel (no sch_netem) the agents pick
tbf + the delayer; where netem exists they pick netem and the same checks hold.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from network_emulation import LinkMeasurement, SshShapingSession, parse_profile
from tools.nodes import VirtualNodes
from network_emulation.probe import SHARED_CLOCK

from ._node_checks import needs_sshd, shaping_left
from .conftest import REPO, needs_root

pytestmark = [pytest.mark.network, needs_root, needs_sshd]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualNodes]:
    with VirtualNodes(2, tmp_path_factory.mktemp("shaping") / "nodes", log=None) as vn:
        yield vn


# test_virtual_cluster.py's 0.3 ms, plus what this probe counts and that one does not: with the delayer on
# the receiver's ingress the probe stamps a datagram when the server reads it, not when the kernel
# received it (that is before the delay). Side by side under load 5-6 on 2 cores, medians of 5:
# virtual cluster 10.24 ms, virtual nodes over ssh 10.36 ms.
DELAY_TOLERANCE_MS = 0.6  # the delayer adds up to ~0.5 ms on a busy host


def session(vn: VirtualNodes, profile: str) -> SshShapingSession:
    return SshShapingSession(parse_profile(profile), "eth0", [n.name for n in vn.nodes], ssh_config=vn.ssh_config)


def left(vn: VirtualNodes) -> dict[str, list[str]]:
    return {n.name: shaping_left(n.namespace) for n in vn.nodes if shaping_left(n.namespace)}


def wait_until(pred, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not pred():
        time.sleep(0.1)
    return pred()


def probe_until(s: SshShapingSession, src: int, dst: int, ok, duration_s: float | None = None,
                attempts: int = 4) -> LinkMeasurement:
    """Measure; on a loaded 2-core machine retry (after a pause) while the measurement misses."""
    m = s.probe(src, dst, duration_s=duration_s)
    for _ in range(attempts - 1):
        if ok(m):
            break
        time.sleep(2.0)
        m = s.probe(src, dst, duration_s=duration_s)
    return m


def test_d10_1g_measured_over_ssh_then_nothing_left(nodes: VirtualNodes) -> None:
    with session(nodes, "d10-1g") as s:
        assert set(s.backends.values()) <= {"netem", "tbf+delayer"} and len(s.backends) == 2
        assert s.iface_addresses == {n.name: n.address for n in nodes.nodes}
        assert s.hostnames == {"node01": "node01", "node02": "node02"}
        if "tbf+delayer" in s.backends.values():
            assert all(left(nodes).values()) and len(left(nodes)) == 2       # rules, qdisc, agent, delayer
        # TCP goodput, ~0.96 of the line rate under netem; the userspace delayer forwards every packet
        # itself, and on a busy 2-core host it can fall short of tbf's rate (0.67 Gbit/s in one CI run,
        # four probes in a row): at most the rate, and not strangled
        low = 0.90 if s.backends["node02"] == "netem" else 0.50

        def ok(m: LinkMeasurement) -> bool:
            return abs(m.one_way_delay_ms - 10) <= DELAY_TOLERANCE_MS and low <= m.bandwidth_gbps <= 1.10
        m = probe_until(s, 0, 1, ok)
        print(f"d10-1g over ssh node01 -> node02 [{s.backends['node02']}]: {m}")
        assert m.one_way_method == SHARED_CLOCK                                # virtual nodes: one kernel, one clock
        assert abs(m.one_way_delay_ms - 10) <= DELAY_TOLERANCE_MS, m
        assert low <= m.bandwidth_gbps <= 1.10, m
        back = probe_until(s, 1, 0, lambda r: abs(r.one_way_delay_ms - 10) <= 0.5, duration_s=0)
        # the other direction is delayed too
        assert abs(back.one_way_delay_ms - 10) <= DELAY_TOLERANCE_MS + 0.2, back
        assert s.describe()["hosts"][1] == {"host": "node02", "hostname": "node02", "iface": "eth0",
                                            "address": nodes.nodes[1].address, "backend": s.backends["node02"]}
    assert left(nodes) == {}
    r = subprocess.run(nodes.ssh_argv("node01", ["true"]), capture_output=True, timeout=30)
    assert r.returncode == 0


HOLD = """
import sys, time
from network_emulation import SshShapingSession, parse_profile
with SshShapingSession(parse_profile("d5-2g"), "eth0", sys.argv[2:], ssh_config=sys.argv[1]) as s:
    print("shaped", flush=True)
    time.sleep(300)
"""


def hold(vn: VirtualNodes) -> subprocess.Popen[str]:
    """A session in a process of its own, shaped when this returns."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(vn.ssh_config), *(n.name for n in vn.nodes)], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "shaped", p.stderr.read() if p.stderr else ""
    return p


def test_sigterm_and_sigkill_of_the_session_clear_the_nodes(nodes: VirtualNodes) -> None:
    p = hold(nodes)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert left(nodes) == {}                                # cleared before the process ended
    p = hold(nodes)
    assert len(left(nodes)) == 2
    p.kill()                                                # no clean-up here: the agents see their stdin close
    p.communicate(timeout=60)
    assert wait_until(lambda: left(nodes) == {}), left(nodes)


def test_killed_agent_leftovers_cleared_by_the_next_session(nodes: VirtualNodes) -> None:
    p = hold(nodes)
    try:
        kill = subprocess.run(nodes.ssh_argv("node02", ["pkill", "-KILL", "-f", "network_emulation.shaping_agent"]),
                              capture_output=True, text=True, timeout=30)
        assert kill.returncode == 0, kill.stderr
        assert wait_until(lambda: not any("shaping_agent" in x or "delayer" in x
                                          for x in shaping_left(nodes.nodes[1].namespace)))
        stale = shaping_left(nodes.nodes[1].namespace)
        assert any("NFQUEUE" in x for x in stale), stale    # its rules blocking everything but ssh, and its qdisc
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert "clearing node02 failed" in err                   # the session saw its agent gone ...
    assert left(nodes) == {"node02": stale}                  # ... and cleared node01 only
    with session(nodes, "none") as s:                        # the next session removes the leftovers first
        assert list(s.leftovers) == ["node02"] and len(s.leftovers["node02"]) == len(stale)
        m = s.probe(0, 1, duration_s=0)                      # and the link carries traffic again, undelayed
        assert m.one_way_delay_ms < 2, m
    assert left(nodes) == {}

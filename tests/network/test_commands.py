"""Exact tc / iptables / ssh command lines (dry run; no root needed)."""
from __future__ import annotations

import io
import shlex
import subprocess
import sys

import pytest

from network_emulation import (PROFILES, LinkSpec, VirtualCluster, matrix_profile, netem_limit, parse_profile,
                               tbf_burst)
from network_emulation.netem import NetemSession, Runner, apply, clear, host_shaping_argv, ssh_argv

from .conftest import REPO


def test_netem_limit() -> None:
    assert netem_limit(10, 1) == 225000           # DT-FM: 1 * 15000 * 10 * 1.5
    assert netem_limit(0.1, 10) == 22500
    assert netem_limit(0.01, 0.1) == 1000          # netem's default is the floor
    for d, r in ((1, 5), (50, 1), (200, 100)):     # always >= 2 x BDP in 1500-byte packets
        assert netem_limit(d, r) >= 2 * r * 1e9 / 8 * d / 1e3 / 1500


def test_tbf_burst() -> None:
    assert tbf_burst(0.1) == 128 * 1024
    assert tbf_burst(5) == 625000                  # 1 ms at 5 Gbit/s
    assert tbf_burst(100) == 1024 * 1024           # never megabytes


def test_netem_and_tbf_argv() -> None:
    p = parse_profile("delay 10ms bandwidth 1Gbps")
    assert host_shaping_argv(p, 0, "eth0", [], "netem") == [
        "tc qdisc replace dev eth0 root netem delay 10ms rate 1gbit limit 225000".split()]
    assert host_shaping_argv(PROFILES["default"], 0, "eth0", [], "netem") == [
        "tc qdisc replace dev eth0 root netem delay 0.1ms rate 10gbit limit 22500".split()]
    assert host_shaping_argv(p, 0, "eth0", [], "tbf") == [
        "tc qdisc replace dev eth0 root tbf rate 1gbit burst 131072 latency 50ms".split()]
    assert host_shaping_argv(PROFILES["none"], 0, "eth0", [], "tbf") == []


def test_matrix_argv_per_destination() -> None:
    m = matrix_profile({"delay_ms": [[0, 2], [8, 0]], "bandwidth_gbps": [[0, 0.5], [2, 0]]})
    cmds = [shlex.join(c) for c in host_shaping_argv(m, 1, "eth0", ["10.0.0.1", "10.0.0.2"], "netem")]
    assert cmds == [
        "tc qdisc replace dev eth0 root handle 1: htb default 1",
        "tc class replace dev eth0 parent 1: classid 1:1 htb rate 100gbit",
        "tc class replace dev eth0 parent 1: classid 1:a htb rate 2gbit ceil 2gbit burst 250000 cburst 250000",
        "tc qdisc replace dev eth0 parent 1:a handle a: netem delay 8ms limit 360000",
        "tc filter replace dev eth0 parent 1: protocol ip prio 1 handle 800::a u32 match ip dst 10.0.0.1/32 flowid 1:a",
    ]


def test_dry_run_runner_and_ssh_quoting() -> None:
    out = io.StringIO()
    r = Runner(host="gpu-1", dry_run=True, out=out)
    apply(r, parse_profile("d5-2g"), "eth0")
    clear(r, "eth0")
    lines = out.getvalue().splitlines()
    assert lines == [
        "ssh -o BatchMode=yes gpu-1 -- 'tc qdisc replace dev eth0 root netem delay 5ms rate 2gbit limit 225000'",
        "ssh -o BatchMode=yes gpu-1 -- 'tc qdisc del dev eth0 root'"]
    evil = ssh_argv("h", ["tc", "qdisc", "show", "dev", "eth0; rm -rf /"])
    assert evil[-1] == "tc qdisc show dev 'eth0; rm -rf /'"
    with pytest.raises(ValueError):
        ssh_argv("-oProxyCommand=x", ["true"])


def test_netem_session_dry_run_always_clears() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        with NetemSession(PROFILES["d10-1g"], "eth0", hosts=["a", "b"], dry_run=True, out=out):
            raise RuntimeError("boom")
    text = out.getvalue()
    assert text.count("netem delay 10ms") == 2 and text.count("qdisc del dev eth0 root") == 2


def test_cli_dry_run() -> None:
    p = subprocess.run([sys.executable, "-m", "network_emulation", "apply", "--dry-run", "--iface", "ens5",
                        "--profile", "delay 50ms bandwidth 1Gbps", "--host", "n1", "--host", "n2"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        f"ssh -o BatchMode=yes {h} -- 'tc qdisc replace dev ens5 root netem delay 50ms rate 1gbit limit 1125000'"
        for h in ("n1", "n2")]
    p = subprocess.run([sys.executable, "-m", "network_emulation", "clear", "--dry-run", "--iface", "eth0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "tc qdisc del dev eth0 root"
    p = subprocess.run([sys.executable, "-m", "network_emulation", "apply", "--dry-run", "--iface", "eth0",
                        "--profile", "delay -5ms bandwidth 1Gbps"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "negative" in p.stderr


def test_virtual_cluster_plan_for_a_matrix() -> None:
    """Queue per (src, dst) selected by destination address; htb class per destination (no system calls)."""
    m = matrix_profile({"delay_ms": [[0, 2, 0], [4, 0, 6], [1, 3, 0]],
                        "bandwidth_gbps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]})
    vc = VirtualCluster(3, m, name="plan")
    vc.backend = "tbf+delayer"
    queues, rules = vc.delayer_rules()
    assert {q: link.delay_ms for q, link in queues.items()} == {1: 2.0, 3: 4.0, 5: 6.0, 6: 1.0, 7: 3.0}  # 0->2: none
    assert rules[0] == "-A FORWARD -m physdev --physdev-in p0 -d 10.77.0.2/32 -j NFQUEUE --queue-num 1"
    assert all("--queue-bypass" not in r for r in rules)
    cmds = vc.shaping_commands()[vc.hosts[0].namespace]
    assert any("10.77.0.3/32" in c for c in cmds) and all(c[0] == "tc" for c in cmds)
    uniform = VirtualCluster(2, "d10-1g", name="plan2")
    uniform.backend = "tbf+delayer"
    assert uniform.delayer_rules() == ({0: LinkSpec(10.0, 1.0), 1: LinkSpec(10.0, 1.0)}, [
        "-A FORWARD -m physdev --physdev-in p0 -j NFQUEUE --queue-num 0",
        "-A FORWARD -m physdev --physdev-in p1 -j NFQUEUE --queue-num 1"])


def test_host_env_and_prefix() -> None:
    vc = VirtualCluster(2, "none", name="envt")
    h = vc.hosts[1]
    assert h.address == "10.77.0.2" and h.iface == "eth0"
    assert h.command_prefix() == ["ip", "netns", "exec", h.namespace]
    assert h.env() == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_P2P_DISABLE": "1",
                       "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}


def test_not_root_message(monkeypatch) -> None:
    from network_emulation import NotRootError
    from network_emulation.netem import require_root
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NotRootError, match="needs root"):
        require_root("netem")
    with pytest.raises(NotRootError, match="needs root"):
        NetemSession(PROFILES["d10-1g"], "eth0")
    with pytest.raises(NotRootError, match="virtual cluster needs root"):
        with VirtualCluster(2, "d10-1g", name="noroot"):
            pass

"""Virtual nodes' ssh files and the shaping-over-ssh plans and command lines (no root needed)."""
from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from network_emulation import PROFILES, SshShapingSession, matrix_profile, parse_profile
from tools import node_ssh
from network_emulation.probe import RTT_HALF, SHARED_CLOCK, summarize
from network_emulation.shaping_agent import Agent, PlanError, check_plan
from network_emulation.ssh_shaping import QUEUE_BASE, plan_for

from .conftest import REPO

NODES = [node_ssh.NodeAddress("node01", "10.88.0.1"), node_ssh.NodeAddress("node02", "10.88.0.2")]


def test_hostfile_and_ssh_config() -> None:
    d = Path("/tmp/rehearsal")
    assert node_ssh.hostfile(NODES) == "node01 slots=1\nnode02 slots=1\n"
    cfg = node_ssh.ssh_config(d, NODES)
    blocks = cfg.split("\n\n")
    assert blocks[0].splitlines()[1:] == ["Host node01", "  HostName 10.88.0.1",
                                          "  SetEnv GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 "
                                          "TP_SOCKET_IFNAME=eth0"]
    common = dict(line.split(None, 1) for line in blocks[-1].splitlines()[1:] if line.strip())
    assert common["IdentityFile"] == "/tmp/rehearsal/id_ed25519"
    assert common["UserKnownHostsFile"] == "/tmp/rehearsal/known_hosts"
    assert common["GlobalKnownHostsFile"] == "/dev/null"
    assert common["StrictHostKeyChecking"] == "no" and common["BatchMode"] == "yes"
    assert node_ssh.etc_hosts(NODES) == "127.0.0.1 localhost\n10.88.0.1 node01\n10.88.0.2 node02\n"


def test_sshd_config_is_the_nodes_own() -> None:
    text = node_ssh.sshd_config(Path("/tmp/rehearsal"), NODES[1])
    conf = dict(line.split(None, 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert conf["ListenAddress"] == "10.88.0.2:22"
    assert conf["HostKey"] == "/tmp/rehearsal/node02/ssh_host_ed25519_key"
    assert conf["AuthorizedKeysFile"] == "/tmp/rehearsal/authorized_keys"
    assert conf["UsePAM"] == "no" and conf["PasswordAuthentication"] == "no"
    assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= set(conf["AcceptEnv"].split())
    assert conf["SetEnv"] == "TMPDIR=/tmp/rehearsal/node02/tmp NCCL_HOSTID=node02"  # its own /tmp and NCCL host
    assert "/etc/ssh" not in text


def test_directory_must_be_plain() -> None:
    node_ssh.check_directory(Path("/tmp/pytest-of-root/nodes-1"))
    for bad in ("relative/dir", "/tmp/with space", "/tmp/per%cent", '/tmp/q"uote'):
        with pytest.raises(ValueError):
            node_ssh.check_directory(Path(bad))


def test_plans_uniform_and_matrix() -> None:
    plan = plan_for(parse_profile("d10-1g"), "eth0", 1, [])
    assert plan["netem"] == ["tc qdisc replace dev eth0 root netem delay 10ms rate 1gbit limit 225000".split()]
    assert plan["tbf"] == ["tc qdisc replace dev eth0 root tbf rate 1gbit burst 131072 latency 50ms".split()]
    assert plan["delays"] == [[QUEUE_BASE, 10.0, None, 0.0, 0.0]]     # queue, delay, source, jitter, loss
    assert plan_for(PROFILES["none"], "eth0", 0, [])["delays"] == []
    m = matrix_profile({"delay_ms": [[0, 2, 8], [3, 0, 0], [5, 1, 0]],
                        "bandwidth_gbps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]})
    addrs = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    # host 2 receives: from host 0 after 8 ms, from host 1 undelayed (0 ms: no queue)
    assert plan_for(m, "eth0", 2, addrs)["delays"] == [[QUEUE_BASE, 8, "10.0.0.1/32", 0, 0]]
    assert plan_for(m, "eth0", 0, addrs)["delays"] == [[QUEUE_BASE + 1, 3, "10.0.0.2/32", 0, 0],
                                                       [QUEUE_BASE + 2, 5, "10.0.0.3/32", 0, 0]]
    lossy = plan_for(parse_profile("delay 0ms bandwidth 1Gbps loss 1% jitter 2ms"), "eth0", 0, [])
    assert lossy["delays"] == [[QUEUE_BASE, 0.0, None, 2.0, 1.0]]    # no delay, but jitter and loss: a queue
    assert lossy["netem"] == [
        "tc qdisc replace dev eth0 root netem delay 0ms 2ms loss 1% rate 1gbit limit 1000".split()]


def test_agent_takes_only_tc_commands_and_exempts_ssh(monkeypatch) -> None:
    plan = plan_for(parse_profile("d5-2g"), "eth0", 0, [])
    assert check_plan(json.loads(json.dumps(plan))) == plan
    for bad in ({**plan, "tbf": [["sh", "-c", "reboot"]]}, {**plan, "delays": [[70000, 1, None]]},
                {**plan, "backend": "magic"}, {"backend": "auto"}):
        with pytest.raises(PlanError):
            check_plan(bad)
    monkeypatch.setenv("SSH_CONNECTION", "10.88.0.254 40000 10.88.0.1 2222")
    rules = [shlex.join(r) for r in Agent(plan).rules()]
    assert rules == [
        "-i eth0 -p tcp --dport 2222 -m comment --comment pipebench-shaping -j ACCEPT",
        "-i eth0 -p tcp --sport 2222 -m comment --comment pipebench-shaping -j ACCEPT",
        f"-i eth0 -m comment --comment pipebench-shaping -j NFQUEUE --queue-num {QUEUE_BASE}",
    ]


def test_session_dry_run_and_agent_command() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        with SshShapingSession(parse_profile("d50-1g"), "ens5", ["gpu-1", "gpu-2"], dry_run=True, out=out,
                               ssh_config="/tmp/r/ssh_config", remote_dir="/srv/pipe bench", remote_python="/srv/py"):
            raise RuntimeError("boom")
    lines = out.getvalue().splitlines()
    agent = [l for l in lines if not l.startswith("#")]
    assert agent == [f"ssh -o BatchMode=yes -F /tmp/r/ssh_config gpu-{i} -- "
                     "'env -C '\"'\"'/srv/pipe bench'\"'\"' /srv/py -m network_emulation.shaping_agent'"
                     for i in (1, 2)]
    assert sum("netem delay 50ms" in l for l in lines) == 2 and sum("tbf rate 1gbit" in l for l in lines) == 2
    with pytest.raises(ValueError):
        SshShapingSession(PROFILES["d10-1g"], "eth0", ["-oProxyCommand=x"], dry_run=True)


def test_one_way_delay_method() -> None:
    raw = {"one_way_ms": [10.2, 10.1, 10.3], "rtt_ms": [20.8, 21.0, 20.6], "bulk": {}, "boot_id": "a"}
    same = summarize(raw, "a")
    assert same.one_way_method == SHARED_CLOCK and same.one_way_delay_ms == 10.2
    other = summarize(raw, "b")                      # clocks differ: the pings' own stamps mean nothing
    assert other.one_way_method == RTT_HALF and other.one_way_delay_ms == 10.4
    assert "[rtt/2]" in str(other)


def test_nodes_cli_bad_requests() -> None:
    for args in (["up", "--nodes", "0"], ["up", "--nodes", "2", "--dir", "/tmp/a b"],
                 ["up", "--nodes", "2", "--subnet", "10.88"]):
        p = subprocess.run([sys.executable, "-m", "tools.nodes", *args], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
        assert p.stderr.startswith("tools.nodes: ")

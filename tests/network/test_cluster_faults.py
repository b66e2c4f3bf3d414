"""Faults across the nodes of a cluster sweep, on four virtual nodes over real ssh: a rank that fails
on one node, a node that crashes mid-run (its sshd is the node's pid 1: killing it kills everything
on the node), a node that is down from the start. Each failed run gets an error record naming the
node, the shaping is cleared on every live node, the other nodes' processes stop, the sweep goes on.

The sweep runs as a real ``python -m runners.sweep --hostfile`` process; the nodes share this
machine's file system, so the suite and its python are used in place (no set-up).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.nodes import VirtualNodes

from ._node_checks import needs_sshd, shaping_left
from .conftest import REPO, needs_root

pytestmark = [pytest.mark.network, pytest.mark.multiprocess, pytest.mark.faults, needs_root, needs_sshd]

LONG = 400  # steps: a run that is still running when the fault comes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualNodes]:
    with VirtualNodes(4, tmp_path_factory.mktemp("faults") / "nodes", log=None) as vn:
        yield vn


def sweep_file(tmp_path: Path, runs: list[tuple[str, str, int]]) -> Path:
    """One experiment per (layout, network, steps): torch_pipe GPipe on a tiny model."""
    text = ('name = "faults"\n[fixed]\nmodel = "tiny"\nnum_layers = 4\nhidden_size = 32\nnum_heads = 2\n'
            'seq_length = 16\nvocab_size = 128\nbatch_size = 4\nmicro_batch_size = 1\nwarmup = 1\ntimeout = 300\n')
    for i, (layout, network, steps) in enumerate(runs):
        text += (f'[[experiment]]\nname = "e{i}"\nlayouts = ["{layout}"]\nnetworks = ["{network}"]\nsteps = {steps}\n'
                 '  [[experiment.systems]]\n  name = "torch_pipe"\n  schedule = "gpipe"\n')
    p = tmp_path / "faults.toml"
    p.write_text(text)
    return p


def start_sweep(vn: VirtualNodes, sweep: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runners.sweep", str(sweep), "--hostfile", str(vn.hostfile),
                             "--ssh-config", str(vn.ssh_config), "--out", str(out), "--no-report"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def node_processes(vn: VirtualNodes, index: int, word: str) -> list[int]:
    """pids (in this machine's pid namespace) of live processes on node ``index`` whose command line has
    ``word`` (a rank: "runners.worker" but not torchrun's "torch.distributed.run", whose argv names it)."""
    pids = subprocess.run(["ip", "netns", "pids", vn.nodes[index].namespace], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            if word == "runners.worker" and b"torch.distributed.run" in argv:
                continue
            if word.encode() in argv and stat not in ("Z", "X"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def wait_for(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def records(out: Path) -> list[dict]:
    return [json.loads(l) for l in out.read_text().splitlines() if l.strip()]


def nothing_runs(vn: VirtualNodes, indices) -> bool:
    return not any(node_processes(vn, i, w) for i in indices
                   for w in ("runners.run", "torch.distributed.run", "runners.worker", "shaping_agent", "delayer.py"))


def test_a_rank_that_fails_on_one_node(nodes: VirtualNodes, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    sweep = start_sweep(nodes, sweep_file(tmp_path, [("P-4", "none", LONG)]), out)  # what follows: the next test
    try:
        worker = wait_for(lambda: node_processes(nodes, 2, "runners.worker"), 180, "a rank on node03")[0]
        time.sleep(3)
        os.kill(worker, signal.SIGKILL)                                       # rank 2 dies on node03
        output, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    assert sweep.returncode == 1, output
    [failed] = records(out)
    assert failed["status"] == "error" and failed["error"].startswith("node03 failed first: its run command exited"), \
        failed["error"]
    assert "rank 2 was killed by SIGKILL" in failed["error"]
    assert nothing_runs(nodes, range(4))                                        # the other nodes stopped too


@pytest.mark.extended
def test_a_node_that_crashes_mid_run_and_stays_down(nodes: VirtualNodes, tmp_path: Path) -> None:
    """node04's sshd (its pid 1) is killed during a shaped run: the run is an error naming node04, the
    shaping of node01-03 is cleared; the next run needs node04 and is an error naming it (it never
    answers); the run after that, on two nodes, is ok with its measured link."""
    out = tmp_path / "r.jsonl"
    sweep = start_sweep(nodes, sweep_file(tmp_path, [("P-4", "d10-1g", LONG), ("P-4", "none", 2),
                                                    ("P-2", "default", 2)]), out)
    try:
        wait_for(lambda: node_processes(nodes, 3, "runners.worker"), 180, "a rank on node04")
        time.sleep(3)
        sshd = [int(c) for c in Path(f"/proc/{nodes.node_inits[3].pid}/task/{nodes.node_inits[3].pid}/children")
                .read_text().split()]
        assert sshd
        os.kill(sshd[0], signal.SIGKILL)                                        # node04 crashes
        crashed = time.monotonic()
        wait_for(lambda: len(records(out)) >= 1 if out.exists() else False, 120, "the crashed run's record")
        stopped_in = time.monotonic() - crashed
        assert nothing_runs(nodes, range(3))                                    # node01-03: ranks and shaping gone
        assert all(shaping_left(n.namespace) == [] for n in nodes.nodes[:3])
        output, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    print(f"crash of node04: its run recorded {stopped_in:.1f} s later")
    assert sweep.returncode == 1, output
    crashed_run, never_up, ok = records(out)
    assert crashed_run["status"] == "error" and crashed_run["error"].startswith(
        "node04 failed first: its ssh connection ended (the node went down or its sshd died)"), crashed_run["error"]
    assert crashed_run["environment"]["network"]["measured_link"]["one_way_delay_ms"] > 9.5
    assert never_up["status"] == "error" and never_up["error"].startswith(
        "node04 failed first: it did not answer ssh"), never_up["error"]
    assert ok["status"] == "ok" and sorted(ok["environment"]["hostnames"]) == ["node01", "node02"]
    assert ok["environment"]["network"]["measured_link"]["one_way_delay_ms"] < 2
    assert nothing_runs(nodes, range(3)) and all(shaping_left(n.namespace) == [] for n in nodes.nodes[:3])

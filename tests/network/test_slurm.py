"""The Slurm launcher on a real Slurm (slurmctld, slurmd, munge) on two virtual nodes: the rehearsal end to
end (runners/run_all.sh --rehearse 2 --slurm), then a node whose slurmd dies mid-run.

Needs root, iproute2, iptables, openssh-server and Debian's slurm-wlm + munge (scripts/setup_env.sh
installs them as root); each run starts 8 python processes (the run command and its guard, torchrun
and a rank on each node).
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
from tools.slurm_nodes import SlurmOnNodes

from ._node_checks import live_processes, needs_slurm, needs_sshd, shaping_left
from .conftest import REPO, needs_root, root_links

pytestmark = [pytest.mark.network, pytest.mark.multiprocess, needs_root, needs_sshd, needs_slurm]

P = 2
D10_ONE_WAY_S = 0.010
SLURM_PROCESSES = ("slurmctld", "slurmd", "slurmstepd", "munged")
RUN_PROCESSES = ("runners.run", "torch.distributed.run", "runners.worker", "shaping_agent", "delayer.py",
                 "network_emulation.slurm_step")


def vnode_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if "-vnodes-" in line}


def slurm_processes() -> set[int]:
    """Live Slurm and munge daemons on this machine (any namespace)."""
    found = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().strip() in SLURM_PROCESSES:
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.add(int(d.name))
        except OSError:
            continue
    return found


# rehearsal-2.toml under d10-1g alone: what Slurm adds is the launch (sbatch, srun) and the shaping through
# srun; GPipe against the default network is compared over ssh (test_rehearsal.py) and locally
D10_ONLY = (REPO / "sweeps" / "rehearsal-2.toml").read_text().replace('networks = ["default", "d10-1g"]',
                                                                     'networks = ["d10-1g"]')


def test_two_node_slurm_rehearsal_then_nothing_left(tmp_path: Path) -> None:
    namespaces, links, daemons = vnode_namespaces(), root_links(), slurm_processes()
    sweep = tmp_path / "rehearsal-2-d10.toml"
    sweep.write_text(D10_ONLY)
    t0 = time.monotonic()
    p = subprocess.run(["bash", "runners/run_all.sh", "--rehearse", "2", "--slurm", "--sweep", str(sweep),
                        "--out", str(tmp_path / "r.jsonl"), "--dir", str(tmp_path / "nodes")],
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHON=sys.executable))
    print(f"rehearsal: {time.monotonic() - t0:.0f} s")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "slurmctld on node01, slurmd and munged on 2 node(s)" in p.stdout
    assert "slurm-submit: submitted batch job" in p.stdout and (tmp_path / "r.sbatch").exists()  # beside the records
    records = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok"], [r.get("error") for r in records]
    for r in records:
        env = r["environment"]
        assert sorted(env["hostnames"]) == ["node01", "node02"], env
        assert env["cluster"]["launcher"] == "slurm" and env["cluster"]["hosts"] == ["node01", "node02"]
        assert env["network"]["measured_between"] == ["node01", "node02"]
        assert env["network"]["backend"] in ("netem", "tbf+delayer") and env["network"]["measured_link"]["samples"] > 0
    (d10,) = records
    assert d10["network"] == "d10-1g" and d10["environment"]["network"]["measured_link"]["one_way_delay_ms"] > 9.5
    # GPipe pays at least the fill and drain of the pipeline: 2 (P - 1) one-way delays per step.
    print(f"P-{P} GPipe median step under d10-1g: {d10['median_step_time']:.3f} s "
          f"(floor {2 * (P - 1) * D10_ONE_WAY_S:.3f} s)")
    assert d10["median_step_time"] >= 2 * (P - 1) * D10_ONE_WAY_S
    assert "| delay 10ms  bandwidth 1Gbps" in p.stdout                          # the report, from the job's output
    # nothing left: no daemon, namespace, host-side link, rank or agent
    assert slurm_processes() <= daemons
    assert vnode_namespaces() <= namespaces
    assert {l for l in root_links() - links if l.startswith("vn")} == set()
    assert live_processes(str(tmp_path)) == []


# ---------------------------------------------------------------------- a node whose slurmd dies

LONG = 400  # steps: a run that is still running when slurmd dies


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmOnNodes]:
    with VirtualNodes(2, tmp_path_factory.mktemp("slurm") / "nodes", log=None) as vn, \
            SlurmOnNodes(vn, gpus_per_node=1, log=None) as s:
        yield s


def node_processes(vn: VirtualNodes, index: int, words: tuple[str, ...]) -> list[str]:
    """Command lines of live processes on node ``index`` with one of ``words``."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", vn.nodes[index].namespace], capture_output=True,
                              text=True).stdout.split():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state not in ("Z", "X") and any(w in argv for w in words):
            found.append(argv)
    return found


def comm_pids(vn: VirtualNodes, index: int, comm: str) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", vn.nodes[index].namespace], capture_output=True, text=True).stdout
    return [int(p) for p in pids.split() if Path(f"/proc/{p}/comm").exists()
            and Path(f"/proc/{p}/comm").read_text().strip() == comm]


def wait_for(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.faults
@pytest.mark.extended
def test_a_node_whose_slurmd_dies_mid_run(slurm: SlurmOnNodes, tmp_path: Path) -> None:
    """node02's slurmd is killed during a shaped run: Slurm sets node02 DOWN, the run's record is an error
    naming node02, its processes and shaping end on both nodes (on node02 through the step guard); the
    next run, which needs two nodes, is recorded unfit."""
    vn = slurm.vn
    sweep = tmp_path / "faults.toml"
    sweep.write_text('name = "faults"\n[fixed]\nmodel = "tiny"\nnum_layers = 4\nhidden_size = 32\nnum_heads = 2\n'
                     'seq_length = 16\nvocab_size = 128\nbatch_size = 4\nmicro_batch_size = 1\nwarmup = 1\n'
                     'timeout = 300\n' + "".join(
                         f'[[experiment]]\nname = "{name}"\nlayouts = ["P-2"]\nnetworks = ["{net}"]\nsteps = {steps}\n'
                         '  [[experiment.systems]]\n  name = "torch_pipe"\n  schedule = "gpipe"\n'
                         for name, net, steps in (("long", "d10-1g", LONG), ("after", "none", 2))))
    out = tmp_path / "r.jsonl"
    submit = subprocess.Popen(slurm.submit_argv([
        "env", "-C", str(REPO), f"PYTHON={sys.executable}", "bash", "runners/run_all.sh", "--sweep", str(sweep),
        "--out", str(out), "--iface", "eth0", "--no-report", "--slurm-submit", "--nodes=2", "--gpus-per-node=1",
        "--wait"]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: node_processes(vn, 1, ("runners.worker",)), 180, "a rank on node02")
        time.sleep(3)
        slurmd = comm_pids(vn, 1, "slurmd")
        assert len(slurmd) == 1
        os.kill(slurmd[0], signal.SIGKILL)                                      # node02's slurmd dies
        died = time.monotonic()
        output, _ = submit.communicate(timeout=300)
        print(f"slurmd of node02 killed: the job ended {time.monotonic() - died:.0f} s later")
    finally:
        if submit.poll() is None:
            submit.kill()
            submit.wait()
    assert submit.returncode == 1, output                                        # a run failed
    job_output = next(Path(l.split("output: ")[1].split(";")[0]) for l in output.splitlines()
                      if l.startswith("slurm-submit: submitted"))
    lost, after = [json.loads(l) for l in out.read_text().splitlines()]
    assert lost["status"] == "error" and lost["error"].startswith(
        "node02 failed first: Slurm lost the node (its slurmd stopped answering"), \
        (lost["error"], job_output.read_text())
    assert lost["environment"]["network"]["measured_link"]["one_way_delay_ms"] > 9.5
    assert after["status"] == "unfit" and "without node02, lost" in after["error"], after["error"]
    # nothing of the runs left on either node: no rank, run command, guard, agent or delayer, no shaping
    wait_for(lambda: not any(node_processes(vn, i, RUN_PROCESSES) for i in range(2)), 60,
             "the runs' processes to end: " + repr([node_processes(vn, i, RUN_PROCESSES) for i in range(2)]))
    assert all(shaping_left(n.namespace) == [] for n in vn.nodes)

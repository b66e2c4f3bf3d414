"""The Slurm mode's pieces that need no running Slurm: reading the allocation, naming the node that failed
from srun's words, the srun and batch script it writes, the rehearsal's configuration; and bad requests
(no allocation, a node list that cannot be expanded, more GPUs than the allocation holds): one line, exit 2.
The end-to-end runs on a real Slurm are in tests/network/test_slurm.py."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.slurm_nodes import gres_conf, slurm_conf, task_prolog
from network_emulation.slurm_step import srun_argv
from runners.sweep.hostfile import DoesNotFit
from runners.sweep.plan import SweepError, load_sweep
from runners.sweep.slurm import Allocation, SlurmExecutor, StepWatch, gpus_per_node
from runners.sweep.slurm_submit import batch_script, output_of, split_argv, without_out

REPO = Path(__file__).resolve().parents[2]
needs_scontrol = pytest.mark.skipif(shutil.which("scontrol") is None,
                                    reason="scontrol missing: apt-get install -y slurm-client (scripts/setup_env.sh)")


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "a100:4"}, (8, "SLURM_GPUS_ON_NODE")),
    ({"SLURM_GPUS_PER_NODE": "gpu:a100:4"}, (4, "SLURM_GPUS_PER_NODE")),
    ({"SLURM_JOB_GPUS": "0,1,2"}, (3, "SLURM_JOB_GPUS")),
    ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, (2, "SLURM_TASKS_PER_NODE, an allocation without GPUs")),
    ({}, (1, "one task per node, an allocation without GPUs")),
])
def test_gpus_per_node_from_the_allocation(env: dict, expected: tuple) -> None:
    assert gpus_per_node(env) == expected


def test_more_gpus_per_node_than_the_allocation_holds() -> None:
    a = Allocation("7", ("node01", "node02"), 1, "SLURM_GPUS_ON_NODE")
    assert [h.slots for h in a.slots()] == [1, 1]
    with pytest.raises(SweepError, match=r"--nproc-per-node 2 asks for more GPUs per node than the allocation holds "
                                         r"\(1, from SLURM_GPUS_ON_NODE\)"):
        a.slots(2)


def watch(lines: list[str], hosts=("node01", "node02")) -> StepWatch:
    w = StepWatch(hosts)
    for line in lines:
        w.see(line + "\n")
    return w


def test_a_node_slurm_lost_is_blamed_before_what_it_caused() -> None:
    w = watch(["0: step 1 ...", "srun: error: Node failure on node02", "srun: error: node01: task 0: Killed",
               "srun: Force Terminated StepId=4.0"])
    assert w.lost == {"node02"}
    assert w.blame() == ("node02 failed first: Slurm lost the node (its slurmd stopped answering: the node went down "
                         "or its slurmd died)")


def test_an_error_of_its_own_is_blamed_before_a_peer_failure() -> None:
    w = watch(["0: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
               "srun: error: node01: task 0: Exited with exit code 1",
               "1: run: error: rank 1 was killed by SIGKILL",
               "srun: error: node02: task 1: Exited with exit code 1"])
    assert w.lost == set()
    assert w.blame() == ("node02 failed first: its run command exited with status 1: "
                         "run: error: rank 1 was killed by SIGKILL")


def test_what_the_stop_ends_is_not_blamed() -> None:
    w = watch(["0: training"])
    w.stopping = True
    w.see("srun: error: node01: task 0: Exited with exit code 130\n")
    assert w.blame() is None and w.first_failure is None
    assert watch(["srun: error: Task launch for StepId=3.1 failed on node node02: Invalid node name specified"]
                 ).blame() == "node02 failed first: its task did not start (Invalid node name specified)"


def executor(lost=()) -> SlurmExecutor:
    a = Allocation("42", ("node01", "node02", "node03"), 1, "SLURM_GPUS_ON_NODE")
    return SlurmExecutor(a.slots(), allocation=a, lost=set(lost))


def test_the_run_step_and_where_runs_go() -> None:
    sweep = load_sweep("rehearsal-2.toml")
    run = sweep.runs[0]
    ex = executor()
    nodes = ex.place(run)
    assert nodes.hosts == ("node01", "node02") and nodes.ranks_per_node == 1
    argv = ex.run_step_argv(run, nodes, "/x/results/.cluster-1.jsonl", "pipebench-1")
    assert argv[:9] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=node01,node02",
                        "--overlap", "--kill-on-bad-exit=0", "--label", "--job-name=pipebench-1"]
    i = argv.index("sh")
    assert argv[i + 1] == "-c" and '"$@" --node-rank "$SLURM_NODEID"' in argv[i + 2]    # the rank of each node
    rest = argv[i + 4:]
    assert rest[:5] == ["env", "GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0",  # NCCL on the shaped link
                        "NCCL_IB_DISABLE=1", "NCCL_NET=Socket"]
    assert rest[6:9] == ["-m", "network_emulation.slurm_step", "--"]                    # under the step guard
    assert rest[-6:] == ["--nnodes", "2", "--rdzv-endpoint", "node01:29500", "--out", "/x/results/.cluster-1.jsonl"]
    assert "--node-rank" not in rest
    assert ex.cluster_environment(run, nodes) == {
        "hosts": ["node01", "node02"], "ranks_per_node": 1, "iface": "eth0", "launcher": "slurm", "job_id": "42",
        "nccl_env": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}}
    assert executor(lost={"node01"}).place(run).hosts == ("node02", "node03")         # a lost node is left out
    with pytest.raises(DoesNotFit, match=r"needs 2 GPUs, the allocation \(without node01, node02, lost\) has 1"):
        executor(lost={"node01", "node02"}).place(run)


def test_srun_argv_refuses_what_is_not_a_node_name() -> None:
    assert srun_argv(["node01"], ["hostname"])[-1] == "hostname"
    for bad in ("-x", "a,b", ""):
        with pytest.raises(ValueError):
            srun_argv([bad], ["hostname"])


def test_the_batch_script(tmp_path: Path) -> None:
    out = tmp_path / "results" / "gpt3.jsonl"
    text = batch_script("sweeps/gpt3-xl-cluster.toml", out, ["--iface", "ib0"],
                        ["--nodes", "12", "--gpus-per-node=1", "--comment", "a b"], "gpt3", python="/v/bin/python")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert f"#SBATCH --output={tmp_path}/results/gpt3-slurm-%j.out" in lines and "#SBATCH --no-kill" in lines
    assert "#SBATCH --nodes 12 --gpus-per-node=1 --comment 'a b'" in lines                # the user's, last
    assert f"cd {shlex.quote(str(REPO))}" in lines and "export PYTHON=/v/bin/python" in lines
    assert lines[-1] == (f"exec bash runners/run_all.sh --slurm --sweep sweeps/gpt3-xl-cluster.toml --iface ib0 "
                         f"--out {out}")
    script = tmp_path / "s.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert split_argv(["s.toml", "--only", "ours", "--", "-N", "2"]) == (["s.toml", "--only", "ours"], ["-N", "2"])
    assert without_out(["--out", "a", "--only", "x", "--out=b"]) == ["--only", "x"]
    assert output_of(["-N", "2", "-o", "x-%j.out"]) == "x-%j.out" and output_of(["--output=y"]) == "y"


def test_the_rehearsal_configuration(tmp_path: Path) -> None:
    conf = slurm_conf(tmp_path, [("node01", "10.88.0.1"), ("node02", "10.88.0.2")], gpus_per_node=2, cpus=4)
    assert "SlurmctldHost=node01(10.88.0.1)" in conf
    assert "NodeName=node02 NodeAddr=10.88.0.2 CPUs=4 Gres=gpu:2 State=UNKNOWN" in conf
    assert f"AuthInfo=socket={tmp_path}/munge/munge.socket.2" in conf and "ProctrackType=proctrack/linuxproc" in conf
    assert gres_conf(tmp_path, 2) == f"Name=gpu File={tmp_path}/gpus/gpu0,{tmp_path}/gpus/gpu1\n"
    assert 'export TMPDIR=/n/$SLURMD_NODENAME/tmp' in task_prolog(Path("/n"))


# ---------------------------------------------------------------------- bad requests: one line, exit 2

def run_all(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", "runners/run_all.sh", *args, "--sweep", "rehearsal-2.toml",
                           "--out", str(tmp_path / "r.jsonl")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**clean, "PYTHON": sys.executable, **env})


def assert_refused(p: subprocess.CompletedProcess[str], tmp_path: Path, words: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and words in p.stderr, p.stderr
    assert list(tmp_path.glob("r.*")) == []                                       # nothing written


def test_slurm_without_an_allocation(tmp_path: Path) -> None:
    assert_refused(run_all(tmp_path, "--slurm"), tmp_path, "not inside a Slurm allocation")
    assert_refused(run_all(tmp_path, "--slurm", "--hostfile", "h"), tmp_path, "leave out --hostfile")


@pytest.fixture
def slurm_conf_file(tmp_path: Path) -> str:
    """A configuration scontrol can read (it expands node lists without a controller)."""
    conf = tmp_path / "conf" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=node[01-02]\nPartitionName=p Nodes=ALL\n")
    return str(conf)


@needs_scontrol
@pytest.mark.parametrize("nodelist", ["node[03-01]", "node[01-", ""])
def test_a_nodelist_that_cannot_be_expanded(tmp_path: Path, slurm_conf_file: str, nodelist: str) -> None:
    p = run_all(tmp_path, "--slurm", SLURM_CONF=slurm_conf_file, SLURM_JOB_ID="7", SLURM_JOB_NODELIST=nodelist)
    assert_refused(p, tmp_path,
                   "not inside a Slurm allocation" if not nodelist else "cannot be expanded into host names")


@needs_scontrol
def test_more_gpus_asked_than_the_allocation_holds(tmp_path: Path, slurm_conf_file: str) -> None:
    p = run_all(tmp_path, "--slurm", "--nproc-per-node", "2", SLURM_CONF=slurm_conf_file, SLURM_JOB_ID="7",
                SLURM_JOB_NODELIST="node[01-02]", SLURM_GPUS_ON_NODE="1")
    assert_refused(p, tmp_path, "--nproc-per-node 2 asks for more GPUs per node than the allocation holds (1")


def test_submit_judges_the_sweep_before_submitting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'bad'\n[fixed]\nmodel = 'tiny'\n[[experiment]]\nlayouts = ['P-3']\nsystems = ['nope']\n")
    p = subprocess.run(["bash", "runners/run_all.sh", "--sweep", str(bad), "--out", str(tmp_path / "r.jsonl"),
                        "--slurm-submit", "--nodes=2"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": sys.executable})
    assert_refused(p, tmp_path, "--slurm-submit: error:")



@needs_scontrol
def test_a_slurm_sweep_is_placed_on_the_allocation_not_judged_against_this_machine(tmp_path: Path,
                                                                                   slurm_conf_file: str) -> None:
    """P-4 D-64 (256 ranks) is refused for a sweep on this machine (#31 item 11); under --slurm it runs on the
    allocation's nodes: planned there, or recorded unfit where the allocation cannot hold it."""
    f = tmp_path / "big.toml"
    f.write_text('name = "big"\n[fixed]\nmodel = "tiny"\nbatch_size = 4\n[[experiment]]\nname = "x"\n'
                 'micro_batch_sizes = [1]\nlayouts = ["P-4 D-64", "P-2 D-512"]\n'
                 '  [[experiment.systems]]\n  name = "ours"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run([sys.executable, "-m", "runners.sweep", str(f), "--slurm", "--dry-run", "--out",
                        str(tmp_path / "o.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**clean, "SLURM_CONF": slurm_conf_file, "SLURM_JOB_ID": "7",
                            "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_GPUS_ON_NODE": "128"})
    assert p.returncode == 0, p.stderr
    assert ("--pp 4 --tp 1 --dp 64 --batch-size 4 --micro-batch-size 1 --network none  (2 node(s) x 128 rank(s)"
            in p.stdout)
    assert "does not fit: needs 1024 GPUs, the allocation has 256" in p.stdout

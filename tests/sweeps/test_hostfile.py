"""Hostfiles with GPU slots and the cluster placement (issue #11 item 6): what fits where, what does
not, and how an unfit run is recorded. Nothing is ssh-ed: the plan is printed, runs that fit go to
nowhere (they are only placed)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runners.sweep.cluster import ClusterExecutor
from runners.sweep.execute import recorded_keys, run_sweep
from runners.sweep.hostfile import DoesNotFit, Host, NodePlacement, parse_hostfile, place
from runners.sweep.plan import SweepError, load_sweep, sweep_from_dict

REPO = Path(__file__).resolve().parents[2]


def hostfile(tmp_path: Path, text: str, name: str = "hosts") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def twelve(slots: int | None = 1) -> str:
    return "".join(f"node{i:02d}" + (f" slots={slots}" if slots else "") + "\n" for i in range(1, 13))


def test_hostfile_slots_bare_names_comments_and_override(tmp_path):
    hf = hostfile(tmp_path, "# the cluster\nnode01 slots=8   # a p3.16xlarge\n\n  node02\n10.0.0.3 slots=1\n")
    assert parse_hostfile(hf) == [Host("node01", 8), Host("node02", 1), Host("10.0.0.3", 1)]
    assert parse_hostfile(hf, slots=4) == [Host("node01", 4), Host("node02", 4), Host("10.0.0.3", 4)]


@pytest.mark.parametrize("text, message", [
    ("node0\n-oProxyCommand=x\n", "bad host name '-oProxyCommand=x'"),
    ("slots=2\n", "bad host name 'slots=2'"),
    ("node0 slots=0\n", "expected 'HOST [slots=N]' with N >= 1"),
    ("node0 slots=two\n", "expected 'HOST [slots=N]'"),
    ("node0 gpus=2\n", "expected 'HOST [slots=N]'"),
    ("node0\nnode0 slots=2\n", "host 'node0' is listed twice"),
    ("# none\n", "lists no hosts"),
])
def test_hostfile_errors_name_the_line(tmp_path, text, message):
    with pytest.raises(SweepError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_hostfile(hostfile(tmp_path, text))


def test_placement_uses_slots_and_spreads_ranks():
    ones = [Host(f"n{i:02d}") for i in range(12)]
    assert place(12, ones) == NodePlacement(tuple(h.name for h in ones), 1)          # P-12: 12 nodes x 1
    assert place(8, ones).ranks_per_node == 1 and place(8, ones).nnodes == 8         # as few per node as fit
    with pytest.raises(DoesNotFit, match=r"^does not fit: needs 48 GPUs, hostfile has 12$"):
        place(48, ones)                                                               # ours P-12 D-4
    with pytest.raises(DoesNotFit, match=r"needs 1 node\(s\) of 8 GPUs \(8 ranks per node\), hostfile has 0"):
        place(8, ones, ranks_per_node=8)                                              # Megatron on one 8-GPU machine
    fours = [Host(f"n{i:02d}", 4) for i in range(12)]
    assert place(48, fours) == NodePlacement(tuple(h.name for h in fours), 4)
    assert place(12, fours).ranks_per_node == 1                                       # spread, not packed
    mixed = [Host("small", 1), Host("big", 8), Host("other", 1)]
    assert place(8, mixed, ranks_per_node=8) == NodePlacement(("big",), 8)           # the host that has the slots
    assert place(2, mixed, devices_per_process=4) == NodePlacement(("big",), 2)       # fairscale: GPUs per process
    with pytest.raises(DoesNotFit, match="needs 8 GPUs, hostfile has 5"):
        place(4, [Host("a", 3), Host("b", 1), Host("c", 1)], devices_per_process=2)
    with pytest.raises(DoesNotFit, match="nodes of equal rank counts"):
        place(6, [Host("a", 4), Host("b", 2)])                                         # torchrun: same ranks per node
    with pytest.raises(DoesNotFit, match="do not divide into nodes of 4"):
        place(6, fours, ranks_per_node=4)
    with pytest.raises(DoesNotFit, match="must span 2 nodes"):
        place(2, [Host("a", 2)], emulated=True)                                        # its links would not be shaped
    assert place(2, [Host("a", 2), Host("b", 2)], emulated=True).nnodes == 2


def plan_lines(tmp_path: Path, hosts_text: str, *extra: str) -> list[str]:
    """`run_all.sh --hostfile H --dry-run` on the seed's sweep: its output lines."""
    p = subprocess.run(["bash", "runners/run_all.sh", "--hostfile", str(hostfile(tmp_path, hosts_text)), "--dry-run",
                        "--out", str(tmp_path / "c.jsonl"), *extra], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "c.jsonl").exists()
    return p.stdout.splitlines()


def placed(lines: list[str], system: str, layout: str) -> list[str]:
    """The placement notes ('(N node(s) x R rank(s): ...') or unfit reasons of a system's runs."""
    pp, dp = layout
    want = f"--system {system} "
    out = []
    for i, line in enumerate(lines):
        if want in line and f"--pp {pp} " in line and f"--dp {dp} " in line and line.startswith("# "):
            out.append(line.split("  (", 1)[1] if "  (" in line else lines[i + 1].strip("# "))
    return out


def test_twelve_single_gpu_hosts_plan_the_seed_sweep(tmp_path):
    """The seed's 12 p3.2xlarge: P-12 is 12 nodes x 1 rank; ours P-12 D-4 and the 8-GPU runs do not fit."""
    lines = plan_lines(tmp_path, twelve(1))
    assert lines[0].startswith("sweep gpt3-xl-cluster on 12 host(s) (12 GPU slots)")
    p12 = placed(lines, "ours", ("12", "1")) + placed(lines, "torch_pipe", ("12", "1"))
    assert len(p12) == 10 and all(p.startswith("12 node(s) x 1 rank(s): node01 node02") for p in p12)
    assert placed(lines, "ours", ("12", "4")) == ["does not fit: needs 48 GPUs, hostfile has 12"] * 5
    megatron = [l for l in lines if "--system megatron" in l or ("--system ours" in l and "--tp 1 " not in l)]
    assert len(megatron) == 20 + 4 and all(l.startswith("# skip (unfit)") for l in megatron)
    assert placed(lines, "torch_pipe", ("8", "1")) == [
        "does not fit: needs 1 node(s) of 8 GPUs (8 ranks per node), hostfile has 0 (at most 1 GPUs per host)"] * 3
    runs = [l for l in lines if "runners.run" in l]
    assert len(runs) == 10 * 12 and not any("--nnodes 12" not in r for r in runs)


def test_slots_and_nproc_override(tmp_path):
    lines = plan_lines(tmp_path, twelve(4), "--only", "ours")                  # 12 nodes of 4 GPUs: P-12 D-4 fits
    d4 = placed(lines, "ours", ("12", "4"))
    assert len(d4) == 5 and all(p.startswith("12 node(s) x 4 rank(s): node01 node02") for p in d4), d4
    lines = plan_lines(tmp_path, twelve(None), "--nproc-per-node", "8", "--only", "megatron")
    meg = [l for l in lines if l.startswith("# [megatron-layouts]")]
    assert len(meg) == 20 and all("(1 node(s) x 8 rank(s): node01; network none)" in l for l in meg)


def test_bad_hostfile_exits_2_with_one_line(tmp_path):
    p = subprocess.run(["bash", "runners/run_all.sh", "--hostfile", str(hostfile(tmp_path, "n0 slots=x\n")),
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "expected 'HOST [slots=N]'" in p.stderr, p.stderr
    p = subprocess.run(["bash", "runners/run_all.sh", "--hostfile", str(tmp_path / "missing"), "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cannot read hostfile" in p.stderr, p.stderr


def test_unfit_runs_are_recorded_once_and_judged_again(tmp_path):
    """An unfit run is skipped with one line and recorded (status unfit, the reason as its error), not
    recorded again while the reason stays the same, and never counted as done: a larger cluster runs it."""
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 4, "micro_batch_size": 1},
                             "systems": ["ours"], "layouts": ["P-4"]})
    out = tmp_path / "o.jsonl"
    executor = ClusterExecutor([Host("n0"), Host("n1")])
    for _ in range(2):
        said = io.StringIO()
        res = run_sweep(sweep, out, executor=executor, probe=False, report=False, need_root_for_network=False,
                        stream=said)
        assert res.not_run == 1 and res.failed == 0 and res.ok == 0
        assert "unfit  [" in said.getvalue() and "does not fit: needs 4 GPUs, hostfile has 2" in said.getvalue()
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    assert rec["status"] == "unfit" and rec["error"] == "does not fit: needs 4 GPUs, hostfile has 2"
    assert rec["key"] == sweep.runs[0].key and rec["environment"]["cluster"]["hostfile"] == ["n0 slots=1", "n1 slots=1"]
    assert recorded_keys(out) == set()


def test_seed_sweep_loads_with_slots_unchanged():
    """The seed sweep's placement hints are ranks per node (Megatron's 8 on one machine)."""
    sweep = load_sweep("gpt3-xl-cluster.toml")
    hints = {r.experiment: r.nproc_per_node for r in sweep.runs}
    assert hints == {"network": None, "megatron-layouts": 8, "ours-layouts": 8, "torch-pipe-8gpu": 8}

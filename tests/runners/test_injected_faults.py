"""Faults given to a run (contract.faults), on real torchrun/gloo ranks: a straggler slows the step,
a killed rank ends a synchronous run as error naming it, diloco goes on without a killed replica
(and takes it back with --rejoin); nothing is left running."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from contract.records import read_records
from runners.launcher import RUN_DIR_PREFIX
from tests.conftest import TINY, run_cli

# Compute has to be most of a step for a slower rank to show in it: 2 layers of hidden 512 at 256
# tokens, 4 micro-batches (the pipeline's fill and drain are a small part of the step).
HEAVY = ["--model", "tiny", "--num-layers", "2", "--hidden-size", "512", "--num-heads", "8", "--seq-length", "256",
         "--vocab-size", "128", "--pp", "2", "--batch-size", "4", "--micro-batch-size", "1", "--steps", "3",
         "--warmup", "1"]
DILOCO = ["--system", "diloco", "--model", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4",
          "--seq-length", "32", "--vocab-size", "256", "--data", "stdlib", "--dp", "3", "--batch-size", "1",
          "--micro-batch-size", "1", "--steps", "16", "--warmup", "0", "--inner-steps", "4", "--eval-every", "8",
          "--kill-replica", "2@10", "--timeout", "300"]


def _nothing_left(out_file: Path) -> None:
    """No process of the run's command line, no run directory of a run command that has ended."""
    listed = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out_file) not in listed, [l for l in listed.splitlines() if str(out_file) in l]
    for d in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        pid = int(d.name.removeprefix(RUN_DIR_PREFIX).split(".")[0])
        assert Path(f"/proc/{pid}").exists(), f"{d} outlived its run command"


@pytest.mark.multiprocess
@pytest.mark.timing
@pytest.mark.parametrize("system", [
    pytest.param(["ours", "--n-slices", "1"], marks=pytest.mark.extended),
    pytest.param(["torch_pipe", "--schedule", "gpipe"], marks=pytest.mark.extended)])
def test_a_slow_rank_slows_the_step(system, out_file):
    base = run_cli("--system", *system, *HEAVY, "--out", str(out_file))
    slow = run_cli("--system", *system, *HEAVY, "--slow-rank", "1:2", "--out", str(out_file))
    assert base.returncode == 0 and slow.returncode == 0, (base.stderr + slow.stderr)[-3000:]
    fast, slowed = read_records(out_file)
    assert slowed["config"]["slow_rank"] == "1:2" and "slow_rank" in slowed["key"]
    how = slowed["environment"]["faults"]["straggler"]
    assert how["rank"] == 1 and how["factor"] == 2 and how["method"]
    assert slowed["median_step_time"] >= 1.5 * fast["median_step_time"], (how, fast["step_times"], slowed["step_times"])


@pytest.mark.multiprocess
@pytest.mark.faults
def test_a_killed_rank_ends_a_synchronous_run_as_error(out_file):
    p = run_cli("--system", "ours", *TINY, "--pp", "2", "--n-slices", "1", "--batch-size", "2", "--micro-batch-size",
                "1", "--steps", "4", "--warmup", "1", "--kill-replica", "1@3", "--out", str(out_file))
    assert p.returncode == 1, p.stderr[-3000:]
    (rec,) = read_records(out_file)
    assert rec["status"] == "error" and rec["error"].startswith("rank 1 was killed after 3 steps (--kill-replica 1@3)")
    assert rec["environment"]["faults"]["killed"][0]["rank"] == 1
    assert "Traceback" not in p.stderr and "ChildFailedError" in rec["withheld_output"], p.stderr[-3000:]  # #54 item 22
    _nothing_left(out_file)


@pytest.mark.multiprocess
@pytest.mark.faults
@pytest.mark.parametrize("rejoin", [
    pytest.param(False, id="without", marks=pytest.mark.extended),
    pytest.param(True, id="rejoin", marks=pytest.mark.extended)])
def test_diloco_goes_on_without_a_killed_replica(rejoin, out_file):
    """Replica 2 of 3 is killed after 10 of 16 steps; the others go on. With --rejoin its standby joins
    the others' next quorum (their sync after step 12: every 4 steps), heals from one of them and runs
    steps 13-16 with them (issue #54 item 10: it never ran a step, and the report said it rejoined).
    Throughput counts only the replicas that ran each step (item 2); the terminal shows no traceback of
    the killed replica's torchrun (item 22)."""
    p = run_cli(*DILOCO, *(["--rejoin"] if rejoin else []), "--out", str(out_file))
    assert p.returncode == 0, p.stderr[-4000:]
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok"
    lives = {r["replica"]: r["lives"] for r in rec["environment"]["faults"]["replicas"]}
    assert lives[0] == lives[1] == [{"steps": [0, 15], "ended": "finished"}]
    assert lives[2][0] == {"steps": [0, 9], "ended": "killed after 10 steps"}
    assert sorted(r["rank"] for r in rec["environment"]["faults"]["killed"]) == [2]
    assert len(rec["step_times"]) == 16 and rec["evals"][-1]["step"] == 16  # the loss on held-out text after
    assert rec["evals"][-1]["loss"] < rec["evals"][0]["loss"]
    if rejoin:
        second = lives[2][1]
        assert second["steps"] == [12, 15] and second["ended"] == "finished" and second["rejoined"], second
        assert second["outer_steps"] == 4  # it healed to the others' outer step and took the last one with them
        assert rec["replicas_per_step"] == [3] * 10 + [2] * 2 + [3] * 4
    else:
        assert len(lives[2]) == 1 and rec["replicas_per_step"] == [3] * 10 + [2] * 6
    work = sum(rec["replicas_per_step"]) / 16 * 1 * 32  # a replica's batch: 1 sequence of 32 tokens
    assert rec["tokens_per_s"] == pytest.approx(work / rec["median_step_time"])
    assert rec["environment"]["device_count"] == 3
    assert rec["tokens_per_s_per_device"] == pytest.approx(32 / rec["median_step_time"])
    assert "Traceback" not in p.stderr and "ChildFailedError" in rec["withheld_output"], p.stderr[-3000:]

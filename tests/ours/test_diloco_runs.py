"""diloco through the real run command (torchrun, gloo ranks, torchft, the lighthouse started and
stopped by the run command):

- diloco passes --verify against the reference's math (the reference's own steps with the outer step
  applied to them, ``reference --diloco``) at H = 1 and H = 4, in fp32 and bf16, and so does Streaming
  DiLoCo with ours' pipeline in each replica (fp32);
- at H = 1 (outer SGD, lr 1, no momentum: the replicas' weights averaged after every step) it reaches
  the held-out loss of synchronous training within 0.05 (1 %) after 8 steps (in the simulation,
  seeds 0-2: 0.016-0.021 above; the replicas average their Adam updates, not their gradients);
- at H = 4 it reaches a lower held-out loss than H = 1 for the bytes it sent, and a larger fall of
  the loss per byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, assert_verified, run_cli

TEXT = ["--model", "tiny", "--hidden-size", "64", "--seq-length", "64", "--vocab-size", "256", "--data", "stdlib",
        "--lr", "1e-3", "--steps", "8", "--warmup", "0"]


def lighthouses() -> list[str]:
    """The torchft lighthouses running on this machine (only diloco's runs start one)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"torchft_lighthouse"):
            found.append(cmdline.parent.name)
    return found


def record(out: Path) -> dict:
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.parametrize("inner_steps, precision", [
    pytest.param("4", "fp32", marks=pytest.mark.extended), pytest.param("1", "bf16", marks=pytest.mark.extended),
    pytest.param("4", "bf16", marks=pytest.mark.extended)])
@pytest.mark.multiprocess
def test_diloco_verifies_against_the_reference_math(inner_steps, precision, tmp_path):
    """H = 1 in fp32: test_h1_reaches_synchronous_training_and_h4_a_lower_loss_per_byte. Five steps:
    at H = 4, the last step's losses and gradients come after an outer step."""
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "diloco", *TINY, "--dp", "2", "--batch-size", "2", "--micro-batch-size", "1",
                   "--steps", "5", "--warmup", "0", "--inner-steps", inner_steps, "--precision", precision,
                   "--verify", "--out", str(out))
    assert_verified(proc)
    rec = record(out)
    assert rec["verify"]["passed"] and rec["options"]["outer_steps"] == 5 // int(inner_steps)
    assert lighthouses() == []


@pytest.mark.multiprocess
def test_streaming_diloco_with_ours_pipeline_verifies(tmp_path):
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "diloco", *TINY, "--pp", "2", "--dp", "2", "--batch-size", "2", "--micro-batch-size",
                   "1",
                   "--steps", "6", "--warmup", "0", "--inner-steps", "4", "--fragments", "2", "--sync-delay", "1",
                   "--fragment-alpha", "0.25", "--n-slices", "2", "--verify", "--out", str(out))
    assert_verified(proc)
    rec = record(out)
    assert rec["label"] == "streaming diloco H=4 F=2 tau=1 alpha=0.25"
    assert rec["options"]["outer_steps"] == 3 and rec["options"]["slices"] == [16, 16]  # a fragment every 2 steps
    assert rec["options"]["eval_weights_every"] == 2  # the global weights change when a fragment is synced
    assert lighthouses() == []


@pytest.mark.extended
@pytest.mark.multiprocess
def test_h1_reaches_synchronous_training_and_h4_a_lower_loss_per_byte(tmp_path):
    runs = {}
    for name, args in {"sync": ["--system", "reference", "--batch-size", "4", "--micro-batch-size", "4"],
                       "h1": ["--system", "diloco", "--dp", "2", "--batch-size", "2", "--micro-batch-size", "2",
                              "--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0", "--verify"],
                       "h4": ["--system", "diloco", "--dp", "2", "--batch-size", "2", "--micro-batch-size", "2",
                              "--inner-steps", "4"]}.items():
        out = tmp_path / f"{name}.jsonl"
        proc = run_cli(*args, *TEXT, "--eval-every", "2", "--out", str(out))
        if name == "h1":
            assert_verified(proc)  # against the reference's math, on text, its evals too
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = record(out)["evals"]
    assert [e["step"] for e in runs["h1"]] == [0, 2, 4, 6, 8]
    assert abs(runs["h1"][-1]["loss"] - runs["sync"][-1]["loss"]) <= 0.05
    h4, h1 = runs["h4"][-1], runs["h1"]
    spent = sum(h4["bytes_sent"])
    assert 0 < spent < sum(h1[-1]["bytes_sent"]) / 3  # 2 outer steps against 8
    same_bytes = [e for e in h1 if sum(e["bytes_sent"]) <= 1.2 * spent][-1]  # H = 1 having sent what H = 4 did
    assert same_bytes["step"] >= 2 and h4["loss"] < same_bytes["loss"]
    start = runs["h4"][0]["loss"]
    assert (start - h4["loss"]) / spent > (start - h1[-1]["loss"]) / sum(h1[-1]["bytes_sent"])
    assert lighthouses() == []

"""ours' data parallelism at D = 3 through the run command (3 gloo ranks, one stage each): every dp
mode's point-to-point sync (ranges of unequal length when a bucket does not divide by 3; the
all-reduce as reduce-scatter + all-gather, which D = 2 does not use) stays exact (--verify) under NCCL's
rules; a lossy wire (plain gloo) is judged with its own tolerance."""
from __future__ import annotations

import json

import pytest

from tests.conftest import NCCL_RULES, TINY, assert_verified, run_cli


@pytest.mark.multiprocess
# all-reduce: its P-2 D-2 case (test_ours_runs)
@pytest.mark.extended
@pytest.mark.parametrize("mode", ["central_ps", "sharded_ps"])
def test_p1_d3_verified(tmp_path, mode):
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "ours", *TINY, *NCCL_RULES, "--pp", "1", "--dp", "3", "--dp-mode", mode,
                   "--n-slices", "2", "--batch-size", "1", "--micro-batch-size", "1", "--steps", "2", "--warmup", "1",
                   "--verify", "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["layout"]["dp"] == 3 and rec["dp_sync_time"] > 0


@pytest.mark.extended
@pytest.mark.multiprocess
def test_lossy_wire_verified_with_its_tolerance_and_labelled(tmp_path):
    """--wire-dtype bf16 (opt-in, lossy): the record and label say so, and --verify judges it with the
    lossy wire's stated tolerance (not fp32's 1e-5, which it cannot meet)."""
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "ours", *TINY, "--pp", "2", "--dp", "2", "--dp-mode", "sharded_ps", "--n-slices", "2",
                   "--wire-dtype", "bf16", "--batch-size", "2", "--micro-batch-size", "1", "--steps", "2",
                   "--warmup", "1", "--verify", "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["options"]["wire_dtype"] == "bf16" and rec["label"] == "ours sharded_ps bf16 wire"
    assert rec["verify"]["tolerance"].startswith("fp32 + bf16 wire") and rec["verify"]["max_abs_grad_diff"] > 1e-5

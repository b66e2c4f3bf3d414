"""ours' data parallelism at D = 3 through the run command (3 gloo ranks, one stage each): every dp
mode's point-to-point sync (ranges of unequal length when a bucket does not divide by 3; the
all-reduce as reduce-scatter + all-gather, which D = 2 does not use) stays exact (--verify)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, assert_verified, run_cli


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["allreduce", "central_ps", "sharded_ps"])
def test_p1_d3_verified(tmp_path, mode):
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "ours", *TINY, "--pp", "1", "--dp", "3", "--dp-mode", mode, "--n-slices", "2",
                   "--batch-size", "1", "--micro-batch-size", "1", "--steps", "2", "--warmup", "1", "--verify",
                   "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["layout"]["dp"] == 3 and rec["dp_sync_time"] > 0

"""ours' data parallelism over a slow network (d10-1g: 10 ms one-way, 1 Gbit/s, each rank on a virtual
host): every dp mode stays exact (--verify PASS against the single-process reference)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, assert_verified, run_cli
from tests.network.conftest import needs_root


@pytest.mark.multiprocess
@pytest.mark.network
@needs_root
# sharded_ps, whose messages are the most (every rank a server of its share); all-reduce and central_ps
# on plain gloo: tests/ours/test_ours_runs.py, tests/ours/test_dp_runs.py (for time)
@pytest.mark.parametrize("mode", ["sharded_ps"])
def test_p2_d2_verified_under_d10_1g(tmp_path, mode):
    out = tmp_path / "runs.jsonl"
    proc = run_cli("--system", "ours", *TINY, "--pp", "2", "--dp", "2", "--dp-mode", mode, "--n-slices", "2",
                   "--batch-size", "2", "--micro-batch-size", "1", "--steps", "2", "--warmup", "0",
                   "--network", "d10-1g", "--verify", "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["network"] == "d10-1g" and rec["dp_sync_time"] > 0

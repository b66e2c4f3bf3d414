"""fairscale Pipe + FullyShardedDataParallel, through the real run command on gloo ranks."""
from __future__ import annotations

import pytest

from contract.records import read_records
from tests.conftest import NCCL_RULES, TINY, assert_verified, run_cli

pytestmark = pytest.mark.multiprocess


def test_fairscale_fsdp_dp2_pipe2_matches_reference(out_file):
    # 2 processes (FSDP over dp=2), each a fairscale Pipe of 2 partitions with 2 micro-batches
    proc = run_cli("--system", "fairscale_fsdp", *TINY, *NCCL_RULES, "--dp", "2", "--pp", "2", "--batch-size", "4",
                   "--micro-batch-size", "2", "--steps", "3", "--warmup", "0", "--eval-every", "3", "--verify",
                   "--out", str(out_file))
    assert_verified(proc)  # with the held-out losses of the gathered weights
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok" and [e["step"] for e in rec["evals"]] == [0, 3]
    assert rec["layout"]["dp"] == 2 and rec["layout"]["pp"] == 2
    assert len(rec["step_times"]) == 3 and len(rec["losses"]) == 3

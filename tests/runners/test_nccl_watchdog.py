"""A hung NCCL run ends by NCCL's watchdog before the launcher's timeout, and its record names the
operation that never completed (on a GPU nothing else can say which message never came)."""
from __future__ import annotations

from runners.launcher import collect
from contract.groups import op_timeout

WATCHDOG = ("[rank1]:[E1126 11:52:10.1 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 3 Rank 1] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV, NumelIn=512, NumelOut=512, "
            "Timeout(ms)=120000) ran for 120004 milliseconds before timing out.")


def test_nccl_waits_less_than_the_run_gloo_as_long():
    assert op_timeout("nccl", 600) == 480 and op_timeout("nccl", 20) == 30
    assert op_timeout("gloo", 600) == 600 and op_timeout("gloo", 20) == 60


def test_the_watchdog_names_the_operation(tmp_path):
    tail = f"{WATCHDOG}\n" \
           "[W] torch.distributed.elastic.multiprocessing.api: Sending process 12 closing signal SIGTERM\n" \
           "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 0)\n  exitcode  : -6 (pid: 12)\n"
    result = collect(tmp_path, [1], timed_out=False, timeout=150, log_tail=tail)
    assert result.status == "error"
    assert "OpType=RECV" in result.error and "NCCL's watchdog" in result.error, result.error
    plain = collect(tmp_path, [1], timed_out=False, timeout=150, log_tail="Traceback\nValueError: x\n")
    assert "watchdog" not in plain.error

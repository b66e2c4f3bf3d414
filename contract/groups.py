"""How long one collective or point-to-point operation may wait, for every process group of a run.

torch gives a group made by ``dist.new_group`` its backend's default timeout (NCCL: 10 minutes), not
the one the world's group was made with: a system's own groups (ours' links, its TP and DP groups,
the evaluation's) take ``Context.op_timeout`` explicitly, so that a hang on any of them ends the same
way (``op_timeout``).
"""
from __future__ import annotations


def op_timeout(backend: str, run_timeout: float) -> float:
    """Seconds one collective or point-to-point operation may wait. gloo: the run's whole timeout (a
    hang there ends as the launcher's ``timeout``, naming each rank's pending operations under
    ``--p2p-semantics nccl``). NCCL: 0.8 of it, so that its watchdog ends a hung run first and names
    the operation it waited on (``WorkNCCL(SeqNum=.., OpType=..)``, in the record's error) instead of
    a bare timeout: on a GPU nothing else can say which message never came."""
    return max(60.0, run_timeout) if backend != "nccl" else max(30.0, 0.8 * run_timeout)

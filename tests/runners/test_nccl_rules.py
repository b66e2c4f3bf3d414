"""--p2p-semantics nccl (``runners.nccl_rules``): gloo under NCCL's point-to-point rules. Proof that
the check can fail: a cross-posted receive pair and a message that does not fit its receive pass on
plain gloo; under the rules the pair hangs, ending as timeout with every rank's pending operations
named, and the message fails the run naming both operations. (The multi-rank --verify tests of
every system run under the rules: ``NCCL_RULES`` in tests/conftest.py.)"""
from __future__ import annotations

import json
import time

import pytest

from contract import ConfigError, RunConfig
from contract.records import read_records
from contract.spec import check_common
from runners import devices
from runners.devices import Gpus
from runners.nccl_rules import pending_summary
from runners.request import Placement, judge, parse_request, resolve_devices
from tests.conftest import NCCL_RULES, run_cli
from workload.configs import get_model_config

PROBE = {"PIPEBENCH_SYSTEMS": "tests.runners.p2p_probe_system"}
ARGS = ["--system", "p2p_probe", "--model", "tiny", "--batch-size", "1", "--micro-batch-size", "1", "--steps", "1",
        "--warmup", "0"]


@pytest.mark.waiting
@pytest.mark.multiprocess
def test_a_cross_posted_pair_passes_on_gloo_and_hangs_under_nccl_rules_naming_the_pending_operations(tmp_path):
    out = tmp_path / "runs.jsonl"
    gloo = run_cli(*ARGS, "--probe-pattern", "both", "--out", str(out), env=PROBE)  # the mismatch too
    assert gloo.returncode == 0, gloo.stderr[-3000:]
    nccl = run_cli(*ARGS, *NCCL_RULES, "--probe-pattern", "cross", "--timeout", "15", "--out", str(out), env=PROBE)
    assert nccl.returncode == 1
    ok, hung = read_records(out)
    assert ok["status"] == "ok" and "p2p_semantics" not in ok["key"]
    assert hung["status"] == "timeout" and hung["config"]["p2p_semantics"] == "nccl", hung["error"]
    assert '"p2p_semantics": "nccl"' in hung["key"]
    pending = hung["error"].partition("pending operations: ")[2]
    ranks = dict(clause.partition(": ")[::2] for clause in pending.split(" | "))
    for me, peer in (("rank 0", 1), ("rank 1", 0)):  # each rank waits in its receive, its send queued behind it
        assert (f"irecv #0 from rank {peer} (float32[4], group 0 of ranks [0, 1], pair with rank {peer}, at "
                f"tests/runners/p2p_probe_system.py:") in ranks[me], hung["error"]
        assert f"1 more queued behind it, among them isend #0 to rank {peer}" in ranks[me], hung["error"]


@pytest.mark.multiprocess
def test_a_message_that_does_not_fit_its_receive_fails_under_nccl_rules_naming_both(tmp_path):
    out = tmp_path / "runs.jsonl"  # (it passes on plain gloo, reshaped in silence: the test above)
    nccl = run_cli(*ARGS, *NCCL_RULES, "--probe-pattern", "mismatch", "--timeout", "60", "--out", str(out), env=PROBE)
    assert nccl.returncode == 1
    (rec,) = read_records(out)
    assert rec["status"] == "error", rec["error"]
    assert rec["error"].startswith("rank 1: ") and "rank 1's irecv #0 from rank 0 (float32[3x2]" in rec["error"]
    assert "was matched with rank 0's isend #0 to rank 1 (float32[2x3]" in rec["error"]
    assert "the shape differs" in rec["error"]


def test_the_pending_operations_of_each_rank_are_summed_up_per_stream(tmp_path):
    now = time.time()
    op = lambda text, kind, stream, ago: {"op": text, "kind": kind, "stream": stream, "running": False,  # noqa: E731
                                          "posted": now - ago, "error": None}
    dumps = {0: [op("irecv #3 from rank 1 (a)", "irecv", "s1", 20), op("irecv #4 from rank 1 (b)", "irecv", "s1", 19),
                 op("isend #0 to rank 1 (c)", "isend", "s1", 19), op("isend #7 to rank 2 (d)", "isend", "s2", 5)],
             1: []}
    for rank, ops in dumps.items():
        (tmp_path / f"pending-rank{rank}.json").write_text(json.dumps({"rank": rank, "time": now, "ops": ops}))
    assert pending_summary(tmp_path) == (
        "rank 0: irecv #3 from rank 1 (a) waiting for its peer's message for 20 s, 2 more queued behind it, "
        "among them isend #0 to rank 1 (c); isend #7 to rank 2 (d) waiting for its peer's receive for 5 s"
        " | rank 1: nothing pending")
    assert pending_summary(tmp_path / "missing") == ""


def test_p2p_semantics_is_judged_and_part_of_the_identity_only_when_not_gloo():
    cfg = RunConfig(system="ours", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    assert "p2p_semantics" not in cfg.identity()  # the records written before the field keep their keys
    assert cfg.replace(p2p_semantics="nccl").identity()["p2p_semantics"] == "nccl"
    with pytest.raises(ConfigError, match="unknown --p2p-semantics 'mpi'; choose from gloo, nccl"):
        check_common(cfg.replace(p2p_semantics="mpi"))


def test_p2p_semantics_nccl_is_refused_where_it_would_do_nothing(monkeypatch):
    """A one-process run sends no message; ranks on CUDA run NCCL itself (the flag's stated rule)."""
    ours = ["--system", "ours", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1", *NCCL_RULES]
    with pytest.raises(ConfigError, match="ours runs one process here, which sends no message"):
        judge(*parse_request(ours))
    judge(*parse_request([*ours, "--pp", "2"]))
    with pytest.raises(ConfigError, match="ranks on CUDA run NCCL itself"):
        judge(*parse_request([*ours, "--pp", "2", "--device", "cuda"]))
    monkeypatch.setattr(devices, "local_gpus", lambda: Gpus(("NVIDIA L4",) * 2, ((8, 9),) * 2, ("sm_89",),
                                                            "2.13.0+cu126", ("0", "1")))
    cfg, spec = parse_request([*ours, "--pp", "2"])
    with pytest.raises(ConfigError, match="ranks on CUDA run NCCL itself"):
        resolve_devices(cfg, spec, Placement())
    assert resolve_devices(cfg.replace(device="cpu"), spec, Placement()).hardware == "cpu"

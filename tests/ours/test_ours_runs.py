"""ours through the real run command (torchrun, gloo ranks): --verify against the single-process
reference (per-step losses and the last step's gradients within 1e-5 after 3 optimizer steps),
over pipeline depths, tensor parallelism, data-parallel modes and slicings, under NCCL's rules (--p2p-semantics nccl)
but for the all-reduce on plain gloo; bad requests; the Chrome trace."""
from __future__ import annotations

import json

import pytest
import torch

from baselines.reference.train import train as reference_train
from contract.rank import Context
from runners.request import parse_request
from runners.run import reference_config
from tests.conftest import NCCL_RULES, TINY, assert_verified, run_cli

COMMON = ["--system", "ours", *TINY, "--batch-size", "4", "--micro-batch-size", "2", "--steps", "3", "--warmup", "0"]


@pytest.mark.multiprocess
def test_p2_equal_slices_verified_and_traced(tmp_path):
    trace = tmp_path / "trace.json"
    proc = run_cli(*COMMON, *NCCL_RULES, "--pp", "2", "--n-slices", "4", "--verify", "--trace", str(trace),
                   "--out", str(tmp_path / "runs.jsonl"))
    assert_verified(proc)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    for rank in (0, 1):
        kinds = {e["tid"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "send", "recv"} <= kinds, kinds
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # 3 steps x 2 batch slices x 4 token slices
    assert sum(1 for e in spans if e["pid"] == 0 and e["tid"] == "forward") == 3 * 2 * 4
    # the default 1f1b order: the last stage runs batch slice 0's backward before batch slice 1's forward
    last = [e["name"] for e in sorted(spans, key=lambda e: e["ts"])
            if e["pid"] == 1 and e["tid"] in ("forward", "backward")]
    assert last[:16] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.3", "B0.2", "B0.1", "B0.0",
                         "F1.0", "F1.1", "F1.2", "F1.3", "B1.3", "B1.2", "B1.1", "B1.0"]
    rec = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert rec["status"] == "ok"


@pytest.mark.extended
@pytest.mark.multiprocess
def test_p2_gpipe_order_verified(tmp_path):
    """--schedule gpipe: every forward, then every backward (the order before 1f1b became the default)."""
    out = tmp_path / "runs.jsonl"
    proc = run_cli(*COMMON, *NCCL_RULES, "--pp", "2", "--n-slices", "2", "--schedule", "gpipe", "--verify",
                   "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["options"]["schedule"] == "gpipe" and rec["label"] == "ours gpipe"


def reference_evals(args: list[str]) -> list[float]:
    """The held-out losses of the run's single-process reference, trained in this process."""
    cfg = reference_config(parse_request(args)[0])
    ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo", config=cfg)
    return [e["loss"] for e in reference_train(cfg, ctx).evals]


@pytest.mark.parametrize("layout,first_stages", [
    # two replicas' first stages (rank = dp_rank * pp + stage), each after its parameter server's update;
    # a later stage never prefetches (stages 1 and 3 here)
    (["--pp", "2", "--dp", "2", "--dp-mode", "sharded_ps"], {0, 2}),
])
@pytest.mark.multiprocess
def test_prefetch_runs_the_next_steps_first_forwards_ahead_and_verifies(tmp_path, layout, first_stages):
    """--prefetch 2: the first stage runs the next step's first two forwards once its optimizer (and,
    with DP, the parameter server's update) has stepped; losses and gradients stay the reference's. The
    same launch is P-2 D-2's sharded parameter server verified under NCCL's rules, with its DP sync time.
    Planned for 4 steps, the run ends after 3: the eval after 2 reaches --target-loss, and the step
    ours has prepared ahead (its receives posted) runs without a prefetch of its own."""
    args = [*COMMON, *layout, "--steps", "4", "--eval-every", "1"]
    evals = reference_evals(args)
    target = (evals[1] + evals[2]) / 2
    trace = tmp_path / "trace.json"
    proc = run_cli(*args, *NCCL_RULES, "--target-loss", f"{target!r}", "--n-slices", "4", "--prefetch", "2", "--verify",
                   "--trace",
                   str(trace), "--out", str(tmp_path / "runs.jsonl"))
    assert_verified(proc)
    rec = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert [e["step"] for e in rec["evals"]] == [0, 1, 2] and len(rec["losses"]) == 3
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in spans if e["tid"] == "prefetch"} == first_stages
    for rank in first_stages:
        ahead = [e for e in spans if e["pid"] == rank and e["tid"] == "prefetch"]
        assert len(ahead) == 2  # after steps 1 and 2 of 3
        for p in ahead:
            inside = [e["name"] for e in spans if e["pid"] == rank and e["tid"] == "forward"
                      and p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"]]
            assert inside == ["F0.0", "F0.1"]
    assert sum(1 for e in spans if e["pid"] == 0 and e["tid"] == "forward") == 3 * 2 * 4
    rec = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert rec["options"]["prefetch"] == 2 and rec["dp_sync_time"] is not None and rec["dp_sync_time"] > 0


@pytest.mark.multiprocess
def test_p3_unequal_slices_with_recompute_verified(tmp_path):
    proc = run_cli(*COMMON, *NCCL_RULES, "--num-layers", "6", "--seq-length", "96", "--pp", "3", "--slices", "40,32,24",
                   "--recompute", "--verify", "--out", str(tmp_path / "runs.jsonl"))
    assert_verified(proc)


@pytest.mark.parametrize("mode,slicing,rules", [
    pytest.param("allreduce", ["--n-slices", "1"], [], marks=pytest.mark.extended),
    ("central_ps", ["--slices", "12,12,8"], NCCL_RULES),
])  # sharded_ps: the prefetch test's launch (P-2 D-2, K=4, NCCL's rules)
@pytest.mark.multiprocess
def test_p2_d2_data_parallel_modes_verified(tmp_path, mode, slicing, rules):
    proc = run_cli(*COMMON, *rules, "--pp", "2", "--dp", "2", "--dp-mode", mode, *slicing, "--verify",
                   "--out", str(tmp_path / "runs.jsonl"))
    assert_verified(proc)
    rec = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert rec["dp_sync_time"] is not None and rec["dp_sync_time"] > 0


@pytest.mark.parametrize("layout", [
    pytest.param(["--pp", "2", "--n-slices", "4"], id="t2-p2"),
    pytest.param(["--dp", "2", "--dp-mode", "sharded_ps", "--n-slices", "2"], id="t2-d2", marks=pytest.mark.extended),
])
@pytest.mark.multiprocess
def test_t2_tensor_parallel_verified(tmp_path, layout):
    """--tp 2 (ours.tp): each stage's block linears split over 2 ranks; losses and the gathered full
    gradients are the reference's, with pipeline links between the same tp_rank of adjacent stages
    (T-2 P-2) and a parameter server per (stage, tp_rank) (T-2 D-2), under NCCL's rules."""
    out = tmp_path / "runs.jsonl"
    proc = run_cli(*COMMON, *NCCL_RULES, "--tp", "2", *layout, "--verify", "--out", str(out))
    assert_verified(proc)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["status"] == "ok" and rec["layout"]["tp"] == 2 and len(rec["losses"]) == 3


@pytest.mark.parametrize("extra,needle", [
    (["--pp", "2", "--slices", "10,10"], "sum to 20, not the sequence length 32"),
    (["--pp", "3"], "do not divide into 3 pipeline stages"),
    (["--pp", "2", "--prefetch", "-1"], "--prefetch must be >= 0"),
    (["--tp", "3"], "--tp 3 must divide the heads (4)"),
])
def test_bad_requests_exit_2_with_one_line(tmp_path, extra, needle):
    out = tmp_path / "runs.jsonl"
    proc = run_cli(*COMMON, *extra, "--out", str(out))
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not out.exists()

"""megatron-core tensor, pipeline and data parallelism, through the real run command on gloo ranks, under
NCCL's rules (--p2p-semantics nccl)."""
from __future__ import annotations

import pytest

from contract.records import read_records
from tests.conftest import NCCL_RULES, TINY, assert_verified, run_cli

pytestmark = pytest.mark.multiprocess

# T-2 alone: inside T-2 x P-2 below, and with sequence parallelism; D-2: with the distributed optimizer
# (T-2 D-2, both in one launch, below)
LAYOUTS = {
    "pp2": ["--pp", "2", "--layers-per-stage", "3,1", *NCCL_RULES],  # megatron-core's layout: 3 layers, then 1
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_megatron_matches_reference(layout, out_file):
    proc = run_cli("--system", "megatron", *TINY, *LAYOUTS[layout], "--batch-size", "4", "--micro-batch-size", "2",
                   "--steps", "3", "--warmup", "0", "--verify", "--out", str(out_file))
    assert_verified(proc)
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok" and len(rec["losses"]) == 3
    assert rec["options"]["layers_per_stage"] == rec["options"]["megatron_stage_layers"] == [3, 1]


def test_megatron_tp2_x_pp2_interleaved_matches_reference(out_file):
    # 4 ranks: TP 2 x PP 2, with the interleaved schedule (2 model chunks per rank, 4 micro-batches).
    # With pp=2 this is the case where in-order p2p matching (NCCL's, and gloo's with one tag) swaps activations and
    # gradients if megatron's batched p2p ops are used (see baselines/megatron/train.py); 1F1B is covered by pp2.
    proc = run_cli("--system", "megatron", *TINY, *NCCL_RULES, "--tp", "2", "--pp", "2", "--schedule", "interleaved",
                   "--batch-size", "4", "--micro-batch-size", "1", "--steps", "3", "--warmup", "0", "--eval-every", "3",
                   "--verify", "--out", str(out_file))
    assert_verified(proc)  # with the held-out losses of the weights gathered over TP and converted
    (rec,) = read_records(out_file)
    assert [e["step"] for e in rec["evals"]] == [0, 3]
    assert rec["layout"]["tp"] == 2 and rec["layout"]["pp"] == 2
    assert rec["options"]["schedule"] == "interleaved" and rec["label"] == "megatron interleaved"


@pytest.mark.extended
def test_megatron_distributed_optimizer_and_sequence_parallel_match_reference(out_file):
    """T-2 D-2 in one launch: the distributed optimizer shards its state over the two replicas, its
    gradient reduce-scatter overlapping the backward and its parameter all-gather the next forward,
    sequence parallelism splits each tensor-parallel pair's activations along the sequence, selective
    recompute runs each attention core again in the backward."""
    proc = run_cli("--system", "megatron", *TINY, *NCCL_RULES, "--tp", "2", "--dp", "2", "--distributed-optimizer",
                   "--sequence-parallel", "--overlap-grad-reduce", "--overlap-param-gather", "--recompute",
                   "--recompute-granularity", "selective", "--batch-size", "4", "--micro-batch-size", "2",
                   "--steps", "3", "--warmup", "0", "--eval-every", "3", "--verify", "--out", str(out_file))
    assert_verified(proc)  # the held-out loss at step 3 too: the overlapped all-gather finished before it
    (rec,) = read_records(out_file)
    assert rec["options"]["distributed_optimizer"] and rec["options"]["sequence_parallel"]
    assert rec["options"]["overlap_grad_reduce"] and rec["options"]["overlap_param_gather"]
    assert rec["label"] == "megatron +distopt +sp +overlap-grad +overlap-param +selective"
    assert rec["layout"]["tp"] == 2 and rec["layout"]["dp"] == 2
    assert rec["options"]["megatron_optimizer"] == "DistributedOptimizer"
    assert rec["options"]["megatron_modules"]["recomputed_core"]

"""Torch Pipe's schedules: the stage placement each needs, the micro-batch counts each can run, and
the zero-bubble and DualPipeV schedules through the real run command on gloo ranks."""
from __future__ import annotations

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from baselines.torch_pipe import SCHEDULES, V_SHAPED, TorchPipeOptions, micro_batch_rule, stage_indices
from contract import ConfigError, RunConfig
from contract.records import read_records
from tests.conftest import NCCL_RULES, TINY, assert_verified, run_cli
from workload.configs import get_model_config


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_placement_is_the_one_the_schedule_expects(schedule, pp):
    options = TorchPipeOptions(schedule=schedule)
    V = options.virtual_pp
    held = {rank: stage_indices(schedule, pp, rank, V) for rank in range(pp)}
    # torch's own stage -> rank mapping, which the V schedules use to address their messages
    expected = generate_stage_to_rank_mapping(pp, pp * V, style="v" if schedule in V_SHAPED else "loop")
    assert {stage: rank for rank, stages in held.items() for stage in stages} == expected
    for stages in held.values():
        assert list(stages) == sorted(stages)  # the schedules take a rank's stages by increasing depth


def _cfg(schedule: str, batch: int, pp: int = 2, **options) -> RunConfig:
    return RunConfig(system="torch_pipe", model=get_model_config("tiny"), batch_size=batch, micro_batch_size=1, pp=pp,
                     options=TorchPipeOptions(schedule=schedule, **options))


@pytest.mark.parametrize("schedule, runnable", [
    # the minimum micro-batch counts measured with 2 ranks (shared/notes/strongest-baselines-on-cpu.md)
    ("gpipe", [1, 2, 3, 4, 5, 6]),
    ("1f1b", [2, 3, 4, 5, 6]),
    ("interleaved", [1, 2, 3, 4, 6]),  # 5 micro-batches: 2 rounds of 2 leave one over
    ("zb", [1, 2, 3, 4, 6]),
    ("zbv", [1, 2, 3, 4, 5, 6]),
    ("dualpipev", [4, 5, 6]),  # at least as many micro-batches as stages (2 per rank)
])
def test_micro_batch_counts_a_schedule_can_run(schedule, runnable):
    assert [m for m in range(1, 7) if micro_batch_rule(schedule, 2, m) is None] == runnable
    for m in range(1, 7):
        if m in runnable:
            _cfg(schedule, m).options.check(_cfg(schedule, m))
        else:
            with pytest.raises(ConfigError, match=f"{schedule} schedule .*--batch-size {m} / --micro-batch-size 1"):
                _cfg(schedule, m).options.check(_cfg(schedule, m))


@pytest.mark.parametrize("schedule", sorted(V_SHAPED))
def test_v_shaped_schedules_take_exactly_two_chunks_per_rank(schedule):
    cfg = _cfg(schedule, 8, virtual_pp=4)
    with pytest.raises(ConfigError, match="exactly 2 model chunks per rank"):
        cfg.options.check(cfg)
    assert TorchPipeOptions(schedule=schedule).virtual_pp == 2


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["zb", "dualpipev"])  # zbv: with FSDP2 below (the same stages, two pipelines)
def test_zero_bubble_and_dualpipev_match_reference(schedule, out_file):
    # P = 2, 4 micro-batches (DualPipeV's minimum), two stages per rank
    proc = run_cli("--system", "torch_pipe", *TINY, *NCCL_RULES, "--pp", "2", "--schedule", schedule,
                   "--batch-size", "4", "--micro-batch-size", "1", "--steps", "2", "--warmup", "0", "--verify",
                   "--out", str(out_file))
    assert_verified(proc)
    (rec,) = read_records(out_file)
    assert rec["label"] == f"torch_pipe {schedule}" and rec["options"]["virtual_pp"] == 2
    placement = [[0, 2], [1, 3]] if schedule == "zb" else [[0, 3], [1, 2]]  # looped, or the V
    assert rec["options"]["stage_placement"] == placement


@pytest.mark.multiprocess
def test_zbv_with_fsdp2_data_parallelism_matches_reference(out_file):
    # 4 ranks: 2 pipelines of 2 stages; under zbv the last stage's block gradients were lost when each
    # block was an FSDP unit of its own (see baselines/torch_pipe/train.py)
    # --eval-every: the held-out losses from FSDP2's gathered weights are the reference's (--verify)
    proc = run_cli("--system", "torch_pipe", *TINY, *NCCL_RULES, "--pp", "2", "--dp", "2", "--schedule", "zbv",
                   "--batch-size", "2",
                   "--micro-batch-size", "1", "--steps", "2", "--warmup", "0", "--eval-every", "1", "--verify",
                   "--out", str(out_file))
    assert_verified(proc)
    rec = read_records(out_file)[-1]
    assert [e["step"] for e in rec["evals"]] == [0, 1, 2]
    assert rec["label"] == "torch_pipe zbv" and rec["options"]["virtual_pp"] == 2
    assert rec["options"]["stage_placement"] == [[0, 3], [1, 2]]  # the V, in each pipeline

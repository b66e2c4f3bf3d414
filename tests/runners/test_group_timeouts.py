"""Every process group a run makes waits as long as the world's (``contract.groups``): torch gives a
group from ``dist.new_group`` its backend's default (NCCL: 10 minutes), so a hang on a system's own
group would outlive the watchdog the run set (seen on the H100: ours' links waited 600 s)."""
from __future__ import annotations

import ast
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from contract.groups import op_timeout
from runners.hang_stacks import STACKS_AT

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("contract", "ours", "baselines", "workload")


def _calls(name: str):
    for d in SOURCES:
        for path in sorted((REPO / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                    if called == name:
                        yield path.relative_to(REPO), node


def test_every_new_group_is_given_the_runs_timeout():
    calls = list(_calls("new_group"))
    assert len(calls) >= 5  # links, evaluation, ours' TP and DP groups, DiLoCo's
    missing = [f"{p}:{n.lineno}" for p, n in calls if not any(k.arg == "timeout" for k in n.keywords)]
    assert not missing, f"dist.new_group without timeout= (it would wait NCCL's 10 minutes): {missing}"
    megatron = list(_calls("initialize_model_parallel"))
    assert megatron and all(any(k.arg == "distributed_timeout_minutes" for k in n.keywords) for _, n in megatron)


def test_a_group_made_with_it_waits_that_long(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wait = datetime.timedelta(seconds=op_timeout("gloo", 90))
        group = dist.new_group([0], timeout=wait)
        assert group._get_backend(torch.device("cpu")).options._timeout == wait
    finally:
        dist.destroy_process_group()


def test_stacks_come_before_the_watchdog():
    run = 100.0
    assert STACKS_AT * run < op_timeout("nccl", run) < run

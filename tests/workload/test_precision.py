"""The precision policy (--precision fp32 | bf16 | fp16): the request, old records, and fp16's loss
scaling across pipeline stages (an overflow on one stage skips the step on every stage, forced on
real gloo ranks through torch_pipe's and ours' own training code: tests/workload/_forced_overflow.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract import ConfigError, RunConfig
from runners.request import build_parser, config_from_args, judge
from tests.conftest import REPO, TINY
from workload.configs import get_model_config
from workload.training import LOSS_SCALING, autocast, grad_scaler


def _config(*flags: str) -> RunConfig:
    args = build_parser().parse_args(["--system", "torch_pipe", *TINY, "--batch-size", "2", "--micro-batch-size", "1",
                                      *flags])
    cfg = config_from_args(args)
    judge(cfg)
    return cfg


def test_precision_flag_and_the_mixed_precision_alias():
    assert _config().precision == "fp32"
    assert _config("--precision", "fp16").precision == "fp16"
    assert _config("--mixed-precision", "--device", "cpu").precision == "bf16"
    assert _config("--mixed-precision", "--device", "cuda").precision == "fp16"  # as --mixed-precision always meant
    with pytest.raises(ConfigError, match="give only --precision fp16"):
        _config("--mixed-precision", "--precision", "fp16")
    with pytest.raises(ConfigError, match="unknown --precision 'fp8'"):
        judge(_config().replace(precision="fp8"))


def test_a_record_written_before_precision_loads_as_its_policy():
    cfg = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    old = {k: v for k, v in cfg.to_dict().items() if k != "precision"}
    assert RunConfig.from_dict({**old, "mixed_precision": False}).precision == "fp32"
    assert RunConfig.from_dict({**old, "mixed_precision": True}).precision == "bf16"  # CPU: bf16 autocast
    assert RunConfig.from_dict({**old, "mixed_precision": True, "device": "cuda"}).precision == "fp16"
    assert RunConfig.from_dict({**old, "mixed_precision": True}).key() == cfg.replace(precision="bf16").key()


def test_each_policy_autocasts_to_its_dtype_and_only_fp16_scales():
    cpu = torch.device("cpu")
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(cpu, precision):
            assert torch.nn.functional.linear(x, w).dtype == dtype
        scaler = grad_scaler(cpu, precision)
        assert scaler.is_enabled() == (precision == "fp16")
    assert grad_scaler(cpu, "fp16").get_scale() == LOSS_SCALING["init_scale"]


@pytest.mark.multiprocess
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    out = tmp_path / "overflow.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(Path(__file__).with_name("_forced_overflow.py")), str(out), "torch_pipe", "ours"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    init = LOSS_SCALING["init_scale"]
    for system, ranks in result.items():
        for rank, log in enumerate(ranks):
            *steps, end = log
            assert [s["stepped"] for s in steps] == [True, False, True], (system, rank, steps)
            assert [s["scale"] for s in steps] == [init, init, init / 2], (system, rank, steps)
            assert [s["scale_after"] for s in steps] == [init, init / 2, init / 2], (system, rank, steps)
        losses = ranks[1][-1]["losses"]  # the last stage's: finite, every step (the skipped one too)
        assert len(losses) == 3 and all(abs(l) < 10 for l in losses), (system, losses)

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
from contract.records import parse_records
from runners.request import judge, parse_request
from tests.conftest import REPO, TINY
from workload.configs import get_model_config
from workload.training import LOSS_SCALING, autocast, grad_scaler

SHAPE = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 128}  # a record's


def _config(*flags: str) -> RunConfig:
    cfg, spec = parse_request(["--system", "torch_pipe", *TINY, "--batch-size", "2", "--micro-batch-size", "1", *flags])
    judge(cfg, spec)
    return cfg


def test_precision_flag():
    assert _config().precision == "fp32"
    assert _config("--precision", "fp16").precision == "fp16"
    assert _config("--precision", "bf16").precision == "bf16"
    with pytest.raises(SystemExit):  # argparse refuses it: one line, exit 2
        _config("--precision", "fp8")
    cfg, spec = parse_request(["--system", "torch_pipe", *TINY, "--batch-size", "2", "--micro-batch-size", "1"])
    with pytest.raises(ConfigError, match="unknown --precision 'fp8'"):  # a sweep's config: judged alike
        judge(cfg.replace(precision="fp8"), spec)


def test_a_record_written_before_precision_loads_as_its_policy():
    """--mixed-precision was bf16 on CPU and fp16 on CUDA: an old config and an old record (its config,
    key and precision) read as the policy it ran, the key the same as a new run's of that policy."""
    cfg = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)
    old = {k: v for k, v in cfg.to_dict().items() if k != "precision"}
    assert RunConfig.from_dict({**old, "mixed_precision": False}).precision == "fp32"
    assert RunConfig.from_dict({**old, "mixed_precision": True}).precision == "bf16"  # CPU: bf16 autocast
    assert RunConfig.from_dict({**old, "mixed_precision": True, "device": "cuda"}).precision == "fp16"
    assert RunConfig.from_dict({**old, "mixed_precision": True}).key() == cfg.replace(precision="bf16").key()

    def record(kind: str) -> dict:
        key = {k: v for k, v in json.loads(cfg.key()).items() if k != "precision"}
        return {"system": "reference", "status": "ok", "model": "tiny", "model_shape": SHAPE, "layout": {},
                "batch_size": 2, "micro_batch_size": 1, "network": "none", "precision": "mixed",
                "config": {**old, "mixed_precision": True}, "key": json.dumps({**key, "mixed_precision": True}),
                "environment": {"device_kind": kind}}

    cpu, cuda = parse_records("\n".join(json.dumps(record(kind)) for kind in ("cpu", "cuda")))
    assert (cpu["precision"], cuda["precision"]) == ("bf16", "fp16")
    assert cpu["config"]["precision"] == "bf16" and "mixed_precision" not in cpu["config"]
    assert cpu["key"] == cfg.replace(precision="bf16").key() and cuda["key"] == cfg.replace(precision="fp16").key()


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

"""The reference's modes in this process (one rank, no process group): plain, --half-weights (megatron's
policy: the model in the half type, fp32 main parameters and gradients) and --diloco (its math is
tested with diloco's options in tests/ours/test_diloco_unit.py)."""
from __future__ import annotations

import pytest
import torch

from baselines.reference import ReferenceOptions
from baselines.reference.train import train
from contract import ConfigError, RunConfig
from contract.rank import Context
from contract.registry import get_system
from workload.configs import get_model_config

MODEL = get_model_config("tiny").with_overrides(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=128)


def run(precision: str, half: bool, mb: int = 1, steps: int = 3):
    cfg = RunConfig(system="reference", model=MODEL, batch_size=4, micro_batch_size=mb, steps=steps, warmup=0,
                    precision=precision, verify=True, options=ReferenceOptions(half_weights=half))
    get_system("reference").validate(cfg)
    return train(cfg, Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo",
                              config=cfg))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_weights_train_the_half_model_with_fp32_main_parameters(precision):
    autocast, half = run(precision, False), run(precision, True)
    assert all(g.dtype == torch.float32 for g in half.grads.values()) and half.grads.keys() == autocast.grads.keys()
    assert half.losses != autocast.losses  # another policy: other roundings
    assert half.losses == pytest.approx(autocast.losses, abs=2e-2)  # of the same training
    rel = max(float((half.grads[n] - g).abs().max() / g.abs().max()) for n, g in autocast.grads.items())
    assert 0 < rel < 0.2
    assert run(precision, True, mb=2).losses == pytest.approx(half.losses, abs=2e-3)  # micro-batching: rounding


def test_the_plain_reference_is_the_same_run_as_ever_and_modes_are_judged():
    assert ReferenceOptions().identity() == {}  # its records and cached references keep their keys
    assert ReferenceOptions(half_weights=True).identity() == {"half_weights": True}
    with pytest.raises(ConfigError, match="--half-weights needs --precision bf16 or fp16"):
        run("fp32", True)
    cfg = RunConfig(system="reference", model=MODEL, batch_size=4, micro_batch_size=1, dp=2,
                    options=ReferenceOptions())
    with pytest.raises(ConfigError, match="only with --diloco"):
        get_system("reference").validate(cfg)

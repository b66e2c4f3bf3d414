"""What every system's training step shares: the optimizer and its settings, and the precision
policies (``RunConfig.precision``):

- ``fp32``: everything in fp32.
- ``bf16``: fp32 weights, the forward under bf16 autocast (matmuls in bf16, reductions, norms and the
  loss in fp32), fp32 gradients and optimizer. No loss scaling: bf16 has fp32's range.
- ``fp16``: the same under fp16 autocast, with dynamic loss scaling (``LOSS_SCALING``): the loss is
  multiplied by the scale before backward, the gradients divided by it before the optimizer step; a
  step whose gradients hold an inf or NaN anywhere (on any rank) is skipped by every rank and the
  scale halved; after ``growth_interval`` good steps in a row it doubles.

A system that keeps half-precision weights instead of autocasting (megatron's Float16Module, see
``contract.SystemSpec.half_weights``) applies the same dtype and the same loss scaling. One scale over
the ranks of a model spread across processes: ``workload.shared_scaler`` (apart: it imports FSDP,
over half a second at every rank's start).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from workload.configs import SGD_MOMENTUM, OptimizerConfig

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's dynamic loss scaling, one policy for every system (torch.amp.GradScaler's defaults; megatron's
# optimizer is configured to the same: initial scale, halving on every overflow, growth interval).
LOSS_SCALING = dict(init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0, growth_interval=2000)


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """``cfg``'s optimizer (``workload.configs.OPTIMIZERS``) over ``params``."""
    params = list(params)
    if cfg.kind == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM)
    return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the policy computes matmuls in (fp32, or the half type)."""
    return HALF_DTYPES.get(precision, torch.float32)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The policy's autocast on ``device`` (nothing under fp32)."""
    if precision not in HALF_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=HALF_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """One process's dynamic loss scaling (``LOSS_SCALING``) under fp16; a disabled pass-through else."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16", **LOSS_SCALING)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation recomputation of every transformer block, applied from outside the model
    (parameter names unchanged): each block's forward is re-run during backward."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for block in model.blocks.values():
        block.forward = partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)

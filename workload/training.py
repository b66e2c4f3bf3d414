"""What every system's training step shares: the optimizer and its settings, and mixed precision."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from workload.configs import OptimizerConfig


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.kind == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """Mixed precision: fp16 on CUDA (with a loss scaler), bf16 on CPU."""
    if not enabled:
        return contextlib.nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """Dynamic loss scaling where fp16 needs it (CUDA); a disabled pass-through elsewhere."""
    return torch.amp.GradScaler(device.type, enabled=enabled and device.type == "cuda")


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation recomputation of every transformer block, applied from outside the model
    (parameter names unchanged): each block's forward is re-run during backward."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for block in model.blocks.values():
        block.forward = partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)

"""The reference: single-process training of the whole model on the global batch, accumulated
over micro-batches. Every system's --verify and every parity test compares against it. Under
``--diloco``, D replicas trained by this same step with DiLoCo's outer step applied to them
(``baselines.reference.outer``)."""
from __future__ import annotations

from typing import Callable

import torch

from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.model import GPT, lm_loss
from workload.training import autocast, checkpoint_blocks, grad_scaler, make_optimizer

Step = Callable[[torch.Tensor, torch.Tensor], float]  # (inputs, targets) -> the batch's loss


def reference_step(cfg: RunConfig, ctx: Context, model: GPT) -> Step:
    """The reference's optimizer step on one batch, its micro-batches' gradients accumulated."""
    if cfg.recompute:
        checkpoint_blocks(model)
    opt = make_optimizer(model.parameters(), cfg.optimizer)
    scaler = grad_scaler(ctx.device, cfg.precision)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=ctx.device)
        for x, y in zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size)):
            with autocast(ctx.device, cfg.precision):
                loss = lm_loss(model(x), y) / cfg.n_micro_batches
            scaler.scale(loss).backward()
            total += loss.detach()
        scaler.step(opt)
        scaler.update()
        return float(total)

    return step


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    if cfg.options.diloco:
        from baselines.reference.outer import train_outer

        return train_outer(cfg, ctx, reference_step)
    model = ctx.build_model()
    step = reference_step(cfg, ctx, model)
    m = run_steps(ctx, 0, lambda _, x, y: StepOutput(loss=step(x, y)), weights=lambda: dict(model.named_parameters()))
    if cfg.verify:
        m.grads = {n: p.grad for n, p in model.named_parameters()}
    return m

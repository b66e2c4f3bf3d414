"""The reference: single-process training of the whole model on the global batch, accumulated
over micro-batches. Every system's --verify and every parity test compares against it."""
from __future__ import annotations

import torch

from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.model import lm_loss
from workload.training import autocast, checkpoint_blocks, grad_scaler, make_optimizer


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    model = ctx.build_model()
    if cfg.recompute:
        checkpoint_blocks(model)
    opt = make_optimizer(model.parameters(), cfg.optimizer)
    scaler = grad_scaler(ctx.device, cfg.precision)

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=ctx.device)
        for x, y in zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size)):
            with autocast(ctx.device, cfg.precision):
                loss = lm_loss(model(x), y) / cfg.n_micro_batches
            scaler.scale(loss).backward()
            total += loss.detach()
        scaler.step(opt)
        scaler.update()
        return StepOutput(loss=float(total))

    m = run_steps(ctx, 0, step, weights=lambda: dict(model.named_parameters()))
    if cfg.verify:
        m.grads = {n: p.grad for n, p in model.named_parameters()}
    return m

"""The reference: single-process training of the whole model on the global batch, accumulated
over micro-batches. Every system's --verify and every parity test compares against it. Under
``--diloco``, D replicas trained by this same step with DiLoCo's outer step applied to them
(``baselines.reference.outer``)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.model import GPT, lm_loss
from workload.training import autocast, checkpoint_blocks, compute_dtype, grad_scaler, make_optimizer


class ReferenceStep:
    """The reference's optimizer step on one batch, its micro-batches' gradients accumulated: under
    the precision's autocast, or (``--half-weights``) with the model in the half type, each
    micro-batch's gradients accumulated in fp32 main parameters, which the optimizer steps and the
    model then copies (megatron's Float16Module and optimizer do the same)."""

    def __init__(self, cfg: RunConfig, ctx: Context, model: GPT):
        if cfg.recompute:
            checkpoint_blocks(model)
        self.cfg, self.ctx, self.model = cfg, ctx, model
        self.named = dict(model.named_parameters())
        self.half = cfg.options.half_weights and cfg.precision != "fp32"
        self.main = {n: torch.nn.Parameter(p.detach().clone()) for n, p in self.named.items()} if self.half \
            else self.named
        if self.half:
            model.to(compute_dtype(cfg.precision))
        self.opt = make_optimizer(self.main.values(), cfg.optimizer)
        self.scaler = grad_scaler(ctx.device, cfg.precision)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        cfg = self.cfg
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.ctx.device)
        for x, y in zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size)):
            with nullcontext() if self.half else autocast(self.ctx.device, cfg.precision):
                loss = lm_loss(self.model(x), y) / cfg.n_micro_batches
            self.scaler.scale(loss).backward()
            total += loss.detach()
            if self.half:
                for n, p in self.named.items():
                    main = self.main[n]
                    main.grad = p.grad.float() if main.grad is None else main.grad + p.grad.float()
                    p.grad = None
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.half:
            with torch.no_grad():
                for n, p in self.named.items():
                    p.copy_(self.main[n])
        return float(total)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name (the fp32 main ones where the model is half)."""
        return self.main

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's gradients by name (fp32 where the model is half)."""
        return {n: p.grad for n, p in self.main.items()}


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    if cfg.options.diloco:
        from baselines.reference.outer import train_outer

        return train_outer(cfg, ctx, ReferenceStep)
    step = ReferenceStep(cfg, ctx, ctx.build_model())
    m = run_steps(ctx, 0, lambda _, x, y: StepOutput(loss=step(x, y)), weights=step.weights)
    if cfg.verify:
        m.grads = step.grads()
    return m

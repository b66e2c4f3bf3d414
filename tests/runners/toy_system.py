"""A fifth system, as a user would add one (docs/adding-a-system.md): one module declaring its
options and SPEC, with its training code; registered for the test through $PIPEBENCH_SYSTEMS.

Single-process training of the whole model whose only option scales the learning rate, so that
``--toy-lr-scale 1`` is the reference exactly (``--verify`` PASS) and any other value is a run of
its own (another identity key)."""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, RunConfig, SystemOptions, SystemSpec, option


@dataclass(frozen=True)
class ToyOptions(SystemOptions):
    toy_lr_scale: float = option(1.0, "multiply the learning rate by this")

    def check(self, config: RunConfig) -> None:
        if not self.toy_lr_scale > 0:
            raise ConfigError(f"--toy-lr-scale must be > 0, got {self.toy_lr_scale}")


def train(config: RunConfig, ctx):
    # The ranks import this module again; torch is imported here so that reading the SPEC (what the
    # run command does for --help) stays light.
    import torch

    from contract.rank import StepOutput, run_steps
    from workload.model import lm_loss
    from workload.training import make_optimizer

    model = ctx.build_model()
    opt_cfg = config.optimizer
    opt = make_optimizer(model.parameters(), type(opt_cfg)(**{**opt_cfg.__dict__,
                                                             "lr": opt_cfg.lr * config.options.toy_lr_scale}))

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        return StepOutput(loss=float(loss))

    m = run_steps(ctx, 0, step)
    if config.verify:
        m.grads = {n: p.grad for n, p in model.named_parameters()}
    m.extra["toy_note"] = "trained"
    return m


SPEC = SystemSpec(
    name="toy",
    train="tests.runners.toy_system:train",
    description="a toy system: the reference with a scaled learning rate",
    options=ToyOptions,
    processes=lambda config: 1,
    label=lambda config: f"toy x{config.options.toy_lr_scale:g}",
    details=lambda options: options.get("toy_note", ""),
)

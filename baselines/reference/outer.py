"""DiLoCo's math in one process (``reference --diloco``; ``contract.outer``): what diloco's --verify
compares against. D replicas of the whole model, each trained by the reference's own step (its
optimizer, precision and micro-batches) on its rows of every step's global batch, as diloco's replicas
are. The global weights are kept apart, with one SGD outer optimizer (Nesterov momentum) per
fragment. With F fragments of H/F steps each (torchft's schedule): after inner step ``H/F - tau`` of
a period, fragment f = (outer steps so far) mod F is prepared: its pseudo-gradient, the mean over
replicas of (global - replica) weights; after step H/F the outer optimizer steps the fragment's
global weights with it, and every replica's fragment becomes (1 - alpha) x global + alpha x its own
weights of that moment.

Measurements: each step's loss, the mean of the replicas'; under --verify the last step's gradients,
the mean of the replicas'; under --eval-every the global weights.
"""
from __future__ import annotations

from typing import Callable

import torch

from contract import RunConfig
from contract.outer import OuterStep
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.partition import fragment_names


def train_outer(cfg: RunConfig, ctx: Context, inner_step: Callable) -> Measurements:
    """``inner_step(cfg, ctx, model)``: the reference's step of one replica's model
    (``baselines.reference.train.ReferenceStep``)."""
    o: OuterStep = cfg.options
    D, F = cfg.dp, o.fragments
    replicas = [ctx.build_model() for _ in range(D)]
    steps = [inner_step(cfg, ctx, model) for model in replicas]
    named = [s.weights() for s in steps]
    frags = fragment_names(cfg.model, cfg.pp, F)
    glob = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named[0].items()}
    outer = [torch.optim.SGD([glob[n] for n in names], lr=o.outer_lr, momentum=o.outer_momentum,
                             nesterov=o.outer_momentum > 0) for names in frags]
    period = o.inner_steps // F
    state = {"local": 0, "outer": 0}
    pending: dict[str, torch.Tensor] = {}
    last_grads: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def outer_step(f: int) -> None:
        for n in frags[f]:
            glob[n].grad = pending.pop(n)
        outer[f].step()
        outer[f].zero_grad(set_to_none=True)
        for d in range(D):
            for n in frags[f]:
                named[d][n].copy_(torch.lerp(glob[n], named[d][n], o.fragment_alpha))

    def step(i: int, _inputs: torch.Tensor, _targets: torch.Tensor) -> StepOutput:
        losses = [steps[d](*ctx.batch(i, d)) for d in range(D)]
        if cfg.verify and not ctx.plan.more_after(i):
            for n in glob:
                last_grads[n] = sum(s.grads()[n] for s in steps) / D
        state["local"] += 1
        f = state["outer"] % F
        if state["local"] == period - o.sync_delay:
            with torch.no_grad():
                for n in frags[f]:
                    pending[n] = sum(glob[n] - named[d][n] for d in range(D)) / D
        if state["local"] == period:
            outer_step(f)
            state["outer"] += 1
            state["local"] = 0
        return StepOutput(loss=sum(losses) / D)

    m = run_steps(ctx, 0, step, weights=lambda: {n: p.detach() for n, p in glob.items()})
    m.extra["eval_weights_every"] = period  # the global weights change once a fragment is synced
    if cfg.verify:
        m.grads = last_grads
    return m

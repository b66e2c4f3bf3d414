"""DiLoCo / Streaming DiLoCo simulated in one process, in plain torch (no torchft): ``diloco --verify``
compares its losses and gradients with this (``diloco_sim``).

D replicas of the whole model, each with its own inner optimizer (the run's), train on their rows of
every step's global batch, as diloco's replicas do. The global weights are kept apart, with one SGD
outer optimizer (Nesterov momentum) per fragment. With F fragments of H/F steps each (torchft's
schedule): after inner step ``H/F - tau`` of a period, fragment f = (outer steps so far) mod F is
prepared: its pseudo-gradient, the mean over replicas of (global - replica) weights; after step H/F
the outer optimizer steps the fragment's global weights with it, and every replica's fragment
becomes (1 - alpha) x global + alpha x its own weights of that moment.

Measurements: each step's loss, the mean of the replicas' losses; under --verify the last step's
gradients, the mean of the replicas'; under --eval-every the global weights.
"""
from __future__ import annotations

import torch

from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from ours.diloco import DiLoCoAlgorithm
from ours.diloco.fragments import fragment_names
from workload.model import lm_loss
from workload.training import autocast, checkpoint_blocks, make_optimizer


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    o: DiLoCoAlgorithm = cfg.options
    D, F = cfg.dp, o.fragments
    replicas = [ctx.build_model() for _ in range(D)]
    if cfg.recompute:
        for model in replicas:
            checkpoint_blocks(model)
    inner = [make_optimizer(model.parameters(), cfg.optimizer) for model in replicas]
    named = [dict(model.named_parameters()) for model in replicas]
    frags = fragment_names(cfg.model, cfg.pp, F)
    glob = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named[0].items()}
    outer = [torch.optim.SGD([glob[n] for n in names], lr=o.outer_lr, momentum=o.outer_momentum,
                             nesterov=o.outer_momentum > 0) for names in frags]
    period = o.inner_steps // F
    state = {"local": 0, "outer": 0}
    pending: dict[str, torch.Tensor] = {}
    last_grads: dict[str, torch.Tensor] = {}
    n_chunks = cfg.batch_size // cfg.micro_batch_size

    def inner_step(d: int, step: int) -> float:
        model = replicas[d]
        inner[d].zero_grad(set_to_none=True)
        inputs, targets = ctx.batch(step, d)
        total = 0.0
        for x, y in zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size)):
            with autocast(ctx.device, cfg.precision):
                loss = lm_loss(model(x), y) / n_chunks
            loss.backward()
            total += float(loss.detach())
        return total

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
        losses = [inner_step(d, i) for d in range(D)]
        if cfg.verify and not ctx.plan.more_after(i):
            for n in glob:
                last_grads[n] = sum(named[d][n].grad for d in range(D)) / D
        for d in range(D):
            inner[d].step()
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

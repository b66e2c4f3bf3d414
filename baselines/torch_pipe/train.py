"""Torch Pipe: torch.distributed.pipelining over P ranks (the schedules and stage placements of
``baselines.torch_pipe``), data parallel over D pipelines with FSDP2 ``fully_shard`` on the dp mesh
dimension (FSDP1 and DDP do not combine correctly with pipelining in torch 2.13).

Stages are built by hand from the shared model (``workload.partition``), so parameter names are the
reference's. Ranks: global rank = dp_rank * P + pp_rank.

Precision (``workload.training``): each stage's forward runs under the policy's autocast. fp16's loss
scaling is one ``SharedGradScaler`` over every rank: the last stage scales each micro-batch's loss,
the gradients reaching the other stages carry that scale, and every stage unscales by the same scale
and skips the step when any stage (or FSDP2 shard) found an overflow.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from baselines.torch_pipe import stage_indices
from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.model import GPT, lm_loss
from workload.partition import stage_specs
from workload.shared_scaler import SharedGradScaler
from workload.training import autocast, checkpoint_blocks, make_optimizer


def _with_autocast(module: GPT, device: torch.device, precision: str) -> None:
    """The precision policy applied from outside: the stage's forward runs under its autocast."""
    forward = module.forward

    def autocast_forward(*args, **kwargs):
        with autocast(device, precision):
            return forward(*args, **kwargs)

    module.forward = autocast_forward


# torch 2.13: under these schedules, blocks of the last stage wrapped as FSDP2 units of their own end
# the step with no gradient at all (found by --verify at --dp 2; DualPipeV and interleaved 1F1B are
# not affected), so each stage is one FSDP unit there.
ONE_FSDP_UNIT = frozenset({"zb", "zbv"})
SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE = {"interleaved": ScheduleInterleaved1F1B, "zb": ScheduleInterleavedZeroBubble,
               "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


def build_schedule(cfg: RunConfig, stages: list[PipelineStage], loss_fn):
    """The schedule over this rank's stages (placed by ``stage_indices`` for the same schedule).
    ``loss_fn`` gives a micro-batch's share of the batch's loss (its mean over the micro-batch count),
    so the schedule does not scale the gradients itself."""
    name, n_mb = cfg.options.schedule, cfg.n_micro_batches
    if name in SINGLE_STAGE:
        return SINGLE_STAGE[name](stages[0], n_mb, loss_fn=loss_fn, scale_grads=False)
    return MULTI_STAGE[name](stages, n_mb, loss_fn=loss_fn, scale_grads=False)


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or its gradient as a full tensor (FSDP2's DTensors all-gathered over dp: collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    return full(p.grad)


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    P, D, V = cfg.pp, cfg.dp, cfg.options.virtual_pp
    dp_rank, pp_rank = divmod(ctx.rank, P)
    mesh = init_device_mesh(ctx.device.type, (D, P), mesh_dim_names=("dp", "pp"))
    specs = stage_specs(cfg.model.n_layer, P * V, cfg.options.stage_layers(cfg))
    mine = [specs[i] for i in stage_indices(cfg.options.schedule, P, pp_rank, V)]
    modules = [ctx.build_stage(spec) for spec in mine]
    for module in modules:
        if cfg.recompute:
            checkpoint_blocks(module)
        if cfg.precision != "fp32":
            _with_autocast(module, ctx.device, cfg.precision)
        if D > 1:
            if cfg.options.schedule not in ONE_FSDP_UNIT:
                for block in module.blocks.values():
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
    stages = [PipelineStage(m, s.index, P * V, ctx.device, group=mesh["pp"].get_group()) for m, s in zip(modules, mine)]
    scaler = SharedGradScaler(ctx.device, cfg.precision)  # over every rank: all stages, all DP shards
    # each micro-batch's share of the loss is scaled before its backward, as the reference scales it: a
    # micro-batch's mean loss scaled whole would run its fp16 backward n_micro times larger, so it
    # would overflow (and skip the step) where the reference does not
    n_mb = cfg.n_micro_batches
    schedule = build_schedule(cfg, stages, loss_fn=lambda out, tgt: scaler.scale(lm_loss(out, tgt) / n_mb))
    params = [p for m in modules for p in m.parameters()]
    opt = make_optimizer(params, cfg.optimizer)
    has_first = any(s.is_first for s in mine)
    has_last = any(s.is_last for s in mine)

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if has_last else {}
        if has_first:
            schedule.step(inputs, **kwargs)
        else:
            schedule.step(**kwargs)
        scaler.step(opt)
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.update()
        loss = float(torch.stack(losses).detach().float().sum()) / scale if losses else None
        return StepOutput(loss=loss)

    def weights() -> dict[str, torch.Tensor]:  # for --eval-every; one pipeline's, every dp rank gathering
        held = {n: full(p.detach()) for module in modules for n, p in module.named_parameters()}
        return held if dp_rank == 0 else {}

    m = run_steps(ctx, dp_rank, step, weights)
    if cfg.verify:
        m.grads = {n: full_grad(p) for module in modules for n, p in module.named_parameters()}
    m.extra = {"stages_per_rank": V, "stage_placement": [list(stage_indices(cfg.options.schedule, P, r, V))
                                                         for r in range(P)]}
    return m

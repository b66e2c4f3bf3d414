"""fairscale: a Pipe over each process's local devices, FullyShardedDataParallel across processes.

As in the seed's dist_fairscale_pipe_fsdp.py: every process (one per data-parallel replica,
world size = dp) holds a whole pipeline, ``fairscale.nn.Pipe`` over an ``nn.Sequential`` of
``config.pp`` stage pieces on that process's devices (on CPU every device is ``cpu``; on CUDA the
process's ``Context.devices``, GPUs ``local_rank·pp … local_rank·pp + pp − 1``), with ``chunks`` =
batch_size / micro_batch_size micro-batches (GPipe: all forwards, then all backwards). Each stage
piece is wrapped in fairscale's FullyShardedDataParallel over all processes: its parameters are
flattened and sharded across the dp replicas, all-gathered for the step, and its gradients are
reduce-scattered (averaged) after backward; Adam (``make_optimizer``) then updates the local shard.

A stage piece is the shared GPT with the parts it does not own removed (workload.partition), so
parameter names and initial weights are those of the reference. On CPU, fairscale's CUDA
assumptions are patched by ``baselines.fairscale_cpu_shim`` (installed only when CUDA is absent).

Precision (``workload.training``): the policy's autocast inside each stage; FSDP keeps fp32 parameters
and reduces fp32 gradients. fp16's loss scaling is one ``SharedGradScaler`` over the processes (as
fairscale's own ShardedGradScaler: each process holds a shard of the gradients, so an overflow in
any shard skips the step everywhere).
Recompute: every transformer block is checkpointed (``workload.training.checkpoint_blocks``).
``dp_sync_time``: wall time inside FSDP's parameter all-gathers and gradient reduce-scatters
(blocking collectives on gloo; on CUDA they are issued on side streams, so the number is the
host-side time only).
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from contract import RunConfig
from contract.rank import Context, Measurements, StepOutput, run_steps
from workload.model import lm_loss
from workload.partition import stage_specs
from workload.shared_scaler import SharedGradScaler
from workload.training import autocast, checkpoint_blocks, make_optimizer

from baselines.fairscale_fsdp import cpu_shim  # noqa: E402

cpu_shim.install()  # before FSDP is first used (no-op with CUDA)

from fairscale.nn import Pipe  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # noqa: E402


class _Timer:
    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return timed


class Stage(nn.Module):
    """One Pipe partition: an FSDP-wrapped stage of the shared GPT, run under autocast (autocast is
    thread-local and Pipe runs partitions in worker threads, so it is entered here)."""

    def __init__(self, fsdp: FSDP, device: torch.device, precision: str):
        super().__init__()
        self.fsdp = fsdp
        self.device = device
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.precision):
            return self.fsdp(x)


def pipe_devices(cfg: RunConfig, ctx: Context) -> list[torch.device]:
    """The pipe's devices, one per stage: the process's GPUs (the run command gave it ``cfg.pp`` of its
    own, or refused the run), or on CPU the CPU for every stage."""
    if ctx.device.type == "cuda":
        if len(ctx.devices) != cfg.pp:
            raise RuntimeError(f"fairscale's pipe of {cfg.pp} stages was given {len(ctx.devices)} GPU(s)")
        return list(ctx.devices)
    return [ctx.device] * cfg.pp


def gather_flat_grads(fsdp: FSDP, of: str = "grad") -> dict[str, torch.Tensor]:
    """The full gradients (``of="data"``: weights) of one FSDP module by parameter name (shards
    all-gathered over dp)."""
    grads: dict[str, torch.Tensor] = {}
    world = fsdp.world_size
    for p in fsdp.params:
        shard = p.data if of == "data" else p.grad if p.grad is not None else torch.zeros_like(p.data)
        shard = shard.detach().contiguous()
        if world > 1:
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard, group=fsdp.process_group)
            full = torch.cat(parts)
        else:
            full = shard.reshape(-1)
        names, shapes, numels = p.metadata()  # a FlatParameter: names relative to the stage GPT
        full = full[: sum(numels)]
        for name, shape, t in zip(names, shapes, full.split(numels)):
            grads[name.removeprefix("_fpw_module.")] = t.view(shape).clone()
    return grads


def train(cfg: RunConfig, ctx: Context) -> Measurements:
    devices = pipe_devices(cfg, ctx)
    timer = _Timer()
    stages: list[Stage] = []
    fsdps: list[FSDP] = []
    for spec, device in zip(stage_specs(cfg.model.n_layer, cfg.pp), devices):
        piece = ctx.build_stage(spec).to(device)
        if cfg.recompute:
            checkpoint_blocks(piece)
        fsdp = FSDP(piece, process_group=dist.group.WORLD, compute_device=device, flatten_parameters=True,
                    mixed_precision=False)
        fsdp._rebuild_full_params = timer.wrap(fsdp._rebuild_full_params)
        fsdp._post_backward_hook = timer.wrap(fsdp._post_backward_hook)
        fsdp._wait_for_post_backward = timer.wrap(fsdp._wait_for_post_backward)
        fsdps.append(fsdp)
        stages.append(Stage(fsdp, device, cfg.precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = Pipe(nn.Sequential(*stages), balance=[1] * cfg.pp, devices=devices, chunks=cfg.n_micro_batches,
                     checkpoint="never")
    opt = make_optimizer(model.parameters(), cfg.optimizer)
    scaler = SharedGradScaler(devices[0], cfg.precision)

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        timer.total = 0.0
        opt.zero_grad(set_to_none=True)
        logits = model(inputs.to(devices[0]))
        loss = lm_loss(logits, targets.to(logits.device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return StepOutput(loss=float(loss.detach()), dp_sync_time=timer.total)

    def weights() -> dict[str, torch.Tensor]:  # for --eval-every; every rank gathers, rank 0 gives
        held = {n: t for fsdp in fsdps for n, t in gather_flat_grads(fsdp, of="data").items()}
        return held if ctx.rank == 0 else {}

    m = run_steps(ctx, ctx.rank, step, weights)
    m.extra["pipe_devices"] = [str(d) for d in devices]
    if cfg.verify:
        grads: dict[str, torch.Tensor] = {}
        for fsdp in fsdps:
            grads.update(gather_flat_grads(fsdp))
        m.grads = grads if ctx.rank == 0 else {}
    return m

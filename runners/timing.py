"""The timing discipline every system runs under: barrier, step, device synchronise, barrier.

Warm-up steps are run and their losses kept, but their times are excluded. The closing barrier's own
seconds are measured apart (``barrier_times``): on a slow network it pays delays of its own.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from runners.context import Context, Measurements


@dataclass(frozen=True)
class StepOutput:
    loss: float | None  # the replica's loss on ranks that see it, else None
    dp_sync_time: float = 0.0  # seconds of data-parallel synchronisation inside the step


StepFn = Callable[[int, torch.Tensor, torch.Tensor], StepOutput]


def run_steps(ctx: Context, dp_rank: int, step_fn: StepFn) -> Measurements:
    """Run warm-up + measured steps of ``step_fn(step, inputs, targets)`` and time each one."""
    cfg = ctx.config
    times: list[float] = []
    losses: list[float] = []
    syncs: list[float] = []
    barriers: list[float] = []
    for step in range(cfg.total_steps):
        inputs, targets = ctx.batch(step, dp_rank)
        dist.barrier()
        start = time.perf_counter()
        out = step_fn(step, inputs, targets)
        ctx.synchronize()
        closing = time.perf_counter()
        dist.barrier()
        end = time.perf_counter()
        elapsed = end - start
        warm = step < cfg.warmup
        if not warm:
            times.append(elapsed)
            syncs.append(out.dp_sync_time)
            barriers.append(end - closing)
        if out.loss is not None:
            losses.append(out.loss)
        if ctx.rank == 0:
            loss = f" loss {out.loss:.4f}" if out.loss is not None else ""
            tag = " (warm-up)" if warm else ""
            print(f"[{cfg.system}] step {step + 1}/{cfg.total_steps} {elapsed:.3f} s{loss}{tag}", file=sys.stderr, flush=True)
    return Measurements(step_times=times, losses=losses or None, dp_sync_times=syncs, barrier_times=barriers)

"""fp16's dynamic loss scaling (``workload.training.LOSS_SCALING``) for a model spread over several
processes: one scale and one verdict for all of them (torch_pipe's stages, fairscale's shards). A
module of its own because torch's sharded scaler imports FSDP and DTensor, over half a second at the
start of every rank that does not need them."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from workload.training import LOSS_SCALING


class SharedGradScaler(ShardedGradScaler):
    """Dynamic loss scaling for a model spread over the ranks of ``group`` (pipeline stages, shards):
    one scale and one decision for all of them. Every rank must call ``step`` (or ``unscale_``) and
    ``update`` once per step, in the same order: the inf/NaN found in each rank's gradients is summed
    over the group before any rank steps, so an overflow on any rank skips the step on every rank, and
    every rank updates its scale from that same verdict. The scales start equal (``LOSS_SCALING``) and
    stay equal without being sent: the rank that computes the loss scales it with the scale every other
    rank unscales by. Every rank creates its scale at once (torch's creates it in the first ``scale``,
    which a pipeline stage without the loss never calls: its ``step`` then fails)."""

    def __init__(self, device: torch.device, precision: str, group: dist.ProcessGroup | None = None):
        super().__init__(device.type, enabled=precision == "fp16", process_group=group or dist.group.WORLD,
                         **LOSS_SCALING)
        if self.is_enabled():
            self._lazy_init_scale_growth_tracker(device)

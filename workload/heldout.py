"""The held-out loss: one fixed batch of the data source's held-out split (``TokenSource.heldout_batch``)
through the full shared model, in fp32, whatever system trained its weights."""
from __future__ import annotations

import torch

from workload.data import TokenSource
from workload.model import GPT, lm_loss
from workload.tokens import EVAL_ROWS

_ROWS_PER_FORWARD = 8


@torch.no_grad()
def heldout_loss(model: GPT, data: TokenSource, rows: int = EVAL_ROWS) -> float:
    """Mean next-token cross-entropy of ``model`` over every token of the held-out batch."""
    device = next(model.parameters()).device
    inputs, targets = data.heldout_batch(rows)
    total, count = 0.0, 0
    for x, y in zip(inputs.split(_ROWS_PER_FORWARD), targets.split(_ROWS_PER_FORWARD)):
        total += float(lm_loss(model(x.to(device)), y.to(device))) * y.numel()
        count += y.numel()
    return total / count

"""Streaming DiLoCo's fragments of a stage as modules (``workload.partition.stage_units`` cut by
``split_units``): what torchft's DiLoCo syncs, one at a time."""
from __future__ import annotations

import torch.nn as nn

from workload.model import GPT
from workload.partition import embedding_names, split_units, stage_units


def stage_fragments(model: GPT, n_layer: int, pp: int, stage: int, n: int) -> list[nn.ModuleDict]:
    """The stage's ``n`` fragments as modules holding its own parameters (not copies)."""
    out = []
    for group in split_units(stage_units(n_layer, pp, stage, embedding_names(model.config)), n):
        out.append(nn.ModuleDict({name.replace(".", "_"): model.get_submodule(name)
                                  for unit in group for name in unit}))
    return out

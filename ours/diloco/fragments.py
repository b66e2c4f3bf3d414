"""Streaming DiLoCo's fragments of a stage: its units in model order (the embeddings, each block, the
head: ln_f and lm_head) cut into F contiguous groups of near-equal counts, the earlier groups one
unit larger. Fragment f of every stage is synced at the same step, so the model's fragment f is the
union of the stages' fragments f (``fragment_names``, which the simulation uses)."""
from __future__ import annotations

import torch
import torch.nn as nn

from workload.configs import ModelConfig
from workload.model import GPT
from workload.partition import stage_specs

Unit = tuple[str, ...]  # the shared model's module names of one unit


def stage_units(n_layer: int, pp: int, stage: int) -> list[Unit]:
    spec = stage_specs(n_layer, pp)[stage]
    units: list[Unit] = [("wte", "wpe")] if spec.is_first else []
    units += [(f"blocks.{i}",) for i in range(spec.first_layer, spec.end_layer)]
    return units + ([("ln_f", "lm_head")] if spec.is_last else [])


def split(units: list[Unit], n: int) -> list[list[Unit]]:
    """``units`` in ``n`` contiguous groups of near-equal counts (the earlier ones larger)."""
    if not 1 <= n <= len(units):
        raise ValueError(f"cannot cut {len(units)} units into {n} fragments")
    q, r = divmod(len(units), n)
    out, start = [], 0
    for f in range(n):
        end = start + q + (1 if f < r else 0)
        out.append(units[start:end])
        start = end
    return out


def stage_fragments(model: GPT, n_layer: int, pp: int, stage: int, n: int) -> list[nn.ModuleDict]:
    """The stage's ``n`` fragments as modules holding its own parameters (not copies)."""
    out = []
    for group in split(stage_units(n_layer, pp, stage), n):
        out.append(nn.ModuleDict({name.replace(".", "_"): model.get_submodule(name)
                                  for unit in group for name in unit}))
    return out


def fragment_names(cfg: ModelConfig, pp: int, n: int) -> list[list[str]]:
    """The shared model's parameter names of each of the ``n`` fragments, over all ``pp`` stages."""
    with torch.device("meta"):  # names only
        model = GPT(cfg)
    names: list[list[str]] = [[] for _ in range(n)]
    for stage in range(pp):
        for f, group in enumerate(split(stage_units(cfg.n_layer, pp, stage), n)):
            for unit in group:
                for name in unit:
                    names[f] += [f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters()]
    return names

"""Split the shared GPT into pipeline stages from outside: a stage is the full model with what it
does not own removed, so parameter names stay those of the single-process reference."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workload.configs import ModelConfig
from workload.model import GPT, init_weights


@dataclass(frozen=True)
class StageSpec:
    index: int
    n_stages: int
    first_layer: int
    end_layer: int  # exclusive

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def stage_specs(n_layer: int, n_stages: int) -> list[StageSpec]:
    """Equal, consecutive layer ranges; the caller has checked that n_stages divides n_layer."""
    if n_stages < 1 or n_layer % n_stages:
        raise ValueError(f"{n_layer} layers do not divide into {n_stages} stages")
    per = n_layer // n_stages
    return [StageSpec(i, n_stages, i * per, (i + 1) * per) for i in range(n_stages)]


def build_stage(cfg: ModelConfig, spec: StageSpec, seed: int, device: torch.device | str) -> GPT:
    """Only the stage's parameters are materialised; they equal the full model's of the same names."""
    with torch.device("meta"):
        model = GPT(cfg)
    for i in range(cfg.n_layer):
        if not spec.first_layer <= i < spec.end_layer:
            del model.blocks[str(i)]
    if not spec.is_first:
        model.wte = model.wpe = None
    if not spec.is_last:
        model.ln_f = model.lm_head = None
    model.to_empty(device=device)
    init_weights(model, cfg, seed)
    return model

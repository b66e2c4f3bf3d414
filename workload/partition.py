"""Split the shared model into pipeline stages from outside: a stage is the full model with what it
does not own removed, so parameter names stay those of the single-process reference."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workload.configs import ModelConfig
from workload.model import GPT, init_weights, meta_gpt


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


def stage_specs(n_layer: int, n_stages: int, counts: tuple[int, ...] | None = None) -> list[StageSpec]:
    """Consecutive layer ranges: ``counts`` layers each (in model order), or equal ones (the caller has
    checked that n_stages divides n_layer)."""
    if counts is None:
        if n_stages < 1 or n_layer % n_stages:
            raise ValueError(f"{n_layer} layers do not divide into {n_stages} stages")
        counts = (n_layer // n_stages,) * n_stages
    if len(counts) != n_stages or sum(counts) != n_layer or min(counts) < 1:
        raise ValueError(f"layer counts {counts} are not {n_stages} stages of {n_layer} layers")
    ends = [sum(counts[:i + 1]) for i in range(n_stages)]
    return [StageSpec(i, n_stages, end - counts[i], end) for i, end in enumerate(ends)]


def build_stage(cfg: ModelConfig, spec: StageSpec, seed: int, device: torch.device | str) -> GPT:
    """Only the stage's parameters are materialised; they equal the full model's of the same names."""
    model = meta_gpt(cfg)
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


# Streaming DiLoCo's fragments: a stage's units in model order (the embeddings, each block, the head:
# ln_f and lm_head) cut into F contiguous groups of near-equal counts, the earlier groups one unit
# larger. Fragment f of every stage is synced at the same step, so the model's fragment f is the union
# of the stages' fragments f (``fragment_names``).
Unit = tuple[str, ...]  # the shared model's module names of one unit


def embedding_names(cfg: ModelConfig) -> Unit:
    """The modules of the first stage's embeddings unit: the tokens', and gpt's learned positions."""
    return ("wte",) if cfg.llama else ("wte", "wpe")


def stage_units(n_layer: int, pp: int, stage: int, embeddings: Unit = ("wte", "wpe")) -> list[Unit]:
    """The stage's units in model order; ``embeddings``: the model's (``embedding_names``)."""
    spec = stage_specs(n_layer, pp)[stage]
    units: list[Unit] = [embeddings] if spec.is_first else []
    units += [(f"blocks.{i}",) for i in range(spec.first_layer, spec.end_layer)]
    return units + ([("ln_f", "lm_head")] if spec.is_last else [])


def split_units(units: list[Unit], n: int) -> list[list[Unit]]:
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


def fragment_names(cfg: ModelConfig, pp: int, n: int) -> list[list[str]]:
    """The shared model's parameter names of each of the ``n`` fragments, over all ``pp`` stages."""
    model = meta_gpt(cfg)
    names: list[list[str]] = [[] for _ in range(n)]
    for stage in range(pp):
        for f, group in enumerate(split_units(stage_units(cfg.n_layer, pp, stage, embedding_names(cfg)), n)):
            for unit in group:
                for name in unit:
                    names[f] += [f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters()]
    return names

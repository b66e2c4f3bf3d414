"""DiLoCo's outer step, as the options both of its implementations take: ``diloco`` runs it on torchft
across processes, and the reference applies it to its own inner steps in one process (``--diloco``),
which is what diloco's ``--verify`` compares against.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023): D replicas each take H inner steps with their own optimizer on their own data; then the
pseudo-gradient, the mean over replicas of (global - replica) weights, is the gradient of an outer
SGD step with Nesterov momentum on the global weights, which every replica then takes up. Streaming
DiLoCo (Douillard et al., 2025): the model in F fragments, one synced every H/F steps in turn, its
all-reduce overlapping ``tau`` inner steps, the replica keeping ``alpha`` of its own weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from contract.config import ConfigError, RunConfig, SystemOptions, option


@dataclass(frozen=True)
class OuterStep(SystemOptions):
    """The outer step's math (H, the outer optimizer, Streaming DiLoCo's fragments)."""

    inner_steps: int = option(8, "H: inner steps (each replica's own optimizer steps) between outer steps; 1 "
                                 "averages every step", metavar="H")
    outer_lr: float = option(0.7, "the outer optimizer's learning rate (SGD with Nesterov momentum on the averaged "
                                  "pseudo-gradient, as the DiLoCo paper)", metavar="LR")
    outer_momentum: float = option(0.9, "the outer optimizer's Nesterov momentum (0: plain SGD)", metavar="M")
    fragments: int = option(1, "Streaming DiLoCo: each stage's model split into F fragments, one synced every H/F "
                               "steps in turn (1: DiLoCo)", metavar="F")
    sync_delay: int = option(0, "Streaming DiLoCo: inner steps a fragment's all-reduce overlaps before the outer "
                                "step waits for it (tau, < H/F)", metavar="TAU")
    fragment_alpha: float = option(0.0, "Streaming DiLoCo: after an outer step, a fragment's weights are "
                                        "(1 - alpha) x global + alpha x local", metavar="ALPHA")

    @property
    def streaming(self) -> bool:
        return self.fragments > 1

    def outer_step(self) -> OuterStep:
        """The outer step's options alone (of a subclass's, which adds its own)."""
        return OuterStep(**{f.name: getattr(self, f.name) for f in OuterStep.declared()})

    def check(self, config: RunConfig) -> None:
        H, F = self.inner_steps, self.fragments
        if H < 1:
            raise ConfigError(f"--inner-steps must be >= 1, got {H}")
        if F < 1:
            raise ConfigError(f"--fragments must be >= 1, got {F}")
        if H % F:
            raise ConfigError(f"--inner-steps {H} must be a multiple of --fragments {F} (one fragment every H/F steps)")
        if not 0 <= self.sync_delay < H // F:
            raise ConfigError(f"--sync-delay must be in 0..{H // F - 1} (below H/F = {H // F}), got {self.sync_delay}")
        if not 0 <= self.fragment_alpha <= 1:
            raise ConfigError(f"--fragment-alpha must be in [0, 1], got {self.fragment_alpha}")
        if not 0 < self.outer_lr < float("inf"):
            raise ConfigError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        fewest = min_units(config.model.n_layer, config.pp)
        if F > fewest:
            raise ConfigError(f"--fragments {F}: a stage of {config.model.n_layer // config.pp} layers has only "
                              f"{fewest} units (embeddings, blocks, head) to split")


def min_units(n_layer: int, pp: int) -> int:
    """The fewest fragment units a stage holds: its blocks, plus the embeddings (first stage) and
    the head (last stage)."""
    per = n_layer // pp
    if pp == 1:
        return per + 2
    return per + 1 if pp == 2 else per


def describe(o: OuterStep) -> str:
    """'diloco H=8', or 'streaming diloco H=4 F=2 tau=1 alpha=0.25'."""
    if not o.streaming:
        return f"diloco H={o.inner_steps}"
    return (f"streaming diloco H={o.inner_steps} F={o.fragments}" + (f" tau={o.sync_delay}" if o.sync_delay else "")
            + (f" alpha={o.fragment_alpha:g}" if o.fragment_alpha else ""))

"""What a system is given (Context) and what it gives back (Measurements)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runners.config import RunConfig
from workload.data import TokenSource
from workload.model import GPT, build_gpt
from workload.partition import StageSpec, build_stage


@dataclass
class Measurements:
    """One rank's measurements. ``losses`` covers every step (warm-up included) and is set only on
    ranks that see the loss (a pipeline's last stage); times cover the measured steps only."""

    step_times: list[float]
    losses: list[float] | None = None
    dp_sync_times: list[float] = field(default_factory=list)
    barrier_times: list[float] = field(default_factory=list)  # the closing barrier of each measured step
    peak_memory_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Under --verify: the last step's gradients (full tensors, averaged over data parallelism) of the
    # parameters this rank holds, by the shared model's parameter names. Never written to a record.
    grads: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Context:
    """Everything a system needs besides the config: where it runs and the seeded workload."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    config: RunConfig

    @property
    def data(self) -> TokenSource:
        m = self.config.model
        return TokenSource(seq_len=m.seq_len, vocab_size=m.vocab_size, seed=self.config.seed, text_path=self.config.data)

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of data-parallel replica dp_rank at this step, on this rank's device."""
        x, y = self.data.replica_batch(step, self.config.batch_size, dp_rank, self.config.dp)
        return x.to(self.device), y.to(self.device)

    def build_model(self) -> GPT:
        return build_gpt(self.config.model, self.config.seed, self.device)

    def build_stage(self, spec: StageSpec) -> GPT:
        return build_stage(self.config.model, spec, self.config.seed, self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

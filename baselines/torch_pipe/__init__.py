"""Torch Pipe: torch.distributed.pipelining over P ranks (GPipe, 1F1B, or interleaved 1F1B with
several model chunks per rank), data parallel over D pipelines with FSDP2 ``fully_shard`` on the dp
mesh dimension. The training code is ``baselines.torch_pipe.train``."""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, PipelineOptions, RunConfig, SystemSpec, option

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class TorchPipeOptions(PipelineOptions):
    schedule: str = option("gpipe", "pipeline schedule", choices=SCHEDULES)

    def check(self, config: RunConfig) -> None:
        super().check(config)
        if self.schedule != "gpipe" and config.n_micro_batches < config.pp:
            raise ConfigError(f"torch.distributed.pipelining's {self.schedule} schedule needs at least as many "
                              f"micro-batches ({config.n_micro_batches}) as pipeline ranks (--pp {config.pp})")


SPEC = SystemSpec(
    name="torch_pipe",
    train="baselines.torch_pipe.train:train",
    description="torch.distributed.pipelining; data parallel with FSDP2 on the dp mesh dimension",
    options=TorchPipeOptions,
    dims=("pp", "dp"),
    label=lambda config: f"torch_pipe {config.options.schedule}",
)

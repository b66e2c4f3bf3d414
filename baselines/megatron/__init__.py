"""megatron-core (0.16.1) tensor, pipeline and data parallelism on the shared GPT workload. The
training code is ``baselines.megatron.train``; the weight conversion ``convert``; the CPU shim
``cpu_shim`` (active only where CUDA is absent, installed before megatron is first imported)."""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, PipelineOptions, RunConfig, SystemSpec, option

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class MegatronOptions(PipelineOptions):
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULES)

    def check(self, config: RunConfig) -> None:
        if self.schedule == "interleaved" and config.pp < 2:
            raise ConfigError("megatron's interleaved schedule needs --pp >= 2")
        super().check(config)
        if config.model.vocab_size % config.tp:
            raise ConfigError(f"megatron splits the vocabulary over --tp {config.tp}: --vocab-size "
                              f"{config.model.vocab_size} must divide by it")
        if self.schedule == "interleaved" and config.n_micro_batches % config.pp:
            raise ConfigError(f"megatron's interleaved schedule needs the micro-batch count ({config.n_micro_batches}) "
                              f"to divide by --pp {config.pp}")


SPEC = SystemSpec(
    name="megatron",
    train="baselines.megatron.train:train",
    description="megatron-core tensor/pipeline/data parallelism",
    options=MegatronOptions,
    dims=("pp", "tp", "dp"),
    label=lambda config: "megatron" if config.options.schedule == "1f1b" else f"megatron {config.options.schedule}",
)

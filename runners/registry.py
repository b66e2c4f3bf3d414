"""One registry maps a system's name to where it lives and what it supports.

Nothing here imports a system: a system's module is imported only inside the rank that runs it
(Megatron's CPU shims, for one, must be installed before megatron is imported).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from runners.config import RunConfig


def _no_check(cfg: "RunConfig") -> None:
    return None


@dataclass(frozen=True)
class SystemSpec:
    name: str
    module: str  # exposes train(config, context) -> Measurements
    dims: tuple[str, ...]  # parallel dimensions it supports beyond 1
    schedules: tuple[str, ...] = ("gpipe",)
    processes: Callable[["RunConfig"], int] = lambda c: c.pp * c.tp * c.dp
    devices_per_process: Callable[["RunConfig"], int] = lambda c: 1
    check: Callable[["RunConfig"], None] = field(default=_no_check)
    description: str = ""

    def load(self):
        return importlib.import_module(self.module)


def _check_torch_pipe(cfg: "RunConfig") -> None:
    from runners.config import ConfigError

    if cfg.schedule != "gpipe" and cfg.n_micro_batches < cfg.pp:
        raise ConfigError(f"torch.distributed.pipelining's {cfg.schedule} schedule needs at least as many micro-batches "
                          f"({cfg.n_micro_batches}) as pipeline ranks (--pp {cfg.pp})")


def _check_megatron(cfg: "RunConfig") -> None:
    from runners.config import ConfigError

    if cfg.virtual_pp > 1 and cfg.pp < 2:
        raise ConfigError("megatron's interleaved schedule needs --pp >= 2")
    if cfg.model.vocab_size % cfg.tp:
        raise ConfigError(f"megatron splits the vocabulary over --tp {cfg.tp}: --vocab-size {cfg.model.vocab_size} must divide by it")
    if cfg.schedule == "interleaved" and cfg.n_micro_batches % cfg.pp:
        raise ConfigError(f"megatron's interleaved schedule needs the micro-batch count ({cfg.n_micro_batches}) to divide by --pp {cfg.pp}")


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("reference", "baselines.reference", dims=(), processes=lambda c: 1,
                   description="single-process training of the whole model: the reference every system is verified against"),
        SystemSpec("torch_pipe", "baselines.torch_pipe", dims=("pp", "dp"), schedules=("gpipe", "1f1b", "interleaved"),
                   check=_check_torch_pipe,
                   description="torch.distributed.pipelining; data parallel with FSDP2 on the dp mesh dimension"),
        SystemSpec("ours", "ours.system", dims=("pp", "dp"),
                   description="token-level pipeline (TeraPipe) with all-reduce or parameter-server data parallelism"),
        SystemSpec("fairscale_fsdp", "baselines.fairscale_fsdp", dims=("pp", "dp"), processes=lambda c: c.dp,
                   devices_per_process=lambda c: c.pp,
                   description="fairscale Pipe over each process's local devices, FullyShardedDataParallel across processes"),
        SystemSpec("megatron", "baselines.megatron", dims=("pp", "tp", "dp"), schedules=("1f1b", "interleaved"),
                   check=_check_megatron, description="megatron-core tensor/pipeline/data parallelism"),
    )
}


def get_system(name: str) -> SystemSpec:
    from runners.config import ConfigError

    try:
        return SYSTEMS[name]
    except KeyError:
        raise ConfigError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}") from None

"""What one run is: ``RunConfig`` (the fields every run has) and ``SystemOptions`` (the fields one
system declares for itself). Plain data and no torch: the run command builds and judges a request
with these before anything heavy is imported.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from workload.configs import ModelConfig, OptimizerConfig

# Fields of RunConfig that do not change what a run measures: two runs that differ only in these
# are the same measurement (a sweep runs it once; a report keeps the newest).
VOLATILE_FIELDS = frozenset({"verify", "timeout", "device"})


class ConfigError(ValueError):
    """A request that cannot run; the message is one line for the user."""


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, identity: bool = True,
           output_path: bool = False) -> Any:
    """Declare one field of a system's options.

    ``help`` is its one line under the system's heading in ``--help``; ``choices`` the values it
    accepts; ``parse`` turns the command line's text into the value (default: the type of
    ``default``; a bool default makes a switch); ``identity=False`` keeps it out of the run's
    identity (a trace file does not change what a run measures); ``output_path`` marks a file the
    run writes, which the run command checks is writable before launching."""
    return field(default=default, metadata=dict(help=help, choices=choices, parse=parse, metavar=metavar,
                                                identity=identity, output_path=output_path))


@dataclass(frozen=True)
class SystemOptions:
    """The base of a system's own options: a frozen dataclass whose fields are declared with
    ``option``. A system with nothing of its own uses this class as it is."""

    def check(self, config: RunConfig) -> None:
        """Raise ConfigError (one line) if the system cannot run ``config``. Systems override it."""

    def lossy(self) -> str | None:
        """What these options round beyond the precision policy (e.g. 'bf16 wire'), or None: the run
        is exact. ``--verify`` judges a lossy run with a tolerance of its own and says so."""
        return None

    @classmethod
    def declared(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def identity(self) -> dict[str, Any]:
        """The options that are part of the run's identity."""
        return {f.name: getattr(self, f.name) for f in self.declared() if f.metadata.get("identity", True)}

    def output_paths(self) -> list[tuple[str, str]]:
        """(option name, path) of every file the run will write."""
        return [(f.name, getattr(self, f.name)) for f in self.declared()
                if f.metadata.get("output_path") and getattr(self, f.name) is not None]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SystemOptions:
        known = {f.name for f in cls.declared()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _plain(value: Any) -> Any:
    """As JSON would give it back (tuples become lists)."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class RunConfig:
    system: str
    model: ModelConfig
    batch_size: int  # per pipeline (data-parallel replica), as in the seed; global batch = batch_size * dp
    micro_batch_size: int
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel degree
    dp: int = 1  # data-parallel degree (pipelines)
    steps: int = 10  # measured steps
    warmup: int = 2  # steps run before the measured ones, excluded from timing
    mixed_precision: bool = False  # fp16 + loss scaling on CUDA, bf16 autocast on CPU
    recompute: bool = False  # activation recomputation
    network: str = "none"  # a network profile of network_emulation; "none": no emulation
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: str | None = None  # a text file (byte-level tokens); synthetic tokens when None
    device: str = "auto"  # auto | cpu | cuda
    verify: bool = False  # also train the single-process reference and compare
    timeout: float = 3600.0  # seconds before the run is stopped and recorded as timeout
    eval_every: int = 0  # evaluate the held-out loss before the first step and every N steps (0: never)
    target_loss: float | None = None  # stop once an eval loss is at or below this (needs eval_every)
    options: SystemOptions = field(default_factory=SystemOptions)  # the system's own options

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp

    @property
    def n_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def precision(self) -> str:
        return "mixed" if self.mixed_precision else "fp32"

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any], options: type[SystemOptions] = SystemOptions) -> RunConfig:
        """The inverse of ``to_dict``; ``options`` is the class of the system's options."""
        d = dict(d)
        d["model"] = ModelConfig(**d["model"])
        d["optimizer"] = OptimizerConfig(**d["optimizer"])
        d["options"] = options.from_dict(d.get("options") or {})
        return cls(**d)

    def identity(self) -> dict[str, Any]:
        """What identifies the measurement: every field but the volatile ones, and of the system's
        options only those that are part of its identity."""
        d = _plain(asdict(self.replace(options=SystemOptions())))
        for name in VOLATILE_FIELDS:
            del d[name]
        d["options"] = _plain(self.options.identity())
        return d

    def key(self) -> str:
        """The run's identity as one string (sorted JSON): a sweep skips a key already recorded,
        a report cell shows the newest record of its key."""
        return json.dumps(self.identity(), sort_keys=True)


@dataclass(frozen=True)
class PipelineOptions(SystemOptions):
    """A pipeline schedule and its model chunks per rank, as pipeline systems declare them. A
    subclass redeclares ``schedule`` with its own default and choices, and lists in ``CHUNKED`` the
    schedules that place several model chunks on every rank."""

    CHUNKED = frozenset({"interleaved"})
    schedule: str = option("gpipe", "pipeline schedule")
    virtual_pp: int | None = option(None, "model chunks per rank (default 2 with a schedule that places several "
                                          "per rank, else 1)", parse=int, metavar="V")

    def __post_init__(self) -> None:
        if self.virtual_pp is None:
            object.__setattr__(self, "virtual_pp", 2 if self.schedule in self.CHUNKED else 1)

    def check(self, config: RunConfig) -> None:
        if self.schedule in self.CHUNKED and self.virtual_pp < 2:
            raise ConfigError(f"--schedule {self.schedule} needs --virtual-pp >= 2 (model chunks per rank)")
        if self.schedule not in self.CHUNKED and self.virtual_pp != 1:
            raise ConfigError(f"--virtual-pp > 1 needs a schedule that places several model chunks per rank "
                              f"({', '.join(sorted(self.CHUNKED))})")
        stages = config.pp * self.virtual_pp
        if config.model.n_layer % stages:
            raise ConfigError(f"{config.model.n_layer} layers do not divide into {stages} pipeline stages "
                              f"(--pp {config.pp} x --virtual-pp {self.virtual_pp})")

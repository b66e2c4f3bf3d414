"""The registry: one entry per system, the name of the module that declares it (its ``SPEC``).

Spec modules are light (no torch, no framework): the run command reads all of them to build its
command line; a system's training code is imported only inside its ranks. More systems can be
added without editing this file by naming their spec modules in ``$PIPEBENCH_SYSTEMS``
(comma-separated), which the ranks inherit.
"""
from __future__ import annotations

import functools
import importlib
import os

from contract.config import ConfigError
from contract.spec import SystemSpec

SYSTEM_MODULES = (
    "baselines.reference",
    "baselines.torch_pipe",
    "ours",
    "baselines.fairscale_fsdp",
    "baselines.megatron",
    "ours.diloco",
)
PLUGINS_ENV = "PIPEBENCH_SYSTEMS"


@functools.cache
def _load(modules: tuple[str, ...]) -> dict[str, SystemSpec]:
    specs: dict[str, SystemSpec] = {}
    for name in modules:
        spec = importlib.import_module(name).SPEC
        if spec.name in specs:
            raise ValueError(f"two systems named {spec.name!r} ({specs[spec.name].train} and {spec.train})")
        specs[spec.name] = spec
    return specs


def systems() -> dict[str, SystemSpec]:
    """Every registered system by name, in registry order."""
    extra = tuple(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())
    return _load(SYSTEM_MODULES + extra)


def get_system(name: str) -> SystemSpec:
    known = systems()
    try:
        return known[name]
    except KeyError:
        raise ConfigError(f"unknown system {name!r}; known: {', '.join(known)}") from None


def read_options(system: str, raw: dict) -> dict:
    """A record's options as its system reads them today: with the defaults of options the record
    predates (e.g. ours' schedule: gpipe); as recorded where the system or an option is not known."""
    try:
        return get_system(system).options.from_dict(raw).to_dict()
    except (ConfigError, TypeError, ValueError):
        return dict(raw)

"""The reference: single-process training of the whole model on the global batch, accumulated over
micro-batches. Every system's --verify and every parity test compares against it. With ``--diloco``
it trains DiLoCo's math in one process (``baselines.reference.outer``): diloco's --verify reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract import ConfigError, RunConfig, SystemSpec, option
from contract.outer import OuterStep, describe


@dataclass(frozen=True)
class ReferenceOptions(OuterStep):
    """The outer step's options, used under ``--diloco`` only."""

    diloco: bool = option(False, "DiLoCo's math in one process: --dp D replicas, each trained by the reference's own "
                                 "step on its rows of the global batch, the outer step (--inner-steps ...) applied "
                                 "to them (--pp: the stages whose fragments Streaming DiLoCo syncs); diloco's "
                                 "--verify reference")

    def identity(self) -> dict[str, Any]:
        return super().identity() if self.diloco else {}  # the plain reference: the same run as ever

    def check(self, config: RunConfig) -> None:
        if self.diloco:
            super().check(config)
        elif config.pp > 1 or config.dp > 1:
            raise ConfigError("reference: --pp and --dp > 1 only with --diloco (one process trains the whole model)")


def label(config: RunConfig) -> str:
    return f"reference {describe(config.options)}" if config.options.diloco else "reference"


SPEC = SystemSpec(
    name="reference",
    train="baselines.reference.train:train",
    description="single-process training of the whole model: the reference every system is verified against",
    options=ReferenceOptions,
    dims=("pp", "dp"),  # under --diloco only: D replicas, P stages' fragments (one process all the same)
    processes=lambda config: 1,
    label=label,
    role="reference",
)

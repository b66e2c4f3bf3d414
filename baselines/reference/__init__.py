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
    """The reference's modes: DiLoCo's math (``--diloco``, with the outer step's options) and half weights."""

    diloco: bool = option(False, "DiLoCo's math in one process: --dp D replicas, each trained by the reference's own "
                                 "step on its rows of the global batch, the outer step (--inner-steps ...) applied "
                                 "to them (--pp: the stages whose fragments Streaming DiLoCo syncs); diloco's "
                                 "--verify reference")
    half_weights: bool = option(False, "under --precision bf16 / fp16: the weights and activations in the half type, "
                                       "fp32 main parameters and gradients accumulated in fp32 (as megatron), not "
                                       "autocast; a half-weights system's --verify reference")

    def identity(self) -> dict[str, Any]:
        """The modes set and, under --diloco, the outer step's options: the plain reference's identity
        is empty, as it was before it had options."""
        outer = {f.name for f in OuterStep.declared()}
        return {k: v for k, v in super().identity().items()
                if (k in outer and self.diloco) or (k in ("diloco", "half_weights") and v)}

    def check(self, config: RunConfig) -> None:
        if self.half_weights and config.precision == "fp32":
            raise ConfigError("reference: --half-weights needs --precision bf16 or fp16")
        if self.diloco:
            if self.half_weights:
                raise ConfigError("reference: --diloco runs under autocast, not --half-weights")
            super().check(config)
        elif config.pp > 1 or config.dp > 1:
            raise ConfigError("reference: --pp and --dp > 1 only with --diloco (one process trains the whole model)")


def label(config: RunConfig) -> str:
    o: ReferenceOptions = config.options
    return "reference" + (f" {describe(o)}" if o.diloco else "") + (" half weights" if o.half_weights else "")


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

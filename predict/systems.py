"""The systems a prediction knows: every system of the registry (``contract.registry``), and the seed's
GPipe as DT-FM ran it (DS3Lab's Decentralized_FM_alpha), which only the simulator runs: it has no
runner here, so it is declared in this one place, the way a system declares itself (its options and
``SPEC``), and a scenario names it as any other system.

DT-FM's GPipe is ours' engine at one token slice in the GPipe order (every forward, then every
backward), its activations sent in the precision's type; its data parallelism DT-FM's: ``central_ps``
(a parameter server on dp_rank 0 over NCCL: per 25 MB bucket a chain reduce, the server's step, a chain
broadcast), or ``sharded_ps`` and ``allreduce`` as ours runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import SystemOptions, SystemSpec, option
from contract.registry import systems
from ours import OursOptions


@dataclass(frozen=True)
class GPipeOptions(SystemOptions):
    schedule: str = option("gpipe", "every forward, then every backward", choices=("gpipe",))
    dp_mode: str = option("central_ps", "DT-FM's data parallelism: its central parameter server (a chain reduce, "
                                        "the step, a chain broadcast), or ours' sharded PS or all-reduce",
                          choices=OursOptions.choices("dp_mode"))


GPIPE = SystemSpec(
    name="gpipe",
    train="",  # no runner: predicted only
    description="the seed's GPipe as DT-FM ran it, with its parameter servers (predicted only: no runner)",
    options=GPipeOptions,
    dims=("pp", "tp", "dp"),
)


def prediction_systems() -> dict[str, SystemSpec]:
    """Every system a prediction may name: the registry's, then the predicted-only ones."""
    return {**systems(), GPIPE.name: GPIPE}

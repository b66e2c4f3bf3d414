"""The systems a prediction knows: every system of the registry (``contract.registry``), the seed's
GPipe as DT-FM ran it (DS3Lab's Decentralized_FM_alpha), and megatron's zero-bubble schedules, which
only the simulator runs: they have no runner here, so they are declared in this one place, the way a
system declares itself (its options and ``SPEC``), and a scenario names them as any other system or
schedule.

DT-FM's GPipe is ours' engine at one token slice in the GPipe order (every forward, then every
backward), its activations sent in the precision's type; its data parallelism DT-FM's: ``central_ps``
(a parameter server on dp_rank 0 over NCCL: per 25 MB bucket a chain reduce, the server's step, a chain
broadcast), or ``sharded_ps`` and ``allreduce`` as ours runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from baselines.megatron import MegatronOptions
from contract import SystemOptions, SystemSpec, option
from contract.registry import get_system, systems
from ours import OursOptions
from predict.pipeline_orders import ZERO_BUBBLE


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


@dataclass(frozen=True)
class MegatronPredictedOptions(MegatronOptions):
    """megatron's options with the schedules Qi et al. built on Megatron-LM ("Zero Bubble Pipeline
    Parallelism", ICLR 2024; sail-sg/zero-bubble-pipeline-parallelism): ``zb1p`` (ZB-H1) and ``zb2p``
    (ZB-H2), their backward split into input and weight gradients, the orders of
    ``predict.pipeline_orders``. megatron-core 0.16.1 has neither, so the run command, which takes
    megatron's options from the registry, refuses them as schedules it does not know."""

    schedule: str = option("1f1b", "pipeline schedule (zb1p, zb2p: the zero-bubble ZB-H1 and ZB-H2, predicted only)",
                           choices=MegatronOptions.choices("schedule") + ZERO_BUBBLE)


MEGATRON = replace(get_system("megatron"), options=MegatronPredictedOptions)


def prediction_systems() -> dict[str, SystemSpec]:
    """Every system a prediction may name: the registry's (megatron with its predicted-only schedules),
    then the predicted-only ones."""
    return {**systems(), MEGATRON.name: MEGATRON, GPIPE.name: GPIPE}


def runnable(system: str, schedule: str | None) -> bool:
    """Whether the run command runs ``system`` with ``schedule`` (None: the system's default); False for
    what only the simulator runs (the seed's GPipe, megatron's zero-bubble schedules)."""
    spec = systems().get(system)
    if spec is None:
        return False
    return schedule is None or schedule in spec.options.choices("schedule")


"""diloco_sim: DiLoCo / Streaming DiLoCo of --dp replicas simulated in one process, without torchft
(``ours.diloco.simulate``): what ``diloco --verify`` compares against. It takes diloco's algorithm options, and
--pp as the number of stages whose fragments Streaming DiLoCo syncs (one process all the same)."""
from __future__ import annotations

from contract import SystemSpec
from ours.diloco import DiLoCoAlgorithm, label

SPEC = SystemSpec(
    name="diloco_sim",
    train="ours.diloco.simulate:train",
    description="DiLoCo / Streaming DiLoCo of --dp replicas simulated in one process, without torchft "
                "(diloco's --verify reference)",
    options=DiLoCoAlgorithm,
    dims=("pp", "dp"),  # --pp: the stages whose fragments it simulates (it runs the whole model)
    processes=lambda config: 1,
    label=label,
    role="reference",
)

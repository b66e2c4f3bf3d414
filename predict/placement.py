"""Where each system puts its ranks on a GPU cluster: the global GPU rank of (dp_rank, stage, tp_rank),
and from it the node, as the systems number them when GPUs are filled node by node.

- megatron: tensor-parallel innermost, then data parallel, then the pipeline (megatron-core's default
  order ``tp-cp-ep-dp-pp``): rank = stage * D * T + dp_rank * T + tp_rank;
- ours and the seed's GPipe (ours' engine): a stage's tensor-parallel ranks next to each other, then
  the stages, then the replicas (``ours.tp.rank_of``): rank = (dp_rank * P + stage) * T + tp_rank;
- torch_pipe: rank = dp_rank * P + stage (its device mesh ("dp", "pp"));
- fairscale_fsdp: one process per pipeline driving its P GPUs: rank = dp_rank * P + stage.

The simulator runs one simulated rank per (dp_rank, stage), numbered dp_rank * P + stage, standing for
its T tensor-parallel GPUs; its host is the node of its tp_rank 0, its network cards those its T GPUs
are mapped to (``Cluster.cards``).
"""
from __future__ import annotations

from predict.run_spec import RunSpec


def gpu_rank(system: str, d: int, s: int, t: int, pp: int, dp: int, tp: int) -> int:
    if system == "megatron":
        return (s * dp + d) * tp + t
    return (d * pp + s) * tp + t


def hosts_of(spec: RunSpec) -> tuple[int, ...]:
    """The node of every simulated rank (dp_rank * P + stage) of ``spec`` on its cluster."""
    c = spec.cluster
    tp = spec.tp
    if tp * spec.pp * spec.dp > c.gpus:
        raise ValueError(f"{spec.system} T-{tp} P-{spec.pp} D-{spec.dp} needs {tp * spec.pp * spec.dp} GPUs; the "
                         f"cluster has {c.nodes} x {c.gpus_per_node}")
    return tuple(gpu_rank(spec.system, d, s, 0, spec.pp, spec.dp, tp) // c.gpus_per_node
                 for d in range(spec.dp) for s in range(spec.pp))


def cards_of(spec: RunSpec) -> tuple[tuple[int, ...], ...]:
    """The network cards of every simulated rank's GPUs (dp_rank * P + stage) of ``spec`` on its node."""
    c = spec.cluster
    return tuple(c.cards(gpu_rank(spec.system, d, s, 0, spec.pp, spec.dp, spec.tp) % c.gpus_per_node, spec.tp)
                 for d in range(spec.dp) for s in range(spec.pp))

"""Torch Pipe: torch.distributed.pipelining over P ranks, data parallel over D pipelines with FSDP2
``fully_shard`` on the dp mesh dimension. The training code is ``baselines.torch_pipe.train``.

Schedules (torch 2.13's classes) and the stages each rank holds (``stage_indices``):

| schedule | class | stages of rank r (P ranks, V chunks per rank) | micro-batches it can run (M) |
| --- | --- | --- | --- |
| gpipe | ScheduleGPipe | r | any |
| 1f1b | Schedule1F1B | r | M >= P |
| interleaved | ScheduleInterleaved1F1B | looped: r, r + P, ..., r + (V-1) P | M < 2P or a multiple of M // P |
| zb | ScheduleInterleavedZeroBubble | looped, as interleaved | as interleaved |
| zbv | ScheduleZBVZeroBubble | the V: r and 2P - 1 - r (V = 2) | any |
| dualpipev | ScheduleDualPipeV | the V, as zbv | M >= 2P (the number of stages) |

The micro-batch rules are the classes' own (their constructors raise on the others); ``check``
judges them before launching.
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import ConfigError, PipelineOptions, RunConfig, SystemSpec, option

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
LOOPED = frozenset({"interleaved", "zb"})  # several chunks per rank, placed round-robin
V_SHAPED = frozenset({"zbv", "dualpipev"})  # exactly two chunks per rank, placed in a V


def stage_indices(schedule: str, pp: int, pp_rank: int, virtual_pp: int) -> tuple[int, ...]:
    """The pipeline stages (of pp * virtual_pp) that rank pp_rank holds under ``schedule``, in the
    order the schedule's stage list expects (its chunks by increasing depth)."""
    if schedule in V_SHAPED:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + v * pp for v in range(virtual_pp))


def micro_batch_rule(schedule: str, pp: int, n_micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run ``n_micro_batches`` micro-batches on ``pp`` ranks (None if it can)."""
    M = n_micro_batches
    if schedule == "1f1b" and M < pp:
        return f"needs at least as many micro-batches as pipeline ranks (--pp {pp}), got {M}"
    if schedule == "dualpipev" and M < 2 * pp:
        return f"needs at least as many micro-batches as pipeline stages (2 x --pp {pp} = {2 * pp}), got {M}"
    if schedule in LOOPED:
        rounds = max(1, M // pp)
        if M % rounds:
            return (f"runs the micro-batches in rounds of about --pp {pp}: {M} micro-batches do not divide into "
                    f"{rounds} rounds (use fewer than {2 * pp} or a multiple of {pp})")
    return None


@dataclass(frozen=True)
class TorchPipeOptions(PipelineOptions):
    CHUNKED = LOOPED | V_SHAPED
    schedule: str = option("gpipe", "pipeline schedule (zb: interleaved zero bubble; zbv, dualpipev: V-shaped, "
                                    "2 chunks per rank)", choices=SCHEDULES)

    def check(self, config: RunConfig) -> None:
        if self.schedule in V_SHAPED and self.virtual_pp != 2:
            raise ConfigError(f"torch_pipe's {self.schedule} schedule places exactly 2 model chunks per rank "
                              f"(the V shape), got --virtual-pp {self.virtual_pp}")
        super().check(config)
        why = micro_batch_rule(self.schedule, config.pp, config.n_micro_batches)
        if why:
            raise ConfigError(f"torch.distributed.pipelining's {self.schedule} schedule {why} "
                              f"(--batch-size {config.batch_size} / --micro-batch-size {config.micro_batch_size})")


SPEC = SystemSpec(
    name="torch_pipe",
    train="baselines.torch_pipe.train:train",
    description="torch.distributed.pipelining; data parallel with FSDP2 on the dp mesh dimension",
    options=TorchPipeOptions,
    dims=("pp", "dp"),
    label=lambda config: f"torch_pipe {config.options.schedule}",
)

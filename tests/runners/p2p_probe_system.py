"""A two-rank system that only exchanges one message each way per step, in the pattern its option
names; registered for the tests through $PIPEBENCH_SYSTEMS, to show what ``--p2p-semantics nccl``
catches (``runners.nccl_rules``) and plain gloo lets pass:

- ``cross``: each rank posts its receive from the other, then its send to it. gloo runs both at once;
  under NCCL a posted receive holds back the pair's later operations, so both ranks wait forever.
- ``mismatch``: rank 0 sends a 2 x 3 tensor, rank 1 receives a 3 x 2 one: the same bytes, so gloo
  delivers it; NCCL would too, silently reshaped, where the run under NCCL's rules fails naming both.
- ``both``: the one, then the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from contract import RunConfig, SystemOptions, SystemSpec, option

PATTERNS = ("cross", "mismatch", "both")


@dataclass(frozen=True)
class ProbeOptions(SystemOptions):
    probe_pattern: str = option("cross", "the messages of a step", choices=PATTERNS)


def train(config: RunConfig, ctx):
    import torch
    import torch.distributed as dist

    from contract.rank import StepOutput, run_steps

    other = 1 - ctx.rank

    def step(_: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        pattern = config.options.probe_pattern
        if pattern in ("cross", "both"):
            got = torch.empty(4)
            recv = dist.irecv(got, other)
            send = dist.isend(torch.full((4,), float(ctx.rank)), other)
            recv.wait()
            send.wait()
            assert got.eq(other).all(), got
        if pattern in ("mismatch", "both"):
            if ctx.rank == 0:
                dist.isend(torch.zeros(2, 3), 1).wait()
            else:
                dist.irecv(torch.empty(3, 2), 0).wait()
        return StepOutput(loss=0.0 if ctx.rank == 0 else None)

    return run_steps(ctx, 0, step)


SPEC = SystemSpec(
    name="p2p_probe",
    train="tests.runners.p2p_probe_system:train",
    description="two ranks exchanging one message each way per step (tests of --p2p-semantics)",
    options=ProbeOptions,
    processes=lambda config: 2,
)

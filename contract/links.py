"""A link: one direction between two ranks (or hosts, stages, nodes). What it costs (``Link``: the one
definition the planner, the layout chooser and the simulator share, with the closed forms of the
collectives over it), and how point-to-point traffic meets NCCL's rules on it (a process group per link
and direction).

NCCL matches a pair's messages in the order they were issued (no tags) and runs a pair's operations
on one stream per process group, in issue order: a posted receive holds back every later operation
of the pair on that group, its sends included (shared/notes/nccl-rules.md). Traffic that goes one
way only on a group of its own is free of both hazards: a rank only sends on it, its peer only
receives, so receives can be posted as far ahead as one likes without holding back a send, and
messages match as long as the receiver posts its receives in the order the sender issues its sends.

NCCL creates a pair's communicator at the pair's first operation, which blocks the host until the
peer issues one too: two ranks whose first operations on two links wait for each other's second
would deadlock there. So each link is opened where its group is made, both ends at once, by one
message.

No torch at import (the planner and the simulator read ``Link``); the process groups import it.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

Ends = tuple[int, int]  # a link's (source, destination) global ranks


# What a link given by a person may be (a cluster's, a planner's flag): a one-way delay of at most 10 s (the
# network profiles' limit, network_emulation.profiles.MAX_DELAY_MS) and 1 Mbit/s to 100 Tbit/s; beyond
# these a number is a slip of a unit, not a network.
MAX_GIVEN_DELAY_MS = 10_000.0
GIVEN_GBPS = (1e-3, 100_000.0)


def given_link_error(delay_ms: float, gbps: float) -> str | None:
    """Why a link of ``delay_ms`` and ``gbps`` given by a person is absurd (one line), or None."""
    if not (math.isfinite(delay_ms) and 0 <= delay_ms <= MAX_GIVEN_DELAY_MS):
        return f"delay {delay_ms:g} ms is absurd (0 to {MAX_GIVEN_DELAY_MS:g} ms)"
    if not (math.isfinite(gbps) and GIVEN_GBPS[0] <= gbps <= GIVEN_GBPS[1]):
        return f"bandwidth {gbps:g} Gbit/s is absurd ({GIVEN_GBPS[0]:g} to {GIVEN_GBPS[1]:g} Gbit/s)"
    return None


@dataclass(frozen=True)
class Link:
    """One direction of a link.

    latency: one-way delay in seconds (wire and software: the time from a message's last byte leaving
        the sender to its arrival); bandwidth: bytes per second of the sender's egress (shared by every
        message the host sends; inf: no limit); in_flight: how many messages may be on the way on this
        link and direction at once (a message starts only when fewer than that are still travelling),
        None for no limit; stall_bytes: where an emulated link holds messages back, the last byte of an
        n-byte message cannot arrive before min(1, n / stall_bytes) one-way delays plus the latency after
        it started, however fast the wire (``predict.gloo_stall`` measures it with gloo; the virtual
        cluster had one of about 25 KiB before it set TCP CUBIC and no slow start after idle, and has
        none since); None: no stall."""

    latency: float = 0.0
    bandwidth: float = math.inf
    in_flight: int | None = None
    stall_bytes: float | None = None

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"link latency must be a finite number >= 0 s, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if self.in_flight is not None and self.in_flight < 1:
            raise ValueError(f"link in_flight must be >= 1 or None, got {self.in_flight!r}")

    @classmethod
    def from_ms_gbps(cls, delay_ms: float, gbps: float, in_flight: int | None = None) -> Link:
        return cls(delay_ms / 1e3, gbps * 1e9 / 8, in_flight)

    def stall(self, nbytes: float) -> float:
        if not self.stall_bytes:
            return 0.0
        return self.latency * min(1.0, nbytes / self.stall_bytes)

    def transfer(self, nbytes: float) -> float:
        """Seconds from the first byte leaving to the last byte arriving, on an idle link."""
        return max(nbytes / self.bandwidth, self.stall(nbytes)) + self.latency

    def collective(self, op: str, n: int, nbytes: float) -> float:
        """Seconds of one collective of ``nbytes`` over ``n`` ranks joined by this link, in closed form:
        a ring all-reduce 2(n - 1) steps of nbytes / n, a reduce-scatter or all-gather n - 1 of them, a
        reduce or broadcast a chain of n - 1 hops pipelined over the whole message."""
        if n < 2:
            return 0.0
        a, B = self.latency, self.bandwidth
        if op == "allreduce":
            return 2 * (n - 1) * (a + nbytes / (n * B))
        if op in ("reduce_scatter", "allgather"):
            return (n - 1) * (a + nbytes / (n * B))
        if op in ("reduce", "broadcast"):
            return (n - 1) * a + nbytes / B
        raise ValueError(f"unknown collective {op!r}")


def posts_ahead(device: torch.device) -> bool:
    """Whether a link's receives are posted ahead of their use (a step or a use ahead) on ``device``.
    gloo (CPU) moves a message only once its receive is posted: ahead. NCCL (CUDA): at the use; a
    receive posted ahead is an NCCL kernel spinning on the GPU until its message comes, across the
    optimizer step and the step's end, and CUDA promises no progress of one stream beside another's
    spinning kernel (NVIDIA/nccl #783, #1766)."""
    return device.type == "cpu"


def link_groups(links: Iterable[Ends], device: torch.device,
                timeout: datetime.timedelta | None = None) -> dict[Ends, dist.ProcessGroup]:
    """A two-rank process group of its own for each link (source, destination), opened by one message
    on ``device`` (see the module docstring); returns those this rank is an end of. Collective over the
    world: every rank passes the same links (the whole world's), and every rank creates every group,
    in one order (a group's other ranks only count it). No links (one process): no process group needed.
    ``timeout``: each operation's (``Context.op_timeout``; None: the backend's default)."""
    import torch
    import torch.distributed as dist

    links = sorted(set(links))
    if not links:
        return {}
    me = dist.get_rank()
    groups = {}
    for src, dst in links:
        if src == dst:
            raise ValueError(f"a link needs two ranks, got {src} -> {dst}")
        group = dist.new_group([src, dst], timeout=timeout)
        if me == src:
            dist.send(torch.zeros(1, device=device), dst, group=group)
        elif me == dst:
            dist.recv(torch.empty(1, device=device), src, group=group)
        if me in (src, dst):
            groups[src, dst] = group
    return groups

"""A process group per link and direction: how point-to-point traffic meets NCCL's rules.

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
"""
from __future__ import annotations

import datetime
from typing import Iterable

import torch
import torch.distributed as dist

Link = tuple[int, int]  # (source, destination) global ranks


def posts_ahead(device: torch.device) -> bool:
    """Whether a link's receives are posted ahead of their use (a step or a use ahead) on ``device``.
    gloo (CPU) moves a message only once its receive is posted: ahead. NCCL (CUDA): at the use; a
    receive posted ahead is an NCCL kernel spinning on the GPU until its message comes, across the
    optimizer step and the step's end, and CUDA promises no progress of one stream beside another's
    spinning kernel (NVIDIA/nccl #783, #1766)."""
    return device.type == "cpu"


def link_groups(links: Iterable[Link], device: torch.device,
                timeout: datetime.timedelta | None = None) -> dict[Link, dist.ProcessGroup]:
    """A two-rank process group of its own for each link (source, destination), opened by one message
    on ``device`` (see the module docstring); returns those this rank is an end of. Collective over the
    world: every rank passes the same links (the whole world's), and every rank creates every group,
    in one order (a group's other ranks only count it). No links (one process): no process group needed.
    ``timeout``: each operation's (``Context.op_timeout``; None: the backend's default)."""
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

"""A cluster's hostfile and where a run's ranks go on its hosts.

The hostfile is DeepSpeed's and Open MPI's format: one host per line, the first is node 0, each
with its GPU slots::

    node01 slots=1        # a p3.2xlarge: one V100
    node02 slots=8        # a p3.16xlarge
    node03                # a bare name is one slot

Blank lines and ``#`` comments are ignored; ``--nproc-per-node N`` gives every host N slots instead.

``place`` puts a run's ranks on the hosts: every node runs the same number of ranks (torchrun's
static rendezvous), as few per node as fit, so that the links the run measures cross nodes; a
sweep's ``nproc_per_node`` hint fixes the ranks per node instead (the seed's Megatron runs: 8 on one
8-GPU machine). A run that cannot be placed raises ``DoesNotFit`` with the reason, e.g.
``does not fit: needs 48 GPUs, hostfile has 12``.

Ranks go to nodes in torchrun's order (node k runs ranks k*r .. k*r + r - 1). With more than one rank
per node, which links stay inside a node is the system's rank order: ours and Torch Pipe number a
pipeline's stages consecutively (they share a node), Megatron its tensor-parallel group.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runners.sweep.plan import SweepError


class DoesNotFit(Exception):
    """A run that the hosts cannot hold; the message is the record's error (``does not fit: ...``)."""


@dataclass(frozen=True)
class Host:
    name: str  # the ssh name (a host name, an address, or an ssh_config Host)
    slots: int = 1  # GPUs (on CPU: ranks' devices) this host offers


@dataclass(frozen=True)
class NodePlacement:
    """The nodes a run uses (node 0 first: the rendezvous) and the ranks each runs."""

    hosts: tuple[str, ...]
    ranks_per_node: int

    @property
    def nnodes(self) -> int:
        return len(self.hosts)


def parse_hostfile(path: str | os.PathLike, slots: int | None = None) -> list[Host]:
    """The hosts of ``path`` in order. ``slots`` (``--nproc-per-node``) overrides every host's slots.
    A malformed file raises SweepError naming the line."""
    if slots is not None and slots < 1:
        raise SweepError(f"--nproc-per-node must be >= 1, got {slots}")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SweepError(f"cannot read hostfile {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SweepError(f"hostfile {path} is not text") from None
    hosts: list[Host] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, fields = words[0], words[1:]
        if name.startswith("-") or "=" in name:
            raise SweepError(f"{path}:{n}: bad host name {name!r}")
        count = 1
        for f in fields:
            key, _, value = f.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise SweepError(f"{path}:{n}: expected 'HOST [slots=N]' with N >= 1, got {line.strip()!r}")
            count = int(value)
        if any(h.name == name for h in hosts):
            raise SweepError(f"{path}:{n}: host {name!r} is listed twice")
        hosts.append(Host(name, slots if slots is not None else count))
    if not hosts:
        raise SweepError(f"hostfile {path} lists no hosts")
    return hosts


def place(world: int, hosts: Sequence[Host], *, devices_per_process: int = 1, ranks_per_node: int | None = None,
          emulated: bool = False, source: str = "hostfile") -> NodePlacement:
    """Nodes for ``world`` ranks of ``devices_per_process`` GPUs each: the fewest ranks per node
    (``ranks_per_node`` when given) that enough hosts have the slots for, the hosts taken in
    hostfile order. Under an emulated network a run of several ranks needs two nodes or more (its
    links are shaped on the nodes' interfaces). Raises DoesNotFit; its reason names the hosts' ``source``
    (the hostfile, or a Slurm allocation)."""
    need, total = world * devices_per_process, sum(h.slots for h in hosts)
    if need > total:
        raise DoesNotFit(f"does not fit: needs {need} GPUs, {source} has {total}")
    if ranks_per_node is not None and world % ranks_per_node:
        raise DoesNotFit(f"does not fit: {world} ranks do not divide into nodes of {ranks_per_node}")
    choices = [ranks_per_node] if ranks_per_node else [r for r in range(1, world + 1) if world % r == 0]
    for r in choices:
        usable = [h.name for h in hosts if h.slots >= r * devices_per_process]
        if len(usable) >= world // r:
            if emulated and world > 1 and world // r < 2:
                raise DoesNotFit(f"does not fit: under an emulated network its {world} ranks must span 2 nodes or "
                                 f"more, and only one host has the slots for them")
            return NodePlacement(tuple(usable[:world // r]), r)
    largest = max(h.slots for h in hosts)
    if ranks_per_node:
        r, g = ranks_per_node, ranks_per_node * devices_per_process
        have = sum(h.slots >= g for h in hosts)
        raise DoesNotFit(f"does not fit: needs {world // r} node(s) of {g} GPUs ({r} ranks per node), "
                         f"{source} has {have} (at most {largest} GPUs per host)")
    raise DoesNotFit(f"does not fit: {world} ranks of {devices_per_process} GPU(s) need nodes of equal rank counts; "
                     f"the {source}'s {len(hosts)} hosts ({total} GPUs, at most {largest} per host) cannot hold them")

"""Collectives as the simulator runs them.

gloo (the CPU runs here): message by message, as gloo's own algorithms post them, so that every
segment pays gloo's receive-posted handshake on the emulated links:
- ``ring_reduce_scatter`` / ``allreduce``: gloo's ring (segments of at most 1 MiB, at least 2 per rank,
  two sends and two receives in flight; each rank sends to rank - 1 and receives from rank + 1),
  ``allreduce`` adds the ring allgather of the same segments;
- ``allgather``: ring, n - 1 steps of one chunk.

nccl (GPU clusters): NCCL's rings, message by message, the group ordered host by host (as NCCL
builds its rings: one crossing of each host's network card per direction): all-reduce 2(n-1) steps,
reduce-scatter and all-gather n-1, each step a chunk of S/n to the next member and one from the
previous; reduce and broadcast a chain that streams S in ``CHAIN_PIECES`` pieces, each forwarded as it
arrives. Every message goes over the link it crosses (NVLink inside a node, the nodes' network cards
between them), so concurrent collectives share what they share. Where a ring's GPUs on a node reach
several cards (``card``: a rank's cards), NCCL runs a channel over each: the ring is split into as
many rings of nbytes / C, each with its node segments rotated so that it leaves and enters every
node through other cards, their steps side by side. ``Link.collective`` gives the same costs
over one idle link (``contract.links``: ring all-reduce 2(n-1)(a + S/(nB)); reduce-scatter / all-gather
(n-1)(a + S/(nB)); chain reduce / broadcast (n-1) a + S/B); groups of more than ``MAX_RING`` ranks, and rings
across nodes that would post more than ``RING_MESSAGES`` messages, take it (a ``Group``).
"""
from __future__ import annotations

from typing import Hashable

from predict.simulator import Group, Recv, Send, Wait
from contract.links import Link

MAX_SEGMENT = 1 << 20  # gloo's kMaxSegmentSize for reduce and allreduce
ELEMENT = 4


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def ring_plan(total: int, n: int) -> tuple[int, int, int]:
    """gloo's (segment bytes, number of segments, segments per rank) for ``total`` bytes on n ranks."""
    seg = _round_up(min(-(-total // (2 * n)), MAX_SEGMENT // ELEMENT * ELEMENT), ELEMENT)
    seg = max(seg, ELEMENT)
    nseg = _round_up(max(-(-total // seg), 2 * n), n)
    return seg, nseg, nseg // n


def _pipelined(ranks: tuple[int, ...], me: int, tag: Hashable, phase: str, total: int, offsets, kind: str) -> list:
    """One ring phase of gloo's allreduce / reduce: iteration i posts the receive (from rank + 1) and
    the send (to rank - 1) of segment i and waits for those of iteration i - 2."""
    n = len(ranks)
    i_me = ranks.index(me)
    to, frm = ranks[(i_me - 1) % n], ranks[(i_me + 1) % n]
    seg, nseg, per = ring_plan(total, n)
    ops: list = []

    def lengths(i: int) -> tuple[int, int]:
        so, ro = offsets(i_me, i, seg, nseg, per)
        return min(seg, total - so), min(seg, total - ro)

    for i in range(nseg):
        if i >= 2:
            s_len, r_len = lengths(i - 2)
            keys = []
            if r_len > 0:
                keys.append((tag, phase, i - 2, frm, me))
            if s_len > 0:
                keys.append((tag, phase, i - 2, me, to))
            if keys:
                ops.append(Wait(tuple(keys), kind))
        if i < nseg - 2:
            s_len, r_len = lengths(i)
            if r_len > 0:
                ops.append(Recv((tag, phase, i, frm, me), frm, r_len))
            if s_len > 0:
                ops.append(Send((tag, phase, i, me, to), to, s_len))
    return ops


def _rs_offsets(rank: int, i: int, seg: int, nseg: int, per: int) -> tuple[int, int]:
    span = nseg * seg
    return (((rank + 1) * per + i) * seg) % span, (((rank + 2) * per + i) * seg) % span


def _ag_offsets(rank: int, i: int, seg: int, nseg: int, per: int) -> tuple[int, int]:
    span = nseg * seg
    return ((rank * per + i) * seg) % span, (((rank + 1) * per + i) * seg) % span


def ring_reduce_scatter(ranks, me, tag, nbytes: int, kind: str) -> list:
    if len(ranks) < 2 or nbytes <= 0:
        return []
    return _pipelined(tuple(ranks), me, tag, "rs", int(nbytes), _rs_offsets, kind)


def allreduce(ranks, me, tag, nbytes: int, kind: str) -> list:
    if len(ranks) < 2 or nbytes <= 0:
        return []
    ranks = tuple(ranks)
    return (_pipelined(ranks, me, tag, "rs", int(nbytes), _rs_offsets, kind)
            + _pipelined(ranks, me, tag, "ag", int(nbytes), _ag_offsets, kind))


def allgather(ranks, me, tag, nbytes: int, kind: str) -> list:
    """Ring allgather of ``nbytes`` in all (each rank contributes nbytes / n)."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2 or nbytes <= 0:
        return []
    i_me = ranks.index(me)
    to, frm = ranks[(i_me + 1) % n], ranks[(i_me - 1) % n]
    chunk = -(-int(nbytes) // n)
    ops: list = []
    for step in range(n - 1):
        rk, sk = (tag, "ag", step, frm, me), (tag, "ag", step, me, to)
        ops += [Recv(rk, frm, chunk), Send(sk, to, chunk), Wait((rk, sk), kind)]
    return ops


CHAIN_PIECES = 16
MAX_RING = 128
# A ring across nodes that would post more messages than this (n members x channels x 2(n-1) steps, per
# collective, per bucket) is taken in closed form too: it would outnumber the step's own messages by orders
# of magnitude, and a large data-parallel group's ring is bound by the cards it crosses, which the closed
# form counts. (The seed's six-node rings, 60 messages, stay simulated message by message.)
RING_MESSAGES = 1024


def nccl_ring(op: str, ranks: tuple, me: int, tag: Hashable, nbytes: float, kind: str,
              channels: tuple[tuple, ...] = ()) -> list:
    """Rank ``me``'s messages of one NCCL collective over ``ranks`` (in ring order; ``channels``: more
    ring orders of the same ranks, the bytes split evenly over them and ``ranks``, step by step)."""
    n = len(ranks)
    ops: list = []
    if op in ("allreduce", "reduce_scatter", "allgather"):
        steps = {"allreduce": 2 * (n - 1), "reduce_scatter": n - 1, "allgather": n - 1}[op]
        rings = (ranks, *channels)
        chunk = nbytes / n / len(rings)
        peers = [(r[(r.index(me) - 1) % n], r[(r.index(me) + 1) % n]) for r in rings]
        for k in range(steps):
            keys: list = []
            for c, (p, q) in enumerate(peers):
                rk, sk = (tag, op, k, p, me, c), (tag, op, k, me, q, c)
                ops += [Recv(rk, p, chunk), Send(sk, q, chunk)]
                keys += [rk, sk]
            ops.append(Wait(tuple(keys), kind))
        return ops
    if op in ("reduce", "broadcast"):  # a chain: toward ranks[0] (reduce) or away from it (broadcast)
        chain = list(reversed(ranks)) if op == "reduce" else list(ranks)
        j = chain.index(me)
        frm = chain[j - 1] if j > 0 else None
        to = chain[j + 1] if j + 1 < n else None
        piece = nbytes / CHAIN_PIECES
        sends = []
        for k in range(CHAIN_PIECES):
            if frm is not None:
                rk = (tag, op, k, frm, me)
                ops += [Recv(rk, frm, piece), Wait((rk,), kind)]
            if to is not None:
                sk = (tag, op, k, me, to)
                ops.append(Send(sk, to, piece))
                sends.append(sk)
        if sends:
            ops.append(Wait(tuple(sends), kind))
        return ops
    raise ValueError(f"unknown collective {op!r}")


def channels(order: tuple, host, card) -> tuple[tuple, ...]:
    """The rings NCCL adds to ``order`` (ranks grouped host by host) where a host's ranks reach several
    network cards (``card``: rank -> its cards): channel j rotates every host's segment by j, so that a
    ring leaves each host from its (j+1)-th rank and enters the next at another; as many channels as
    the fewest cards a host's ranks reach, one ring without cards or with the group on one host."""
    segments: dict = {}
    for r in order:
        segments.setdefault(host(r), []).append(r)
    if card is None or len(segments) < 2:
        return ()
    c = min(len({card(r) for r in seg}) for seg in segments.values())
    return tuple(tuple(r for seg in segments.values() for r in seg[j:] + seg[:j]) for j in range(1, c))


def collective(transport: str, op: str, ranks, me: int, tag, nbytes: float, link: Link, kind: str,
               host=None, card=None) -> list:
    """The ops rank ``me`` runs for one collective, by transport (gloo: its algorithms' messages; nccl:
    NCCL's rings over the group ordered by ``host`` (rank -> host; None: as given), a channel a card
    where ``card`` (rank -> its network cards) gives several (``channels``), or a closed-form ``Group``
    over ``link`` for a group larger than ``MAX_RING``)."""
    ranks = tuple(ranks)
    if len(ranks) < 2:
        return []
    if transport == "nccl":
        if len(ranks) > MAX_RING or host is None:
            return [Group((tag, op), ranks, link.collective(op, len(ranks), nbytes), kind)]
        order = tuple(sorted(ranks, key=lambda r: (host(r), r)))
        if op in ("reduce", "broadcast"):  # the chain starts at the root, ranks[0]
            order = (ranks[0],) + tuple(r for r in order if r != ranks[0])
            return nccl_ring(op, order, me, tag, nbytes, kind)
        return nccl_ring(op, order, me, tag, nbytes, kind, channels(order, host, card))
    if op == "allreduce":
        return allreduce(ranks, me, tag, int(nbytes), kind)
    if op == "reduce_scatter":
        return ring_reduce_scatter(ranks, me, tag, int(nbytes), kind)
    if op == "allgather":
        return allgather(ranks, me, tag, int(nbytes), kind)
    raise ValueError(f"unknown collective {op!r}")

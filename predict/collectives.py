"""Collectives as the simulator runs them.

gloo (the CPU runs here): message by message, as gloo's own algorithms post them, so that every
segment pays gloo's receive-posted handshake on the emulated links:
- ``ring_reduce_scatter`` / ``allreduce``: gloo's ring (segments of at most 1 MiB, at least 2 per rank,
  two sends and two receives in flight; each rank sends to rank - 1 and receives from rank + 1),
  ``allreduce`` adds the ring allgather of the same segments;
- ``allgather``: ring, n - 1 steps of one chunk.

nccl (GPU clusters): closed forms over one link (latency a, bandwidth B), for a group that leaves
together (``Group``): ring all-reduce 2(n-1)(a + S/(nB)); reduce-scatter / all-gather (n-1)(a + S/(nB));
chain reduce / broadcast (n-1) a + S/B (the chunks stream down the chain: every link carries S once).
"""
from __future__ import annotations

from typing import Hashable

from predict.simulator import Group, Recv, Send, Wait
from predict.run_spec import Link

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


# ---- closed forms (nccl) ---------------------------------------------------------------------
def closed_form(op: str, n: int, nbytes: float, link: Link) -> float:
    """Seconds of one collective over n ranks joined by ``link`` (see the module docstring)."""
    if n < 2:
        return 0.0
    a, B = link.latency, link.bandwidth
    if op == "allreduce":
        return 2 * (n - 1) * (a + nbytes / (n * B))
    if op in ("reduce_scatter", "allgather"):
        return (n - 1) * (a + nbytes / (n * B))
    if op in ("reduce", "broadcast"):
        return (n - 1) * a + nbytes / B
    raise ValueError(f"unknown collective {op!r}")


def collective(transport: str, op: str, ranks, me: int, tag, nbytes: float, link: Link, kind: str) -> list:
    """The ops rank ``me`` runs for one collective, by transport (gloo: messages; nccl: a Group)."""
    ranks = tuple(ranks)
    if len(ranks) < 2:
        return []
    if transport == "nccl":
        return [Group((tag, op), ranks, closed_form(op, len(ranks), nbytes, link), kind)]
    if op == "allreduce":
        return allreduce(ranks, me, tag, int(nbytes), kind)
    if op == "reduce_scatter":
        return ring_reduce_scatter(ranks, me, tag, int(nbytes), kind)
    if op == "allgather":
        return allgather(ranks, me, tag, int(nbytes), kind)
    raise ValueError(f"unknown collective {op!r}")

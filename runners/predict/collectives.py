"""Collectives as the simulator runs them.

gloo (the CPU runs here): message by message, as gloo's own algorithms post them, so that every
segment pays gloo's receive-posted handshake on the emulated links:
- ``barrier``: dissemination barrier, ceil(log2 n) rounds of a 0-byte message to rank + 2^k;
- ``ring_reduce_scatter`` / ``allreduce``: gloo's ring (segments of at most 1 MiB, at least 2 per rank,
  two sends and two receives in flight; each rank sends to rank - 1 and receives from rank + 1),
  ``allreduce`` adds the ring allgather of the same segments;
- ``reduce``: the ring reduce-scatter, then every rank's chunk to the root;
- ``broadcast``: binomial tree from the root, whole buffer per message;
- ``allgather``: ring, n - 1 steps of one chunk.

nccl (GPU clusters): closed forms over one link (latency a, bandwidth B), for a group that leaves
together (``Group``): ring all-reduce 2(n-1)(a + S/(nB)); reduce-scatter / all-gather (n-1)(a + S/(nB));
reduce and broadcast pipelined along a chain, (n-1)a + S/B; barrier 2 ceil(log2 n) a.
"""
from __future__ import annotations

import math
from typing import Hashable

from runners.predict.engine import Group, Recv, Send, Wait
from runners.predict.spec import Link

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


def barrier(ranks: tuple[int, ...], me: int, tag: Hashable, kind: str = "barrier") -> list:
    n = len(ranks)
    if n < 2:
        return []
    i_me = ranks.index(me)
    ops: list = []
    d = 1
    while d < n:
        frm, to = ranks[(i_me - d) % n], ranks[(i_me + d) % n]
        rk, sk = (tag, "bar", d, frm, me), (tag, "bar", d, me, to)
        ops += [Recv(rk, frm, 0), Send(sk, to, 0), Wait((rk, sk), kind)]
        d <<= 1
    return ops


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


def reduce(ranks, me, root: int, tag, nbytes: int, kind: str) -> list:
    """gloo's reduce: ring reduce-scatter, then each rank's chunk to the root (global rank ``root``)."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2 or nbytes <= 0:
        return []
    total = int(nbytes)
    ops = _pipelined(ranks, me, tag, "rs", total, _rs_offsets, kind)
    seg, nseg, per = ring_plan(total, n)
    chunk = per * seg
    if me == root:
        keys = []
        for j, r in enumerate(ranks):
            length = min(chunk, total - j * chunk)
            if r != me and length > 0:
                keys.append((tag, "gather", r, me))
                ops.append(Recv(keys[-1], r, length))
        if keys:
            ops.append(Wait(tuple(keys), kind))
    else:
        j = ranks.index(me)
        length = min(chunk, total - j * chunk)
        if length > 0:
            key = (tag, "gather", me, root)
            ops += [Send(key, root, length), Wait((key,), kind)]
    return ops


def broadcast(ranks, me, root: int, tag, nbytes: int, kind: str) -> list:
    """gloo's binomial-tree broadcast from global rank ``root``."""
    ranks = tuple(ranks)
    n = len(ranks)
    if n < 2:
        return []
    vrank = (ranks.index(me) - ranks.index(root)) % n
    dim = max(1, math.ceil(math.log2(n)))
    mask = (1 << dim) - 1
    ops: list = []
    sends = []
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask:
            continue
        vpeer = vrank ^ (1 << i)
        if vpeer >= n:
            continue
        peer = ranks[(vpeer + ranks.index(root)) % n]
        if vrank & (1 << i) == 0:
            key = (tag, "bcast", me, peer)
            ops.append(Send(key, peer, nbytes))
            sends.append(key)
        else:
            key = (tag, "bcast", peer, me)
            ops += [Recv(key, peer, nbytes), Wait((key,), kind)]
    if sends:
        ops.append(Wait(tuple(sends), kind))
    return ops


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
    if op == "barrier":
        return 2 * math.ceil(math.log2(n)) * a
    raise ValueError(f"unknown collective {op!r}")


def collective(transport: str, op: str, ranks, me: int, tag, nbytes: float, link: Link, kind: str,
               root: int | None = None) -> list:
    """The ops rank ``me`` runs for one collective, by transport (gloo: messages; nccl: a Group)."""
    ranks = tuple(ranks)
    if len(ranks) < 2:
        return []
    if transport == "nccl":
        return [Group((tag, op), ranks, closed_form(op, len(ranks), nbytes, link), kind)]
    if op == "barrier":
        return barrier(ranks, me, tag, kind)
    if op == "allreduce":
        return allreduce(ranks, me, tag, int(nbytes), kind)
    if op == "reduce_scatter":
        return ring_reduce_scatter(ranks, me, tag, int(nbytes), kind)
    if op == "allgather":
        return allgather(ranks, me, tag, int(nbytes), kind)
    if op == "reduce":
        return reduce(ranks, me, ranks[0] if root is None else root, tag, int(nbytes), kind)
    if op == "broadcast":
        return broadcast(ranks, me, ranks[0] if root is None else root, tag, int(nbytes), kind)
    raise ValueError(f"unknown collective {op!r}")

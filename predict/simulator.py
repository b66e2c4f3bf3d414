"""A discrete-event simulator of ranks running programs over a network.

Each rank runs a program: a list of operations executed in order.

- ``Compute(seconds, kind)``: the rank computes for ``seconds`` of its own time. Where ranks share
  ``cores`` (a CPU host), the computing processes share them equally (processor sharing): with k
  processes computing on c cores each progresses at min(1, c / k).
- ``Send(key, dst, nbytes)`` / ``Recv(key, src, nbytes)``: post one side of message ``key`` (never
  blocks). ``Wait(keys, kind)`` blocks until each message is sent (on its sender) or has arrived (on
  its receiver).
- ``Group(key, ranks, seconds, kind)``: a collective in closed form: every member blocks until all
  members reached it, then all leave ``seconds`` later.
- ``Defer(chunks)``: queue deferred work (ours' weight gradients); ``FillWait(key)``: wait for one
  message, running queued chunks while it has not arrived (a chunk, once started, finishes);
  ``Flush(kind, keep)``: run what is queued beyond ``keep`` seconds of it as one computation, the
  oldest chunks first (the rest stays queued in its chunks; ``keep`` 0: everything).
- ``Mark(name)``: note the time (and the rank's accounting) under ``name``.

Messages. The data of a message becomes ready to leave at
    gloo: max(send posted, receive posted + the one-way delay back to the sender)
        (gloo sends a buffer only after the receiver's "receive posted" notice has arrived),
    nccl: max(send posted, receive posted).
It then waits for its link (one direction of one host pair): at most ``in_flight`` messages travel on
it at once (None: as many as are issued), and the sender's egress carries one message at a time at the
link's bandwidth (on a GPU cluster between hosts, the receiver's network card too, and every GPU of a
simulated tensor-parallel group sends its copy through them: ``Network``). It leaves
the sender (send complete) ``nbytes / bandwidth`` after it started and arrives ``latency`` after
max(that, the link's stall for its size) (``Link.stall``: the emulated links' per-message stall).
Messages between ranks of one host use the network's intra-host link.

Accounting: every rank's time is split by kind: compute kinds, and waits classified as ``bubble``
(waiting for a peer that had not posted the data yet), ``comm`` (waiting while the data was ready:
the network's share), or the Wait's own kind (``dp``, ``barrier``, ...).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Hashable

from contract.links import Link


@dataclass(frozen=True, slots=True)
class Compute:
    seconds: float
    kind: str


@dataclass(frozen=True, slots=True)
class Send:
    key: Hashable
    dst: int
    nbytes: float


@dataclass(frozen=True, slots=True)
class Recv:
    key: Hashable
    src: int
    nbytes: float


@dataclass(frozen=True, slots=True)
class Wait:
    keys: tuple
    kind: str = "p2p"  # p2p waits are split into bubble and comm; any other kind is kept as is


@dataclass(frozen=True, slots=True)
class Group:
    key: Hashable
    ranks: tuple[int, ...]
    seconds: float
    kind: str


@dataclass(frozen=True, slots=True)
class Defer:
    chunks: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FillWait:
    key: Hashable
    fill_kind: str = "wgrad"


@dataclass(frozen=True, slots=True)
class Flush:
    kind: str = "wgrad"
    keep: float = 0.0


@dataclass(frozen=True, slots=True)
class Mark:
    name: str


Op = Compute | Send | Recv | Wait | Group | Defer | FillWait | Flush | Mark


INSTANT = Link(0.0, math.inf)  # between a rank and its communication stream


@dataclass(frozen=True)
class Network:
    """Who is where and how they are linked.

    Simulated rank r lives on host ``hosts[r]`` (None: r // ranks_per_host). Between two hosts a
    message takes ``link``, or ``matrix[a][b]`` where every pair of hosts has a link of its own;
    between ranks of one host ``intra_link`` (None: ``link``).

    A GPU cluster (``gpu``): a simulated rank stands for ``copies[r]`` GPUs (a tensor-parallel group),
    each of which sends its own copy of every message; inside a host each GPU has links of its own, so
    the copies travel side by side, while between hosts they cross the network cards their GPUs use
    (``cards[r]``, of the host's; default one card a host), the sender's and the receiver's, each card
    carrying its share of the copies (one message at a time, both ways at once; a per-pair ``matrix``
    gives every pair its own). Without ``gpu`` (the CPU runs), a host's messages leave through one
    egress per destination kind (its NIC, or its internal links), one copy each.

    ``streams``: where set, rank ``streams + r`` is rank r's communication stream (NCCL's collectives
    on a CUDA stream of their own, beside r's computation): on r's GPUs and host, its messages to and
    from r instant."""

    link: Link
    transport: str = "gloo"
    intra_link: Link | None = None
    ranks_per_host: int = 1
    hosts: tuple[int, ...] | None = None
    matrix: tuple | None = None
    copies: tuple[int, ...] | None = None
    gpu: bool = False
    cards: tuple[tuple[int, ...], ...] | None = None
    streams: int | None = None
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # ports, links: asked per message

    def gpus_of(self, rank: int) -> int:
        """The simulated rank whose GPUs ``rank`` runs on (itself, or the rank a stream serves)."""
        return rank - self.streams if self.streams is not None and rank >= self.streams else rank

    def host(self, rank: int) -> int:
        rank = self.gpus_of(rank)
        return self.hosts[rank] if self.hosts is not None else rank // self.ranks_per_host

    def between(self, src: int, dst: int) -> Link:
        key = ("between", src, dst)
        if key not in self._memo:
            self._memo[key] = self._between(src, dst)
        return self._memo[key]

    def _between(self, src: int, dst: int) -> Link:
        if self.gpus_of(src) == self.gpus_of(dst):
            return INSTANT
        a, b = self.host(src), self.host(dst)
        if a == b and self.intra_link is not None:
            return self.intra_link
        if self.matrix is not None and a != b:
            return self.matrix[a][b]
        return self.link

    def wire_bytes(self, src: int, dst: int, nbytes: float) -> float:
        """Bytes that cross the sender's port for one message: every copy where the copies share a
        network card (between hosts of a GPU cluster), one otherwise."""
        if self.gpu and self.copies is not None and self.host(src) != self.host(dst):
            r = self.gpus_of(src)
            return nbytes * self.copies[r] / (len(self.cards[r]) if self.cards is not None else 1)
        return nbytes

    def ports(self, src: int, dst: int) -> tuple[tuple, tuple | None]:
        """(the sender's egress, the receiver's ingress or None) a message between them occupies."""
        key = ("ports", src, dst)
        if key not in self._memo:
            self._memo[key] = self._ports(src, dst)
        return self._memo[key]

    def _ports(self, src: int, dst: int) -> tuple[tuple, tuple | None]:
        if self.gpus_of(src) == self.gpus_of(dst):
            return ("stream", src, dst), None
        a, b = self.host(src), self.host(dst)
        if not self.gpu:
            return (a, self.intra_link is not None and a == b), None
        if a == b:
            return ("gpu", src, dst), None
        if self.matrix is not None:
            return ("pair", a, b), None
        out, into = ((self.cards[self.gpus_of(src)], self.cards[self.gpus_of(dst)]) if self.cards is not None
                     else ((0,), (0,)))
        return ("nic out", a, out), ("nic in", b, into)


class SimulationError(RuntimeError):
    """The programs cannot complete (a message never posted by its peer, a collective a member skips)."""


@dataclass
class _Msg:
    key: Hashable
    src: int = -1
    dst: int = -1
    nbytes: float = 0.0
    send_post: float | None = None
    recv_post: float | None = None
    ready: float | None = None
    sent: float | None = None
    arrived: float | None = None


@dataclass
class _Rank:
    program: list
    pc: int = 0
    state: str = "ready"  # ready | computing | blocked | done
    remaining: float = 0.0  # nominal seconds left of the current computation
    compute_kind: str = ""
    compute_start: float = 0.0
    fill: bool = False  # the current computation is a FillWait chunk (the FillWait is re-checked after it)
    blocked_since: float = 0.0
    waiting: tuple = ()
    wait_kind: str = ""
    deferred: deque = field(default_factory=deque)
    acc: dict = field(default_factory=lambda: defaultdict(float))
    marks: dict = field(default_factory=dict)


@dataclass
class SimResult:
    """Per rank: the time and a copy of the accounting at each Mark (name -> (time, {kind: s}))."""

    marks: list[dict]
    end_time: float

    def window(self, rank: int, start: str, end: str) -> tuple[float, dict[str, float]]:
        t0, a0 = self.marks[rank][start]
        t1, a1 = self.marks[rank][end]
        return t1 - t0, {k: a1.get(k, 0.0) - a0.get(k, 0.0) for k in set(a0) | set(a1)}


class Simulator:
    """Run ``programs`` (one list of ops per rank, ranks 0..n-1) over ``network``.

    cores: CPU cores the ranks share (None: every rank has its own device), or the capacity measured for
    1, 2, ... processes computing at once (``cores[k - 1]``: cores' worth of work k processes get
    together; the last entry holds for more), e.g. on a host shared with other work; procs[r]: processes
    rank r stands for in the processor sharing (a simulated rank may represent a tensor-parallel group)."""

    def __init__(self, programs: list[list], network: Network, cores: float | tuple | None = None,
                 procs: list[int] | None = None):
        self.ranks = [_Rank(list(p)) for p in programs]
        self.net = network
        self.cores = cores
        self.procs = procs or [1] * len(programs)
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.msgs: dict[Hashable, _Msg] = {}
        self.waiters: dict[Hashable, list[int]] = defaultdict(list)
        self.groups: dict[Hashable, set[int]] = {}
        self.link_queue: dict[tuple[int, int], deque] = defaultdict(deque)
        self.in_transit: dict[tuple[int, int], int] = defaultdict(int)
        self.egress_free: dict[tuple, float] = defaultdict(float)
        self.egress_pairs: dict[tuple, set] = defaultdict(set)  # pairs with queued messages, by egress
        self.retry_at: dict[tuple[int, int], float] = {}
        self.computing: set[int] = set()
        self.last_rate_time = 0.0

    # ---- events ------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def _msg(self, key: Hashable) -> _Msg:
        m = self.msgs.get(key)
        if m is None:
            m = self.msgs[key] = _Msg(key)
        return m

    def _rate(self) -> float:
        if self.cores is None or not self.computing:
            return 1.0
        active = sum(self.procs[r] for r in self.computing)
        if isinstance(self.cores, tuple):
            return min(1.0, self.cores[min(active, len(self.cores)) - 1] / active)
        return min(1.0, self.cores / active)

    def _advance(self, t: float) -> None:
        """Move the clock to t, consuming computation at the current sharing rate."""
        if t > self.now and self.computing:
            done = (t - self.now) * self._rate()
            for r in self.computing:
                self.ranks[r].remaining -= done
        self.now = max(self.now, t)

    # ---- messages ----------------------------------------------------------------------------
    def _post(self, m: _Msg) -> None:
        if m.send_post is None or m.recv_post is None or m.ready is not None:
            return
        if self.net.transport == "gloo":
            back = self.net.between(m.dst, m.src).latency
            m.ready = max(m.send_post, m.recv_post + back)
        else:
            m.ready = max(m.send_post, m.recv_post)
        self._at(m.ready, "ready", m.key)

    def _egress(self, pair: tuple[int, int]) -> tuple:
        """The sender's port a message uses (see ``Network.ports``)."""
        return self.net.ports(*pair)[0]

    def _try_links_of(self, egress: tuple) -> None:
        for pair in sorted(self.egress_pairs[egress]):
            self._try_link(pair)

    def _try_link(self, pair: tuple[int, int]) -> None:
        q = self.link_queue[pair]
        link = self.net.between(*pair)
        egress, ingress = self.net.ports(*pair)
        limit = link.in_flight if link.in_flight is not None else math.inf
        while q and self.in_transit[pair] < limit:
            start = max(self.now, self.egress_free[egress], self.egress_free[ingress] if ingress else 0.0)
            if start > self.now + 1e-15:
                if self.retry_at.get(pair) != start:
                    self.retry_at[pair] = start
                    self._at(start, "retry", pair)
                return
            m = q.popleft()
            if not q:
                self.egress_pairs[egress].discard(pair)
            wire = self.net.wire_bytes(m.src, m.dst, m.nbytes) / link.bandwidth
            self.egress_free[egress] = self.now + wire
            if ingress:
                self.egress_free[ingress] = self.now + wire
            self.in_transit[pair] += 1
            m.sent = self.now + wire
            m.arrived = self.now + max(wire, link.stall(m.nbytes)) + link.latency
            self._at(m.sent, "sent", m.key)
            self._at(m.arrived, "arrived", m.key)

    def _complete(self, m: _Msg, rank: int) -> float | None:
        """When message m is complete from rank's side (None: not yet known)."""
        return m.sent if rank == m.src else m.arrived

    def _waits_done(self, r: int) -> bool:
        st = self.ranks[r]
        for key in st.waiting:
            m = self.msgs.get(key)
            t = self._complete(m, r) if m is not None else None
            if t is None or t > self.now + 1e-15:
                return False
        return True

    # ---- ranks -------------------------------------------------------------------------------
    def _block(self, r: int, keys: tuple, kind: str) -> None:
        st = self.ranks[r]
        st.state, st.blocked_since, st.waiting, st.wait_kind = "blocked", self.now, keys, kind
        for key in keys:
            self.waiters[key].append(r)

    def _unblock(self, r: int) -> None:
        st = self.ranks[r]
        waited = self.now - st.blocked_since
        if waited > 0:
            if st.wait_kind == "p2p":
                # the share of the wait before the data existed is a bubble, the rest communication
                posted = [self._data_time(self.msgs[k], r) for k in st.waiting]
                bubble = min(waited, max(0.0, max(posted, default=st.blocked_since) - st.blocked_since))
                st.acc["bubble"] += bubble
                st.acc["comm"] += waited - bubble
            else:
                st.acc[st.wait_kind] += waited
        st.state, st.waiting = "ready", ()
        if not isinstance(st.program[st.pc], FillWait):
            st.pc += 1

    def _data_time(self, m: _Msg, r: int) -> float:
        """When the data of m was there to be sent (for its receiver: the send's post; for its sender:
        the moment the receiver was ready for it)."""
        if r == m.dst:
            return m.send_post if m.send_post is not None else self.now
        return m.ready if m.ready is not None else self.now

    def _start_compute(self, r: int, seconds: float, kind: str, fill: bool = False) -> None:
        st = self.ranks[r]
        if seconds <= 0:
            if not fill:
                st.pc += 1
            return
        st.state, st.remaining, st.compute_kind, st.compute_start, st.fill = "computing", seconds, kind, self.now, fill
        if self.cores is None:  # a device of its own: the end is known now
            self._at(self.now + seconds, "computed", r)
        else:
            self.computing.add(r)

    def _finish_compute(self, r: int) -> None:
        st = self.ranks[r]
        self.computing.discard(r)
        st.acc[st.compute_kind] += self.now - st.compute_start
        st.state = "ready"
        if not st.fill:
            st.pc += 1
        st.fill = False

    def _post_op(self, r: int, op: Send | Recv) -> None:
        """Rank r posts its side of a message (a send or a receive, each once)."""
        m = self._msg(op.key)
        if isinstance(op, Send):
            if m.send_post is not None:
                raise SimulationError(f"message {op.key!r} sent twice")
            m.src, m.dst, m.nbytes, m.send_post = r, op.dst, max(m.nbytes, op.nbytes), self.now
        else:
            if m.recv_post is not None:
                raise SimulationError(f"message {op.key!r} received twice")
            if m.src < 0:
                m.src, m.dst = op.src, r
            m.nbytes, m.recv_post = max(m.nbytes, op.nbytes), self.now
        self._post(m)

    @staticmethod
    def _drain(st, keep: float) -> float:
        """The deferred work a Flush runs, all but ``keep`` seconds of it, taken from the oldest chunks
        (what is kept stays in its chunks)."""
        run = max(0.0, sum(st.deferred) - keep)
        if keep <= 0:
            st.deferred.clear()
        left = run
        while st.deferred and left > 0:
            if st.deferred[0] <= left:
                left -= st.deferred.popleft()
            else:
                st.deferred[0] -= left
                left = 0.0
        return run

    def _step_rank(self, r: int) -> None:
        """Execute rank r's zero-time ops until it computes, blocks or ends."""
        st = self.ranks[r]
        prog = st.program
        while st.state == "ready":
            if st.pc >= len(prog):
                st.state = "done"
                return
            op = prog[st.pc]
            if isinstance(op, Compute):
                self._start_compute(r, op.seconds, op.kind)
            elif isinstance(op, (Send, Recv)):
                self._post_op(r, op)
                st.pc += 1
            elif isinstance(op, Wait):
                st.waiting = op.keys
                if self._waits_done(r):
                    st.waiting = ()
                    st.pc += 1
                else:
                    self._block(r, op.keys, op.kind)
            elif isinstance(op, FillWait):
                st.waiting = (op.key,)
                if self._waits_done(r):
                    st.waiting = ()
                    st.pc += 1
                elif st.deferred:
                    st.waiting = ()
                    self._start_compute(r, st.deferred.popleft(), op.fill_kind, fill=True)
                else:
                    self._block(r, (op.key,), "p2p")
            elif isinstance(op, Defer):
                st.deferred.extend(op.chunks)
                st.pc += 1
            elif isinstance(op, Flush):
                self._start_compute(r, self._drain(st, op.keep), op.kind)
            elif isinstance(op, Group):
                members = self.groups.setdefault(op.key, set())
                members.add(r)
                st.state, st.blocked_since, st.wait_kind = "blocked", self.now, op.kind
                if len(members) == len(op.ranks):
                    self._at(self.now + op.seconds, "group", op.key)
                elif len(members) > len(op.ranks):
                    raise SimulationError(f"collective {op.key!r}: more members than its {len(op.ranks)} ranks")
            elif isinstance(op, Mark):
                st.marks[op.name] = (self.now, dict(st.acc))
                st.pc += 1
            else:
                raise SimulationError(f"unknown operation {op!r}")

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> SimResult:
        for r in range(len(self.ranks)):
            self._step_rank(r)
        while True:
            # the next computation to finish at the current sharing rate
            t_comp, r_comp = math.inf, -1
            if self.computing:
                rate = self._rate()
                for r in self.computing:
                    t = self.now + max(0.0, self.ranks[r].remaining) / rate
                    if t < t_comp:
                        t_comp, r_comp = t, r
            t_event = self.heap[0][0] if self.heap else math.inf
            if t_comp == math.inf and t_event == math.inf:
                break
            if t_comp <= t_event:
                self._advance(t_comp)
                self._finish_compute(r_comp)
                self._step_rank(r_comp)
                continue
            t, _, kind, payload = heapq.heappop(self.heap)
            self._advance(t)
            woken = self._event(kind, payload)
            for r in woken:
                self._step_rank(r)
        stuck = [r for r, st in enumerate(self.ranks) if st.state != "done"]
        if stuck:
            r = stuck[0]
            st = self.ranks[r]
            op = st.program[st.pc] if st.pc < len(st.program) else None
            raise SimulationError(f"deadlock: rank {r} stuck at op {st.pc} {op!r} (and {len(stuck) - 1} other ranks)")
        return SimResult(marks=[st.marks for st in self.ranks], end_time=self.now)

    def _event(self, kind: str, payload) -> list[int]:
        if kind == "ready":
            m = self.msgs[payload]
            pair = (m.src, m.dst)
            self.link_queue[pair].append(m)
            self.egress_pairs[self._egress(pair)].add(pair)
            self._try_link(pair)
            return []
        if kind == "retry":
            if self.retry_at.get(payload) != self.now:  # stale: a later retry of the pair replaced it
                return []
            del self.retry_at[payload]
            self._try_link(payload)
            return []
        if kind == "sent":
            m = self.msgs[payload]
            self._try_links_of(self._egress((m.src, m.dst)))
            return self._wake(payload)
        if kind == "arrived":
            m = self.msgs[payload]
            pair = (m.src, m.dst)
            self.in_transit[pair] -= 1
            self._try_link(pair)
            return self._wake(payload)
        if kind == "computed":
            self._finish_compute(payload)
            return [payload]
        if kind == "group":
            members = self.groups.pop(payload)
            for r in members:
                st = self.ranks[r]
                st.acc[st.wait_kind] += self.now - st.blocked_since
                st.state = "ready"
                st.pc += 1
            return sorted(members)
        raise SimulationError(f"unknown event {kind}")

    def _wake(self, key: Hashable) -> list[int]:
        """Unblock the ranks whose waits message ``key`` completed; the others stay registered under
        the keys they still wait for."""
        woken, keep = [], []
        for r in self.waiters.pop(key, []):
            st = self.ranks[r]
            if st.state == "blocked" and self._waits_done(r):
                self._unblock(r)
                woken.append(r)
            elif st.state == "blocked" and key in st.waiting:
                keep.append(r)  # its side of this message is not complete yet (e.g. sent, not arrived)
        if keep:
            self.waiters[key].extend(keep)
        return woken

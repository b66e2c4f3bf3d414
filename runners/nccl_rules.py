"""NCCL's point-to-point rules on gloo (``--p2p-semantics nccl``): a CPU shim, installed by the rank
worker before the system's ``train`` runs where the backend is gloo; systems do not know of it.

gloo matches messages by tag and runs every operation on threads of its own, so code that would hang
or swap tensors under NCCL runs fine on a laptop. Under this shim gloo follows NCCL's rules
(shared/notes/nccl-rules.md), and such code fails here as it would on a cluster:

1. Messages between two ranks are matched in the order they were issued; tags are ignored. Every
   send and receive takes the next sequence number of its stream (3) and direction, and travels
   under a gloo tag made from that number; the caller's tag is dropped.
2. A message must be what the receive it is matched with expects: each payload is preceded by a
   header (shape, dtype, the sending operation and its call site), and a receive whose header
   differs from its own shape or dtype fails the run with an error naming both operations.
3. A pair's operations run one at a time, in issue order. Each stream of a rank runs its operations
   on a thread of its own, one entry after another: a receive holds back every later operation of
   its stream until its message has arrived, a send until the peer's receive has taken it. The
   streams are ProcessGroupNCCL's: a single isend/irecv/send/recv runs on its group's stream for
   the pair (group, peer), so separate process groups are separate streams; the operations posted
   together by one ``batch_isend_irecv`` are one entry on the group's own stream (NCCL runs a
   batch on the group's communicator, whatever the peers) and progress together.
4. NCCL creates a pair's communicator on a group at the pair's first single operation there, and
   that call blocks the host until the peer has issued one too (ProcessGroupNCCL without a bound
   device, as the rank worker runs it): here the first single operation of a pair on a group waits
   for the peer's before it is queued.
5. Collectives take tensors on the run's device only.

What each rank has pending is written to ``<run dir>/pending-rank<R>.json`` every half second
(``PENDING_GLOB``), so that a run that hangs here, as it would under NCCL, ends as ``timeout`` with
every rank's pending operations named (``runners.launcher`` reads them, ``pending_summary``).

Not modelled: a collective on a group with a batch in flight waits for it under NCCL (they share the
group's stream), and the first batch or collective on a group creates its communicator, for which
every rank of the group must arrive; here neither waits. With a device bound at
``init_process_group`` (``device_id``), NCCL would run a group's single operations on the group's
communicator too (one stream per group, not per pair). ``Work.wait`` blocks the host, where NCCL's
blocks only the current stream; the order of the work is the same, because every NCCL operation
waits for the current stream before it starts.

The functions are patched in ``torch.distributed`` and in ``torch.distributed.distributed_c10d``,
where torch's own helpers (``send_object_list``, ``P2POp``'s check of its op) look them up; code
that took a function by name before ``install`` keeps gloo's rules.
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.c10d_logger as c10d_logger
import torch.distributed.distributed_c10d as c10d

PENDING_GLOB = "pending-rank*.json"
HEADER_BYTES = 512  # a message's header: JSON, padded
DUMP_EVERY_S = 0.5
_TAGS_PER_SEQ = 4  # the pair stream's header and payload, the batch stream's header and payload
_CONNECT_TAG = 2**31 - 1  # a pair's first operation on a group (4)
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "_all_gather_base",
                "_reduce_scatter_base", "all_reduce_coalesced", "all_gather_coalesced")
_SKIPPED = {os.path.abspath(f) for f in (__file__, c10d.__file__, c10d_logger.__file__)}  # not a call site


class NcclRuleError(RuntimeError):
    """What NCCL would refuse, or get wrong in silence (a message matched with a receive it does not fit)."""


def _site() -> str:
    """Where the operation was issued: the first frame outside this shim and torch's c10d modules."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _SKIPPED:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, os.getcwd() + os.sep):
        if marker in path:
            path = path.rpartition(marker)[2]
            break
    return f"{path}:{frame.f_lineno}"


@dataclass(eq=False)
class _Op:
    """One send or receive as issued: what it moves, between whom, on which stream, and its state."""

    kind: str  # "isend" | "irecv"
    tensor: torch.Tensor
    peer: int  # global rank
    group: dist.ProcessGroup
    group_peer: int
    stream: "_Stream | None"
    seq: int  # its number among its stream's operations in its direction
    tag: int  # the gloo tag of its header (the payload's is tag + 1)
    site: str
    serial: int  # issue order on this rank
    posted: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def name(self) -> str:
        return f"{self.kind} #{self.seq} {'to' if self.kind == 'isend' else 'from'} rank {self.peer}"

    @property
    def stream_name(self) -> str:
        return self.stream.name if self.stream is not None else _stream_name(self.group, "pair", self.peer)

    def describe(self) -> str:
        shape = "x".join(map(str, self.tensor.shape)) or "scalar"
        dtype = str(self.tensor.dtype).removeprefix("torch.")
        return f"{self.name()} ({dtype}[{shape}], {self.stream_name}, at {self.site})"

    def header(self, rank: int) -> torch.Tensor:
        """What the receiver checks: the shape and dtype, and the operation for its error (shortened to fit)."""
        fields = {"rank": rank, "shape": list(self.tensor.shape), "dtype": str(self.tensor.dtype), "op": ""}
        room = HEADER_BYTES - len(json.dumps(fields).encode())
        op = self.describe()
        fields["op"] = op if len(op) <= room else op[: max(room - 3, 0)] + "..."
        data = json.dumps(fields, ensure_ascii=True).encode().ljust(HEADER_BYTES)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _stream_name(group: dist.ProcessGroup, kind: str, peer: int | None) -> str:
    where = f"group {group.group_name[:8]} of ranks {dist.get_process_group_ranks(group)}"
    return f"{where}, pair with rank {peer}" if kind == "pair" else f"{where}, batched"


def _read_header(buf: torch.Tensor) -> dict:
    return json.loads(buf.numpy().tobytes().decode(errors="replace").strip() or "{}")


class _Stream:
    """One NCCL stream of this rank: its entries (operations posted together) run one after another,
    in issue order, on a thread of its own."""

    def __init__(self, rules: "_Rules", name: str):
        self.rules, self.name = rules, name
        self.entries: collections.deque[list[_Op]] = collections.deque()
        self.error: BaseException | None = None
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name=f"nccl-rules {name}", daemon=True).start()

    def submit(self, ops: list[_Op]) -> None:
        with self._ready:
            self.entries.append(ops)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self.entries:
                    self._ready.wait()
                entry = self.entries[0]
            try:
                if self.error is not None:
                    raise NcclRuleError(f"an earlier operation of {self.name} failed: {self.error}")
                self._transfer(entry)
            except BaseException as exc:  # handed to whoever waits on the entry's operations
                self.error = self.error or exc
                for op in entry:
                    op.error = exc
            with self._ready:
                self.entries.popleft()
            for op in entry:
                op.done.set()
            self.rules.changed()

    def _transfer(self, entry: list[_Op]) -> None:
        """Move the entry's messages together: every header and payload sent, every header received
        and checked before its payload is received."""
        me = self.rules.rank
        works, heads = [], []
        for op in entry:
            if op.kind == "isend":
                works.append(op.group.send([op.header(me)], op.group_peer, op.tag))
                works.append(op.group.send([op.tensor], op.group_peer, op.tag + 1))
            else:
                buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
                heads.append((op, buf, op.group.recv([buf], op.group_peer, op.tag)))
        for op, buf, work in heads:
            work.wait()
            theirs = _read_header(buf)
            wrong = [what for what, mine, sent in (("shape", list(op.tensor.shape), theirs.get("shape")),
                                                   ("dtype", str(op.tensor.dtype), theirs.get("dtype")))
                     if mine != sent]
            if wrong:
                verb = "differs" if len(wrong) == 1 else "differ"
                raise NcclRuleError(
                    f"NCCL rules: rank {me}'s {op.describe()} was matched with rank {theirs.get('rank')}'s "
                    f"{theirs.get('op')}: the {' and '.join(wrong)} {verb} (NCCL matches a pair's messages in the "
                    "order they were issued and ignores tags)")
            works.append(op.group.recv([op.tensor], op.group_peer, op.tag + 1))
        for work in works:
            work.wait()

    def running(self) -> list[_Op]:
        with self._ready:
            return list(self.entries[0]) if self.entries else []


class _Work(dist.Work):
    """The caller's handle on one operation: ``wait`` returns once it has completed (or raises its error)."""

    def __init__(self, op: _Op):
        super().__init__()
        self.op = op

    def wait(self, timeout=None) -> bool:
        self.op.done.wait()
        if self.op.error is not None:
            raise self.op.error
        return True

    def is_completed(self) -> bool:
        return self.op.done.is_set()

    def is_success(self) -> bool:
        return self.op.done.is_set() and self.op.error is None

    def exception(self):
        return self.op.error

    def source_rank(self) -> int:
        return self.op.group_peer

    _source_rank = source_rank

    def synchronize(self) -> None:
        self.wait()


class _Rules:
    """The shim's state on one rank: its streams, sequence numbers and pending operations."""

    def __init__(self, rank: int, device: torch.device, dump_dir: Path | None, original: dict):
        self.rank, self.device, self.dump_dir, self.original = rank, device, dump_dir, original
        self.lock = threading.Lock()
        self.streams: dict[tuple, _Stream] = {}
        self.seqs: collections.Counter = collections.Counter()
        self.serials = itertools.count()
        self.pending: dict[int, _Op] = {}
        self.connected: dict[tuple, threading.Event] = {}  # (group, peer): the pair's first operation is through
        self.connecting: dict[tuple, dict] = {}  # those still waiting for the peer's, as the dump shows them
        self.version = 0
        if dump_dir is not None:
            threading.Thread(target=self._dump_forever, name="nccl-rules dump", daemon=True).start()

    def changed(self) -> None:
        with self.lock:
            self.pending = {k: op for k, op in self.pending.items() if not op.done.is_set()}
            self.version += 1

    def _stream(self, group: dist.ProcessGroup, kind: str, peer: int | None) -> _Stream:
        key = (group.group_name, kind, peer)
        if key not in self.streams:
            self.streams[key] = _Stream(self, _stream_name(group, kind, peer))
        return self.streams[key]

    def connect(self, kind: str, tensor: torch.Tensor, group: dist.ProcessGroup, peer: int, group_peer: int) -> None:
        """Before a pair's first single operation on a group is queued: wait for the peer's (4)."""
        key = (group.group_name, peer)
        with self.lock:
            done = self.connected.get(key)
            first = done is None
            if first:
                done = self.connected[key] = threading.Event()
                op = _Op(kind, tensor, peer, group, group_peer, None, 0, 0, _site(), -1)
                self.connecting[key] = {"op": op.describe(), "kind": "connect", "stream": op.stream_name,
                                        "running": True, "posted": op.posted, "error": None}
                self.version += 1
        if not first:
            done.wait()
            return
        try:
            token, got = torch.zeros(1, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
            for work in (group.send([token], group_peer, _CONNECT_TAG), group.recv([got], group_peer, _CONNECT_TAG)):
                work.wait()
        finally:
            with self.lock:
                del self.connecting[key]
                self.version += 1
            done.set()

    def issue(self, specs: list[tuple[str, torch.Tensor, dist.ProcessGroup, int, int]], batched: bool) -> list[_Work]:
        """Number, queue and start ``(kind, tensor, group, peer, group_peer)`` operations: one entry
        on the group's stream when ``batched``, else each on its pair's stream."""
        site = _site()
        ops: list[_Op] = []
        with self.lock:
            for kind, tensor, group, peer, group_peer in specs:
                stream_kind = "batch" if batched else "pair"
                stream = self._stream(group, stream_kind, None if batched else peer)
                key = (kind, group.group_name, stream_kind, peer)
                seq = self.seqs[key]
                self.seqs[key] += 1
                tag = seq * _TAGS_PER_SEQ + (2 if batched else 0)
                op = _Op(kind, tensor, peer, group, group_peer, stream, seq, tag, site, next(self.serials))
                ops.append(op)
                self.pending[op.serial] = op
            self.version += 1
            entries = [ops] if batched else [[op] for op in ops]
            for entry in entries:
                entry[0].stream.submit(entry)
        return [_Work(op) for op in ops]

    # ---- what is pending, for the launcher ------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """The operations not completed yet: those waiting for the peer's first operation on their pair,
        then the queued ones in issue order, each with its stream and whether it is the one its stream
        runs (waiting for its peer) or queued behind it."""
        with self.lock:
            ops = sorted(self.pending.values(), key=lambda op: op.serial)
            out = list(self.connecting.values())
        for op in ops:
            if op.done.is_set():
                continue
            running = op in op.stream.running()
            out.append({"op": op.describe(), "kind": op.kind, "stream": op.stream.name, "running": running,
                        "posted": op.posted, "error": None if op.stream.error is None else str(op.stream.error)})
        return out

    def _dump_forever(self) -> None:
        path = self.dump_dir / f"pending-rank{self.rank}.json"
        written = -1
        while True:
            time.sleep(DUMP_EVERY_S)
            if self.version == written:
                continue
            written = self.version
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": self.rank, "time": time.time(), "ops": self.snapshot()}))
            tmp.rename(path)


_rules: _Rules | None = None


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else c10d._get_default_group()


def _peer(group: dist.ProcessGroup, peer: int | None, group_peer: int | None, what: str) -> tuple[int, int]:
    """(global rank, group rank) of a peer given either way."""
    if peer is None and group_peer is None:
        raise NcclRuleError(f"NCCL rules: NCCL has no {what} from any source: name the peer")
    if group_peer is None:
        return peer, dist.get_group_rank(group, peer)
    return dist.get_global_rank(group, group_peer), group_peer


def _p2p(kind: str, tensor, peer, group, group_peer) -> dist.Work | None:
    group = _group(group)
    if c10d._rank_not_in_group(group):
        return None
    peer, group_peer = _peer(group, peer, group_peer, "receive" if kind == "irecv" else "send")
    _rules.connect(kind, tensor, group, peer, group_peer)
    return _rules.issue([(kind, tensor, group, peer, group_peer)], batched=False)[0]


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    """torch.distributed.isend under NCCL's rules (the tag is ignored)."""
    return _p2p("isend", tensor, dst, group, group_dst)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    """torch.distributed.irecv under NCCL's rules (the tag is ignored; a source is required)."""
    return _p2p("irecv", tensor, src, group, group_src)


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> None:
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> int:
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    work.wait()
    return work.op.peer


def batch_isend_irecv(p2p_op_list: list) -> list[dist.Work]:
    """torch.distributed.batch_isend_irecv under NCCL's rules: the operations are one entry on their
    group's stream and progress together."""
    c10d._check_p2p_op_list(p2p_op_list)
    specs = []
    for p in p2p_op_list:
        kind = "isend" if p.op in (isend, _rules.original["isend"]) else "irecv"
        group = _group(p.group)
        if c10d._rank_not_in_group(group):
            continue
        specs.append((kind, p.tensor, group, p.peer, p.group_peer))
    return _rules.issue(specs, batched=True) if specs else []


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _on_run_device(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for t in _tensors([*args, *kwargs.values()]):
            if t.device != _rules.device:
                raise NcclRuleError(f"NCCL rules: {name} was given a tensor on {t.device}: collectives on an NCCL "
                                    f"group take tensors on the run's device ({_rules.device}) only")
        return fn(*args, **kwargs)

    return checked


def install(rank: int, device: torch.device, dump_dir: Path | None = None) -> bool:
    """Make this rank's gloo traffic follow NCCL's rules (see the module docstring); write what is
    pending to ``dump_dir``. A no-op (False) where the default backend is not gloo: on NCCL the rules
    hold anyway."""
    global _rules
    if dist.get_backend() != "gloo":
        return False
    if _rules is not None:
        return True
    mine = {"isend": isend, "irecv": irecv, "send": send, "recv": recv, "batch_isend_irecv": batch_isend_irecv}
    original = {name: getattr(c10d, name) for name in (*mine, *_COLLECTIVES) if hasattr(c10d, name)}
    _rules = _Rules(rank, device, dump_dir, original)
    patched = dict(mine, **{name: _on_run_device(name, original[name]) for name in _COLLECTIVES if name in original})
    for name, fn in patched.items():
        setattr(c10d, name, fn)
        if hasattr(dist, name):
            setattr(dist, name, fn)
    return True


def pending_summary(run_dir: Path) -> str:
    """Every rank's pending operations as its last dump gave them ('' where none was written: the run
    did not follow NCCL's rules): per stream, the operation it runs and what is queued behind it."""
    now = time.time()
    parts = []
    for path in sorted(run_dir.glob(PENDING_GLOB), key=lambda p: int(p.stem.removeprefix("pending-rank"))):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        streams: dict[str, list[dict]] = {}
        for o in dump.get("ops") or []:
            streams.setdefault(o["stream"], []).append(o)
        clauses = []
        for ops in streams.values():
            head, queued = ops[0], ops[1:]
            awaited = {"irecv": "message", "isend": "receive",
                       "connect": "first operation on the pair (NCCL creates the pair's communicator then)"}
            text = f"{head['op']} waiting for its peer's {awaited[head['kind']]} for {now - head['posted']:.0f} s"
            if head.get("error"):
                text += f" (failed: {head['error']})"
            if queued:
                sends = [o for o in queued if o["kind"] != head["kind"]]
                text += f", {len(queued)} more queued behind it" + (f", among them {sends[0]['op']}" if sends else "")
            clauses.append(text)
        parts.append(f"rank {dump['rank']}: " + ("; ".join(clauses) or "nothing pending"))
    return " | ".join(parts)

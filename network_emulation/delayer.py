"""Userspace packet delayer on nfnetlink_queue (standard library only; runs as a script).

    python delayer.py --queue 0:10 --queue 1:10:2:0.5   # queue-num:delay-ms[:jitter-ms[:loss-%]], repeatable

Binds the given NFQUEUE numbers on one AF_NETLINK socket with metadata-only
copy (NFQNL_COPY_META) and whole GSO packets (NFQA_CFG_F_GSO), notes each
packet's arrival, and accepts it ``delay`` ms later: one NFQNL_MSG_VERDICT_BATCH
per queue releases every due packet at once (ids are FIFO per queue, so no
reordering). A queue with loss drops each packet with that probability on
arrival (an NF_DROP verdict of its own; a GSO packet is dropped whole, as netem
drops an skb); with jitter each packet is held delay + U(-jitter, +jitter) ms,
but never released before the packet ahead of it (no reordering). Runs
SCHED_FIFO where permitted, so CPU-bound ranks do not delay it.

Prints ``ready`` once bound. Reads commands on stdin, one a line:
``set QUEUE DELAY_MS JITTER_MS LOSS_PCT`` (packets arriving from then on are
held and dropped so; those held keep their release time) and ``stats`` (one
line of JSON on stdout: per queue, the packets seen and dropped). Exits when
stdin reaches EOF, i.e. when the owning process dies, whatever way it dies.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import random
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
QUEUE_MAXLEN = 1 << 17  # packets held per queue before the kernel drops
PR_SET_TIMERSLACK = 29
REALTIME_PRIORITY = 10  # SCHED_FIFO; the kernel's RT throttling still leaves 5 % of each core to others


def _attr(kind: int, payload: bytes) -> bytes:
    a = struct.pack("=HH", 4 + len(payload), kind) + payload
    return a + b"\0" * (-len(a) % 4)


def _msg(msg_type: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


def _config(sock: socket.socket, queue: int, attrs: bytes, seq: int) -> None:
    sock.send(_msg(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
    while True:
        data = sock.recv(65536)
        off = 0
        while off + 16 <= len(data):
            length, mtype, _, mseq, _ = struct.unpack_from("=IHHII", data, off)
            if mtype == NLMSG_ERROR and mseq == seq:
                (err,) = struct.unpack_from("=i", data, off + 16)
                if err:
                    raise OSError(-err, f"nfqueue config of queue {queue}: {os.strerror(-err)}")
                return
            off += (length + 3) & ~3


def open_queues(queues: list[int]) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    seq = 1
    for q in queues:
        for attrs in (
            _attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
            _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)),
            _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN)),
            _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO)) + _attr(NFQA_CFG_MASK,
                                                                             struct.pack(">I", NFQA_CFG_F_GSO)),
        ):
            _config(sock, q, attrs, seq)
            seq += 1
    return sock


def packet_ids(data: bytes) -> list[tuple[int, int]]:
    """(queue, packet id) of every NFQNL_MSG_PACKET in one netlink read."""
    out = []
    off, n = 0, len(data)
    while off + 20 <= n:
        length, mtype = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if mtype == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            queue = struct.unpack_from(">H", data, off + 18)[0]
            a, end = off + 20, off + length
            while a + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x3FFF == NFQA_PACKET_HDR:
                    out.append((queue, struct.unpack_from(">I", data, a + 4)[0]))
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3
    return out


def verdict_batch(queue: int, last_id: int) -> bytes:
    return _msg(NFQNL_MSG_VERDICT_BATCH, queue, _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last_id)))


def verdict_drop(queue: int, packet_id: int) -> bytes:
    return _msg(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_DROP, packet_id)))


class Queue:
    """What the delayer does to one queue's packets, the delay, jitter and loss of the link the queue
    stands for (a profile's ``LinkSpec``: this script imports nothing of the suite), and what it has
    done: packets seen and dropped."""

    def __init__(self, delay_ms: float, jitter_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        self.seen = self.dropped = 0
        self.last_due = 0.0
        self.set(delay_ms, jitter_ms, loss_pct)

    def set(self, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
        self.delay, self.jitter, self.loss = delay_ms / 1e3, jitter_ms / 1e3, loss_pct / 100

    def arrive(self, t: float, rng: random.Random) -> float | None:
        """The release time of a packet that arrived at ``t``, or None: dropped."""
        self.seen += 1
        if self.loss and rng.random() < self.loss:
            self.dropped += 1
            return None
        due = t + self.delay
        if self.jitter:
            due = max(t, due + rng.uniform(-self.jitter, self.jitter), self.last_due)
        self.last_due = due
        return due


def queue_arg(queue: int, delay_ms: float, jitter_ms: float = 0.0, loss_pct: float = 0.0) -> str:
    """The ``--queue`` argument of one queue (``parse_queue``'s inverse)."""
    extra = f":{jitter_ms:.6g}:{loss_pct:.6g}" if jitter_ms or loss_pct else ""
    return f"{queue}:{delay_ms:.6g}{extra}"


def parse_queue(spec: str) -> tuple[int, Queue]:
    """``NUM:DELAY[:JITTER[:LOSS]]`` (ms, ms, %) -> (queue number, its link)."""
    q, *values = spec.split(":")
    if not 1 <= len(values) <= 3:
        raise ValueError(f"bad queue {spec!r}: NUM:DELAY_MS[:JITTER_MS[:LOSS_PCT]]")
    return int(q), Queue(*map(float, values))


def command(line: str, queues: dict[int, Queue]) -> str | None:
    """Carry out one stdin command; returns the line to print, if any."""
    words = line.split()
    if words[:1] == ["set"] and len(words) == 5 and int(words[1]) in queues:
        queues[int(words[1])].set(*map(float, words[2:]))
    elif words == ["stats"]:
        return json.dumps({q: {"seen": k.seen, "dropped": k.dropped} for q, k in queues.items()})
    elif words:
        print(f"delayer: ignored command {line!r}", file=sys.stderr, flush=True)
    return None


def run(queues: dict[int, Queue], seed: int | None = None) -> None:
    try:  # exact wake-ups: no timer slack
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:  # run before the training ranks when a packet arrives or falls due: CPU-bound ranks on
        # the same cores would otherwise delay the reads (a later arrival stamp) and the releases
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (OSError, AttributeError):
        pass  # not permitted (no root / no CAP_SYS_NICE): the ordinary scheduler
    sock = open_queues(sorted(queues))
    sock.setblocking(False)
    rng = random.Random(seed)
    held: dict[int, collections.deque[tuple[float, int]]] = {q: collections.deque() for q in queues}
    stdin = sys.stdin.fileno()
    pending = b""
    print("ready", flush=True)
    now = time.monotonic
    while True:
        t = now()
        for q, dq in held.items():
            last = -1
            while dq and dq[0][0] <= t:
                last = dq.popleft()[1]
            if last >= 0:
                sock.send(verdict_batch(q, last))
        due = [dq[0][0] for dq in held.values() if dq]
        timeout = max(0.0, min(due) - now()) if due else None
        readable, _, _ = select.select([sock, stdin], [], [], timeout)
        if stdin in readable:
            data = os.read(stdin, 4096)
            if not data:
                return  # owner gone
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                reply = command(line.decode(errors="replace"), queues)
                if reply is not None:
                    print(reply, flush=True)
        if sock in readable:
            for _ in range(64):  # bounded, so due packets still leave under a flood
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    break
                t = now()
                for q, pid in packet_ids(data):
                    release = queues[q].arrive(t, rng)
                    if release is None:
                        sock.send(verdict_drop(q, pid))
                    else:
                        held[q].append((release, pid))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queue", action="append", required=True, metavar="NUM:DELAY_MS[:JITTER_MS[:LOSS_PCT]]")
    ap.add_argument("--owner", type=int, default=0, help="pid of the owning process (for ps; informative)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the drops and the jitter (default: random)")
    args = ap.parse_args(argv)
    queues = dict(map(parse_queue, args.queue))
    try:
        run(queues, args.seed)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

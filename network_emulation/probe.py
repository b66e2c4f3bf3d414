"""Measure one link: one-way delay and its jitter (UDP ping-pong), packet loss (a paced train of
numbered UDP datagrams, counted by the server) and TCP bandwidth (a short bulk transfer).

Standard library only; the same file is the script run inside each host:

    python probe.py server --port 47000 [--watch-stdin]
    python probe.py client --address 10.77.0.2 --port 47000 --samples 20 --train 500 --duration 1

Hosts that share one kernel (virtual hosts, virtual nodes: the same boot id) share one
clock: there the one-way delay is measured directly (the kernel's receive timestamp of the
datagram, SO_TIMESTAMPNS, minus the client's send time). Between real hosts, whose clocks
differ, it is reported as RTT/2 (``one_way_method`` says which). Bandwidth is TCP goodput (payload bytes) over the
second half of the transfer, i.e. after slow start; the whole-transfer mean is kept too. Loss is the share of the
train's datagrams that did not arrive (one direction); jitter is half the spread between the 5th and 95th
percentiles of the one-way delays (a delay uniform in D ± J reads about 0.9 J). TCP buffers are left to
autotuning (the cluster raises tcp_rmem/tcp_wmem to 64 MB); setting SO_RCVBUF would cap them at net.core.rmem_max.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import asdict, dataclass
from pathlib import Path

PING = struct.Struct("!IQ")  # seq, client send time (CLOCK_REALTIME ns)
PONG = struct.Struct("!IQQ")  # seq, client send time, server receive time
TRAIN = struct.Struct("!4sI")  # b"LOSS", seq: one datagram of the loss train
COUNT_ASK, COUNT = b"CNT?", struct.Struct("!4sI")  # the client's question, the server's answer (b"CNT=", count)
TRAIN_RATE = 4000  # datagrams a second: ~1.6 Mbit/s with headers, well below the slowest emulated link
DEFAULT_PORT = 47000
CHUNK = 1 << 20
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
SHARED_CLOCK, RTT_HALF = "shared-clock", "rtt/2"
STAMPS = ("kernel", "socket")
PR_SET_TIMERSLACK = 29
SOCKET_STAMP_PRIORITY = 5  # below the delayer's SCHED_FIFO priority
LOSS_TRAIN = 4000  # at 1 % loss: 95 % of measurements within 0.7-1.3 %
NO_LOSS_TRAIN = 500


@dataclass(frozen=True)
class LinkMeasurement:
    one_way_delay_ms: float  # median, src -> dst
    bandwidth_gbps: float  # steady-state TCP goodput src -> dst
    rtt_ms: float  # median UDP round trip
    one_way_delay_p90_ms: float
    mean_bandwidth_gbps: float  # goodput over the whole transfer, slow start included
    transfer_s: float
    samples: int
    one_way_method: str = SHARED_CLOCK  # "shared-clock": receive minus send time; "rtt/2": clocks differ
    loss_pct: float = float("nan")  # the train's datagrams that did not arrive, src -> dst
    train_packets: int = 0  # the train's datagrams sent
    jitter_ms: float = float("nan")  # half the 5-95 % spread of the one-way delays

    def describe(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        how = "" if self.one_way_method == SHARED_CLOCK else f" [{self.one_way_method}]"
        text = (f"one-way delay {self.one_way_delay_ms:.3f} ms{how} (p90 {self.one_way_delay_p90_ms:.3f}, "
                f"jitter {self.jitter_ms:.3f}), rtt {self.rtt_ms:.3f} ms")
        if self.train_packets:
            text += f", loss {self.loss_pct:.2f} % of {self.train_packets}"
        if self.transfer_s > 0:
            text += (f", bandwidth {self.bandwidth_gbps:.3f} Gbit/s "
                     f"(mean {self.mean_bandwidth_gbps:.3f} over {self.transfer_s:.2f} s)")
        return text


# ---------------------------------------------------------------- server side
def _kernel_rx_ns(ancdata: list[tuple[int, int, bytes]]) -> int:
    """The kernel's receive time of a datagram (CLOCK_REALTIME ns), so that the server's own
    scheduling latency on a loaded machine does not count as link delay."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            return sec * 1_000_000_000 + nsec
    return time.time_ns()


def _bulk_receive(conn: socket.socket) -> dict[str, float]:
    buf = bytearray(4 << 20)
    marks: list[tuple[float, int]] = []
    total = 0
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
        marks.append((time.monotonic(), total))
    if len(marks) < 2:
        return {"bytes": total, "mean_gbps": 0.0, "steady_gbps": 0.0, "seconds": 0.0}
    t0, t1 = marks[0][0], marks[-1][0]
    mid = t0 + (t1 - t0) / 2
    tm, bm = next((t, b) for t, b in marks if t >= mid)
    if t1 - tm <= 0:
        tm, bm = marks[0]
    return {
        "bytes": total,
        "seconds": t1 - t0,
        "mean_gbps": (total - marks[0][1]) * 8 / (t1 - t0) / 1e9,
        "steady_gbps": (total - bm) * 8 / (t1 - tm) / 1e9,
    }


def boot_id() -> str:
    """This kernel's boot id: two processes with the same one read the same clock."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def _prefer_cpu() -> None:
    """Wake promptly on a loaded machine: no timer slack, SCHED_FIFO below the delayer's priority
    (where permitted; otherwise the ordinary scheduler)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(SOCKET_STAMP_PRIORITY))
    except (OSError, AttributeError):
        pass


def serve(port: int, timeout_s: float = 60.0, watch_stdin: bool = False, stamp: str = "kernel") -> None:
    """Echo UDP pings (adding the receive time) until one TCP bulk transfer is done; then exit.
    Prints ``ready <boot id>`` once listening. With ``watch_stdin`` also exits when stdin reaches
    EOF (the caller is gone, e.g. its ssh connection closed).

    ``stamp``: "kernel" takes the kernel's receive time of the datagram (device receive, so the
    server's scheduling latency does not count); "socket" the time the server reads it, needed
    when the delay is added after the device receive (the delayer on the receiver's ingress,
    raw PREROUTING): the server then runs SCHED_FIFO where permitted."""
    if stamp == "socket":
        _prefer_cpu()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    udp.bind(("0.0.0.0", port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(1)
    print(f"ready {boot_id()}", flush=True)
    watched = [sys.stdin.fileno()] if watch_stdin else []
    train = 0  # datagrams of the loss train received
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([udp, tcp, *watched], [], [], 1.0)
        if watched and watched[0] in readable and not os.read(watched[0], 4096):
            return
        if udp in readable:
            data, anc, _, peer = udp.recvmsg(64, socket.CMSG_SPACE(16))
            t = _kernel_rx_ns(anc) if stamp == "kernel" else time.time_ns()
            if len(data) == PING.size:
                seq, sent = PING.unpack(data)
                udp.sendto(PONG.pack(seq, sent, t), peer)
            elif len(data) == TRAIN.size and data.startswith(b"LOSS"):
                train += 1
            elif data == COUNT_ASK:
                udp.sendto(COUNT.pack(b"CNT=", train), peer)
        if tcp in readable:
            conn, _ = tcp.accept()
            with conn:
                conn.sendall(json.dumps(_bulk_receive(conn)).encode() + b"\n")
            return


# ---------------------------------------------------------------- client side
def _pings(address: str, port: int, samples: int, warmup: int = 3) -> tuple[list[float], list[float]]:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(1.0)
    one_way, rtt = [], []
    seq = 0
    for _ in range(4 * (samples + warmup)):
        if len(one_way) >= samples:
            break
        seq += 1
        sent = time.time_ns()
        udp.sendto(PING.pack(seq, sent), (address, port))
        try:
            while True:
                data = udp.recv(64)
                now = time.time_ns()
                rseq, rsent, rrecv = PONG.unpack(data)
                if rseq == seq:
                    break
        except (socket.timeout, struct.error):
            continue
        if seq > warmup:
            one_way.append((rrecv - rsent) / 1e6)
            rtt.append((now - rsent) / 1e6)
        time.sleep(0.002)
    if len(one_way) < max(1, samples // 2):
        raise RuntimeError(f"probe: only {len(one_way)} of {samples} UDP pings to {address} came back")
    return one_way, rtt


def _loss_train(address: str, port: int, packets: int, wait_s: float) -> dict[str, int]:
    """Send ``packets`` numbered datagrams paced at ``TRAIN_RATE`` a second, wait ``wait_s`` for the
    last to arrive, then ask the server how many did (asking again until it answers)."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    burst = 8
    start = time.monotonic()
    for seq in range(packets):
        udp.sendto(TRAIN.pack(b"LOSS", seq), (address, port))
        if seq % burst == burst - 1:
            ahead = start + (seq + 1) / TRAIN_RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
    time.sleep(wait_s)
    udp.settimeout(max(0.2, wait_s))
    for _ in range(40):
        udp.sendto(COUNT_ASK, (address, port))
        try:
            while True:
                data = udp.recv(64)
                if len(data) == COUNT.size and data.startswith(b"CNT="):
                    return {"sent": packets, "received": COUNT.unpack(data)[1]}
        except socket.timeout:
            continue
    raise RuntimeError(f"probe: the server at {address} never said how much of the loss train arrived")


def _bulk_send(address: str, port: int, duration_s: float) -> dict[str, float]:
    with socket.create_connection((address, port), timeout=30) as s:
        chunk = memoryview(bytes(CHUNK))
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            part = s.recv(4096)
            if not part:
                break
            reply += part
    return json.loads(reply)


def client(address: str, port: int, samples: int, duration_s: float, train: int = 0) -> dict[str, object]:
    one_way, rtt = _pings(address, port, samples)
    lost = _loss_train(address, port, train, wait_s=2 * max(rtt) / 1e3 + 0.1) if train > 0 else {}
    bulk = _bulk_send(address, port, duration_s) if duration_s > 0 else {}
    return {"one_way_ms": one_way, "rtt_ms": rtt, "train": lost, "bulk": bulk, "boot_id": boot_id()}


def _percentile(values: list[float], q: float) -> float:
    """The q-th quantile (0..1) of sorted ``values``, by the nearest rank."""
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(raw: dict, server_boot_id: str | None = None) -> LinkMeasurement:  # type: ignore[type-arg]
    """One measurement from the client's raw output. The one-way delay is measured when client and
    server share a clock (same boot id, or ``server_boot_id`` not given), else it is RTT/2."""
    rtt = sorted(raw["rtt_ms"])
    client_boot = raw.get("boot_id", "unknown")
    shared = server_boot_id is None or (server_boot_id == client_boot and client_boot != "unknown")
    ow = sorted(raw["one_way_ms"]) if shared else [r / 2 for r in rtt]
    bulk = raw.get("bulk") or {}
    train = raw.get("train") or {}
    sent = int(train.get("sent", 0))
    return LinkMeasurement(
        one_way_delay_ms=statistics.median(ow),
        bandwidth_gbps=float(bulk.get("steady_gbps", float("nan"))),
        rtt_ms=statistics.median(rtt),
        one_way_delay_p90_ms=ow[min(len(ow) - 1, int(0.9 * len(ow)))],
        mean_bandwidth_gbps=float(bulk.get("mean_gbps", float("nan"))),
        transfer_s=float(bulk.get("seconds", 0.0)),
        samples=len(ow),
        one_way_method=SHARED_CLOCK if shared else RTT_HALF,
        loss_pct=100 * (1 - train["received"] / sent) if sent else float("nan"),
        train_packets=sent,
        jitter_ms=(_percentile(ow, 0.95) - _percentile(ow, 0.05)) / 2,
    )


Wrap = Callable[[list[str]], list[str]]
"""Turns the probe script's own arguments (``["server", "--port", "47000"]``) into a full argv
that runs it somewhere: inside a namespace, or on a node over ssh."""


def bulk_duration(profile, src: int, dst: int) -> float:
    """Seconds of the bulk transfer for the src -> dst link of ``profile``: 1 s, longer (up to 4 s)
    on long round trips so that TCP leaves slow start."""
    rtt_ms = sum(link.delay_ms for link in (profile.link(src, dst), profile.link(dst, src)) if link)
    return min(4.0, max(1.0, 25 * rtt_ms / 1e3))


class LinkProbing:
    """Hosts whose links can be measured (a local virtual cluster, an ssh shaping session): ``probe``
    is what every measurement shares, ``_measure`` runs the probe's two ends where the hosts are."""

    profile: Any  # the shaping: the bulk transfer runs longer on long round trips

    def probe(self, src: int, dst: int, *, samples: int | None = None, duration_s: float | None = None,
              train: int | None = None, port: int = DEFAULT_PORT) -> LinkMeasurement:
        """Measure the link from host ``src`` to host ``dst``: median one-way delay and its jitter,
        packet loss and steady TCP goodput.

        ``samples``: pings (20; 50 on a link set to jitter, for the spread). ``train``: datagrams of
        the loss train (``LOSS_TRAIN`` on a link set to lose packets, enough to tell 0.5 % from 2 %;
        else ``NO_LOSS_TRAIN``, a check that it loses none). ``duration_s`` of the bulk transfer: by
        default 1 s, longer (up to 4 s) on long round trips so that TCP leaves slow start; 0
        measures the delay only."""
        if src == dst:
            raise ValueError("probe needs two different hosts")
        link = self.profile.link(src, dst)
        if samples is None:
            samples = 50 if link is not None and link.jitter_ms else 20
        if train is None:
            train = LOSS_TRAIN if link is not None and link.loss_pct else NO_LOSS_TRAIN
        if duration_s is None:
            duration_s = bulk_duration(self.profile, src, dst)
        return self._measure(src, dst, samples=samples, duration_s=duration_s, train=train, port=port)

    def probe_links(self) -> dict[str, Any]:
        """Every kind of link of the profile measured once, on the first host pair that has it
        (``profiles.link_classes``: one for a uniform profile, one per kind of link of a matrix):
        ``measured_links``, each measurement with its pair (``src``, ``dst``) and what the link was
        ``set`` to; ``measured_link``, the slowest one's (what a simulation of the run reads)."""
        from .profiles import link_classes, slowest

        classes = link_classes(self.profile)
        links = [{"src": i, "dst": j, "set": link.describe(), **self.probe(i, j).describe()} for i, j, link in classes]
        src, dst, _ = slowest(classes)
        return {"measured_link": next(m for m in links if (m["src"], m["dst"]) == (src, dst)), "measured_links": links}

    def _measure(self, src: int, dst: int, *, samples: int, duration_s: float, train: int,
                 port: int) -> LinkMeasurement:
        raise NotImplementedError


def measure_with(server: Wrap, client: Wrap, address: str, *, port: int = DEFAULT_PORT, samples: int = 20,
                 duration_s: float = 1.0, train: int = 0, stamp: str = "kernel") -> LinkMeasurement:
    """Start the probe server through ``server``, then the client through ``client`` towards
    ``address``; measure the client -> server direction. The server's stdin is a pipe held open
    for the measurement: closing it ends the server wherever it runs. ``stamp``: see ``serve``."""
    if stamp not in STAMPS:
        raise ValueError(f"stamp must be one of {STAMPS}, got {stamp!r}")
    srv = subprocess.Popen(server(["server", "--port", str(port), "--watch-stdin", "--stamp", stamp]),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline().split() if srv.stdout else []
        if line[:1] != ["ready"]:
            raise RuntimeError(f"probe server did not start (exit {srv.poll()})")
        out = subprocess.run(client(["client", "--address", address, "--port", str(port),
                                     "--samples", str(samples), "--duration", str(duration_s),
                                     "--train", str(train)]),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=60 + samples + duration_s + train / TRAIN_RATE)
        if out.returncode != 0:
            raise RuntimeError(f"probe client failed: {out.stderr.strip().splitlines()[-1:]}")
        return summarize(json.loads(out.stdout), line[1] if len(line) > 1 else None)
    finally:
        from .signals import end_by_stdin  # here: this file also runs as a script on the hosts

        end_by_stdin(srv, 5.0)


def measure(server_prefix: Sequence[str], client_prefix: Sequence[str], address: str, *,
            port: int = DEFAULT_PORT, samples: int = 20, duration_s: float = 1.0, train: int = 0) -> LinkMeasurement:
    """Run the server under ``server_prefix`` (e.g. ``ip netns exec h1``) and the client under
    ``client_prefix``, both with this Python; measure the client -> server direction."""
    py = [sys.executable, "-I", str(Path(__file__).resolve())]
    return measure_with(lambda args: [*server_prefix, *py, *args], lambda args: [*client_prefix, *py, *args],
                        address, port=port, samples=samples, duration_s=duration_s, train=train)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="link probe (runs inside one virtual host)")
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--watch-stdin", action="store_true", help="exit when stdin reaches EOF")
    s.add_argument("--stamp", choices=STAMPS, default="kernel",
                   help="receive time: the kernel's (default) or when read (delay added after device receive)")
    c = sub.add_parser("client")
    c.add_argument("--address", required=True)
    c.add_argument("--port", type=int, default=DEFAULT_PORT)
    c.add_argument("--samples", type=int, default=20)
    c.add_argument("--duration", type=float, default=1.0)
    c.add_argument("--train", type=int, default=0, help="datagrams of the loss train (0: none)")
    a = ap.parse_args(argv)
    if a.role == "server":
        serve(a.port, watch_stdin=a.watch_stdin, stamp=a.stamp)
    else:
        json.dump(client(a.address, a.port, a.samples, a.duration, a.train), sys.stdout)


if __name__ == "__main__":
    main()

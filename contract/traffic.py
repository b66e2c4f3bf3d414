"""The bytes this process has sent over TCP: what a rank's records report as "bytes sent".

Counted by the kernel, per socket: for every TCP socket the process holds open, ``TCP_INFO``'s
``tcpi_bytes_sent`` minus ``tcpi_bytes_retrans`` (Linux >= 4.19), i.e. the payload bytes the kernel
has put on the wire once, headers and retransmissions left out. Every system is counted the same
way, whatever library sends (gloo's pairs of every process group, torchft's process group and its
manager's RPCs, the TCP stores), on loopback as across a virtual cluster's links. Left out: sockets
opened and closed between two readings (``SentBytes`` keeps the last reading of a socket that has
closed since), UDP, and transports that are not the process's TCP sockets (NCCL over NVLink, shared
memory or InfiniBand: on GPUs the count is then what crossed TCP only).
"""
from __future__ import annotations

import os
import socket
import struct

# struct tcp_info (include/uapi/linux/tcp.h): tcpi_bytes_sent and tcpi_bytes_retrans, two __u64
_BYTES_SENT_AT = 200
_INFO_LEN = _BYTES_SENT_AT + 16


def _socket_bytes() -> dict[tuple[int, int], int]:
    """(fd, inode) -> payload bytes sent, of every TCP socket of this process."""
    out: dict[tuple[int, int], int] = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
            if (st.st_mode & 0o170000) != 0o140000:  # not a socket
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
        except OSError:
            continue
        finally:
            s.close()
        if len(info) >= _INFO_LEN:
            sent, retrans = struct.unpack_from("=QQ", info, _BYTES_SENT_AT)
            out[fd, st.st_ino] = sent - retrans
    return out


class SentBytes:
    """A running count of this process's TCP payload bytes sent since it was created."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], int] = {}
        self._start = self._total()

    def _total(self) -> int:
        self._seen.update(_socket_bytes())
        return sum(self._seen.values())

    def read(self) -> int:
        """Bytes sent since this counter was created."""
        return self._total() - self._start

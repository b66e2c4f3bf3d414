"""Copying a child process's output as it comes: one helper for the launcher, the sweep and the
cluster mode; and what a failed rank's words mean."""
from __future__ import annotations

import collections
import threading
from typing import IO, Callable, Iterable

# How a rank that failed because another one did reports it (gloo's words): such an error is not
# the cause; the launcher names the rank that failed first, the cluster mode the node.
PEER_FAILURE = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused", "Socket closed")


def is_peer_failure(text: str) -> bool:
    """``text`` (an error) says that a peer went away, not what went wrong first."""
    return any(p.lower() in text.lower() for p in PEER_FAILURE)


class Pump:
    """A thread that reads ``stream`` line by line until it closes, writes each line (with
    ``prefix``) to every sink, and keeps the last ``keep`` lines. ``intercept(line)`` may claim a
    line (return True): it is then neither written nor kept (e.g. a pid announcement)."""

    def __init__(self, stream: IO, sinks: Iterable[IO] = (), *, prefix: str = "", keep: int = 60,
                 intercept: Callable[[str], bool] | None = None, lock: threading.Lock | None = None):
        self.stream, self.sinks, self.prefix, self.intercept = stream, list(sinks), prefix, intercept
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._lock = lock or threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for raw in self.stream:
            line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if self.intercept is not None and self.intercept(line):
                continue
            text = self.prefix + line
            with self._lock:
                self.lines.append(text)
                for sink in self.sinks:
                    sink.write(text)
                    sink.flush()

    def mute(self) -> None:
        """Keep reading (and keeping the last lines) but write nothing more to the sinks."""
        with self._lock:
            self.sinks = []

    def join(self, timeout: float | None = 5.0) -> None:
        self._thread.join(timeout)

    @property
    def tail(self) -> str:
        with self._lock:
            return "".join(self.lines)

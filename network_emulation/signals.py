"""Turn SIGINT/SIGTERM/SIGHUP into exceptions so ``with`` blocks always clean up.

The only process-global state of the package: the previous handlers, saved and
restored around each guarded block.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM/SIGHUP arrives inside a guarded block."""


def _raise(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(128 + signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt and SIGTERM/SIGHUP raise Terminated,
    so the enclosing context managers' ``__exit__`` runs. No-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while the block (a teardown) runs; re-deliver them afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for s in pending[:1]:
            signal.raise_signal(s)

"""Turn SIGINT/SIGTERM/SIGHUP into exceptions so ``with`` blocks always clean up; and stop a child
process (``stop_process``).

The only process-global state of the package: the previous handlers, saved and
restored around each guarded block.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
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


class Guarded:
    """A resource set up on entering a ``with`` block and torn down on leaving it, however it is left:
    while it is open SIGINT, SIGTERM and SIGHUP raise (``signals_raise``), so a killed owner still
    tears it down; a start that fails part way tears down what it had set up before the error goes
    on. Subclasses define ``start()`` and ``close()`` (which must cope with a partial start)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._signals = signals_raise()
        self._signals.__enter__()
        try:
            self.start()
        except BaseException:
            self.close()
            self._signals.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, et, ev, tb) -> None:
        try:
            self.close()
        finally:
            self._signals.__exit__(et, ev, tb)


def stop_process(proc: subprocess.Popen, first: int | None = signal.SIGTERM, grace_s: float = 5.0, *,
                 group: bool = False) -> int:
    """Stop a child and reap it, the one way every part of the suite does: send ``first`` (None: it
    was asked already, e.g. its stdin closed, or it is to be killed at once), wait up to ``grace_s``
    for it to end, then SIGKILL. With ``group`` the signals go to its process group (a child started
    in a session of its own, with its children), and the group gets SIGKILL at the end even when its
    leader has gone (its children may linger). Returns its exit status."""
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    if first is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            send(first)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGKILL)
        proc.wait()
    if group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def processes_where(match: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids of this machine's processes whose argv (``/proc/PID/cmdline``, split at NULs) ``match``es."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(argv):
            found.append(int(d.name))
    return found


def end_by_stdin(proc: subprocess.Popen, grace_s: float) -> int:
    """Stop a child that ends when its stdin closes (a probe server, a delayer): close its stdin, wait up
    to ``grace_s``, then SIGKILL (``stop_process``); its stdout is closed after. Returns its exit status."""
    if proc.stdin:
        proc.stdin.close()
    status = stop_process(proc, None, grace_s)
    if proc.stdout:
        proc.stdout.close()
    return status


def cli_status(prog: str, run: Callable[[], int | None], refused: tuple[type[BaseException], ...], *,
               failed: tuple[type[BaseException], ...] = (RuntimeError,), said: tuple[str, str] = ("", ""),
               interrupted: str | None = None) -> int:
    """A command line's exit status, the one way the suite's commands end: what ``run`` returns (None: 0);
    for a ``refused`` error one line on stderr (``prog: <said[0]><error>``) and 2; for a ``failed`` one,
    one line (``said[1]``) and 1; on Ctrl-C 130, on a signal ``signals_raise`` turned into ``Terminated``
    its status (with ``interrupted``: a line '<interrupted>: interrupted')."""
    try:
        return run() or 0
    except refused as e:
        print(f"{prog}: {said[0]}{e}", file=sys.stderr)
        return 2
    except failed as e:
        print(f"{prog}: {said[1]}{e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        if interrupted:
            print(f"{interrupted}: interrupted", file=sys.stderr)
        return e.code if isinstance(e, Terminated) else 130


"""Copying a child process's output as it comes: one helper for the launcher, the sweep and the
cluster mode; what a failed rank's words mean; and what of a run's output the terminal is spared."""
from __future__ import annotations

import collections
import re
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


TRACEBACK_STARTS = ("Traceback (most recent call last):", "During handling of the above exception",
                    "The above exception was the direct cause")
# torchrun's own log lines (glog format) and the exceptions that carry its report of a failed rank
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
TORCHRUN_ERRORS = ("torch.distributed.elastic.", "ChildFailedError", "SignalException")
# torchft's checkpoint server (a replica that heals fetches its state from a peer's): http.server's line
# of each request
_CHECKPOINT_LOG = re.compile(r'^\S+ - - \[[^]]*\] "GET /checkpoint/')
# what a rank still running late prints before its stacks (runners.hang_stacks): the line stays, the
# stacks that follow it are withheld
HANG_STACKS = "every thread's stack follows"
WITHHELD_LINES = 400  # of a run's withheld output, the last ones kept


class Withheld:
    """What of a run's output (its ranks' and torchrun's, through ``Pump``) the terminal is spared, the
    last ``WITHHELD_LINES`` of it kept for the run's record: the tracebacks of ranks that failed
    because another did (a peer's failure: a killed replica), torchrun's report of a failed rank (its
    log lines and its ChildFailedError, with the summary under it), the requests torchft's checkpoint
    server logs (a replica healing from a peer), a hang's stacks, and everything after ``mute`` (what
    ranks print while they are stopped). A rank's own traceback (its error, not a
    peer's) still goes to the terminal. ``sink(stream)`` makes the filter of one stream (each keeps
    its own place in a block); the filters share the kept lines."""

    def __init__(self, terminal: IO):
        self.terminal = terminal
        self.lines: collections.deque[str] = collections.deque(maxlen=WITHHELD_LINES)
        self.muted = False
        self._lock = threading.Lock()

    def sink(self) -> _Filter:
        return _Filter(self)

    def mute(self) -> None:
        self.muted = True

    def keep(self, lines: Iterable[str]) -> None:
        with self._lock:
            self.lines.extend(lines)

    def show(self, lines: Iterable[str]) -> None:
        if self.muted:
            self.keep(lines)
            return
        for line in lines:
            self.terminal.write(line)
        self.terminal.flush()

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)


class _Filter:
    """One stream's filter for ``Withheld``: a file-like sink that ``Pump`` writes whole lines to."""

    def __init__(self, owner: Withheld):
        self.owner = owner
        self.block: list[str] = []  # a traceback being read (decided at its exception line)
        self.state = "text"  # text | traceback | report (torchrun's summary, to its closing rule) | stacks
        self.rules = 0  # of torchrun's summary, the rules of '=' read

    def write(self, line: str) -> None:
        bare = line.rstrip("\n")
        if self.state == "traceback":
            self.block.append(line)
            if bare[:1] in (" ", "\t") or not bare.strip() or bare.startswith(TRACEBACK_STARTS):
                return
            self._decide(bare)  # the exception's line: the block is complete
        elif self.state == "report":
            self.owner.keep([line])
            self.rules += set(bare.strip()) == {"="}
            if self.rules == 2:  # its summary stands between two rules of '='
                self.state = "text"
        elif self.state == "stacks" and (not bare.strip() or bare.startswith(("Thread 0x", "Current thread 0x", "  "))):
            self.owner.keep([line])
        else:
            self.state = "text"
            if bare.startswith(TRACEBACK_STARTS):
                self.state, self.block = "traceback", [line]
            elif _TORCHRUN_LOG.match(bare) or _CHECKPOINT_LOG.match(bare):
                self.owner.keep([line])
            else:
                self.owner.show([line])
                if bare.endswith(HANG_STACKS):
                    self.state = "stacks"

    def _decide(self, exception: str) -> None:
        """A complete traceback whose last line is ``exception``: withheld if torchrun's or a peer's."""
        block, self.block, self.state = self.block, [], "text"
        if any(e in exception for e in TORCHRUN_ERRORS):
            self.owner.keep(block)
            self.state = "report" if exception.rstrip().endswith(":") else "text"  # its summary follows
            self.rules = 0
        elif is_peer_failure(exception):
            self.owner.keep(block)
        else:
            self.owner.show(block)

    def flush(self) -> None:
        pass

"""Run the run command as a child process and read the record it appended: the one way the sweep,
the benchmarks, the planner's evaluation and the tests start runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Sequence

from contract.records import read_records
from network_emulation.signals import stop_process
from runners.lifetime import die_with_parent
from runners.output import Pump
from runners.record import remove_records

REPO = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 30.0  # after SIGINT, how long the run command gets to stop its ranks before it is killed


@dataclass(frozen=True)
class Invocation:
    returncode: int
    record: dict | None  # the record the run appended to its --out (None: it wrote none)
    output: str  # the last lines it printed (stdout and stderr)

    @property
    def last_line(self) -> str:
        lines = [l for l in self.output.splitlines() if l.strip()]
        return lines[-1] if lines else f"exit status {self.returncode}"


def _kill_on_parent_death() -> None:
    die_with_parent(signal.SIGTERM)  # the run command stops its ranks and exits without a record


def run_command(args: Sequence[str], *, out: str | os.PathLike | None = None, timeout: float | None = None,
                python: str = sys.executable, sinks: Iterable[IO] = (), pass_fds: Sequence[int] = (),
                env: dict[str, str] | None = None) -> Invocation:
    """``python -m runners.run ARGS --out OUT`` (a temporary file when ``out`` is None); returns its exit
    status, the record it appended, and its last output lines (also copied to ``sinks`` as they come).

    Past ``timeout`` seconds it is interrupted (it stops its ranks) and, if it does not stop, killed.
    If this process is interrupted (Ctrl-C, SIGTERM raised as an exception), the child is
    interrupted too before the exception goes on; if this process dies, the child gets SIGTERM."""
    temp = None
    if out is None:
        fd, temp = tempfile.mkstemp(suffix=".jsonl", prefix="run-")
        os.close(fd)
        out = temp
    out = Path(out)
    before = len(read_records(out))
    argv = [python, "-m", "runners.run", *args, "--out", str(out)]
    try:
        proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                           **(env or {})},
                                pass_fds=tuple(pass_fds), preexec_fn=_kill_on_parent_death)
        pump = Pump(proc.stdout, sinks, keep=40)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc, signal.SIGINT, STOP_GRACE_S)
            pump.lines.append(f"stopped after {timeout:g} s\n")
        except BaseException:
            stop_process(proc, signal.SIGINT, STOP_GRACE_S)
            raise
        finally:
            pump.join()
        records = read_records(out)
        return Invocation(proc.returncode, records[-1] if len(records) > before else None, pump.tail)
    finally:
        if temp:
            remove_records(temp)


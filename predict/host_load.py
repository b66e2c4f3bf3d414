"""How busy the host is with other work while a run measures its steps.

This machine is shared: other processes compete for its cores. ``watch_run`` runs the run command and
samples, every ``period`` seconds, how many threads on the host are runnable (``/proc/loadavg``) and not
the run's own (its process tree's threads, this sampler's); rank 0's "step k/N" lines mark the measured
steps, and the mean over them is the run's background load: B threads that keep competing for the cores. With c quiet
cores, k computing ranks then get ``cores_with_background(c, B)[k - 1]`` cores' worth between them (processor sharing,
less what the host loses switching where the k outnumber the cores).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from network_emulation.signals import stop_process

PROC = Path("/proc")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process."""
    out = {}
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "stat").read_text()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2:].split()  # after "pid (comm) "
        out[int(d.name)] = (int(rest[1]), rest[0])
    return out


def tree(root: int) -> set[int]:
    """``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    mine, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in mine:
            mine.add(pid)
            stack.extend(children.get(pid, []))
    return mine


def _running_threads(pids) -> int:
    n = 0
    for pid in pids:
        try:
            for t in (PROC / str(pid) / "task").iterdir():
                text = (t / "stat").read_text()
                n += text[text.rfind(")") + 2] == "R"
        except OSError:
            continue
    return n


def others_runnable(mine: set[int]) -> int:
    """Runnable threads on the host (``/proc/loadavg``) that are not ``mine`` (the run's process tree and
    this sampler's process, whose sampling thread is runnable while it reads). May be negative: ``mine``
    are read a moment after the host's count, and a thread that blocks or wakes in between (Megatron's
    tensor-parallel all-reduces, many a step) counts one way or the other; the mean over a run
    (``watch_run``) is clamped at 0, not each sample: clamping each sample reads a quiet host under
    Megatron T-2 as 0.7-1.5 threads of background."""
    running = int((PROC / "loadavg").read_text().split()[3].split("/")[0])
    return running - _running_threads(mine)


def cores_with_background(cores: float, background: float, n: int = 8, crowded: float = 1.0) -> tuple[float, ...]:
    """Cores' worth k = 1..n computing processes get when ``background`` others compete for ``cores``;
    where the k themselves outnumber the cores, ``crowded`` of that (the time the host loses switching
    between more processes than it has cores: fitted by the calibration, 1 = none lost)."""
    return tuple((min(float(k), cores * k / (k + background)) if k + background > cores else float(k))
                 * (crowded if k > cores else 1.0) for k in range(1, n + 1))


def watch_run(argv: list[str], cwd: Path, timeout: float = 900, period: float = 0.02) -> tuple[int, float | None]:
    """Run ``argv`` (the run command); (exit status, mean background load over the measured steps, or
    None if no measured step was seen)."""
    samples: list[tuple[float, int]] = []
    marks: list[tuple[float, bool]] = []  # (time, warm-up?) of each "step k/N" line
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample():
        mine, refreshed = set(), 0.0
        while not done.is_set():
            try:
                if time.monotonic() - refreshed > 0.5:  # the run's processes come and go: re-read its tree
                    mine, refreshed = tree(proc.pid) | {os.getpid()}, time.monotonic()
                samples.append((time.monotonic(), others_runnable(mine)))
            except (OSError, ValueError, IndexError):
                pass
            done.wait(period)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stderr:
            if "] step " in line:
                marks.append((time.monotonic(), "(warm-up)" in line))
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop_process(proc, signal.SIGKILL, 5.0)
        done.set()
        sampler.join()
    starts = [t for t, warm in marks if warm]
    measured = [t for t, warm in marks if not warm]
    if not measured:
        return proc.returncode, None
    t0, t1 = (starts[-1] if starts else measured[0]), measured[-1]
    window = [n for t, n in samples if t0 <= t <= t1]
    return proc.returncode, (max(0.0, sum(window) / len(window)) if window else None)

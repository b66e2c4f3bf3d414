"""Keeping a run's processes tied to the run command: whatever way it dies, they die with it.

On Linux a process can ask the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``):
the torchrun agents ask for SIGKILL when the run command dies, and every rank asks for SIGKILL when
its agent dies, so that nothing outlives a run command killed with SIGKILL (or a rank stopped with
SIGSTOP, which SIGKILL still ends). Elsewhere these are no-ops. What a run command leaves on disk (its
run directory) goes with it too: a watchdog (``DirectoryWatchdog``; this file is its program) removes
it when the run command ends, however it ends.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask for ``sig`` when the parent dies; False where the platform cannot. Safe in a preexec_fn."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent_now() -> None:
    """``die_with_parent`` for a process already running: if its parent died before the call (it was
    re-parented to init), exit at once."""
    if die_with_parent() and os.getppid() == 1:
        os._exit(1)


OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")  # cgroup v2, v1


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this memory cgroup so far, or None
    where no counter is readable."""
    for path in OOM_COUNTERS:
        try:
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (with its pid, a name no later process
    reuses); None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 where there is none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """``<pid>.<start time>.<pid namespace>`` of this process, for names of things it owns (see
    ``owner_alive``)."""
    pid = os.getpid()
    return f"{pid}.{start_time(pid) or 0:x}.{pid_namespace():x}"


def owner_alive(tag: str) -> bool:
    """The owner of ``tag`` still runs. An owner in another pid namespace counts as alive: it cannot
    be seen from here (virtual nodes share this machine's /tmp, each in a pid namespace of its own)."""
    try:
        pid, start, *namespace = tag.split(".")
        owner = (int(pid), int(start, 16))
        if namespace and int(namespace[0], 16) != pid_namespace():
            return True
        return start_time(owner[0]) == owner[1]
    except ValueError:
        return False



class DirectoryWatchdog:
    """A watchdog process that removes the directory ``path`` when this process ends, however it ends
    (SIGKILL too): it holds the reading end of a pipe whose writing end only this process has (not
    inherited by its children) and removes ``path`` at the pipe's end of file. ``remove`` removes it
    now and ends the watchdog. In a session of its own: a Ctrl-C to the owner's terminal does not
    reach it."""

    def __init__(self, path: Path):
        self.path = path
        read, self._write = os.pipe()  # both close-on-exec: the ranks never hold the writing end
        try:
            self._process = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve()), str(path)],
                                             stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True)
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def remove(self) -> None:
        """Remove the directory now, and end the watchdog (it finds nothing left to remove)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._write is not None:
            os.close(self._write)
            self._write = None
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _watch(path: Path) -> None:
    """The watchdog's program: wait for the end of its standard input (the owner ended, or released
    it); then remove ``path``, again while dying ranks may still be writing into it."""
    while os.read(0, 4096):
        pass
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.25)


if __name__ == "__main__":
    _watch(Path(sys.argv[1]))

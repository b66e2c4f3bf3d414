"""Owner tags of the things a run command owns (its run directory): whose owner is gone; the watchdog
that removes a run directory with its owner."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import time
from pathlib import Path

from runners.launcher import RUN_DIR_PREFIX, reap_stale_run_dirs
from runners.lifetime import DirectoryWatchdog, owner_alive, owner_tag, pid_namespace, start_time


def test_owner_tags_name_the_process_and_its_pid_namespace():
    pid, start, ns = owner_tag().split(".")
    assert int(pid) == os.getpid() and int(start, 16) == start_time(os.getpid()) and int(ns, 16) == pid_namespace()
    assert owner_alive(owner_tag())
    assert owner_alive(f"{os.getpid()}.{start_time(os.getpid()):x}")           # a tag without its namespace


def test_a_dead_owner_here_is_gone_one_in_another_pid_namespace_is_not():
    p = subprocess.Popen([sys.executable, "-c", "from runners.lifetime import owner_tag; print(owner_tag())"],
                         stdout=subprocess.PIPE, text=True)
    tag = p.communicate()[0].strip()
    assert not owner_alive(tag)                                                 # it ended: its directory is stale
    pid, start, ns = tag.split(".")
    other = f"{pid}.{start}.{int(ns, 16) + 1:x}"
    assert owner_alive(other)   # another node's run command (virtual nodes share /tmp): never reaped from here
    assert not owner_alive("garbage") and not owner_alive("12.zz.1")


def _within(seconds: float, done) -> bool:
    end = time.time() + seconds
    while not done() and time.time() < end:
        time.sleep(0.05)
    return done()


def _watchdogs_of(path: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", f"lifetime.py {path}"], capture_output=True, text=True).stdout.split()


def test_a_directory_goes_with_its_owner_however_it_ends(tmp_path):
    """Issue #31, item 14: after a SIGKILL of the run command its run directory stayed until the next
    run removed it. Its watchdog removes it; an owner that removes it itself ends the watchdog too."""
    owned = tmp_path / "run"
    owned.mkdir()
    (owned / "result.json").write_text("{}")
    code = ("import sys, time; from pathlib import Path; from runners.lifetime import DirectoryWatchdog; "
            "w = DirectoryWatchdog(Path(sys.argv[1])); print('watched', flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(owned)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "watched" and owned.exists()
    owner.kill()
    owner.wait()
    # the watchdog polls 4 times a second; a crowded host may start it late. It may still be ending (an
    # interpreter's exit) after the directory went: a directory made again before it ended would be its.
    assert _within(60.0, lambda: not owned.exists() and not _watchdogs_of(owned))
    owned.mkdir()
    watchdog = DirectoryWatchdog(owned)
    assert _watchdogs_of(owned)
    watchdog.remove()
    assert not owned.exists() and not _watchdogs_of(owned)   # remove() waits for its watchdog to end


def test_the_next_run_reaps_a_run_directory_whose_owner_and_watchdog_are_gone(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "from runners.lifetime import owner_tag; print(owner_tag())"],
                         stdout=subprocess.PIPE, text=True)
    dead = p.communicate()[0].strip()
    stale = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{dead}-"))
    mine = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{owner_tag()}-"))
    try:
        reap_stale_run_dirs()
        assert not stale.exists() and mine.exists()
    finally:
        mine.rmdir()

"""Owner tags of the things a run command owns (its run directory): whose owner is gone."""
from __future__ import annotations

import os
import subprocess
import sys

from runners.lifetime import owner_alive, owner_tag, pid_namespace, start_time


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

"""Whether a run's ranks outnumbered the cores they had: no comparison is drawn from such a run.

Each rank reports the machine it ran on, the cores it was allowed to run on and the threads it
computes with (``rank_cores``); the record groups the ranks by machine (``oversubscription``). A
machine is its kernel's boot id, not its host name: the virtual nodes of a rehearsal each have a host
name of their own, yet all share this machine's cores (12 ranks on 2 cores are 12 ranks on 2 cores,
whatever the nodes are called).
"""
from __future__ import annotations

import os
import socket
from collections import defaultdict
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """This machine's identity across network and UTS namespaces: its boot id, else its host name."""
    try:
        return BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def allowed_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_cores(threads: int) -> dict:
    """What a rank reports for the check: its machine, the cores it had, the threads it computes with."""
    return {"machine": machine_id(), "cores": allowed_cores(), "threads": threads}


def oversubscription(ranks: list[dict]) -> dict | None:
    """Where the ranks' threads outnumbered the cores of the machine they shared, the worst machine's
    {"threads", "ranks", "cores", "machines"} (``machines``: how many were oversubscribed); None where
    every machine had a core per thread, or where the ranks did not report (``rank_cores``)."""
    per: dict[str, list[dict]] = defaultdict(list)
    for r in ranks:
        if not r.get("machine") or not r.get("cores"):
            return None
        per[r["machine"]].append(r)
    found = []
    for rs in per.values():
        threads = sum(int(r.get("threads") or 1) for r in rs)
        cores = max(int(r["cores"]) for r in rs)
        if threads > cores:
            found.append({"threads": threads, "ranks": len(rs), "cores": cores})
    if not found:
        return None
    worst = max(found, key=lambda f: f["threads"] / f["cores"])
    return {**worst, "machines": len(found)}


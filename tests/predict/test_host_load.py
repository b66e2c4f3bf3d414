"""The host's background load while a run measures its steps (predict.host_load), on real processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from predict.host_load import watch_run

# a run's stand-in: rank 0's step lines around two busy threads that block and wake many times a second
# (as tensor-parallel ranks do), 1.5 s of measured steps
RUN = r"""
import sys, threading, time
def work():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        t = time.monotonic()
        while time.monotonic() - t < 0.003:
            pass
        time.sleep(0.002)
print("[x] step 1/2 0.1 s (warm-up)", file=sys.stderr, flush=True)
threads = [threading.Thread(target=work) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print("[x] step 2/2 1.5 s", file=sys.stderr, flush=True)
"""


# the same steps around 1.5 s of sleep: what the sampler reads of the host alone
IDLE = RUN.replace("threads = [threading.Thread(target=work) for _ in range(2)]", "threads = []").replace(
    "[t.join() for t in threads]", "time.sleep(1.5)")
MOVED = 0.5  # runnable threads the host's own load may move between the first and the last reading
# The host's own load (runnable threads) above which the test's three busy threads (the run's two, the
# busy loop) crowd its cores: a sampler that reads the runnable threads then resolves no single one
# (on 2 cores at a load of 3.4, a busy loop beside the run read +0.3 to +0.4; at 1.45, +0.44).
BUSY = (os.cpu_count() or 2) - 1.5


ATTEMPTS = 3  # the host's load can move between the readings (another session's ranks start): any one that holds


def _readings() -> dict:
    def background(code: str) -> float:
        _, load = watch_run([sys.executable, "-c", code], Path.cwd(), timeout=60)
        assert load is not None
        return load

    before, alone, mid = background(IDLE), background(RUN), background(IDLE)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        beside = background(RUN)
    finally:
        busy.kill()
        busy.wait()
    return dict(before=before, alone=alone, mid=mid, beside=beside, after=background(IDLE))


def test_a_run_that_blocks_and_wakes_is_not_its_own_background_and_another_process_is():
    """Relative to the host's own load, read before and after (a shared host is seldom quiet): the run's
    threads add nothing to it, a busy loop beside the run about one thread (the host read before, between
    and after). Skipped, with the readings, where the host's load moved by more than ``MOVED`` meanwhile,
    or is above ``BUSY``, in every one of
    ``ATTEMPTS`` attempts: no difference of one thread can be told then; it fails where every attempt
    on a steady host reads wrong."""
    wrong, unsteady = [], []
    for _ in range(ATTEMPTS):
        r = _readings()
        idle = (r["before"], r["mid"], r["after"])
        host = max(idle)
        if host - min(idle) > MOVED or host > BUSY:
            unsteady.append(r)
            continue
        # clamping each sample at 0 made the first about 1 (Megatron T-2 read 0.7-1.5); the busy loop: one more
        if r["alone"] < host + 0.5 and r["beside"] > r["alone"] + 0.5:
            return
        wrong.append(r)
    if not wrong:
        pytest.skip(f"the host's own load moved or was busy in every attempt: {unsteady}")
    raise AssertionError(f"read wrong on a steady host: {wrong} (unsteady: {unsteady})")

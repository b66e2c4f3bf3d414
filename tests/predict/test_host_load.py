"""The host's background load while a run measures its steps (predict.host_load), on real processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_a_run_that_blocks_and_wakes_is_not_its_own_background_and_another_process_is():
    _, alone = watch_run([sys.executable, "-c", RUN], Path.cwd(), timeout=60)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _, beside = watch_run([sys.executable, "-c", RUN], Path.cwd(), timeout=60)
    finally:
        busy.kill()
        busy.wait()
    assert alone is not None and beside is not None
    assert beside > alone + 0.5, (alone, beside)  # the busy loop: about one runnable thread more
    assert alone < 0.5, alone  # clamping each sample at 0 made this about 1 (Megatron T-2 read 0.7-1.5)

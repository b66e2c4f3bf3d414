"""A run command interrupted while it imports torch stops (exit 130, no record, no rank).

torch imports numpy inside a ``try`` that swallows any exception raised there: a SIGINT that arrived
while numpy was being imported used to vanish (the run went on with SIGINT and SIGTERM ignored, and
so did its torchrun: the cluster mode could stop it only with SIGKILL). Found by the cluster
rehearsal; the SIGINT is sent here once numpy's extension is mapped, i.e. inside that import.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]


def _caught(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith("SigCgt")).split()[1], 16)


def _numpy_loading(pid: int) -> bool:
    return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.waiting
@pytest.mark.parametrize("attempt", range(2))
def test_sigint_while_torch_imports(tmp_path: Path, attempt: int) -> None:
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "runners.run", "--system", "torch_pipe", *TINY, "--pp", "2",
                          "--batch-size", "2", "--micro-batch-size", "1", "--steps", "2", "--warmup", "0",
                          "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not (_caught(p.pid) & (1 << (signal.SIGTERM - 1))):  # its handlers are in: the import follows
            assert p.poll() is None and time.monotonic() < end
            time.sleep(0.002)
        while not _numpy_loading(p.pid):
            assert p.poll() is None and time.monotonic() < end
            time.sleep(0.002)
        time.sleep(0.05 * attempt)
        p.send_signal(signal.SIGINT)
        output, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, output[-2000:]
    assert "interrupted by SIGINT" in output and not out.exists()

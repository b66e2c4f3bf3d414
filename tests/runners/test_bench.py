"""The side-by-side benchmark script and its machine check (run for real, on the tiny model)."""
import subprocess
import sys

import pytest

from runners.machine import Capacity, parallel_capacity
from tests.conftest import REPO


@pytest.mark.multiprocess
def test_parallel_capacity_measures_processes_at_once():
    cap = parallel_capacity(2, seconds=0.3)
    assert cap.n == 2 and cap.alone_gflops > 0 and cap.together_gflops > 0
    assert 0 < cap.effective_cores <= 2 * 1.5  # noise can make "together" a little faster than "alone"
    assert "effective cores" in cap.describe()
    assert Capacity(2, 100.0, 50.0).effective_cores == 1.0


@pytest.mark.multiprocess
def test_ours_vs_gpipe_runs_both_systems_and_prints_ratios():
    proc = subprocess.run(
        [sys.executable, "-m", "runners.bench", "ours-vs-gpipe", "--model", "tiny", "--batch", "1", "--reps", "1",
         "--slices", "2", "--steps", "2", "--warmup", "1", "--no-reference", "--no-capacity-check"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed" not in proc.stdout, proc.stdout + proc.stderr
    rows = [l for l in proc.stdout.splitlines() if l.strip().startswith("1 |")]
    assert any("torch_pipe GPipe" in r for r in rows) and any("ours K=2" in r for r in rows), proc.stdout
    assert "best: ours K=2, torch_pipe GPipe / ours = " in proc.stdout

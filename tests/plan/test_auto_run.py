"""--n-slices auto (the default) through the run command."""
from __future__ import annotations

import pytest

from contract.records import read_records
from tests.conftest import run_cli

pytestmark = pytest.mark.multiprocess


def test_ours_slices_by_default_on_cpu_small(out_file):
    """--n-slices left out: the planner's slicing from the fitted cpu-small model in results/plan (more
    than one slice), recorded with how it was chosen."""
    proc = run_cli("--system", "ours", "--model", "cpu-small", "--num-layers", "2", "--pp", "2", "--batch-size", "1",
                   "--micro-batch-size", "1", "--steps", "1", "--warmup", "0", "--out", str(out_file), timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok" and rec["options"]["n_slices"] == "auto"
    assert len(rec["options"]["slices"]) > 1 and sum(rec["options"]["slices"]) == 1024
    assert rec["options"]["slicing"].startswith("planner (cpu-h512-a8-s1024-v1024.json)")
    assert rec["details"].startswith(f"auto, planner: K={len(rec['options']['slices'])}")

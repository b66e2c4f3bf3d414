"""--n-slices auto through the run command."""
from __future__ import annotations

import pytest

from tests.conftest import read_jsonl, run_cli

pytestmark = pytest.mark.multiprocess


def test_run_ours_with_auto_slices(tmp_path, out_file):
    proc = run_cli("--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1",
                   "--n-slices", "auto", "--steps", "2", "--warmup", "0", "--out", str(out_file), timeout=300,
                   env={"OURS_PLAN_DIR": str(tmp_path / "plan")})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    recs = read_jsonl(out_file)
    assert recs and recs[-1]["status"] == "ok", recs[-1] if recs else proc.stderr[-3000:]
    assert list((tmp_path / "plan").glob("*-quick.json"))  # rank 0 profiled, fitted and cached

"""--n-slices auto through the run command (needs the ours engine, ours/system.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (REPO / "ours" / "system.py").exists(),
                    reason="the ours engine (ours/system.py) does not exist yet: --system ours cannot run")
def test_run_ours_with_auto_slices(tmp_path, out_file):
    proc = run_cli("--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1",
                   "--n-slices", "auto", "--steps", "2", "--warmup", "0", "--out", str(out_file), timeout=300,
                   env={"OURS_PLAN_DIR": str(tmp_path / "plan")})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    recs = read_jsonl(out_file)
    assert recs and recs[-1]["status"] == "ok", recs[-1] if recs else proc.stderr[-3000:]
    assert list((tmp_path / "plan").glob("*-quick.json"))  # rank 0 profiled, fitted and cached

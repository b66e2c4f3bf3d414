"""--n-slices auto (the default) and --n-slices search through the run command."""
from __future__ import annotations

import pytest

from contract.records import read_records
from ours import leading_forwards
from ours.plan.tune import CANDIDATES
from tests.conftest import assert_verified, run_cli

pytestmark = pytest.mark.multiprocess


@pytest.mark.extended
def test_ours_searches_its_slicing_when_asked_and_stays_exact(out_file):
    """--n-slices search: the ranks time a few K equal slices, starting near the planner's slicing, and
    keep the fastest, recorded with every K they timed; the timing steps leave nothing behind (--verify
    against the reference passes). The default, auto, is the planner's slicing alone (``test_auto``). A
    --prefetch beyond what the chosen slicing lets the first stage run ahead is lowered, and the record says so."""
    proc = run_cli("--system", "ours", "--model", "cpu-small", "--num-layers", "2", "--seq-length", "256", "--pp", "2",
                   "--batch-size", "2", "--micro-batch-size", "1", "--steps", "1", "--warmup", "0", "--verify",
                   "--n-slices", "search", "--prefetch", "99", "--out", str(out_file), timeout=300)
    assert_verified(proc)
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok" and rec["options"]["n_slices"] == "search"
    slices, how = rec["options"]["slices"], rec["options"]["slicing"]
    assert len(slices) in CANDIDATES and len(set(slices)) == 1 and sum(slices) == 256
    assert how.startswith(f"tuned: K={len(slices)} of K=") and "started near K=" in how and "by planner" in how
    timed = how.split(" of ")[1].split(";")[0].split(", ")
    assert 3 <= len(timed) <= 5 and f"K={len(slices)} " in how.split(" of ")[1]
    assert rec["details"].startswith(f"search, tuned: K={len(slices)}")
    lead = leading_forwards("1f1b", 2, len(slices), 0, 2)
    assert rec["options"]["prefetch"] == lead < 99 and rec["options"]["prefetch_asked"] == 99
    assert rec["details"].endswith(f"prefetch {lead} (99 asked: the forwards the first stage runs before its first "
                                   "backward)") and rec["details"] in proc.stdout

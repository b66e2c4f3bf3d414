"""Lossy wire precision (opt-in): activations, their gradients and the DP push and pull in bf16 stay
close to the fp32 wire, and do differ from it (the lossy path is taken); the DP replicas stay identical. One training
step of P-2 D-2 per DP mode, on real gloo ranks (tests/ours/_wire_dtype.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# bf16 keeps 8 significant bits: each value crossing the wire is off by at most 2^-9 (0.2 %) relative.
# Measured here (tiny 4-layer model, slices 12,12,8): loss 4.5e-5, gradients 3.1e-3, parameters 4.5e-3
# (the largest relative errors are in the biases, whose value after one step is the update itself).
LOSS_TOL = 1e-3  # absolute, on a loss of about ln(128) = 4.85: activations rounded once per stage boundary
GRAD_TOL = 2e-2  # relative to each tensor's largest |averaged gradient|
PARAM_TOL = 2e-2  # relative to each tensor's largest |parameter| after one SGD step


@pytest.mark.extended
@pytest.mark.multiprocess
def test_bf16_wire_close_to_fp32_for_every_dp_mode(tmp_path):
    out = tmp_path / "wire.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(Path(__file__).with_name("_wire_dtype.py")), str(out), "bfloat16"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert set(result) == {"allreduce", "central_ps", "sharded_ps"}
    for mode, r in result.items():
        assert 0 < r["loss_diff"] <= LOSS_TOL, (mode, r)
        assert 0 < r["grad_rel"] <= GRAD_TOL, (mode, r)
        assert 0 < r["param_rel"] <= PARAM_TOL, (mode, r)
        assert r["replica_diff"] == 0, (mode, r)  # every replica applies the same (rounded) update

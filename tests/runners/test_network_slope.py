"""The network-slope bench: its fit and wire bounds (no processes), its bad requests, and one real run
on the local virtual cluster."""
from __future__ import annotations

import subprocess
import sys

import pytest

from runners.network_slope import Sample, busiest_link_bytes, fit_slope, slope_of, stage_param_counts
from tests.conftest import REPO, TINY
from tests.network.conftest import needs_root
from workload.configs import get_model_config
from workload.model import count_params


def test_slope_splits_a_step_into_schedule_dp_sync_and_barrier():
    # step = 50 ms + 7 delays, of which DP sync 2 delays (+10 ms) and the barrier 2 delays
    samples = [Sample(d, 0.05 + 7 * d * 1e-3, 0.01 + 2 * d * 1e-3, 2 * d * 1e-3) for d in (10.0, 20.0, 40.0)]
    s = slope_of(samples)
    assert s.total == pytest.approx(7) and s.dp_sync == pytest.approx(2) and s.barrier == pytest.approx(2)
    assert s.schedule == pytest.approx(3)
    assert slope_of([Sample(10, 0.1, 0.0, None), Sample(20, 0.2, 0.0, None)]).schedule is None
    with pytest.raises(ValueError):
        fit_slope([5.0, 5.0], [1.0, 2.0])


def test_busiest_link_bytes_per_dp_mode():
    M = 100.0
    assert busiest_link_bytes("central_ps", 2, M) == 200  # the server's link: push and pull of one replica
    assert busiest_link_bytes("central_ps", 4, M) == 600
    assert busiest_link_bytes("sharded_ps", 2, M) == 200  # each host sends and receives half, twice
    assert busiest_link_bytes("sharded_ps", 4, M) == 300
    assert busiest_link_bytes("allreduce", 4, M) == 300
    assert busiest_link_bytes("central_ps", 1, M) == 0


def test_stage_parameters_add_up_to_the_model():
    for name in ("tiny", "cpu-small"):
        cfg = get_model_config(name)
        assert sum(stage_param_counts(name, 2, {})) == count_params(cfg, include_embeddings=True)
    assert stage_param_counts("tiny", 1, {"n_layer": 2, "n_embd": 64}) == [
        count_params(get_model_config("tiny").with_overrides(n_layer=2, n_embd=64), include_embeddings=True)]


@pytest.mark.parametrize("args", [["--delays", "10"], ["--delays", "10", "10"], ["--reps", "0", "--delays", "1", "2"]])
def test_bad_requests_exit_2_with_one_line(args):
    proc = subprocess.run([sys.executable, "-m", "runners.network_slope", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert len([l for l in proc.stderr.splitlines() if l.strip()]) == 1, proc.stderr


@pytest.mark.multiprocess
@pytest.mark.network
@needs_root
def test_bench_fits_ours_on_the_virtual_cluster():
    proc = subprocess.run(
        [sys.executable, "-m", "runners.network_slope", "--configs", "ours", "--delays", "5", "25", "--reps", "1",
         "--steps", "3", "--warmup", "1", "--batch-size", "2", "--micro-batch-size", "1", "--n-slices", "2",
         "--", *TINY[2:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("ours P-2 "))
    cells = [c.strip() for c in row.split("|")]
    paid, schedule, barrier = float(cells[3]), float(cells[4]), float(cells[6])
    # the pipeline's fill and drain and the closing barrier: at least a delay each, and not absurdly many
    assert 2 <= paid <= 12 and schedule >= 0.5 and barrier >= 0.5, proc.stdout
    assert cells[-1] == "2"

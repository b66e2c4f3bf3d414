"""The network-slope bench: its fit and wire bounds (no processes), its bad requests, and one real run
on the local virtual cluster."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.network_slope import Sample, busiest_link_bytes, fit_slope, main, slope_of, stage_param_counts
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


def _record(system: str, dp: int, mode: str | None, delay: float, step: float, sync: float, barrier: float) -> dict:
    options = {"schedule": "gpipe"} if system == "torch_pipe" else {"dp_mode": mode, "slices": [64, 64]}
    return {"status": "ok", "system": system, "layout": {"pp": 2, "tp": 1, "dp": dp}, "options": options,
            "network": f"delay {delay:g}ms bandwidth 1Gbps", "median_step_time": step, "min_step_time": step - 0.01,
            "dp_sync_time": sync,
            "barrier_time": barrier, "model": "tiny", "batch_size": 2, "micro_batch_size": 1,
            "model_shape": {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 128, "vocab_size": 512}}


def test_tables_from_kept_records(tmp_path, capsys):
    recs = []
    for d in (10.0, 30.0):
        recs.append(_record("ours", 1, None, d, 0.1 + 4 * d / 1e3, 0.0, 2 * d / 1e3))
        recs.append(_record("ours", 2, "central_ps", d, 0.2 + 8 * d / 1e3, 0.005 + 2 * d / 1e3, 4 * d / 1e3))
        recs.append(_record("torch_pipe", 1, None, d, 0.1 + 10 * d / 1e3, 0.0, 2 * d / 1e3))
    # records of other runs (another system, no emulated link, a torch_pipe run without a schedule) are skipped, said
    others = [{**recs[0], "system": "megatron"}, {**recs[0], "network": "none"}, {**recs[0], "system": "torch_pipe"}]
    path = tmp_path / "kept.jsonl"
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in others[:2] + recs + others[2:]))
    assert main(["--from-records", str(path)]) == 0
    out = capsys.readouterr()
    assert "3 record(s) not of the bench's configurations skipped: record 1 (megatron: " in out.err, out.err
    paid, wire = out.out.split("DP sync against the wire")

    def table(text: str) -> dict[str, list[str]]:
        return {l.split("|")[0].strip(): [c.strip() for c in l.split("|")] for l in text.splitlines() if "|" in l}

    rows, wire_rows = table(paid), table(wire)
    assert rows["ours P-2"][3:8] == ["4.0", "2.0", "0.0", "2.0", "4.0"]
    assert rows["ours P-2 D-2 central_ps"][3:8] == ["8.0", "2.0", "2.0", "4.0", "8.0"]
    assert rows["torch_pipe GPipe P-2"][3] == "10.0"
    # the stage of 478464 parameters, 4 bytes each, pushed and pulled over the server's link at 1 Gbit/s
    assert float(wire_rows["ours P-2 D-2 central_ps"][2]) == pytest.approx(2 * 478464 * 4 * 8 / 1e9 * 1e3, abs=0.1)


@pytest.mark.parametrize("args", [["--delays", "10"], ["--delays", "10", "10"], ["--reps", "0", "--delays", "1", "2"],
                                  ["--from-records", "/nonexistent.jsonl"], ["--from-records", "tests"]])
def test_bad_requests_exit_2_with_one_line(args):
    proc = subprocess.run([sys.executable, "-m", "bench.network_slope", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert len([l for l in proc.stderr.splitlines() if l.strip()]) == 1, proc.stderr


@pytest.mark.multiprocess
@pytest.mark.network
@needs_root
def test_bench_fits_ours_on_the_virtual_cluster():
    # delays far apart against the tiny step's computation (about 20 ms, up to 55 ms more on a loaded host), and the
    # median of 6 steps: a host's load moves the slope by a few tenths (over 5 and 25 ms, 3 steps, by over 2 delays)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.network_slope", "--configs", "ours", "--delays", "10", "130", "--reps", "1",
         "--steps", "6", "--warmup", "1", "--batch-size", "2", "--micro-batch-size", "1", "--n-slices", "2",
         "--", *TINY[2:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    row = next(l for l in proc.stdout.splitlines() if l.strip().startswith("ours P-2 "))
    cells = [c.strip() for c in row.split("|")]
    paid, schedule, barrier = float(cells[3]), float(cells[4]), float(cells[6])
    # the pipeline's fill and drain (2 delays, less what computation hides), not absurdly many; the last rank to reach
    # the closing barrier (a dissemination barrier, one delay per round) leaves it at once
    assert 1.5 <= paid <= 12 and schedule >= 1.2 and barrier <= 1, proc.stdout
    assert cells[-1] == "2"

"""Links that lose packets and links that change during a run, on the virtual cluster with real ranks."""
from __future__ import annotations

import json
import statistics

import pytest

from contract.records import read_records
from tests.conftest import TINY, run_cli
from tests.network.conftest import needs_root

OURS = ["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1", "--n-slices", "1",
        "--steps", "4", "--warmup", "1"]


@needs_root
@pytest.mark.network
@pytest.mark.multiprocess
@pytest.mark.extended  # its loss probe reads far above the set 1 % where the delayer is starved of a core
def test_a_lossy_link_measures_its_loss_and_is_timed_beside_the_same_link_without(out_file):
    clean = run_cli(*OURS, "--network", "delay 10ms bandwidth 1Gbps", "--out", str(out_file))
    lossy = run_cli(*OURS, "--network", "delay 10ms bandwidth 1Gbps loss 1%", "--out", str(out_file))
    assert clean.returncode == 0 and lossy.returncode == 0, (clean.stderr + lossy.stderr)[-3000:]
    without, with_loss = read_records(out_file)
    measured = with_loss["environment"]["network"]["measured_link"]
    assert measured["set"]["loss_pct"] == 1 and measured["train_packets"] >= 4000
    assert 0.5 <= measured["loss_pct"] <= 2.0, measured
    assert without["environment"]["network"]["measured_link"]["loss_pct"] < 0.5
    assert with_loss["network_setting"]["loss_pct"] == 1 and "loss_pct" not in without["network_setting"]
    assert with_loss["environment"]["network"]["delayer_counts"]["dropped"] >= 0  # the run's own packets counted
    for rec in (without, with_loss):  # each step time beside the other's: same run but the loss
        assert rec["status"] == "ok" and rec["median_step_time"] > 0.02  # 10 ms each way at least


@needs_root
@pytest.mark.network
@pytest.mark.multiprocess
@pytest.mark.extended
def test_a_trace_that_halves_the_bandwidth_shows_in_the_step_times(tmp_path, out_file):
    """20 Mbit/s, 10 from 1.5 s to 3.5 s after the first step, 20 again after: 256 KB activations each
    way per micro-batch make a step's time mostly the link's."""
    trace = tmp_path / "halves.json"
    trace.write_text(json.dumps({"links": "all", "points": [{"at_s": 1.5, "bandwidth_gbps": 0.01},
                                                            {"at_s": 3.5, "bandwidth_gbps": 0.02}]}))
    p = run_cli("--system", "ours", "--model", "tiny", "--num-layers", "2", "--hidden-size", "256", "--num-heads", "4",
                "--seq-length", "256", "--vocab-size", "128", "--pp", "2", "--batch-size", "2", "--micro-batch-size",
                "1", "--n-slices", "1", "--steps", "16", "--warmup", "1", "--network", "delay 1ms bandwidth 20Mbps",
                "--network-trace", str(trace), "--out", str(out_file))
    assert p.returncode == 0, p.stderr[-3000:]
    (rec,) = read_records(out_file)
    applied = rec["environment"]["network"]["trace"]["applied"]
    assert [a["at_s"] for a in applied] == [1.5, 3.5] and all("error" not in a for a in applied), applied
    starts, times = rec["step_starts"], rec["step_times"]
    assert len(starts) == len(times) == 16
    halved = [t for s, t in zip(starts, times) if 1.5 <= s and s + t <= 3.5]  # wholly within the stretch
    whole = [t for s, t in zip(starts, times) if s + t <= 1.5 or s >= 3.5]
    assert halved and whole, (starts, times)
    assert statistics.median(halved) >= 1.4 * statistics.median(whole), list(zip(starts, times))

"""The run command under --network: ranks in the local virtual cluster, shaped as the profile says."""
import subprocess
from pathlib import Path

import pytest

from contract.records import read_records
from tests.conftest import TINY, run_cli
from tests.network.conftest import needs_root

ARGS = ["--system", "torch_pipe", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1", "--steps", "3",
        "--warmup", "1"]


@needs_root
@pytest.mark.network
@pytest.mark.multiprocess
def test_run_records_backend_and_measured_link_and_slows_down(out_file):
    fast = run_cli(*ARGS, "--out", str(out_file))
    slow = run_cli(*ARGS, "--network", "delay 10ms bandwidth 1Gbps", "--verify", "--out", str(out_file))
    assert fast.returncode == 0, fast.stderr[-3000:]
    assert slow.returncode == 0, slow.stderr[-3000:]
    assert slow.stdout.strip().splitlines()[-1].endswith("PASS")
    unshaped, shaped = read_records(out_file)
    net = shaped["environment"]["network"]
    assert net["backend"] in ("netem", "tbf+delayer")
    assert abs(net["measured_link"]["one_way_delay_ms"] - 10.0) < 1.0
    # GPipe with 2 micro-batches over 2 stages: every measured step holds at least 2 forward and 2 backward
    # hops of >= 10 ms each, a floor from the link alone (a comparison with the unshaped run's time would
    # judge the host's load, not the shaping).
    assert min(shaped["step_times"]) >= 4 * 0.010
    assert "measured_link" not in (unshaped["environment"].get("network") or {})
    # no virtual cluster of a run command that has ended (other runs may be going on beside this test)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    owners = {int(ns.removeprefix("nemu-").split(".")[0]) for ns in listed if ns.startswith("nemu-") and "-run-" in ns}
    assert all(Path(f"/proc/{pid}").exists() for pid in owners), listed

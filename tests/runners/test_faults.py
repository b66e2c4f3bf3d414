"""Faults end clean and are told truthfully: real run commands, real ranks, real signals.

- the run command killed (SIGKILL, a rank stopped with SIGSTOP): its agents and ranks die within
  seconds, locally and in the virtual cluster (whose namespaces go too), and so does its run directory;
- SIGINT / SIGTERM: ranks stopped, one line, exit 130 / 143, no record, no run directory;
- every request that can be judged before launching is: exit 2, one line naming the real flag, nothing written;
- a CPU out-of-memory is status oom; a rank killed by a signal is named with the signal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runners.launcher import RUN_DIR_PREFIX
from contract.records import read_records
from tests.conftest import REPO, TINY, run_cli
from tests.network.conftest import needs_root

LONG = ["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1", "--steps", "100000"]


def _processes() -> dict[int, str]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def _ranks_of(run_dir_marker: str) -> list[int]:
    return [pid for pid, cmd in _processes().items() if run_dir_marker in cmd and "runners.worker" in cmd]


def _start(out: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A long run command; returns it and its run directory once two ranks are training."""
    proc = subprocess.Popen([sys.executable, "-m", "runners.run", *LONG, *extra, "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        dirs = [cmd.split("runners.worker ")[1].split()[0] for pid, cmd in _processes().items()
                if "runners.worker /" in cmd and f"{RUN_DIR_PREFIX}{proc.pid}." in cmd]
        if len(set(dirs)) == 1 and len(_ranks_of(dirs[0])) >= 2 and (Path(dirs[0]) / "config.json").exists():
            time.sleep(3)  # into training
            return proc, dirs[0]
    proc.kill()
    raise AssertionError("the ranks did not start")


def _gone_within(pids_fn, seconds: float) -> list[int]:
    end = time.time() + seconds
    while time.time() < end:
        left = pids_fn()
        if not left:
            return []
        time.sleep(0.2)
    return pids_fn()


@pytest.mark.waiting
@pytest.mark.faults
@pytest.mark.multiprocess
def test_sigkill_of_the_run_command_with_a_stopped_rank_leaves_nothing(out_file):
    proc, run_dir = _start(out_file)
    ranks = _ranks_of(run_dir)
    os.kill(ranks[-1], signal.SIGSTOP)
    proc.kill()
    proc.wait()
    assert _gone_within(lambda: [p for p, c in _processes().items() if run_dir in c], 5.0) == []
    # its run directory goes with it (its watchdog), not when the next run command comes (issue #31, item 14)
    assert _gone_within(lambda: [run_dir] if Path(run_dir).exists() else [], 5.0) == []
    assert not out_file.exists()


@pytest.mark.waiting
@pytest.mark.faults
@pytest.mark.multiprocess
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_stop_the_ranks_and_write_nothing(out_file, sig, code):
    proc, run_dir = _start(out_file)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1] == (f"python -m runners.run: interrupted by {signal.Signals(sig).name}: "
                                            "ranks stopped, no record written")
    assert "Traceback" not in err
    assert not out_file.exists() and not Path(run_dir).exists()
    assert _gone_within(lambda: [p for p, c in _processes().items() if run_dir in c], 5.0) == []


@needs_root
@pytest.mark.faults
@pytest.mark.network
@pytest.mark.multiprocess
def test_sigkill_under_network_emulation_leaves_no_namespace_or_process(out_file):
    proc, run_dir = _start(out_file, "--network", "d10-1g")
    owner = f"nemu-{proc.pid}."

    def namespaces() -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [n for n in listed if n.startswith(owner)]

    assert namespaces()
    os.kill(_ranks_of(run_dir)[0], signal.SIGSTOP)
    proc.kill()
    proc.wait()
    assert _gone_within(lambda: [p for p, c in _processes().items() if run_dir in c or owner in c], 5.0) == []
    assert _gone_within(namespaces, 5.0) == []


def _bad_requests(tmp: Path) -> list[tuple[list[str], str]]:
    base = ["--system", "reference", *TINY, "--batch-size", "2", "--micro-batch-size", "1"]
    ours_p2 = ["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1"]
    (tmp / "adir").mkdir()
    text, matrix = tmp / "text.txt", tmp / "matrix.txt"
    text.write_text("training text " * 20)
    matrix.write_text('{"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]}')
    return [
        (base + ["--out", str(tmp / "adir")], "--out " + str(tmp / "adir") + " is a directory"),
        (base + ["--out", str(tmp / "missing" / "r.jsonl")],
         "--out " + str(tmp / "missing" / "r.jsonl") + ": no such directory"),
        (base + ["--out", "/dev/full"], "--out /dev/full is not a regular file"),
        (base + ["--out", "/proc/r.jsonl"], "--out /proc/r.jsonl: cannot write in /proc"),
        (["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1", "--trace",
          str(tmp / "missing" / "t.json"), "--out", str(tmp / "r.jsonl")], "--trace " + str(tmp / "missing")),
        (base + ["--data", str(tmp / "missing.txt"), "--vocab-size", "256"],
         "--data " + str(tmp / "missing.txt") + ": not a readable file"),
        (base + ["--device", "cuda"], "--device cuda: CUDA is not available"),
        (base + ["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (base + ["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
        (base + ["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
        (base + ["--network", "delay 1ms bandwidth 50kbps"],
         "--network: bandwidth 0.05 Mbit/s is below what the emulation can do"),
        (base + ["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
        (base + ["--hidden-size", "66"], "--hidden-size 66 is not divisible by --num-heads 4"),
        (base + ["--hidden-size", "1000000"],
         "--pp 1 --tp 1 --dp 1 starts 1 ranks on this machine, which need at least"),
        # issue #31: one file for two roles, a network for one process, a matrix not named *.json
        (base + ["--vocab-size", "256", "--data", str(text), "--out", str(text)],
         f"--out {text} and --data {text} are the same file"),
        (base + ["--network", "d10-1g"], "--network d10-1g: reference runs one process here"),
        (ours_p2 + ["--network", str(matrix)], "a per-link matrix is read from a JSON file named *.json"),
    ]


@pytest.mark.faults
def test_requests_judged_before_launching(tmp_path):
    """Each: exit 2, one line naming a real flag of the run command, no record, no run started."""
    from runners.request import build_parser

    flags = {s for a in build_parser()._actions for s in a.option_strings}
    for args, message in _bad_requests(tmp_path):
        out = tmp_path / "r.jsonl"
        if "--out" not in args:
            args = args + ["--out", str(out)]
        start = time.time()
        proc = run_cli(*args, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert message in lines[0], (message, lines[0])
        named = [w.rstrip(":,") for w in lines[0].split() if w.startswith("--")]
        assert named and all(f in flags for f in named), lines[0]
        assert not out.exists() and time.time() - start < 30
    assert (tmp_path / "text.txt").read_text() == "training text " * 20  # an input is never written to
    assert not [p for p in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*")
                if not (p / "config.json").exists() and p.stat().st_mtime > time.time() - 60]


@pytest.mark.waiting
@pytest.mark.faults
@pytest.mark.multiprocess
def test_cpu_out_of_memory_is_recorded_as_oom(out_file):
    """A model that fits but whose logits do not (1,000 sequences of 32 tokens over a million-token
    vocabulary: 128 GB); one whose weights alone do not fit is refused before launch."""
    proc = run_cli("--system", "reference", *TINY, "--vocab-size", "1000000", "--batch-size", "1000",
                   "--micro-batch-size", "1000", "--steps", "1", "--out", str(out_file), timeout=300)
    assert proc.returncode == 1
    (rec,) = read_records(out_file)
    assert rec["status"] == "oom" and rec["error"].startswith("rank 0:") and "allocate" in rec["error"]


@pytest.mark.waiting
@pytest.mark.faults
@pytest.mark.multiprocess
def test_a_rank_killed_by_a_signal_is_named(out_file):
    proc, run_dir = _start(out_file)
    os.kill(max(_ranks_of(run_dir)), signal.SIGKILL)  # rank 1 (started second)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    (rec,) = read_records(out_file)
    assert rec["status"] == "error" and rec["error"].endswith("was killed by SIGKILL"), rec["error"]

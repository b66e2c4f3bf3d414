"""scripts/gpu_check.sh where there is no GPU: it judges its arguments, says so and exits 0, writing
nothing; and how its rows judge what the runs recorded."""
from __future__ import annotations

import subprocess

import pytest
import torch

from tools.gpu_check import Line, Report, barrier_line, memory_line, slug, verify_line
from tests.conftest import REPO


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path without a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "summary.md"
    p = _check("--out", str(out), "--only", "one-rank", "--steps", "2")
    assert p.returncode == 0, p.stderr
    assert "no GPU here" in p.stdout and "nothing checked" in p.stdout
    assert not out.exists() and not out.with_suffix(".jsonl").exists()


def test_its_arguments_are_judged_first(tmp_path):
    for args, message in ((["--only", "bogus"], "invalid choice: 'bogus'"),
                          (["--steps", "0"], "--steps: takes a finite whole number >= 1"),
                          (["--out", str(tmp_path / "missing" / "s.md")], "no such directory"),
                          (["--device", "tpu"], "invalid choice: 'tpu'"),
                          (["--jobs", "0"], "--jobs: takes a finite whole number >= 1"),
                          (["--run-timeout", "5"], "--run-timeout: takes a finite number >= 30")):
        p = _check(*args)
        assert p.returncode == 2 and message in p.stderr.strip().splitlines()[-1], (args, p.stderr)


def test_names():
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert Line("a", None, "x | y").row() == "| a | not run | x / y |"


def _rec(passed=True, kind="cuda", alloc=(10 << 20,), reserved=(20 << 20,)):
    return {"status": "ok", "median_step_time": 0.02, "environment": {"device_kind": kind, "device_name": "GPU"},
            "verify": {"passed": passed, "tolerance": "fp32, tol 1e-5", "max_abs_loss_diff": 0.0,
                       "max_rel_grad_diff": 1e-6, "n_grads": 53},
            "peak_memory_bytes": list(alloc), "peak_reserved_bytes": list(reserved), "cpu_rss_bytes": [300 << 20],
            "barrier_time": 0.0002, "barrier_time_first": 0.001}


def test_rows_judge_the_records():
    assert verify_line("c", _rec(), "").passed is True
    assert verify_line("c", _rec(passed=False), "").passed is False
    assert verify_line("c", None, "line\nrank 1: boom\n") == Line("c", False, "no record: rank 1: boom")
    assert memory_line({"a": _rec()}).passed is True
    assert memory_line({"a": _rec(reserved=(5 << 20,))}).passed is False  # reserved below allocated: not a peak
    assert memory_line({"a": _rec(alloc=(), reserved=())}).passed is False  # a GPU run without GPU memory
    assert memory_line({}).passed is None
    shaped = {"none": dict(_rec(), barrier_time_first=0.001), "d10-1g": dict(_rec(), barrier_time_first=0.012)}
    assert barrier_line(shaped).passed is True
    shaped["d10-1g"]["barrier_time_first"] = 0.0005  # a barrier that does not block the host
    assert barrier_line(shaped).passed is False


def test_the_summary_is_written_after_every_row(tmp_path):
    """A check script stopped part-way (a device lease's end) keeps the rows it had."""
    out = tmp_path / "gpu-check.md"
    report = Report(out, "NVIDIA H100 80GB HBM3", ["--jobs", "4"])
    report.add(Line("environment", True, "sm_90"))
    assert "| environment | PASS | sm_90 |" in out.read_text() and "(in progress)" in out.read_text()
    report.add(Line("one rank: ours fp32", False, "error: x"))
    report.finish("interrupted after 2 checks")
    text = out.read_text()
    assert "1 passed, 1 failed, 0 not run (interrupted after 2 checks)." in text and "| **FAIL** |" in text

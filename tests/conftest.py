"""Shared helpers: tests drive the real run command, with real torchrun/gloo ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """The tests marked ``timing`` (they compare measured step times) last in their session, each tier
    otherwise in its collected order: scripts/test.sh runs its sessions side by side, and the end of a
    session is its quietest part."""
    items.sort(key=lambda item: item.get_closest_marker("timing") is not None)


@pytest.fixture(scope="session", autouse=True)
def _session_reference_cache(tmp_path_factory):
    """--verify's reference cache (runners.reference_cache) of this test session only: the tests'
    runs share references with each other, never with an earlier session or the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPEBENCH_CACHE", str(tmp_path_factory.mktemp("pipebench-cache")))
        yield


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """python -m runners.run ARGS..., from the repo root; returns the completed process (text)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "runners.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


NOT_TRAINING = {"p2p_probe"}  # tests/runners/p2p_probe_system.py: one message each way per step


def records_above_peak(directory: Path) -> list[str]:
    """Every record under ``directory`` (its *.jsonl files) whose MFU is above 100 %, as 'file: system
    layout mfu'. The CPU peak is the model's own best rate (workload.cpu_peak), so a real run cannot
    exceed it; one that does means the peak is wrong. The test-only systems that exchange messages
    without training the model (``NOT_TRAINING``) have no model FLOPs to hold against a peak."""
    from contract.records import read_records

    bad = []
    for path in sorted(directory.rglob("*.jsonl")):
        for rec in read_records(path):
            if rec.get("mfu") is not None and rec["mfu"] > 1.0 and rec.get("system") not in NOT_TRAINING:
                bad.append(f"{path.name}: {rec['system']} {rec.get('layout')} MFU {rec['mfu']:.1%} "
                           f"(peak {rec.get('peak_tflops')} TFLOP/s, {rec.get('peak_source')})")
    return bad


@pytest.fixture(autouse=True)
def _no_record_above_the_peak(request):
    """Every test that has a tmp_path fails if a record it left there shows an MFU above 100 %."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        bad = records_above_peak(tmp)
        if bad:
            pytest.fail("records with an MFU above 100 %:\n" + "\n".join(bad), pytrace=False)


TINY = ["--model", "tiny", "--num-layers", "4", "--hidden-size", "64", "--num-heads", "4", "--seq-length", "32",
        "--vocab-size", "128"]
"""A model small enough for many multi-process tests on 2 cores."""

NCCL_RULES = ["--p2p-semantics", "nccl"]
"""gloo under NCCL's point-to-point rules (runners.nccl_rules): the multi-rank --verify tests run in this
stricter mode, but for a few kept on plain gloo."""


def assert_verified(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("verify (")]
    assert lines and lines[-1].endswith("PASS"), proc.stdout


@pytest.fixture
def out_file(tmp_path: Path) -> Path:
    return tmp_path / "runs.jsonl"

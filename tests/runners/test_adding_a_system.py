"""Adding a system takes one module, one registry entry and one test: a toy system with an option of
its own, registered through the registry's $PIPEBENCH_SYSTEMS, runs end to end through the run
command and the sweep; its option is refused for every other system, and other systems' options for it."""
from __future__ import annotations

import io

import pytest

from contract.records import read_records
from tests.conftest import TINY, assert_verified, run_cli

TOY = {"PIPEBENCH_SYSTEMS": "tests.runners.toy_system"}
ARGS = [*TINY, "--batch-size", "2", "--micro-batch-size", "2", "--steps", "2", "--warmup", "0"]


def test_help_shows_the_toy_options_under_its_heading():
    proc = run_cli("--help", env=TOY, timeout=60)
    assert proc.returncode == 0
    heading = proc.stdout.index("toy options")
    assert "--toy-lr-scale" in proc.stdout[heading:]


def test_options_belong_to_their_system(out_file):
    foreign = run_cli("--system", "torch_pipe", *ARGS, "--toy-lr-scale", "2", "--out", str(out_file), env=TOY)
    assert foreign.returncode == 2 and not out_file.exists()
    assert foreign.stderr.strip().splitlines() == [
        "python -m runners.run: error: --toy-lr-scale is an option of toy, not of torch_pipe"]
    other = run_cli("--system", "toy", *ARGS, "--dp-mode", "central_ps", "--out", str(out_file), env=TOY)
    assert other.returncode == 2 and "--dp-mode is an option of ours, not of toy" in other.stderr
    bad = run_cli("--system", "toy", *ARGS, "--toy-lr-scale", "0", "--out", str(out_file), env=TOY)
    assert bad.returncode == 2 and "--toy-lr-scale must be > 0" in bad.stderr
    unknown = run_cli("--system", "toy", *ARGS, "--out", str(out_file))  # not registered without the variable
    assert unknown.returncode == 2 and "invalid choice: 'toy'" in unknown.stderr


@pytest.mark.multiprocess
def test_toy_system_runs_end_to_end(out_file):
    proc = run_cli("--system", "toy", *ARGS, "--verify", "--out", str(out_file), env=TOY)
    assert_verified(proc)
    (rec,) = read_records(out_file)
    assert rec["status"] == "ok" and rec["label"] == "toy x1" and rec["details"] == "trained"
    assert rec["options"] == {"toy_lr_scale": 1.0, "toy_note": "trained"}
    assert '"toy_lr_scale": 1.0' in rec["key"]


def test_the_sweep_plans_toy_runs_with_their_option(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPEBENCH_SYSTEMS", "tests.runners.toy_system")
    from runners.sweep.execute import run_sweep
    from runners.sweep.plan import SweepError, sweep_from_dict

    fixed = {"model": "tiny", "batch_size": 2, "micro_batch_size": 2}
    with pytest.raises(SweepError, match="is an option of toy"):
        sweep_from_dict({"fixed": fixed, "systems": ["reference", {"name": "reference", "toy_lr_scale": 2.0}]})
    sweep = sweep_from_dict({"fixed": fixed, "systems": [{"name": "toy", "toy_lr_scale": [1.0, 2.0]}, "reference"]})
    toy = [r for r in sweep.runs if r.system == "toy"]
    assert len(toy) == 2 and all(r.valid for r in toy) and len({r.key for r in toy}) == 2
    calls = []
    run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r.system) or (0, ""), probe=False,
              report=False, need_root_for_network=False, stream=io.StringIO())
    assert sorted(calls) == ["reference", "toy", "toy"]

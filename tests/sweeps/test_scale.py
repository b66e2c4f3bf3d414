"""The scaled-down sweep (the cluster rehearsal's): the same plan on a tiny model."""
from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
from pathlib import Path

from runners.sweep.plan import SWEEPS_DIR, load_sweep, sweep_from_dict
from runners.sweep.scale import scale_down, scaled_batch

REPO = Path(__file__).resolve().parents[2]


def arg(run, flag: str) -> str:
    return run.args[run.args.index(flag) + 1]


def shape(run) -> tuple:
    """What must not change: system, options, layout, micro-batch size, network, placement hint."""
    drop = {"--model", "--hidden-size", "--num-heads", "--seq-length", "--vocab-size", "--batch-size", "--steps",
            "--warmup", "--timeout"}
    args = [a for i, a in enumerate(run.args) if a not in drop and (i == 0 or run.args[i - 1] not in drop)]
    return run.experiment, tuple(args), run.network, run.nproc_per_node, run.world


def test_seed_sweep_scaled_keeps_the_plan():
    data = tomllib.loads((SWEEPS_DIR / "gpt3-xl-cluster.toml").read_text())
    before = copy.deepcopy(data)
    full, small = sweep_from_dict(data), sweep_from_dict(scale_down(data))
    assert data == before                                             # the input is left alone
    assert small.name == "gpt3-xl-cluster-scaled" and len(small.runs) == len(full.runs) == 42
    assert not small.invalid_runs
    assert [shape(r) for r in small.runs] == [shape(r) for r in full.runs]
    for r in small.runs:
        assert arg(r, "--model") == "tiny" and arg(r, "--num-layers") == "24"   # P-12: still 2 layers per stage
        assert arg(r, "--hidden-size") == "64" and arg(r, "--seq-length") == "64" and arg(r, "--num-heads") == "16"
        assert arg(r, "--batch-size") == "16" and arg(r, "--steps") == "3" and arg(r, "--warmup") == "1"
        assert float(arg(r, "--timeout")) <= 600 and "--recompute" in r.args
    assert {r.key for r in small.runs}.isdisjoint({r.key for r in full.runs})


def test_batch_stays_divisible_by_every_micro_batch_size():
    assert scaled_batch(64, {1}) == 16
    assert scaled_batch(64, {1, 2, 4, 8, 16}) == 16
    assert scaled_batch(8, {1}) == 2
    assert scaled_batch(8, {3}) == 3
    assert scaled_batch(100, {6, 4}) == 36                              # 25 raised to a multiple of 12
    assert scaled_batch(2, {2}) == 2


def test_heads_follow_tensor_parallel_degrees_and_single_experiment_files():
    small = scale_down({"name": "one", "model": "gpt3-xl", "batch_size": 64, "micro_batch_size": 1,
                        "layouts": ["T-8", "T-2 P-4"], "systems": ["megatron"], "num_heads": 12})
    sweep = sweep_from_dict(small)
    assert not sweep.invalid_runs and len(sweep.runs) == 2
    assert all(arg(r, "--num-heads") == "16" and arg(r, "--num-layers") == "24" for r in sweep.runs)


def test_scale_down_flag_plans_the_scaled_sweep(tmp_path):
    p = subprocess.run([sys.executable, "-m", "runners.sweep", "gpt3-xl-cluster.toml", "--scale-down", "--dry-run",
                        "--only", "ours", "--out", str(tmp_path / "o.jsonl")], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    runs = [l for l in p.stdout.splitlines() if "runners.run" in l]
    assert len(runs) == 14 and all("--model tiny --num-layers 24 --hidden-size 64" in r for r in runs)
    assert load_sweep("gpt3-xl-cluster.toml", scale_down).name == "gpt3-xl-cluster-scaled"
    p = subprocess.run([sys.executable, "-m", "runners.sweep", "--scale-down", "--networks", "none", "--",
                        "--system", "ours"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--scale-down scales a sweep file" in p.stderr


def test_list_settings_are_scaled_axis_by_axis():
    small = scale_down({"fixed": {"model": "gpt3-xl", "batch_size": [32, 64], "micro_batch_size": 1, "steps": [2, 5]},
                        "experiment": [{"systems": ["ours"], "layouts": ["P-2"]}]})
    exp = small["experiment"][0]
    assert exp["batch_size"] == [8, 16] and exp["steps"] == [2, 3]
    assert len(sweep_from_dict(small).valid_runs) == 4

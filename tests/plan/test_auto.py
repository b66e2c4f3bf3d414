"""auto_slicing: the planner with a fitted model that covers the shape, else the rule of thumb; the CLI end to end on
a small shape."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ours.plan.auto import (SimulatedChoice, auto_slicing, default_granularity, fitted_model_path, rule_of_thumb,
                            simulated_choices_path, write_simulated_choices)
from ours.plan.latency import LatencyModel
from contract import RunConfig
from ours import OursOptions
from workload.configs import MODEL_CONFIGS

REPO = Path(__file__).resolve().parents[2]


def _config(model="tiny", pp=2, batch=2, micro=1, **over):
    m = MODEL_CONFIGS[model].with_overrides(**over)
    return RunConfig(system="ours", model=m, batch_size=batch, micro_batch_size=micro, pp=pp,
                     options=OursOptions(n_slices="auto"))


def test_without_a_fitted_model_the_rule_of_thumb_never_gives_one_slice(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.delenv("OURS_PLAN_MODEL", raising=False)
    chosen = auto_slicing(_config(), torch.device("cpu"))  # tiny: 128 tokens
    assert chosen.slices == (64, 64) and chosen.source.startswith("rule (no fitted latency model for cpu-h128")
    assert rule_of_thumb(1024, 2) == (128,) * 8 and rule_of_thumb(512, 2) == (128,) * 4
    assert rule_of_thumb(2048, 12) == (128,) * 16 and rule_of_thumb(3, 2) == (2, 1) and rule_of_thumb(2, 1) == (1, 1)


def test_one_stage_takes_one_slice_whatever_the_planner_has(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    _toy_model(128).save(tmp_path / "cpu-h128-a4-s128-v512.json")
    chosen = auto_slicing(_config(pp=1), torch.device("cpu"))
    assert chosen.slices == (128,) and chosen.source.startswith("rule (one stage")
    from ours import describe_slicing

    assert describe_slicing({"n_slices": "auto", "slices": [128], "slicing": chosen.source}) == "auto, rule: K=1 (128)"
    assert len(auto_slicing(_config(pp=2), torch.device("cpu")).slices) > 1


def test_a_model_fitted_at_a_longer_sequence_covers_shorter_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.delenv("OURS_PLAN_MODEL", raising=False)
    _toy_model(256).save(tmp_path / "cpu-h128-a4-s256-v512.json")
    _toy_model(512).save(tmp_path / "cpu-h128-a4-s512-v512.json")
    assert fitted_model_path(_config().model, "cpu").name == "cpu-h128-a4-s256-v512.json"  # shortest that covers
    assert fitted_model_path(_config(seq_len=512).model, "cpu").name == "cpu-h128-a4-s512-v512.json"
    assert fitted_model_path(_config(seq_len=1024).model, "cpu") is None
    assert fitted_model_path(_config(vocab_size=1024).model, "cpu") is None
    chosen = auto_slicing(_config(), torch.device("cpu"))
    assert sum(chosen.slices) == 128 and chosen.source == "planner (cpu-h128-a4-s256-v512.json)"


def test_a_slicing_chosen_by_simulation_for_the_layout_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.delenv("OURS_PLAN_MODEL", raising=False)
    _toy_model(128).save(tmp_path / "cpu-h128-a4-s128-v512.json")
    cfg = _config(batch=2)
    path = simulated_choices_path(cfg.model, "cpu")
    choice = lambda batch, slices: SimulatedChoice(n_layer=4, pp=2, batch_size=batch, micro_batch_size=1,  # noqa: E731
                                                   slices=slices, simulated_seconds=0.1, formula_slices=(64, 64),
                                                   formula_simulated_seconds=0.2, candidates=3)
    write_simulated_choices(path, [choice(2, (96, 32)), choice(4, (128,))])
    write_simulated_choices(path, [choice(2, (32, 32, 64))])  # replaces the batch-2 entry, keeps batch 4
    chosen = auto_slicing(cfg, torch.device("cpu"))
    assert chosen.slices == (32, 32, 64) and chosen.source == f"simulator ({path.name})"
    assert auto_slicing(_config(batch=4), torch.device("cpu")).slices == (128,)
    other = auto_slicing(_config(batch=8), torch.device("cpu"))  # no simulated layout: the formula
    assert other.source == "planner (cpu-h128-a4-s128-v512.json)"
    monkeypatch.setenv("OURS_PLAN_MODEL", str(tmp_path / "cpu-h128-a4-s128-v512.json"))
    assert auto_slicing(cfg, torch.device("cpu")).source.startswith("planner")


def _toy_model(seq_len: int) -> LatencyModel:
    ls = list(range(8, seq_len + 1, 8))
    return LatencyModel(n_embd=128, n_head=4, seq_len=seq_len, vocab_size=512, b_grid=[1], l_grid=ls,
                        t0=[[1e-3 + 1e-4 * l for l in ls]], gamma=2e-7, delta=2e-4)


def test_auto_slicing_uses_explicit_model_file(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    _toy_model(128).save(path)
    monkeypatch.setenv("OURS_PLAN_MODEL", str(path))
    cfg = _config()
    slices = auto_slicing(cfg, torch.device("cpu")).slices
    assert sum(slices) == 128 and len(slices) > 1
    assert slices == auto_slicing(cfg, torch.device("cpu")).slices
    assert list(slices) == sorted(slices, reverse=True)  # context cost: later slices no longer
    assert default_granularity(2048) == 8 and default_granularity(8192) == 32


@pytest.mark.multiprocess  # the profile's point-to-point part starts two gloo processes
def test_cli_profile_fit_solve(tmp_path):
    env = {"OURS_PLAN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    def run(*a):
        return subprocess.run([sys.executable, "-m", "ours.plan", *a], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)

    prof = tmp_path / "prof.json"
    p = run("profile", "--model", "tiny", "--seq-len", "64", "--quick", "--no-progress", "--out", str(prof))
    assert p.returncode == 0, p.stderr
    d = json.loads(prof.read_text())
    assert d["model"]["seq_len"] == 64 and d["torch"] == torch.__version__ and d["device"] == "cpu"
    assert {x["c"] for x in d["layer"]} > {0} and len(d["p2p"]) >= 2
    p = run("fit", "--profile", str(prof))
    assert p.returncode == 0, p.stderr
    assert "context_holdout" in p.stdout or "context_all" in p.stdout
    p = run("solve", "--model", "tiny", "--seq-len", "64", "--pp", "2", "--batch-size", "2", "--json",
            "--out", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert sum(plan["slices"]) == 64 and plan["batch_slice"] in (1, 2) and plan["predicted_step"] > 0
    assert "slices [" in p.stdout.splitlines()[-1]

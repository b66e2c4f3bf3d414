"""python -m predict plan: ours' slicing per layout chosen by simulation, where --n-slices auto finds it."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from contract import RunConfig
from ours import OursOptions
from ours.plan.auto import auto_slicing, read_simulated_choices, simulated_choices_path
from predict.__main__ import main
from workload.configs import get_model_config

REPO = Path(__file__).resolve().parents[2]
LATENCY_MODEL = REPO / "ours" / "plan" / "fitted" / "cpu-h512-a8-s1024-v1024.json"


def test_plan_writes_the_simulated_best_that_auto_then_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.delenv("OURS_PLAN_MODEL", raising=False)
    shutil.copy(LATENCY_MODEL, tmp_path / LATENCY_MODEL.name)
    assert main(["plan", "--model", "cpu-small", "--pp", "2", "--batch-size", "1", "4"]) == 0
    model = get_model_config("cpu-small")
    (b1, b4) = read_simulated_choices(simulated_choices_path(model, "cpu"))
    for c in (b1, b4):
        assert sum(c.slices) == sum(c.formula_slices) == 1024 and c.candidates >= 5
        assert c.simulated_seconds <= c.formula_simulated_seconds  # the formula's optimum is a candidate
    assert b4.simulated_seconds > b1.simulated_seconds
    cfg = RunConfig(system="ours", model=model, batch_size=4, micro_batch_size=1, pp=2, options=OursOptions())
    chosen = auto_slicing(cfg, torch.device("cpu"))
    assert chosen.slices == b4.slices and chosen.source.startswith("simulator")
    assert "simulated best" in capsys.readouterr().out


def test_plan_without_a_latency_model_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.delenv("OURS_PLAN_MODEL", raising=False)
    assert main(["plan", "--model", "cpu-small"]) == 2
    assert "no fitted latency model" in capsys.readouterr().err

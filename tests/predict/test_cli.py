"""python -m predict with the run command's own flags, and with a sweep file; the prediction a
record carries."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

RUN = ["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1",
       "--n-slices", "4"]


def predict_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "predict", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_one_run_from_the_run_commands_flags():
    p = predict_cli(*RUN, "--network", "d10-1g")
    assert p.returncode == 0, p.stderr
    line = p.stdout.splitlines()[1]
    assert line.startswith("predicted step ") and "exposed comm" in line and "bubble" in line
    gpu = predict_cli("--system", "torch_pipe", "--model", "gpt3-xl", "--pp", "12", "--batch-size", "64",
                      "--micro-batch-size", "1", "--recompute", "--network", "d10-1g",
                      "--device-file", "predict/devices/v100.json")
    assert gpu.returncode == 0 and "v100.json" in gpu.stdout, gpu.stderr
    bad = predict_cli("--system", "fairscale_fsdp", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1")
    assert bad.returncode == 2 and "no program for fairscale_fsdp" in bad.stderr
    foreign = predict_cli("--system", "torch_pipe", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1",
                          "--n-slices", "4")
    assert foreign.returncode == 2 and "is an option of ours" in foreign.stderr


def test_a_sweep_predicted_in_the_reports_shape(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text('networks = ["default", "d10-1g"]\nlayouts = ["P-2"]\n'
                     'systems = ["ours", {name = "torch_pipe", schedule = "gpipe"}, {name = "reference", layouts = ["1"]}]\n'
                     '[fixed]\nmodel = "tiny"\nbatch_size = 2\nmicro_batch_size = 1\n')
    p = predict_cli("sweep", str(sweep))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# Predicted: sweep s") and "Network setting" in p.stdout
    assert "not predicted" in p.stderr and "reference" in p.stderr


def test_a_record_carries_the_prediction_where_this_machine_is_calibrated():
    from predict.this_machine import record_prediction
    from runners.request import build_parser, config_from_args

    pred = record_prediction(config_from_args(build_parser().parse_args(RUN)))
    assert pred["step_time"] > 0 and abs(sum(pred[k] for k in ("compute", "overhead", "exposed_comm", "bubble",
                                                                 "dp_sync", "barrier")) - pred["step_time"]) < 1e-9


def test_a_fault_of_the_simulator_leaves_the_record_without_a_prediction(monkeypatch, capsys):
    from predict import this_machine as local
    from predict.simulator import SimulationError
    from runners.request import build_parser, config_from_args

    def broken(*args, **kwargs):
        raise SimulationError("deadlock: rank 0 stuck")

    monkeypatch.setattr(local, "predict_here", broken)
    assert local.record_prediction(config_from_args(build_parser().parse_args(RUN))) is None
    assert capsys.readouterr().err.strip() == "prediction not made: SimulationError: deadlock: rank 0 stuck"

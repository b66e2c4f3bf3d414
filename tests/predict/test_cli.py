"""python -m predict with the run command's own flags, with a sweep file, and over a records file (the
predictions the report shows beside the measured step times)."""
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
                     'systems = ["ours", {name = "torch_pipe", schedule = "gpipe"}, {name = "fairscale_fsdp", layouts = ["D-2"]}]\n'
                     '[fixed]\nmodel = "tiny"\nbatch_size = 2\nmicro_batch_size = 1\n')
    p = predict_cli("sweep", str(sweep))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# Predicted: sweep s") and "Network setting" in p.stdout
    assert "not predicted" in p.stderr and "fairscale_fsdp" in p.stderr


def test_a_run_is_predicted_where_this_machine_is_calibrated():
    from predict.this_machine import record_prediction
    from runners.request import parse_request

    pred = record_prediction(parse_request(RUN)[0])
    assert pred["step_time"] > 0 and abs(sum(pred[k] for k in ("compute", "overhead", "exposed_comm", "bubble",
                                                                 "dp_sync", "barrier")) - pred["step_time"]) < 1e-9


def test_a_fault_of_the_simulator_leaves_the_record_without_a_prediction(monkeypatch, capsys):
    from predict import this_machine as local
    from predict.simulator import SimulationError
    from runners.request import parse_request

    def broken(*args, **kwargs):
        raise SimulationError("deadlock: rank 0 stuck")

    monkeypatch.setattr(local, "predict_here", broken)
    assert local.record_prediction(parse_request(RUN)[0]) is None
    assert capsys.readouterr().err.strip() == "prediction not made: SimulationError: deadlock: rank 0 stuck"


def test_recorded_runs_predicted_beside_their_records_and_shown_by_the_report(tmp_path):
    import report
    from contract.records import predictions_path
    from runners.record import build_record
    from runners.request import parse_request

    records = tmp_path / "runs.jsonl"
    lines = []
    for argv, kind in ((RUN, "cpu"), (RUN + ["--seed", "1"], "cuda"), (RUN[:-2] + ["--n-slices", "2"], "cpu")):
        cfg, spec = parse_request(argv)
        rec = build_record(cfg, spec, "ok", None, None, {"device_kind": kind, "device_name": kind})
        rec.median_step_time = 0.5
        lines.append(rec)
    records.write_text("".join(r.to_json() + "\n" for r in lines))
    p = predict_cli("records", str(records))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{records}: 2 run(s) predicted ({predictions_path(records)})"
    kept = __import__("json").loads(predictions_path(records).read_text())
    assert set(kept) == {lines[0].run_id, lines[2].run_id}  # a GPU run is not this machine's to predict
    shown = report.load_records([str(tmp_path)])
    assert [r.get("prediction", {}).get("step_time") for r in shown] == [
        kept[lines[0].run_id]["step_time"], None, kept[lines[2].run_id]["step_time"]]
    assert "(pred " in report.render(shown)
    assert predict_cli("records", str(tmp_path / "missing.jsonl")).returncode == 2

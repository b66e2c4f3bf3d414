"""python -m predict with the run command's own flags, with a sweep file, and over a records file (the
predictions the report shows beside the measured step times)."""
from __future__ import annotations

import subprocess
import sys

import pytest

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
                      "--device-file", "V100 SXM2 16GB")
    assert gpu.returncode == 0 and "V100 SXM2 16GB" in gpu.stdout, gpu.stderr
    for precision in ("bf16", "fp16"):
        half = predict_cli("--system", "megatron", "--model", "gpt3-xl", "--tp", "2", "--batch-size", "8",
                           "--micro-batch-size", "1", "--precision", precision, "--gpu", "A100 SXM4 80GB")
        assert half.returncode == 0 and "predicted step" in half.stdout, half.stderr
    unknown = predict_cli(*RUN, "--gpu", "nonesuch")
    assert unknown.returncode == 2 and "no device file for 'nonesuch'" in unknown.stderr
    bad = predict_cli("--system", "fairscale_fsdp", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1")
    assert bad.returncode == 2 and "no program for fairscale_fsdp" in bad.stderr
    foreign = predict_cli("--system", "torch_pipe", "--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1",
                          "--n-slices", "4")
    assert foreign.returncode == 2 and "is an option of ours" in foreign.stderr


def test_a_sweep_predicted_in_the_reports_shape(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text('networks = ["default", "d10-1g"]\nlayouts = ["P-2"]\n'
                     'systems = ["ours", {name = "torch_pipe", schedule = "gpipe"}, '
                     '{name = "fairscale_fsdp", layouts = ["D-2"]}]\n'
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


def _records(tmp_path, medians=(0.5, 0.5, 0.5)):
    """Three recorded runs of RUN's kind: ours K=4 on CPU, the same on a GPU, ours K=2 on CPU."""
    from runners.record import build_record
    from runners.request import parse_request

    records = tmp_path / "runs.jsonl"
    lines = []
    for (argv, kind), t in zip(((RUN, "cpu"), (RUN + ["--seed", "1"], "cuda"), (RUN[:-2] + ["--n-slices", "2"], "cpu")),
                               medians):
        cfg, spec = parse_request(argv)
        rec = build_record(cfg, spec, "ok", None, None, {"device_kind": kind, "device_name": kind})
        rec.median_step_time = t
        lines.append(rec)
    records.write_text("".join(r.to_json() + "\n" for r in lines))
    return records, lines


def _calibrated(tmp_path, monkeypatch, speed=0.05):
    """A calibration of this host and code version under tmp_path (the newest committed one's overheads
    and the tiny model's profile), made at ``speed``; the speed probe answers ``speed`` too."""
    import json
    import shutil

    from predict import this_machine as local

    own = local.calibration_dir(tmp_path)
    own.mkdir(parents=True)
    kept = local.latest_calibration()
    cal = json.loads((kept / "calibration.json").read_text())
    cal["identity"] = {"host": local.host_name(), "code": local.code_version(), "when": "now", "speed_tflops": speed}
    (own / "calibration.json").write_text(json.dumps(cal))
    shutil.copy(kept / "profile-h128-a4-s128-v512.json", own)
    monkeypatch.setattr(local, "speed_probe", lambda: speed)
    return local.load_calibration(tmp_path, strict=True)


def test_without_this_hosts_calibration_every_run_is_not_modelled_and_one_line_says_why(tmp_path):
    import json

    from reporting import load_records, render
    from contract.records import predictions_path
    from predict.this_machine import predict_records

    records, lines = _records(tmp_path)
    said = []
    assert predict_records(records, directory=tmp_path / "none", log=said.append) == {}
    assert len(said) == 1 and "no calibration of this host" in said[0] and "python -m predict calibrate" in said[0]
    kept = json.loads(predictions_path(records).read_text())
    assert set(kept) == {lines[0].run_id, lines[2].run_id}  # a GPU run is not this machine's to predict
    assert all("no calibration of this host" in v["not_modelled"] for v in kept.values())
    text = render(load_records([str(records)]))
    assert "(not modelled)" in text and "(pred " not in text
    p = predict_cli("records", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 2


def test_predictions_only_for_validated_cases_with_the_calibration_they_used(tmp_path, monkeypatch):
    import json

    from reporting import load_records, render
    from contract.records import predictions_path
    from predict import this_machine as local

    cal = _calibrated(tmp_path, monkeypatch)
    records, lines = _records(tmp_path)
    # K=4 and K=2 are one case (ours P-2 s128): measured 5 % and 30 % above their predictions, errors
    # -4.8 % and -23.1 %: largest beyond 20 %, not modelled
    truth = [local.predict_here(local.config_as_run(json.loads(r.to_json())), None, cal).step_time for r in lines]
    records, lines = _records(tmp_path, medians=(truth[0] * 1.05, 1.0, truth[2] * 1.3))
    local.validate_records([records], directory=tmp_path, log=lambda line: None)
    v = json.loads((tmp_path / "validation.json").read_text())
    assert list(v["cases"]) == ["ours P-2 s128"] and v["cases"]["ours P-2 s128"]["max"] == pytest.approx(0.3 / 1.3)
    assert not v["cases"]["ours P-2 s128"]["modelled"] and "| ours P-2 s128 | 2 | 13.9 % | 23.1 % | no |" in \
        (tmp_path / "validation.md").read_text()
    # the records file may be run again and replaced: the validation names the commit its records are of
    made = sorted({json.loads(r.to_json())["environment"]["git_commit"][:12] for r in lines})
    assert v["commits"] == made
    assert f"{records} (records of commit {made[0]})" in (tmp_path / "validation.md").read_text()
    said = []
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {} and said == []
    assert "largest 23 %" in json.loads(predictions_path(records).read_text())[lines[0].run_id]["not_modelled"]
    # within the bounds: the K=2 run measured 12 % above (errors -4.8 % and -10.7 %); the runs it judged get
    # no prediction beside them, later runs of the same case do
    records, judged = _records(tmp_path, medians=(truth[0] * 1.05, 1.0, truth[2] * 1.12))
    local.validate_records([records], directory=tmp_path, log=lambda line: None)
    said = []
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {}
    assert "scored this very run" in json.loads(predictions_path(records).read_text())[judged[0].run_id]["not_modelled"]
    records, lines = _records(tmp_path, medians=(truth[0], 1.0, truth[2]))
    made = local.predict_records(records, directory=tmp_path, log=said.append)
    assert said == [] and set(made) == {lines[0].run_id, lines[2].run_id}
    assert all(p["source"] == f"predict, {cal.name}" and cal.identity["code"] in p["source"] for p in made.values())
    assert "(pred " in render(load_records([str(records)]))
    # the host got 30 % faster than at its calibration: refused in one line, the predictions made while the
    # calibration held kept as they are; without them, every run not modelled and why
    monkeypatch.setattr(local, "speed_probe", lambda: 0.065)
    earlier = predictions_path(records).read_text()
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {}
    assert len(said) == 1 and "1.30x the speed of its calibration" in said[0] and "bound ±10%" in said[0]
    assert "earlier predictions are kept" in said[0] and predictions_path(records).read_text() == earlier
    predictions_path(records).unlink()
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {}
    kept = json.loads(predictions_path(records).read_text())
    assert all("1.30x" in v["not_modelled"] for v in kept.values())
    # a validation of another calibration judges nothing for this one
    monkeypatch.setattr(local, "speed_probe", lambda: 0.05)
    v["calibration"] = {**v["calibration"], "code": "another"}
    (tmp_path / "validation.json").write_text(json.dumps(v))
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {}
    kept = json.loads(predictions_path(records).read_text())
    assert "not validated on this calibration's runs" in kept[lines[0].run_id]["not_modelled"]


def test_a_case_whose_runs_the_validation_could_not_predict_is_not_modelled_and_says_why(tmp_path, monkeypatch):
    """A main job's torch_pipe zbv has no program in the simulator, so its case was validated
    with no errors at all; predicting the records then failed on the missing error."""
    import json

    from contract.records import predictions_path
    from predict import this_machine as local

    _calibrated(tmp_path, monkeypatch)
    records, lines = _records(tmp_path)

    def unknown(*args, **kwargs):
        raise ValueError("unknown schedule 'zbv' for torch_pipe")

    with monkeypatch.context() as m:
        m.setattr(local, "predict_here", unknown)
        local.validate_records([records], directory=tmp_path, log=lambda line: None)
    case = json.loads((tmp_path / "validation.json").read_text())["cases"]["ours P-2 s128"]
    assert case["median"] is None and not case["modelled"] and "unknown schedule 'zbv'" in case["why"]
    said = []
    assert local.predict_records(records, directory=tmp_path, log=said.append) == {} and said == []
    why = json.loads(predictions_path(records).read_text())[lines[0].run_id]["not_modelled"]
    assert why == "ours P-2 s128: the validation predicted none of its runs: unknown schedule 'zbv' for torch_pipe"


def test_an_auto_run_is_predicted_with_the_slices_it_used():
    import json

    from predict.this_machine import config_as_run
    from runners.record import build_record
    from runners.request import parse_request

    cfg, spec = parse_request(RUN[:-2])  # --n-slices auto
    rec = json.loads(build_record(cfg, spec, "ok", None, None, {}).to_json())
    rec["options"]["slices"] = [32, 32, 32, 32]
    assert config_as_run(rec).options.token_slices(128) == (32, 32, 32, 32)


def test_repetitions_of_an_auto_run_are_each_predicted_with_the_slices_they_kept(tmp_path, monkeypatch):
    """In predict-check, ours' auto kept K=1, 2 and 4 in three launches of one run; the validation
    predicted all three with the last one's K."""
    import json

    from predict import this_machine as local
    from runners.record import build_record
    from runners.request import parse_request

    cal = _calibrated(tmp_path, monkeypatch)
    cfg, spec = parse_request(RUN[:-2])  # --n-slices auto
    recs = []
    for slices in ([32, 32, 32, 32], [64, 64]):
        rec = json.loads(build_record(cfg, spec, "ok", None, None,
                                      {"device_kind": "cpu", "device_name": "cpu"}).to_json())
        rec["options"]["slices"] = slices
        rec["median_step_time"] = local.predict_here(local.config_as_run(rec), None, cal).step_time  # as predicted
        recs.append(rec)
    assert recs[0]["key"] == recs[1]["key"] and recs[0]["median_step_time"] != recs[1]["median_step_time"]
    records = tmp_path / "runs.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in recs))
    local.validate_records([records], directory=tmp_path, log=lambda line: None)
    (row,) = json.loads((tmp_path / "validation.json").read_text())["rows"]
    assert row["runs"] == 2 and row["error"] == pytest.approx(0, abs=1e-9)


def test_a_run_that_cannot_fit_its_gpu_is_predicted_oom():
    """Issue #44, item 6: GPT-3 175B on one 16 GB V100 was "predicted step 241.3 s"."""
    p = predict_cli("--system", "ours", "--model", "gpt3-175b", "--pp", "1", "--batch-size", "1",
                    "--micro-batch-size", "1", "--gpu", "V100 SXM2 16GB")
    assert p.returncode == 0, p.stderr
    assert "predicted: oom: needs" in p.stdout and "predicted step" not in p.stdout and "holds 15.2 GiB" in p.stdout


def test_records_commands_name_a_directory_and_tell_skipped_lines_under_their_own_name(tmp_path):
    for command in ("records", "validate"):
        proc = subprocess.run([sys.executable, "-m", "pipebench", "predict", command, str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"pipebench predict {command}: error: {tmp_path}: a directory, not a records file"), proc.stderr
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"a": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "pipebench", "predict", "validate", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"pipebench predict validate: {bad}:1: not a run record")

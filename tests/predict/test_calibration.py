"""Calibration round trips (overheads on CPU, efficiency on GPU), the profile's interpolation, the glue
to RunConfig, and the seed's tables predicted from its default GPipe row."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from predict.fitting import fit_overheads
from workload.compute import CpuCompute, Overheads, Table3
from predict.from_config import spec_from_config
from predict.this_machine import local_link
from predict.step_time import predict
from contract.links import Link
from predict.run_spec import RunSpec
from workload.configs import ModelConfig

TOY = ModelConfig("toy", n_layer=4, n_embd=64, n_head=4, seq_len=64, vocab_size=128)


def synthetic_profile() -> dict:
    """t(b, l, c) = b (1e-4 + 1e-5 l + 1e-7 l c) for the forward; the backward twice, half of it weights."""
    layer = []
    for b in (1, 2):
        for l in (8, 16, 32, 48, 64):
            for c in (0, 16, 32):
                if c + l <= 64:
                    fwd = b * (1e-4 + 1e-5 * l + 1e-7 * l * c)
                    layer.append(dict(b=b, l=l, c=c, fwd=fwd, bwd_in=fwd, wgrad=fwd, bwd_full=2 * fwd))
    return dict(model=dict(n_embd=64, n_head=4, seq_len=64, vocab_size=128), layer=layer,
                head=dict(fwd_per_token=1e-6, bwd_in_per_token=1e-6, wgrad_per_token=1e-6), embed_per_token=1e-7,
                optimizer_per_param=1e-9, p2p_fit=dict(latency=1e-4, bandwidth=1e9))


def test_table_interpolates_the_grid_and_the_context_term():
    t = Table3(tuple((p["b"], p["l"], p["c"], p["fwd"]) for p in synthetic_profile()["layer"]))
    assert t(1, 24, 0) == pytest.approx(1e-4 + 1e-5 * 24)
    assert t(1, 16, 40) == pytest.approx(1e-4 + 1e-5 * 16 + 1e-7 * 16 * 40)
    assert t(2, 8, 0) == pytest.approx(2 * (1e-4 + 8e-5))


def test_profile_rows_are_made_non_decreasing_in_length():
    prof = synthetic_profile()
    slow = next(p for p in prof["layer"] if p["b"] == 1 and p["l"] == 16 and p["c"] == 0)
    slow["fwd"] *= 5  # a measurement slowed by contention
    cm = CpuCompute(prof)
    assert cm.layer_forward(1, 16, 0) <= cm.layer_forward(1, 32, 0) * 1.0001


def test_overheads_round_trip():
    truth = Overheads(step=0.004, unit=0.002)
    cm = CpuCompute(synthetic_profile())
    link = Link(2e-4, 1e9)
    specs = [RunSpec("torch_pipe", TOY, b, 1, link, pp=2) for b in (2, 4, 8)]
    measured = [predict(s, cm.with_overheads("torch_pipe", truth), cores=2.0).step_time for s in specs]
    fitted, report = fit_overheads("torch_pipe", [(s, m, cm) for s, m in zip(specs, measured)], 2.0, ("step", "unit"))
    assert fitted.step == pytest.approx(truth.step, rel=0.02)
    assert fitted.unit == pytest.approx(truth.unit, rel=0.02)
    assert max(abs(r["error"]) for r in report) < 1e-3


def test_compute_factor_round_trip():
    """A baseline's kernels at 0.8 of the profiled time: separable from the per-unit overhead by runs whose
    micro-batches carry different amounts of math."""
    truth = Overheads(step=0.004, unit=0.002, compute=0.8)
    cm = CpuCompute(synthetic_profile())
    link = Link(2e-4, 1e9)
    specs = [RunSpec("torch_pipe", TOY, b, mb, link, pp=2) for b, mb in ((2, 1), (4, 1), (4, 2), (8, 2))]
    measured = [predict(s, cm.with_overheads("torch_pipe", truth), cores=2.0).step_time for s in specs]
    assert measured[2] != pytest.approx(predict(specs[2], cm.with_overheads("torch_pipe", Overheads(0.004, 0.002)),
                                                cores=2.0).step_time, rel=0.01)  # the factor matters
    fitted, _ = fit_overheads("torch_pipe", [(s, m, cm) for s, m in zip(specs, measured)], 2.0,
                              ("step", "unit", "compute"))
    assert fitted.compute == pytest.approx(0.8, rel=0.02)
    assert fitted.unit == pytest.approx(0.002, rel=0.05)


def test_tensor_parallel_factor_round_trip():
    """A tensor-parallel rank's math at 1.4 of half the profiled math, fitted with Megatron's per-step
    cost from two T-2 runs of different amounts of math; the factor leaves a pipeline run alone."""
    truth = Overheads(step=0.004, tp=1.4)
    cm = CpuCompute(synthetic_profile())
    link = Link(2e-4, 1e9)
    specs = [RunSpec("megatron", TOY.with_overrides(seq_len=seq), b, 1, link, pp=1, tp=2)
             for seq, b in ((32, 2), (64, 1), (64, 2))]
    measured = [predict(s, cm.with_overheads("megatron", truth), cores=2.0).step_time for s in specs]
    fitted, report = fit_overheads("megatron", [(s, m, cm) for s, m in zip(specs[:2], measured[:2])], 2.0,
                                   ("step", "tp"))
    assert fitted.tp == pytest.approx(1.4, rel=0.02) and fitted.step == pytest.approx(0.004, rel=0.05)
    assert report[0]["tp"] == 2
    held_out = predict(specs[2], cm.with_overheads("megatron", fitted), cores=2.0).step_time
    assert held_out == pytest.approx(measured[2], rel=0.01)
    pipe = RunSpec("megatron", TOY, 2, 1, link, pp=2)
    assert predict(pipe, cm.with_overheads("megatron", truth), cores=2.0).step_time == pytest.approx(
        predict(pipe, cm.with_overheads("megatron", Overheads(step=0.004)), cores=2.0).step_time)


def test_a_tensor_parallel_calibration_run_is_its_own_layout():
    from predict.this_machine import LocalRun, matches

    rec = dict(config=dict(system="megatron", model=dict(name="cpu-small", seq_len=256), pp=1, tp=2, dp=1,
                           batch_size=2, micro_batch_size=1, network="none", options=dict(schedule="1f1b")))
    run = LocalRun("megatron", "cpu-small", pp=1, tp=2, seq=256, schedule="1f1b")
    assert matches(run, rec) and "T-2 B=2" in run.name and "P-1" not in run.name
    assert "--tp" in run.argv(Path("x.jsonl"), 2, 1)
    assert not matches(LocalRun("megatron", "cpu-small", pp=1, seq=256, schedule="1f1b"), rec)


def test_spec_from_a_run_config():
    from runners.request import parse_request

    cfg, _ = parse_request(["--system", "ours", "--model", "tiny", "--pp", "2", "--dp", "2", "--batch-size", "2",
                            "--micro-batch-size", "1", "--n-slices", "4", "--dp-mode", "central_ps"])
    link = local_link("d10-1g", (1e-4, 2e9), {"one_way_delay_ms": 10.2, "bandwidth_gbps": 0.9}, 24576)
    spec = spec_from_config(cfg, link)
    assert spec.slices == (32, 32, 32, 32) and spec.dp == 2 and spec.dp_mode == "central_ps"
    assert spec.link.latency == pytest.approx(10.3e-3) and spec.link.bandwidth == pytest.approx(0.9e9 / 8)
    assert spec.link.stall_bytes == 24576


def test_the_message_latency_over_an_emulated_link_replaces_the_loopback_one():
    link = local_link("d10-1g", (2.5e-4, 2e9), {"one_way_delay_ms": 10.2, "bandwidth_gbps": 0.9}, None, 3e-5)
    assert link.latency == pytest.approx(10.23e-3) and link.stall_bytes is None
    assert local_link("none", (2.5e-4, 2e9), None, None, 3e-5).latency == pytest.approx(2.5e-4)


def test_message_probe_fits_a_stall_and_no_stall():
    from predict.gloo_stall import fit_message_latency, fit_stall

    delay, bw = 0.02, 1.25e8
    sizes = (2048, 8192, 32768, 65536, 262144)
    stalled = [dict(bytes=n, round_trip=2 * (delay + n / bw + 1e-4 + delay * min(1.0, n / 25600))) for n in sizes]
    assert fit_stall(stalled, delay, bw) == pytest.approx(25600, rel=0.04)
    clean = [dict(bytes=n, round_trip=2 * (delay + n / bw + 1e-4)) for n in sizes]
    assert fit_stall(clean, delay, bw) is None
    assert fit_message_latency(clean, delay, bw) == pytest.approx(1e-4)


def test_calibration_records_are_matched_by_their_system_options():
    """A record keeps a system's own options under config["options"]; matching must read them there."""
    from predict.this_machine import LocalRun, matches

    def record(system, **options):
        return dict(config=dict(system=system, model=dict(name="tiny", seq_len=128), pp=2, dp=1, batch_size=2,
                                micro_batch_size=1, network="none", options=options))

    assert matches(LocalRun("ours", "tiny", n_slices=4), record("ours", n_slices=4, dp_mode="allreduce"))
    assert not matches(LocalRun("ours", "tiny", n_slices=1), record("ours", n_slices=4, dp_mode="allreduce"))
    # ours' order of units: a record without it ran gpipe (the calibration's); 1f1b is another run
    assert not matches(LocalRun("ours", "tiny", n_slices=4), record("ours", n_slices=4, schedule="1f1b"))
    assert matches(LocalRun("ours", "tiny", n_slices=4, schedule="1f1b"), record("ours", n_slices=4, schedule="1f1b"))
    assert matches(LocalRun("torch_pipe", "tiny"), record("torch_pipe", schedule="gpipe", virtual_pp=1))
    assert not matches(LocalRun("torch_pipe", "tiny", schedule="1f1b"), record("torch_pipe", schedule="gpipe"))


def test_the_glue_refuses_what_it_does_not_model_and_resolves_auto_slicing(tmp_path, monkeypatch):
    from predict.from_config import NotModelled
    from predict.this_machine import record_prediction
    from runners.request import parse_request

    def cfg(*a):
        return parse_request(["--model", "tiny", "--batch-size", "2", "--micro-batch-size", "1", *a])[0]

    link = Link.from_ms_gbps(0.1, 10)
    auto = spec_from_config(cfg("--system", "ours", "--pp", "2"), link).slices  # the planner, this CPU's profile
    assert sum(auto) == 128 and len(auto) > 1
    with pytest.raises(NotModelled, match="search"):
        spec_from_config(cfg("--system", "ours", "--pp", "2", "--n-slices", "search"), link)
    with pytest.raises(NotModelled, match="fp32"):
        spec_from_config(cfg("--system", "ours", "--pp", "2", "--precision", "bf16"), link)
    with pytest.raises(NotModelled):
        spec_from_config(cfg("--system", "fairscale_fsdp"), link)
    ahead = {a: spec_from_config(cfg("--system", "ours", "--pp", "2", *a), link).prefetch
             for a in [(), ("--prefetch", "0"), ("--prefetch", "2")]}
    assert ahead == {(): 1, ("--prefetch", "0"): 0, ("--prefetch", "2"): 2}  # --prefetch auto: P - 1
    assert record_prediction(cfg("--system", "reference")) is None  # a record without a prediction


def test_a_matrix_whose_links_differ_is_not_modelled(tmp_path, capsys):
    """Issue #31, item 4: a run under a two-region matrix was predicted (0.090 s, no DP sync, against
    0.329 s measured) as if every link were its link 0 -> 1; a matrix of one kind of link is that link."""
    from predict.from_config import NotModelled, single_link
    from predict.this_machine import predict_records
    from runners.record import append_record, build_record
    from runners.request import parse_request

    hetero = {"delay_ms": [[0, 0.1], [67, 0]], "bandwidth_gbps": [[0, 10], [0.79, 0]]}
    with pytest.raises(NotModelled, match="a per-link matrix with 2 kinds of link is not modelled"):
        single_link("two-region.json", hetero)
    same = single_link("net.json", {"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]})
    assert (same.delay_ms, same.bandwidth_gbps) == (5, 1) and single_link("none") is None
    cfg, spec = parse_request(["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2",
                               "--micro-batch-size", "1", "--n-slices", "2"])
    cfg = cfg.replace(network="two-region.json", network_matrix=hetero)
    rec = build_record(cfg, spec, "ok", None, None, {"device_kind": "cpu"})
    append_record(tmp_path / "r.jsonl", rec)
    assert predict_records(tmp_path / "r.jsonl") == {}
    said = capsys.readouterr().out
    assert f"run {rec.run_id} (ours): not predicted: --network two-region.json: a per-link matrix" in said


def test_a_calibration_run_is_fitted_by_its_median_repetition():
    from predict.this_machine import LocalRun, median_runs

    a, b = LocalRun("torch_pipe", "tiny", batch=2), LocalRun("ours", "tiny", n_slices=4)
    rec = lambda t, i: {"median_step_time": t, "run_id": i}  # noqa: E731
    measured = [(a, rec(0.030, "a1"), 0.1), (b, rec(0.050, "b1"), 0.0), (a, rec(0.045, "a2"), 1.5),
                (b, rec(0.052, "b2"), 0.2), (a, rec(0.029, "a3"), 0.3)]
    rows = {r: (x["run_id"], bg) for r, x, bg in median_runs(measured)}
    assert rows[a] == ("a1", 0.3)  # the slow spell (a2, busy) moves neither the time nor the load
    assert rows[b] == ("b1", 0.1)  # an even count: the lower middle record, the loads' median


def test_calibration_fit_recovers_what_made_its_runs(tmp_path):
    """``fit_calibration`` on runs simulated from known overheads, both pipelines' math factors and the
    share of the cores four ranks on two cores keep: it finds them again, and every run within 2 %."""
    from contract.registry import get_system
    from predict.from_config import spec_from_config
    from predict.host_load import cores_with_background
    from predict.this_machine import PROFILED, LocalRun, fit_calibration, shape_key
    from runners.record import build_record
    from runners.request import build_parser, config_from_args

    truth = {"torch_pipe": Overheads(step=0.004, unit=0.002, compute=1.2),
             "ours": Overheads(step=0.01, unit_layer=2e-4, dp=0.003, compute=1.15)}
    crowded = 0.8
    runs = (LocalRun("torch_pipe", "tiny", batch=2), LocalRun("torch_pipe", "tiny", batch=4, micro=2),
            LocalRun("torch_pipe", "tiny", batch=8, seq=64),
            LocalRun("ours", "tiny", n_slices=1), LocalRun("ours", "tiny", n_slices=4),
            LocalRun("ours", "tiny", batch=4, seq=64, n_slices=2),
            LocalRun("ours", "tiny", dp=2, n_slices=4, dp_mode="central_ps"),
            LocalRun("ours", "tiny", batch=8, seq=64, dp=2, n_slices=2, dp_mode="allreduce"))
    prof = synthetic_profile()
    for m in [r.shape() for r in runs] + [m for m, _ in PROFILED]:
        (tmp_path / f"profile-{shape_key(m)}.json").write_text(json.dumps(prof))
    (tmp_path / "stall-probe.json").write_text(json.dumps({"stall_bytes": 0.0, "message_latency": None}))
    link = local_link("none", (1e-4, 1e9))
    with open(tmp_path / "calibration-runs.jsonl", "w") as out:
        for r in runs:
            args = build_parser().parse_args(r.argv(tmp_path / "x.jsonl", 2, 1)[3:])
            cfg = config_from_args(args, get_system(r.system))
            t = predict(spec_from_config(cfg, link), CpuCompute(prof, truth),
                        cores_with_background(2.0, 0.0, crowded=crowded)).step_time
            rec = build_record(cfg, get_system(r.system), "ok", None, None, {})
            rec.median_step_time = t
            out.write(rec.to_json() + "\n")
    cal = fit_calibration(runs, tmp_path, speed=0.1, log=lambda *_: None)
    assert cal.cores[:4] == pytest.approx((1.0, 2.0, 2.0 * crowded, 2.0 * crowded))
    assert cal.overhead["torch_pipe"].compute == pytest.approx(1.2, rel=0.03)
    assert cal.overhead["ours"].compute == pytest.approx(1.15, rel=0.03)
    assert cal.overhead["ours"].dp == pytest.approx(0.003, rel=0.1)
    assert max(abs(row["error"]) for row in cal.runs) < 0.02
    assert json.loads((tmp_path / "calibration.json").read_text())["cores"][2] == pytest.approx(2.0 * crowded)


def test_a_prediction_is_never_shown_beside_a_run_its_validation_scored(tmp_path, monkeypatch):
    """Two runs of one case: the validation scored the first; the report's predictions (``predict
    records``) show one beside the second only, and the calibration's own runs are never scored."""
    from predict import this_machine as tm
    from runners.record import append_record, build_record
    from runners.request import parse_request

    cfg, spec = parse_request(["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2",
                               "--micro-batch-size", "1", "--n-slices", "2"])
    runs = []
    for t in (0.1, 0.11):
        rec = build_record(cfg, spec, "ok", None, None, {"device_kind": "cpu"})
        rec.median_step_time = t
        append_record(tmp_path / "job.jsonl", rec)
        runs.append(rec.run_id)
    case = tm.case_of(json.loads((tmp_path / "job.jsonl").read_text().splitlines()[0]))
    cal = type("Cal", (), {"identity": "x", "directory": tmp_path, "name": "a test calibration"})()
    monkeypatch.setattr(tm, "load_calibration", lambda *a, **k: cal)
    monkeypatch.setattr(tm, "speed_moved", lambda c, now=None: None)
    monkeypatch.setattr(tm, "modelled_cases", lambda c, d=None: {case: dict(modelled=True, run_ids=[runs[0]],
                                                                            median=0.01, max=0.02)})
    monkeypatch.setattr(tm, "record_prediction", lambda cfg, probed=None, cal=None: {"step_time": 0.105})
    kept = tm.predict_records(tmp_path / "job.jsonl", tmp_path)
    assert set(kept) == {runs[1]}
    shown = json.loads((tmp_path / "job.predictions.json").read_text())
    assert "scored this very run" in shown[runs[0]]["not_modelled"]
    # the calibration's own runs (its calibration-runs*.jsonl) are left out of a validation
    (tmp_path / "calibration-runs.jsonl").write_text((tmp_path / "job.jsonl").read_text().splitlines()[0] + "\n")
    assert tm.calibration_run_ids(cal) == {runs[0]}


def test_a_systems_math_factor_is_fitted_per_model_where_its_runs_span_several(tmp_path):
    """Runs of two models whose math ours runs at different factors of the profile's (tiny's below it,
    cpu-small's above: what this host's calibration runs show): each model's factor is the one that fits
    its runs best at the overheads of all the runs, and predicts them closer than the one factor of all
    the runs; where one factor holds for both models (torch_pipe) each model's is it; a model without
    runs takes what all the runs fitted; the factors survive the calibration file."""
    from contract.registry import get_system
    from predict.from_config import spec_from_config
    from predict.host_load import cores_with_background
    from predict.this_machine import PROFILED, Calibration, LocalRun, fit_calibration, model_key, shape_key
    from runners.record import build_record
    from runners.request import build_parser, config_from_args
    from workload.configs import get_model_config

    factor = {"tiny": 0.85, "cpu-small": 1.2}
    truth = {"torch_pipe": Overheads(step=0.004, compute=1.2), "ours": Overheads()}
    runs = (LocalRun("torch_pipe", "tiny", batch=2), LocalRun("torch_pipe", "tiny", batch=4),
            LocalRun("torch_pipe", "cpu-small", seq=64, batch=2), LocalRun("torch_pipe", "cpu-small", seq=64, batch=4),
            LocalRun("ours", "tiny", n_slices=1), LocalRun("ours", "tiny", n_slices=4),
            LocalRun("ours", "cpu-small", seq=64, n_slices=2), LocalRun("ours", "cpu-small", seq=64, batch=4))
    prof = synthetic_profile()
    for m in [r.shape() for r in runs] + [m for m, _ in PROFILED]:
        (tmp_path / f"profile-{shape_key(m)}.json").write_text(json.dumps(prof))
    (tmp_path / "stall-probe.json").write_text(json.dumps({"stall_bytes": 0.0, "message_latency": None}))
    link, cores = local_link("none", (1e-4, 1e9)), cores_with_background(2.0, 0.0)
    specs, measured = {}, {}
    with open(tmp_path / "calibration-runs.jsonl", "w") as out:
        for r in runs:
            args = build_parser().parse_args(r.argv(tmp_path / "x.jsonl", 2, 1)[3:])
            cfg = config_from_args(args, get_system(r.system))
            specs[r] = spec_from_config(cfg, link)
            made = {**truth, "ours": Overheads(compute=factor[r.model])}
            measured[r] = predict(specs[r], CpuCompute(prof, made), cores).step_time
            rec = build_record(cfg, get_system(r.system), "ok", None, None, {})
            rec.median_step_time = measured[r]
            out.write(rec.to_json() + "\n")
    cal = fit_calibration(runs, tmp_path, speed=0.1, log=lambda *_: None)
    own = {m: cal.model_overhead[model_key(get_model_config(m))] for m in factor}
    for m in factor:
        assert own[m]["torch_pipe"]["compute"] == pytest.approx(1.2, rel=0.02)
    assert cal.overhead["torch_pipe"].step == pytest.approx(0.004, rel=0.05)

    def squares(m: str, overheads: Overheads) -> float:  # ours' runs of model m: their squared relative errors
        return sum((predict(specs[r], CpuCompute(prof, {"ours": overheads}), cores).step_time / measured[r] - 1) ** 2
                   for r in runs if r.system == "ours" and r.model == m)

    for m in factor:
        best = own[m]["ours"]["compute"]
        fitted = dataclasses.replace(cal.overhead["ours"], compute=best)
        assert squares(m, fitted) < squares(m, cal.overhead["ours"])  # closer than one factor of all the runs
        assert squares(m, fitted) < min(squares(m, dataclasses.replace(fitted, compute=best * k)) for k in (0.98, 1.02))
    assert own["tiny"]["ours"]["compute"] < own["cpu-small"]["ours"]["compute"]
    small = get_model_config("cpu-small")
    assert cal.overheads_for(small)["ours"].compute == own["cpu-small"]["ours"]["compute"]
    other = get_model_config("gpt3-xl")  # no run of its width: what all ours' runs fitted
    assert cal.overheads_for(other)["ours"] == cal.overhead["ours"]
    kept = Calibration.from_json(json.loads((tmp_path / "calibration.json").read_text()), tmp_path)
    assert kept.overheads_for(small) == cal.overheads_for(small)
    assert kept.compute(small.with_overrides(seq_len=64)).overheads("ours") == cal.overheads_for(small)["ours"]


def test_a_gpt_profile_is_never_read_for_llama(tmp_path):
    """Profiles are found by the planner's shape names: llama-cpu-small has cpu-small's width, heads and
    vocabulary but its own layers (grouped key/value heads, SwiGLU), so cpu-small's profile does not cover
    it; its own does, at any shorter sequence."""
    from predict.this_machine import find_profile, shape_key
    from workload.configs import get_model_config

    gpt, llama = get_model_config("cpu-small"), get_model_config("llama-cpu-small")
    (tmp_path / f"profile-{shape_key(gpt.with_overrides(seq_len=4096))}.json").write_text('{"of": "gpt"}')
    assert find_profile(gpt, tmp_path) == {"of": "gpt"}
    with pytest.raises(FileNotFoundError, match="no profile covers llama-"):
        find_profile(llama, tmp_path)
    (tmp_path / f"profile-{shape_key(llama.with_overrides(seq_len=4096))}.json").write_text('{"of": "llama"}')
    assert find_profile(llama.with_overrides(seq_len=2048), tmp_path) == {"of": "llama"}
    assert find_profile(gpt, tmp_path) == {"of": "gpt"}


def test_predictions_are_judged_by_the_hosts_speed_during_their_sweep(tmp_path, monkeypatch):
    """A sweep's speed probes (OUT.speed) within an hour of its records: their median is the host's speed
    the predictions are judged by (one 20 % slow: refused, saying so; the probe now is not asked); a probe
    of another time is not theirs, and without any the probe now decides."""
    from predict import this_machine as tm
    from runners.record import append_record, build_record
    from runners.request import parse_request
    from runners.sweep.execute import speed_probes_path

    cfg, spec = parse_request(["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2",
                               "--micro-batch-size", "1", "--n-slices", "2"])
    rec = build_record(cfg, spec, "ok", None, None, {"device_kind": "cpu"})
    rec.median_step_time = 0.1
    records = tmp_path / "job.jsonl"
    append_record(records, rec)
    cal = tm.Calibration({}, (1e-4, 1e9), (1.0, 2.0), identity={"host": "h", "code": "c", "speed_tflops": 0.1},
                         directory=tmp_path)
    monkeypatch.setattr(tm, "load_calibration", lambda *a, **k: cal)
    asked = []
    monkeypatch.setattr(tm, "speed_probe", lambda: asked.append(1) or 0.1)
    import datetime

    when = datetime.datetime.fromisoformat(json.loads(records.read_text())["timestamp"]).timestamp()
    tm.keep_speed(speed_probes_path(records), 0.08)  # what the file holds: when (now, here), speed, label
    assert set(json.loads(speed_probes_path(records).read_text())) == {"when", "speed_tflops", "label"}
    speed_probes_path(records).write_text("".join(  # the sweep's, and one of five hours before: not theirs
        json.dumps({"when": t, "speed_tflops": v, "label": ""}) + "\n"
        for t, v in [(when - 60, 0.08), (when + 60, 0.08), (when + 30, 0.1), (when - 5 * 3600, 0.1)]))
    assert sorted(tm.speeds_during(records, [json.loads(records.read_text())])) == [0.08, 0.08, 0.1]
    said: list[str] = []
    assert tm.predict_records(records, tmp_path, log=said.append) == {}
    assert not asked
    assert any("median of the 3 probes its sweep took: 80.0 GFLOP/s" in line for line in said)
    assert any("not predicting" in line and "during the runs, this host runs at 0.80x" in line for line in said)
    speed_probes_path(records).unlink()
    said.clear()
    tm.predict_records(records, tmp_path, log=said.append)
    assert asked and not any("during the runs" in line for line in said)

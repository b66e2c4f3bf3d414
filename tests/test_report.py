import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reporting import render
from contract import RunConfig
from runners.record import append_record, build_record
from contract.registry import get_system
from contract.records import read_records
from tests.conftest import REPO
from workload.configs import get_model_config


def _rec(system="megatron", tp=1, pp=1, dp=1, mb=1, status="ok", t=1.0, network="none"):
    spec = get_system(system)
    cfg = RunConfig(system=system, model=get_model_config("gpt3-xl"), batch_size=64, micro_batch_size=mb, pp=pp, tp=tp,
                    dp=dp, network=network, options=spec.options())
    n = pp * tp * dp
    ranks = None
    if status == "ok":
        ranks = [{"rank": r, "step_times": [t] * 3, "losses": [1.0] * 3 if r == n - 1 else None,
                  "dp_sync_times": [0.0] * 3,
                  "gpu_memory": [{"device": "cuda:0", "allocated_bytes": 1 << 30, "reserved_bytes": 1 << 30}],
                  "cpu_rss_bytes": 1 << 28, "extra": {}, "hostname": "h", "device": "cuda:0",
                  "device_name": "Tesla V100-SXM2-16GB", "backend": "nccl", "peak_tflops": 15.7,
                  "peak_source": "table:fp32"}
                 for r in range(n)]
    return build_record(cfg, spec, status, None if status == "ok" else "CUDA out of memory", ranks,
                        {"torch_version": "2.13", "device_kind": "cuda", "device_name": "Tesla V100-SXM2-16GB",
                         "device_count": n})


def _reps(spread=0.02, **kw) -> list[dict]:
    """Three repetitions of one run: its step time t, and t less and more ``spread``."""
    t = kw.pop("t", 1.0)
    return [_rec(t=t * f, **kw).__dict__ for f in (1 - spread, 1.0, 1 + spread)]


def _round_robin(*runs: list[dict]) -> list[dict]:
    """The runs' repetitions in the order a sweep launches them: one of each, round after round."""
    return [rec for round_ in zip(*runs) for rec in round_]


def test_layout_table_like_the_seed():
    recs = [_rec(tp=8, t=25.0), _rec(pp=8, t=19.71), _rec(tp=4, pp=2, t=20.64), _rec(tp=2, pp=4, t=20.81),
            _rec(tp=8, mb=16, status="oom"), _rec(pp=8, mb=16, status="error")]
    text = render([r.__dict__ for r in recs])
    header = next(l for l in text.splitlines() if "Micro batch size" in l)
    for col in ("T-8", "P-8", "T-4 P-2", "T-2 P-4"):
        assert col in header
    assert "19.71 s" in text and "Fail (OOM)" in text and "Fail (error)" in text
    assert "precision: fp32" in text and "batch: 64 per pipeline" in text


def test_network_table_like_the_seed():
    recs = []
    for net, t1, t4 in [("default", 15.16, 16.17), ("d10-1g", 22.9, 33.39), ("d1-5g", 15.49, 17.55)]:
        recs += [_rec(system="ours", pp=12, network=net, t=t1), _rec(system="ours", pp=12, dp=4, network=net, t=t4)]
    text = render([r.__dict__ for r in recs])
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if "Network setting" in l)
    table = lines[start:start + 5]
    assert "P-12 D-4" in table[0] and "33.39 s" in "\n".join(table)
    # rows are ordered by delay: default first, then 1 ms, then 10 ms
    order = [l.split("|")[1] for l in table[2:5]]
    assert "1ms" in order[1] and "10ms" in order[2], order


def test_cli_reads_a_directory_and_writes_the_report(tmp_path):
    append_record(tmp_path / "a.jsonl", _rec(pp=8, t=19.71))
    append_record(tmp_path / "b.jsonl", _rec(pp=8, mb=2, status="timeout"))
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "report.py", str(tmp_path), "--out", str(out)], cwd=REPO,
                          capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "19.71 s" in out.read_text() and "Fail (timeout)" in out.read_text()
    bad = subprocess.run([sys.executable, "report.py", str(tmp_path / "missing")], cwd=REPO, capture_output=True,
                         text=True)
    assert bad.returncode == 2


def _with(rec, **config):
    """The record as another config would have made it (a different run: another identity key)."""
    d = dict(rec.__dict__)
    d["config"] = {**d["config"], **config}
    d["key"] = d["key"] + json.dumps(config, sort_keys=True)
    return d


def test_a_cell_shows_only_runs_of_its_exact_config():
    """An ok run is not masked by a later failed run of another config (more steps): they go to
    tables of their own, each headed by its steps."""
    ok = [_rec(pp=8, t=19.71).__dict__, _rec(tp=8, t=25.0).__dict__]
    failed = [_with(_rec(pp=8, status="error"), steps=20), _with(_rec(tp=8, t=24.0), steps=20)]
    text = render(ok + failed)
    tables = text.split("### ")[1:]
    first = next(t for t in tables if "3 measured steps (10 configured)" in t)  # as recorded: 3 step times
    second = next(t for t in tables if "3 measured steps (20 configured)" in t)
    assert "19.71 s" in first and "25.00 s" in first and "Fail" not in first
    assert "Fail (error)" in second and "24.00 s" in second


def test_runs_that_differ_in_an_option_get_columns_of_their_own():
    a = _rec(system="ours", pp=2, t=2.0)
    b = _rec(system="ours", pp=2, t=1.5)
    b.config = {**b.config, "options": {**b.config["options"], "n_slices": 8}}
    b.key = b.key + "K8"
    text = render([a.__dict__, b.__dict__, _rec(system="torch_pipe", pp=2, t=3.0).__dict__])
    header = next(l for l in text.splitlines() if "Micro batch size" in l)
    assert "ours P-2 (n_slices auto)" in header and "ours P-2 (n_slices 8)" in header


def test_a_record_from_before_an_option_shows_the_value_it_ran_with():
    new = _rec(system="ours", pp=2, t=1.5)
    old = _rec(system="ours", pp=2, t=2.0)
    old.config = {**old.config, "options": {k: v for k, v in old.config["options"].items() if k != "schedule"}}
    old.key = old.key + "old"
    header = next(l for l in render([old.__dict__, new.__dict__]).splitlines() if "Micro batch size" in l)
    assert "ours P-2 (schedule gpipe)" in header and "ours P-2 (schedule 1f1b)" in header


def test_the_report_answers_first_and_has_no_single_cell_table():
    recs = _round_robin(*(_reps(system=system, pp=12, network=net, t=t) for net, tt in
                          (("default", (10.0, 15.16)), ("d10-1g", (14.0, 22.9)))
                          for system, t in zip(("ours", "torch_pipe"), tt)))
    recs += [_rec(pp=8, t=19.71).__dict__]  # alone in its table: only in the table of every run
    text = render(recs)
    assert text.index("## Summary") < text.index("### ")
    assert "ours `ours P-12` 10.00 s ±2 % against the best baseline `torch_pipe gpipe P-12` 15.16 s ±2 %: " \
           "**1.52x** faster (1.52-1.52x, min-max of 3 pairs: 1.52, 1.52, 1.52)" in text
    for table in text.split("### ")[1:]:
        rows = [l for l in table.splitlines() if l.startswith("|")][2:]
        cells = [c for l in rows for c in l.split("|")[2:-1]]
        assert len(cells) > 1, table
    assert "19.71 s" in text.split("## Every run")[1]


def test_the_summary_races_runs_of_the_same_device_count():
    recs = _round_robin(_reps(system="ours", pp=2, network="d10-1g", t=0.6),
                        _reps(system="torch_pipe", pp=2, network="d10-1g", t=0.8),
                        _reps(system="ours", pp=2, dp=2, network="d10-1g", t=1.5),
                        _reps(system="torch_pipe", pp=2, dp=2, network="d10-1g", t=3.0))
    summary = render(recs).split("## Summary")[1].split("\n## ")[0]
    two = next(l for l in summary.splitlines() if "pipeline, 2 devices" in l)
    four = next(l for l in summary.splitlines() if "pipeline + data-parallel, 4 devices" in l)
    assert "against the best baseline `torch_pipe gpipe P-2` 0.800 s ±2 %: **1.33x** faster" in two
    assert "P-2 D-2` 1.50 s ±2 % against the best baseline `torch_pipe gpipe P-2 D-2` 3.00 s ±2 %: **2.00x** faster" \
        in four


def test_repetitions_combine_into_a_median_and_an_interval():
    recs = [_rec(pp=8, t=t).__dict__ for t in (1.0, 1.2, 1.1)] + _reps(tp=8, t=2.0, spread=0.0)
    text = render(recs)
    layout = text.split("### ")[1]
    assert "1.10 s ±10 %" in layout and "2.00 s ±0 %" in layout
    assert "min-max" in text.split("## Summary")[1]  # the summary states which interval
    every = text.split("## Every run")[1]
    assert "1.10 s ±10 %" in every and re.search(r"\| +3 \| 1.10 s", every)  # one line per run, its repetitions
    single = render([_rec(pp=8, t=1.0).__dict__, _rec(system="torch_pipe", pp=8, t=3.0).__dict__])
    assert "1.00 s (1 run)" in single and "no claim: one pair of neighbouring launches, no interval" in single
    assert "fastest" not in single.split("## Summary")[1].split("###")[0].replace("no fastest", "")


def test_the_summary_names_a_winner_only_where_the_intervals_separate():
    ours, pipe = _reps(system="ours", pp=2, t=1.0, spread=0.05), _reps(system="torch_pipe", pp=2, t=1.04, spread=0.05)
    ours[0], ours[2] = ours[2], ours[0]  # neighbours whose ratios straddle 1: 0.99, 1.04, 1.09
    summary = render(_round_robin(ours, pipe)).split("## Summary")[1].split("\n## ")[0]
    line = next(l for l in summary.splitlines() if "micro-batch 1" in l)
    assert "no difference beyond noise (paired: 1.04x (0.94-1.15x, min-max of 3 pairs: 0.94, 1.04, 1.15))" in line, line
    assert "faster" not in line and "slower" not in line
    recs = _round_robin(_reps(system="ours", pp=2, t=1.3, spread=0.05),
                        _reps(system="torch_pipe", pp=2, t=1.0, spread=0.05))
    line = next(l for l in render(recs).splitlines() if "micro-batch 1" in l)
    assert "**1.30x** slower (1.30-1.30x; paired: 0.77x (0.77-0.77x, min-max of 3 pairs: 0.77, 0.77, 0.77))" in line


def test_no_comparison_is_drawn_from_an_oversubscribed_run():
    crowded = {"threads": 12, "ranks": 12, "cores": 2, "machines": 1}
    recs = [{**r, "oversubscribed": crowded} for r in _reps(system="ours", pp=12, network="d10-1g", t=1.0)]
    recs += [{**r, "oversubscribed": crowded} for r in _reps(system="torch_pipe", pp=12, network="d10-1g", t=2.0)]
    text = render(recs)
    line = next(l for l in text.split("## Summary")[1].splitlines() if "10ms" in l)
    assert "faster" not in line and "fastest" not in line
    assert "no comparison from `ours P-12`, `torch_pipe gpipe P-12`: its ranks outnumbered the cores they had " \
           "(12 ranks on 2 cores)" in line
    table = text.split("### ")[1]
    assert "1.00 s ±2 % (oversubscribed)" in table and "2.00 s ±2 % (oversubscribed)" in table
    assert "12 ranks on 2 cores" in text.split("## Every run")[1]


def test_a_line_that_is_not_a_record_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, _rec(pp=8, t=19.71))
    with open(path, "a") as f:
        f.write('{"a": 1}\nnot json\n')
    proc = subprocess.run([sys.executable, "report.py", str(path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "19.71 s" in proc.stdout
    assert "r.jsonl:2: not a run record" in proc.stderr and "r.jsonl:3: not JSON" in proc.stderr


def test_every_run_shows_the_ranks_busy_share():
    gpu = _rec(system="torch_pipe", pp=2, t=2.0)
    cpu = _rec(system="ours", pp=2, t=1.0)
    cpu.busy_fraction = [0.862, 0.951]
    table = render([gpu.__dict__, cpu.__dict__]).split("## Every run")[1]
    header = next(l for l in table.splitlines() if l.startswith("|"))
    assert "busy per rank" in header
    ours_row = next(l for l in table.splitlines() if l.startswith("| ours"))
    pipe_row = next(l for l in table.splitlines() if l.startswith("| torch_pipe"))
    col = [c.strip() for c in header.split("|")].index("busy per rank")
    assert ours_row.split("|")[col].strip() == "86%-95%" and pipe_row.split("|")[col].strip() == ""  # GPU: no share


def test_older_records_without_the_network_setting_read_it_from_their_emulation():
    recs = []
    for net, t in (("d10-1g", 2.0), ("d1-5g", 1.2)):
        for system, pp in (("ours", 12), ("torch_pipe", 12)):
            d = _rec(system=system, pp=pp, network=net, t=t).__dict__
            setting = d.pop("network_setting")  # as the run command wrote records before it kept the setting
            d["environment"]["network"] = {"profile": {"name": net, "label": setting["label"], "kind": "uniform",
                                                       "link": {k: setting[k] for k in ("delay_ms", "bandwidth_gbps")}}}
            recs.append(d)
    assert render(recs) == render([_rec(system=s, pp=12, network=n, t=t).__dict__
                                   for n, t in (("d10-1g", 2.0), ("d1-5g", 1.2)) for s in ("ours", "torch_pipe")])
    bare = {k: v for k, v in recs[0].items() if k not in ("environment",)}
    assert "d10-1g" in render([bare, {**bare, "system": "torch_pipe", "label": "torch_pipe", "key": "other"}])


def test_the_rest_of_a_runs_identity_is_stated_where_it_is_not_runconfigs_default():
    from workload.configs import OptimizerConfig

    plain = [_rec(pp=8, t=19.71).__dict__, _rec(tp=8, t=25.0).__dict__]
    assert "seed" not in render(plain) and " lr " not in render(plain)
    changed = []
    for r in plain:
        cfg = RunConfig.from_dict(r["config"], get_system("megatron").options)
        cfg = cfg.replace(seed=3, optimizer=OptimizerConfig(kind="sgd", lr=1e-3))
        changed.append({**r, "config": cfg.to_dict(), "key": cfg.key()})
    assert "seed 3, sgd lr 0.001" in render(changed)


def test_the_report_never_writes_over_what_it_reads(tmp_path, capsys):
    """Issue #31, item 1: report.py F.jsonl --out F.jsonl overwrote its 3 records with markdown."""
    from report import main

    records = tmp_path / "F.jsonl"
    for t in (19.71, 20.0, 21.0):
        append_record(records, _rec(pp=8, t=t))
    before = records.read_text()
    other = tmp_path / "other.jsonl"
    append_record(other, _rec(tp=8, t=25.0))
    (tmp_path / "link.md").symlink_to(records)
    for out, message in ((records, "which the report reads"), (tmp_path / "link.md", "which the report reads"),
                         (tmp_path / "F.predictions.json", None), (other, "holds run records"),
                         (tmp_path, "is a directory, not a file")):
        if message is None:  # the predictions kept beside an input are read too
            out.write_text("{}")
            message = "which the report reads"
        assert main([str(records), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main([str(tmp_path), "--out", str(tmp_path / "sub" / "x.jsonl")]) == 0  # not yet a file of records
    assert main([str(tmp_path / "sub"), "--out", str(tmp_path / "sub" / "x.jsonl")]) == 2  # now an input
    assert records.read_text() == before and len(read_records(other)) == 1


def test_an_output_that_cannot_be_written_is_refused_before_the_report_is_made(tmp_path, capsys):
    """``--out`` or ``--plots`` where no file can be made (under a file, a virtual file system) was a
    traceback after the whole report was rendered; now one line and exit status 2, nothing written.
    A directory that does not exist yet is made, as before."""
    from report import main

    records = tmp_path / "F.jsonl"
    append_record(records, _rec(pp=8, t=19.71))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = [("--out", str(blocker / "sub" / "x.md"), f"{blocker} is not a directory"),
             ("--plots", str(blocker / "plots"), f"{blocker} is not a directory")]
    if Path("/proc").is_dir():  # a file system that takes no new file, even from root
        cases.append(("--out", "/proc/pipebench-report.md", "cannot write in /proc"))
    for flag, out, message in cases:
        assert main([str(records), flag, out]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and f"{flag} {out}: {message}" in err[0], err
        assert captured.out == ""  # refused before the report was made
    made = tmp_path / "new" / "dir" / "x.md"
    assert main([str(records), "--out", str(made)]) == 0 and made.is_file()
    assert not list(tmp_path.rglob(".write-check-*"))


def test_malformed_fields_are_left_out_with_a_warning_naming_file_and_line(tmp_path, capsys):
    """Issue #31, item 8: a median step time that is NaN or text crashed the report; a record without
    one showed as an ok cell holding only its prediction."""
    from report import main

    path = tmp_path / "r.jsonl"
    append_record(path, _rec(tp=8, t=25.0))
    for value in (float("nan"), "fast", None):
        d = _rec(pp=8, t=19.71).__dict__
        if value is None:
            del d["median_step_time"]
        else:
            d["median_step_time"] = value
        with open(path, "a") as f:
            f.write(json.dumps(d) + "\n")
    (tmp_path / "r.predictions.json").write_text(json.dumps({d["run_id"]: {"step_time": 0.046},
                                                             "other": {"step_time": "soon"}}))
    assert main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}:2: field median_step_time left out (nan is not a finite number)" in err
    assert f'{path}:3: field median_step_time left out ("fast" is not a finite number)' in err
    assert f"{path}:4: an ok record without a median_step_time" in err
    assert "the prediction of run other left out (no finite step_time)" in err and "Traceback" not in err
    assert "ok, no step time (pred 0.046)" in out and "only `megatron T-8` 25.00 s (1 run) to compare" in out


def test_records_of_one_config_on_different_hardware_never_share_a_cell(tmp_path):
    """Issue #31, item 5: a newer record with device_kind cuda replaced the CPU measurement in its cell,
    and with only device_kind edited it sat in the "hardware: cpu" table and was called fastest."""
    def run(system, pp, t, kind="cpu", timestamp="2025-01-01T00:00:00+00:00"):
        d = _rec(system=system, pp=pp, t=t).__dict__
        d["environment"] = {**d["environment"], "device_kind": kind, "device_name": "cpu"}
        return {**d, "timestamp": timestamp}

    cpu, baseline = run("ours", 2, 0.3), run("torch_pipe", 2, 0.4)
    gpu = {**run("ours", 2, 0.01, kind="cuda", timestamp="2025-01-02T00:00:00+00:00"), "key": cpu["key"]}
    text = render([cpu, baseline, gpu])
    cpu_table = next(t for t in text.split("## Every run")[0].split("### ")[1:] if "hardware: cpu;" in t)
    assert "0.300 s" in cpu_table and "0.010 s" not in cpu_table
    assert "`ours P-2` 0.300 s (1 run)" in text.split("## Every run")[0] and "0.010 s" in text.split("## Every run")[1]


def test_runs_under_one_matrix_file_with_other_contents_are_rows_of_their_own(tmp_path, capsys):
    """Issue #31, items 3 and 4: the 5 ms and the 40 ms runs of one edited net.json shared a row, and
    a heterogeneous matrix was plotted at its link 0 -> 1 (0.1 ms)."""
    from reporting import plot_networks, to_frame

    def under(matrix: dict, t: float, system: str = "ours"):
        d = _rec(system=system, pp=2, network="net.json", t=t).__dict__
        cfg = RunConfig.from_dict(d["config"], get_system(system).options).replace(network_matrix=matrix)
        return {**d, **{k: v for k, v in build_record(cfg, get_system(system), "ok", None, None, {}).__dict__.items()
                        if k in ("config", "key", "network_setting")}}

    def uniform(delay, gbps):
        return {"delay_ms": [[0, delay], [delay, 0]], "bandwidth_gbps": [[0, gbps], [gbps, 0]]}

    hetero = {"delay_ms": [[0, 0.1], [67, 0]], "bandwidth_gbps": [[0, 10], [0.79, 0]]}
    recs = [under(uniform(5, 1), 0.2), under(uniform(5, 1), 0.3, "torch_pipe"), under(uniform(40, 0.1), 0.9),
            under(uniform(40, 0.1), 1.2, "torch_pipe"), under(hetero, 0.5), under(hetero, 0.7, "torch_pipe")]
    text = render(recs)
    table = text.split("### Step time by network setting")[1].split("## Every run")[0]
    rows = [l for l in table.splitlines() if l.startswith("| net.json")]
    assert len(rows) == 3, table
    assert "net.json (2 hosts, 5 ms, 1 Gbit/s) [" in rows[0] and "0.200 s" in rows[0] and "0.900 s" not in rows[0]
    assert "net.json (2 hosts, 40 ms, 0.1 Gbit/s) [" in rows[1] and "0.900 s" in rows[1]
    assert "net.json (2 hosts, 0.1-67 ms, 0.79-10 Gbit/s) [" in rows[2]  # ordered by its slowest link
    paths = plot_networks(to_frame(recs), tmp_path / "plots")
    assert len(paths) == 1 and "plot: left out net.json (2 hosts, 0.1-67 ms" in capsys.readouterr().err


def test_cpu_and_gpu_records_of_one_config_are_different_runs():
    """Issue #31, item 5, with the hardware in the run's identity (RunConfig.hardware): the record of
    a run on a GPU is not the newest record of its CPU run, and never sits in a CPU table."""
    def run(system: str, t: float, hardware: str):
        spec = get_system(system)
        cfg = RunConfig(system=system, model=get_model_config("tiny"), batch_size=2, micro_batch_size=1, pp=2,
                        options=spec.options(), hardware=hardware)
        kind, _, name = hardware.partition(":")
        ranks = [{"rank": r, "step_times": [t] * 3, "losses": [1.0] * 3 if r == 1 else None, "dp_sync_times": [0.0] * 3,
                  "gpu_memory": [], "cpu_rss_bytes": 1 << 28, "extra": {}, "hostname": "h",
                  "device": "cpu" if kind == "cpu" else f"cuda:{r}", "device_name": name or "cpu",
                  "backend": "gloo" if kind == "cpu" else "nccl", "peak_tflops": 1.0, "peak_source": "x"}
                 for r in range(2)]
        return build_record(cfg, spec, "ok", None, ranks, {}).__dict__

    cpu, gpu = run("ours", 0.3, "cpu"), run("ours", 0.01, "cuda:NVIDIA H100 80GB HBM3")
    assert cpu["key"] != gpu["key"]
    text = render([cpu, run("torch_pipe", 0.4, "cpu"), gpu, run("torch_pipe", 0.02, "cuda:NVIDIA H100 80GB HBM3")])
    tables = text.split("## Every run")[0].split("### ")[1:]
    on_cpu = next(t for t in tables if "hardware: cpu;" in t)
    on_gpu = next(t for t in tables if "hardware: cuda: NVIDIA H100 80GB HBM3;" in t)
    assert "0.300 s" in on_cpu and "0.010 s" not in on_cpu and "0.010 s" in on_gpu and "0.300 s" not in on_gpu


def test_the_report_prints_the_commits_of_its_records_and_warns_where_they_differ():
    recs = _reps()
    text = render(recs)
    commit = recs[0]["environment"]["git_commit"]
    assert f"Made by: commit {commit[:12]}" in text and "torch 2.13" in text
    recs[0]["environment"] = {**recs[0]["environment"], "git_commit": "f" * 40, "git_dirty": True}
    recs[1]["environment"] = {k: v for k, v in recs[1]["environment"].items() if k not in ("git_commit", "versions")}
    text = render(recs)
    assert "**Warning**: the records come from 3 commits: " in text
    assert "commit ffffffffffff (dirty) (1 record)" in text and "no commit recorded (1 record)" in text
    assert "**Warning**: the records come from 2 sets of versions" in text


def test_the_summary_claims_like_for_like_only():
    """Pipelines with pipelines, tensor parallelism with tensor parallelism, each on as many devices
    (fairscale's P-2, one process on CPU, is a 2-device pipeline); diloco never by step time. The
    faster tensor-parallel ours T-2 is never claimed against a pipeline."""
    recs = _round_robin(_reps(system="ours", tp=2, t=0.6), _reps(system="megatron", tp=2, t=0.9),
                        _reps(system="ours", pp=2, t=0.8), _reps(system="torch_pipe", pp=2, t=0.85),
                        _reps(system="fairscale_fsdp", pp=2, t=1.0), _reps(system="diloco", dp=2, t=0.3))
    for r in recs:
        if r["system"] == "fairscale_fsdp":
            r["environment"]["device_count"] = 1  # one process on CPU
    summary = render(recs).split("## Summary")[1].split("\n## ")[0]
    lines = [l for l in summary.splitlines() if l.startswith("  - ")]
    tensor = next(l for l in lines if ", tensor, 2 devices:" in l)
    pipeline = next(l for l in lines if ", pipeline, 2 devices:" in l)
    assert "`ours T-2`" in tensor and "`megatron T-2`" in tensor and "P-2" not in tensor
    assert "**1.50x** faster" in tensor
    assert "`ours P-2`" in pipeline and "`torch_pipe gpipe P-2`" in pipeline and "`fairscale_fsdp P-2`" in pipeline
    assert "T-2" not in pipeline and "diloco" not in pipeline
    assert "against the best baseline `torch_pipe gpipe P-2` 0.850 s ±2 %: **1.06x** faster" in pipeline
    (slow_method,) = [l for l in lines if "diloco" in l]
    assert "not compared by step time" in slow_method and "faster" not in slow_method
    assert not any("1 device" in l for l in lines)
    assert "across kinds the tables show the runs side by side, with no claim" in summary


def test_a_sweep_of_four_repeats_claims_from_paired_launches():
    """The host drifts by a quarter over four rounds: each run's own interval is wide and the two overlap,
    but the neighbours' ratio holds (1.30 within 2 %), and the claim comes from it."""
    drift = (1.0, 1.25, 0.85, 1.1)
    ours = [_rec(system="ours", pp=2, t=1.0 * d).__dict__ for d in drift]
    pipe = [_rec(system="torch_pipe", pp=2, t=1.3 * d * e).__dict__ for d, e in zip(drift, (1.0, 1.02, 0.99, 1.01))]
    text = render(_round_robin(ours, pipe))
    cells = text.split("### ")[1]
    assert "1.05 s ±20 %" in cells and "1.37 s ±21 %" in cells  # each run's own min-max: they overlap
    line = next(l for l in text.split("## Summary")[1].splitlines() if "pipeline, 2 devices" in l)
    assert "**1.31x** faster (1.29-1.33x, min-max of 4 pairs: 1.30, 1.33, 1.29, 1.31)" in line, line


def test_loss_and_faults_are_rows_and_headings_of_their_own():
    """A lossy link is a row after the same link without loss; a straggler's runs a table of their own."""
    recs = [_rec(system="ours", pp=2, network=net, t=t) for net, t in
            [("delay 10ms bandwidth 1Gbps loss 1%", 3.0), ("delay 10ms bandwidth 1Gbps", 2.0),
             ("delay 10ms bandwidth 1Gbps loss 0.1%", 2.5)]]
    text = render([r.__dict__ for r in recs])
    rows = [l for l in text.splitlines() if l.startswith("| delay 10ms")]
    assert [" ".join(r.split("|")[1].split()) for r in rows] == [
        "delay 10ms bandwidth 1Gbps", "delay 10ms bandwidth 1Gbps loss 0.1%",
        "delay 10ms bandwidth 1Gbps loss 1%"], rows
    slow = _rec(system="ours", pp=2, network="delay 10ms bandwidth 1Gbps", t=4.0).__dict__
    cfg = RunConfig.from_dict(slow["config"], get_system("ours").options).replace(slow_rank="1:2")
    text = render([recs[1].__dict__, {**slow, "config": cfg.to_dict(), "key": cfg.key()}])
    assert "| faults " in text and "rank 1 2x slower" in text
    assert "| faults " not in render([r.__dict__ for r in recs])  # no column where no run has faults


def test_a_directory_is_read_for_run_records_only(tmp_path, capsys):
    """Issue #54, item 21: the report on results/ warned ten lines about each of the project's own files
    that hold no run record (a probe's loads, a study's samples). A file named on the command line is
    still read as records, and each line that is not one is told."""
    from report import main

    append_record(tmp_path / "runs.jsonl", _rec(pp=8, t=19.71))
    (tmp_path / "spread.jsonl").write_text("".join(json.dumps({"case": "reference", "seed": s}) + "\n"
                                                   for s in range(30)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "loads.jsonl").write_text('{"load": 1.5}\n' * 20)
    (tmp_path / "empty.jsonl").write_text("")
    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "19.71 s" in out
    told = [line for line in err.splitlines() if not line.startswith("report.py: warning: ")]  # provenance's
    assert told == [f"report.py: skipped 2 files that hold no run record: {tmp_path / 'spread.jsonl'}, "
                                f"{tmp_path / 'sub' / 'loads.jsonl'}"]
    assert main([str(tmp_path / "spread.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "spread.jsonl:1: not a run record" in err and "hold no run record" not in err


def test_claims_are_made_within_one_commit():
    """Issue #54, item 21: records of 7 commits were pooled into one claim, with a warning only. Each
    commit's records are tables and claims of their own, and the summary says which commit a claim is of."""
    def of(commit: str, recs: list[dict]) -> list[dict]:
        for r in recs:
            r["environment"] = {**r["environment"], "git_commit": commit * 40, "git_dirty": False}
        return recs

    older = of("a", _round_robin(_reps(system="ours", pp=2, t=1.0), _reps(system="torch_pipe", pp=2, t=1.3)))
    newer = of("b", _round_robin(_reps(system="ours", pp=2, t=1.3), _reps(system="torch_pipe", pp=2, t=1.0)))
    assert ("Every claim is of the records' one code version (commit aaaaaaaaaaaa)."
            in render(older).split("## Summary")[1])
    text = render(older + newer)
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert ("The records come from 2 code versions (commit aaaaaaaaaaaa, commit bbbbbbbbbbbb): claims are made per "
            "commit, never across two") in summary
    blocks = summary.split("- **Layouts**, ")[1:]
    assert len(blocks) == 2
    a = next(b for b in blocks if "; code: commit aaaaaaaaaaaa:" in b)
    b = next(b for b in blocks if "; code: commit bbbbbbbbbbbb:" in b)
    assert "ours `ours P-2` 1.00 s ±2 % against the best baseline `torch_pipe gpipe P-2` 1.30 s ±2 %: **1.30x** " \
           "faster" in a
    assert "ours `ours P-2` 1.30 s ±2 % against the best baseline `torch_pipe gpipe P-2` 1.00 s ±2 %: **1.30x** " \
           "slower" in b
    tables = text.split("## Layouts (no network emulation)")[1].split("## Every run")[0].split("### ")[1:]
    assert len(tables) == 2 and all(t.count("±2 %") == 2 for t in tables)  # a cell of both commits: ±25 %
    every = text.split("## Every run")[1]
    assert "| code " in every.splitlines()[4] and every.count("commit bbbbbbbbbbbb") == 2


def test_the_usage_names_the_command_typed(capsys):
    """Issue #54, item 23: through pipebench, the usage line named `python report.py`."""
    import pipebench
    from report import main

    with pytest.raises(SystemExit) as typed:
        pipebench.main(["report", "--help"])
    assert typed.value.code == 0 and capsys.readouterr().out.startswith("usage: pipebench report [-h]")
    with pytest.raises(SystemExit) as bad:
        pipebench.main(["report", "--target", "x"])
    assert bad.value.code == 2 and capsys.readouterr().err.startswith("pipebench report: error: argument --target")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python report.py [-h]")


def test_the_network_plot_draws_each_column_over_every_delay_with_its_interval(tmp_path, capsys):
    """Issue #53, item 8: one line per system and layout, a point per delay (four here), each with its
    repetitions' interval; a lossy link is not a point of the plain link at its delay."""
    from reporting import plot_networks, to_frame
    from reporting.plots import network_lines

    recs = []
    for net, t in (("default", 1.0), ("d1-5g", 1.1), ("d5-2g", 1.3), ("d10-1g", 1.6)):
        recs += _round_robin(_reps(system="ours", pp=2, network=net, t=t),
                             _reps(system="torch_pipe", pp=2, network=net, t=1.2 * t))
    recs += _reps(system="ours", pp=2, network="delay 10ms bandwidth 1Gbps loss 1%", t=3.0)
    ((_, fixed, lines, left),) = network_lines(to_frame(recs))
    assert list(lines) == ["ours P-2", "torch_pipe gpipe P-2"] and fixed["model"] == "gpt3-xl"
    ours = lines["ours P-2"]
    assert ours["delay"].tolist() == [0.1, 1.0, 5.0, 10.0] and ours["bandwidth"].tolist() == [10.0, 5.0, 2.0, 1.0]
    assert ours["median"].tolist() == pytest.approx([1.0, 1.1, 1.3, 1.6])
    assert ours["low"].tolist() == pytest.approx([0.98 * t for t in (1.0, 1.1, 1.3, 1.6)])
    assert ours["high"].tolist() == pytest.approx([1.02 * t for t in (1.0, 1.1, 1.3, 1.6)])
    assert len(left) == 1 and left[0].startswith("delay 10ms bandwidth 1Gbps loss 1%: its link loses")
    (path,) = plot_networks(to_frame(recs), tmp_path)
    assert path.stat().st_size > 0 and "plot: left out delay 10ms bandwidth 1Gbps loss 1%" in capsys.readouterr().err


@pytest.mark.parametrize("ratios, common", [((0.85, 0.9, 0.8), "faster"), ((1.1, 1.2, 1.05), "slower"),
                                            ((0.9, 1.1, 1.0), None)])
def test_the_predictions_shown_are_scored_against_the_runs_beside_them(ratios, common) -> None:
    """The report says how far the predictions it shows lie from the measured runs beside them, and names
    a shift every case shares (the host's speed since calibration) where all of them err one way."""
    layouts = [dict(tp=8, t=10.0), dict(pp=8, t=12.0), dict(tp=2, pp=4, t=14.0)]
    records = []
    for ratio, layout in zip(ratios, layouts):
        t = layout["t"]
        for rec in _reps(**layout):
            rec["prediction"] = {"step_time": t * ratio}
            records.append(rec)
    text = render(records)
    errors = sorted(r - 1 for r in ratios)
    assert (f"3 runs (each the median of its repetitions), each prediction against the run's measured step: "
            f"{errors[1] * 100:+.1f} % at the median ({errors[0] * 100:+.1f} % to {errors[-1] * 100:+.1f} %)") in text
    if common:
        assert f"Every one predicts the run {common} than it ran" in text
    else:
        assert "Every one" not in text


def test_no_prediction_shown_no_predictions_paragraph() -> None:
    assert "**Predictions**" not in render(_reps(tp=8, t=10.0))


def test_a_record_whose_counts_cannot_be_is_skipped_and_records_without_a_key_are_not_one_run(tmp_path):
    base = {k: v for k, v in _rec(pp=2, t=1.0).__dict__.items() if k not in ("key", "config", "label", "mfu")}
    odd = [{**base, "layout": {"pp": 0}}, {**base, "batch_size": -2}, {**base, "model_shape": {}},
           {**base, "micro_batch_size": True}]
    fine = [{**base, "system": "torch_pipe"}, {**base, "batch_size": 32}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in odd + fine))
    proc = subprocess.run([sys.executable, "report.py", str(path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for line, what in enumerate(("layout pp", "batch_size", "model_shape n_layer, model_shape n_embd",
                                 "micro_batch_size"), 1):
        assert f"r.jsonl:{line}: not a run record ({what}" in proc.stderr, proc.stderr
    every = proc.stdout.split("## Every run")[1]
    rows = [l for l in every.splitlines() if l.startswith("| ") and "system" not in l]
    assert len(rows) == 2 and rows[0].startswith("| torch_pipe") and "32 per pipeline" in rows[1], every

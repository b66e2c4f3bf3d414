"""What a demanding and a hostile user tried (issue #44), table by table: every bad request refused
before anything runs, in one line with exit status 2 and no traceback; a bad line of a records file
skipped with a warning naming the file and the line; nothing overwritten that the command was not
asked to write; a record that cannot be written printed in full; labels that say what ran. Each
command's ``main`` runs in this process where it can (no training starts: every case is refused or
only reads); run_all.sh's own flags through bash."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract import RunConfig
from contract.records import read_records
from contract.registry import get_system
from runners.record import append_record, build_record, hold_records, release_records
from tests.conftest import REPO
from workload.configs import get_model_config

PYTHON = sys.executable
SWEEP = """name = "s"
[fixed]
model = "tiny"
batch_size = 1
micro_batch_size = 1
steps = 2
warmup = 1
[[experiment]]
name = "a"
layouts = ["1"]
  [[experiment.systems]]
  name = "reference"
"""
TWICE = SWEEP + SWEEP[SWEEP.index("[[experiment]]"):]
OURS = ["--system", "ours", "--model", "cpu-small", "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1"]
LAYOUT = ["layout", "--model", "gpt3-xl", "--batch-size", "64"]
LINK = "is absurd"
DILOCO = ["--system", "diloco", "--model", "tiny", "--batch-size", "1", "--micro-batch-size", "1"]


def _main(module: str):
    """The ``main`` of a command, imported here (report.py is a top-level module)."""
    import importlib

    return importlib.import_module(module).main


def _exit_status(main, argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns it or exits (argparse)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def _files(tmp_path: Path) -> dict[str, Path]:
    sweep, twice, noeff, notjson = (tmp_path / n for n in ("S.toml", "D.toml", "noeff.json", "notjson.json"))
    sweep.write_text(SWEEP)
    twice.write_text(TWICE)
    noeff.write_text(json.dumps({"device": "x", "peak_tflops": {"fp32": 1.0}}))
    notjson.write_text("not json")
    return {"S": sweep, "D": twice, "NOEFF": noeff, "NOTJSON": notjson}


# (issue item, command module, argv with {NAME} for _files' paths, what the one line says)
REFUSED = [
    (1, "runners.sweep.__main__", ["{S}", "--out", "{S}", "--dry-run"], "is the sweep file"),
    (1, "runners.sweep.__main__", ["{S}", "--out", "/proc/x.jsonl"], "--out /proc/x.jsonl: cannot write in /proc"),
    (1, "runners.sweep.__main__", ["{S}", "--out", "{S}.d/x.jsonl", "--plots", "{S}"], "S.toml is not a directory"),
    (1, "runners.sweep.__main__", ["{S}", "--plots", "p", "--no-report", "--dry-run"], "--plots are the report's"),
    (1, "runners.sweep.__main__", ["{S}", "--port", "70000", "--dry-run"], "--port: takes a finite whole number >= 1 "
                                                                           "and <= 65535, got '70000'"),
    (4, "runners.run", [*DILOCO, "--dp", "2", "--steps", "2", "--warmup", "1"],
     "the measured steps hold no outer step"),
    (4, "runners.run", [*DILOCO, "--dp", "1", "--steps", "9"], "--dp 1 has nothing to average"),
    (5, "predict.__main__", [*OURS, "--in-flight", "0"], "--in-flight: takes a whole number of messages >= 1"),
    (5, "predict.__main__", [*OURS, "--device-file", "{NOEFF}"], "noeff.json lacks name, part"),
    (5, "predict.__main__", [*OURS, "--device-file", "{NOTJSON}"], "notjson.json is not valid"),
    (5, "predict.__main__", [*OURS, "--gpu", "nope"], "no device file for 'nope'"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "10ms,0Gbps"], LINK),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter=-5ms,1Gbps"], LINK),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "nanms,infGbps"], "a link is LATENCY,BANDWIDTH"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "1e999ms,1Gbps"], LINK),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "1e9ms,1Gbps"], "delay 1e+09 ms is absurd"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "1ms,0.0001Mbps"], "bandwidth 1e-07 Gbit/s"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "8", "--gpus-per-node", "8", "--intra", "fast"],
     "a link is LATENCY,BANDWIDTH"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "10,1"], "a link is LATENCY,BANDWIDTH"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "7", "--inter", "10ms,1Gbps"], "no T x P = 7 divides the model"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "10ms,1Gbps", "--gpu", "nope"],
     "no device file for 'nope'"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "10ms,1Gbps", "--memory-gb", "0"],
     "--memory-gb: takes a finite number > 0"),
    (7, "ours.plan.__main__", [*LAYOUT, "--model", "gpt3-175b", "--devices", "8", "--gpus-per-node", "8",
                               "--intra", "5us,300GB/s"], "no layout of gpt3-175b on 8 devices fits the 15.2 GiB"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12", "--inter", "10ms,1Gbps", "--memory-gb", "1"],
     "no layout of gpt3-xl on 12 devices fits --memory-gb 1: the least a device needs is"),
    (7, "ours.plan.__main__", [*LAYOUT, "--devices", "12"], "need --inter"),
    (7, "ours.plan.__main__", [*LAYOUT, "--matrix", "{NOTJSON}"], "not a per-link matrix"),
    (9, "tools.rehearse", ["1"], "no run of rehearsal-2-scaled fits 1 virtual node(s)"),
    (10, "runners.sweep.__main__", ["{D}", "--dry-run"], "the same run planned twice in experiment 'a'"),
    (13, "tools.rehearse", ["2", "--dry-run"], "unrecognized arguments: --dry-run"),
    (15, "report", ["--target", "nan", "{S}"], "--target: a held-out loss is a finite number > 0, got 'nan'"),
    (15, "report", ["--target", "-5", "{S}"], "--target: a held-out loss is a finite number > 0, got '-5'"),
    (19, "runners.run", ["--system", "ours", "--model", "tiny", "--tp", "2", "--wire-dtype", "bf16", "--batch-size",
                         "1", "--micro-batch-size", "1"], "not of tensor parallelism's all-reduces"),
]


@pytest.mark.parametrize("item, module, argv, says", REFUSED,
                         ids=[f"item{c[0]}-{c[1].split('.')[0]}-{i}" for i, c in enumerate(REFUSED)])
def test_a_bad_request_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, item, module,
                                                                  argv, says):
    files = _files(tmp_path)
    monkeypatch.chdir(REPO)
    before = {n: p.read_bytes() for n, p in files.items()}
    status = _exit_status(_main(module), [a.format(**files) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err and {n: p.read_bytes() for n, p in files.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files.values())  # nothing written


@pytest.mark.parametrize("flags, says", [
    (["--quality", "--sweep", "sweeps/local.toml", "--dry-run"],
     "--quality runs sweeps/quality.toml; leave out --sweep"),
    (["--quality", "--rehearse", "2", "--dry-run"], "--rehearse brings nodes up and has no --dry-run"),
    (["--sweep", "sweeps/local.toml", "--sweep", "sweeps/local-dp.toml", "--dry-run"], "--sweep given twice"),
])
def test_run_all_refuses_flags_that_would_silently_win(flags, says):
    """Item 13: the last of two flags naming what runs won without a word; --rehearse --dry-run
    printed a usage of many lines."""
    p = subprocess.run(["bash", "runners/run_all.sh", *flags], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": PYTHON})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr


def test_a_full_file_system_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """Item 8: --out on a full file system trained, then lost the record in two tracebacks."""
    class Full:
        f_bfree = f_bavail = 0
        f_frsize, f_blocks = 4096, 1000

    monkeypatch.setattr("runners.request.os.statvfs", lambda path: Full())
    out = tmp_path / "r.jsonl"
    status = _main("runners.run")(["--system", "reference", "--model", "tiny", "--batch-size", "1",
                                   "--micro-batch-size", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and "its file system has 0.0 MiB free" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def _record(system: str = "reference", precision: str = "fp32", status: str = "ok", **fields):
    spec = get_system(system)
    cfg = RunConfig(system=system, model=get_model_config("tiny"), batch_size=1, micro_batch_size=1,
                    precision=precision, options=spec.options(), **fields)
    return build_record(cfg, spec, status, None if status == "ok" else "failed", None, {"device_kind": "cpu"})


def test_a_record_that_cannot_be_written_is_printed_in_full(tmp_path, capsys, monkeypatch):
    """Item 8, once the run has trained: the record goes to stderr, whole, and the run command exits 1."""
    from runners.run import keep_record

    def full(path, line):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("runners.record.append_line", full)
    rec = _record()
    assert not keep_record(str(tmp_path / "r.jsonl"), rec, "python -m runners.run")
    err = capsys.readouterr().err.splitlines()
    assert "the record could not be written (No space left on device)" in err[0]
    assert json.loads(err[1]) == json.loads(rec.to_json())


NOT_UTF8 = b'{"a": 1}\n\xff\xfe not text\n'


def test_a_line_that_is_not_utf8_is_skipped_with_a_warning_by_every_reader(tmp_path, capsys, monkeypatch):
    """Item 3: one such line crashed report.py (file and directory), the sweep (also --dry-run) and
    predict records / validate with a UnicodeDecodeError; a binary file crashed the report too."""
    good = _record(status="error")
    bad = tmp_path / "runs.jsonl"
    append_record(bad, good)
    bad.write_bytes(bad.read_bytes() + NOT_UTF8)
    warned = []
    assert [r["run_id"] for r in read_records(bad, warned.append)] == [good.run_id]
    assert warned == [f"{bad}:2: not a run record (no system, status, model, model_shape, layout, batch_size, "
                      "micro_batch_size, network): line skipped", f"{bad}:3: not UTF-8 text: line skipped"]
    binary = tmp_path / "ls.jsonl"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:20000])
    monkeypatch.chdir(REPO)
    sweep = tmp_path / "S.toml"
    sweep.write_text(SWEEP)
    for module, argv, status in (("report", [str(bad)], 0), ("report", [str(tmp_path)], 0),
                                 ("runners.sweep.__main__", [str(sweep), "--out", str(bad), "--dry-run"], 0),
                                 ("predict.__main__", ["records", str(bad)], 0),
                                 ("predict.__main__", ["validate", str(bad)], 2)):  # no ok CPU run in it
        assert _exit_status(_main(module), argv) == status, (module, argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{bad}:3: not UTF-8 text" in err, (module, err)
    assert _exit_status(_main("report"), [str(binary)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) <= 11 and "more warning(s) of this file not shown" in err[-1], err


def test_validate_writes_only_when_asked_and_refuses_records_without_a_cpu_run(tmp_path, capsys, monkeypatch):
    """Item 2: predict validate on any records file replaced the committed validation that predict
    records reads, also from empty or GPU-only input (exit 0)."""
    from predict.this_machine import CALIBRATIONS

    kept = {p: p.read_bytes() for p in CALIBRATIONS.glob("validation.*")}
    empty, gpu = tmp_path / "empty.jsonl", tmp_path / "gpu.jsonl"
    empty.write_text("")
    append_record(gpu, build_record(*_gpu_run(), "ok", None, None, {"device_kind": "cuda"}))
    monkeypatch.chdir(REPO)
    for records in (empty, gpu):
        assert _exit_status(_main("predict.__main__"), ["validate", str(records)]) == 2
        assert "no ok CPU run to validate" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in CALIBRATIONS.glob("validation.*")} == kept


def _gpu_run():
    spec = get_system("reference")
    return RunConfig(system="reference", model=get_model_config("tiny"), batch_size=1, micro_batch_size=1), spec


def test_locks_beside_the_records_go_with_their_holders(tmp_path):
    """Item 17: an empty X.lock and X.writer.lock stayed beside every --out."""
    out = tmp_path / "r.jsonl"
    fd = hold_records(out)
    with pytest.raises(BlockingIOError):
        hold_records(out)
    append_record(out, _record())
    release_records(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    release_records(hold_records(out))  # taken again once released
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_labels_and_summaries_say_what_ran():
    """Item 11: diloco's one-process math was labelled diloco (one column with diloco's own runs, its options
    shown as None); the summary line and the report's Every run table had no precision. Item 14: a run that
    reached its target within its warm-up said 'ok (this node's ranks finished ...)' on its one node.
    Item 16: a --prefetch that 'auto' lowered was not said."""
    from ours import describe_run
    from reporting import render
    from runners.run import summary

    sim = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=1, micro_batch_size=1, dp=2,
                    options=get_system("reference").options(diloco=True, inner_steps=2))
    assert get_system("reference").run_label(sim) == "reference diloco H=2"
    fp32, bf16 = _record(), _record(precision="bf16")
    for rec in (fp32, bf16):
        rec.median_step_time = rec.min_step_time = rec.max_step_time = 0.05
        rec.tokens_per_s, rec.tflops_per_device, rec.mfu = 100.0, 0.01, 0.1
    assert " tiny bf16 pp=1 " in summary(bf16) and " tiny fp32 pp=1 " in summary(fp32)
    every = [line for line in render([fp32.__dict__, bf16.__dict__]).split("## Every run")[1].splitlines()
             if line.startswith("| ")]
    assert [[cell.strip() for cell in line.split("|")[1:4]] for line in every] == [
        ["system", "model", "precision"], ["reference", "tiny", "fp32"], ["reference", "tiny", "bf16"]]
    early = _record(eval_every=1, target_loss=100.0, data="stdlib", warmup=1)
    early.evals = [{"step": 0, "tokens": 0, "wall_time": 0.0, "loss": 5.6, "bytes_sent": [0]}]
    assert summary(early) == ("reference: ok, no step time: the held-out loss reached --target-loss 100 at the eval "
                              "after 0 steps, and the run ended within its 1 warm-up step(s) (lower --warmup to time "
                              "a step)")
    assert summary(early, node0=False).endswith("ok (this node's ranks finished; node 0 writes the record)")
    lowered = describe_run({"n_slices": "auto", "slices": [64, 64], "prefetch": 2, "prefetch_asked": 99})
    assert lowered == "K=2 (64x2), prefetch 2 (99 asked: the forwards the first stage runs before its first backward)"


def test_no_quality_winner_from_single_runs():
    """Item 12: the time-to-quality section claimed '1.03x faster' from one run of each, both shown 0.05 s."""
    from reporting import quality_section
    from tests.test_report_quality import _rec

    text = quality_section([_rec("ours", "d50-1g", 0, [5.6, 3.4], 0.05, 100, dp_mode="sharded_ps"),
                            _rec("torch_pipe", "d50-1g", 0, [5.6, 3.4], 0.0515, 100)])
    wins = text.split("Which wins")[1]
    assert "faster" not in wins and "no claim: a single run has no interval" in wins, wins


def test_sbatch_saying_submitted_in_plain_words_is_a_submission(tmp_path, monkeypatch, capsys):
    """Item 18: 'Submitted batch job 4242' with exit 0 was reported 'sbatch refused the job' (exit 2)."""
    from runners.sweep.slurm_submit import submit

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    assert submit(tmp_path / "s.sbatch", [], str(tmp_path / "s-%j.out")) == 0
    assert "submitted batch job 4242; output: " + str(tmp_path / "s-4242.out") in capsys.readouterr().out
    (fake / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed' >&2\nexit 1\n")
    assert submit(tmp_path / "s.sbatch", [], str(tmp_path / "s-%j.out")) == 2
    assert "sbatch refused the job: sbatch: error: Batch job submission failed" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Round three (issue #54), the command line: plan solve's refusals (item 6), plan layout's --devices beside a
# --matrix and K for slices only (item 20), every usage naming the command typed (item 23).
# ---------------------------------------------------------------------------------------------------------------
SOLVE = ["solve", "--model", "gpt3-xl", "--device-file", "V100 SXM2 16GB", "--batch-size", "8", "--pp", "2"]
WHOLE = "takes a finite whole number >= 1, got"
# argv after SOLVE (a later flag overrides SOLVE's), and the one line; before: a traceback, or the bad value
# silently ignored (--granularity 0, --micro-batch-size 0) or accepted (--tp 3 with 16 heads)
SOLVE_REFUSED = [
    (["--pp", "0"], f"argument --pp: {WHOLE} '0'"),  # ZeroDivisionError
    (["--tp", "0"], f"argument --tp: {WHOLE} '0'"),  # ZeroDivisionError
    (["--batch-size", "0"], f"argument --batch-size: {WHOLE} '0'"),  # ValueError: no feasible slicing
    (["--pp", "5"], "24 layers do not divide into 5 pipeline stages (--pp 5)"),  # ValueError
    (["--granularity", "-64"], f"argument --granularity: {WHOLE} '-64'"),  # ValueError
    (["--granularity", "0"], f"argument --granularity: {WHOLE} '0'"),  # the default used instead
    (["--micro-batch-size", "3"], "--batch-size 8 is not divisible by --micro-batch-size 3"),  # ValueError
    (["--micro-batch-size", "0"], f"argument --micro-batch-size: {WHOLE} '0'"),  # every divisor tried
    (["--batch-slices", "0"], "argument --batch-slices: takes comma-separated whole numbers >= 1, got '0'"),
    (["--batch-slices", "3"], "batch slice 3 does not divide the batch size 8"),  # ValueError
    (["--tp", "3"], "--tp 3 must divide the heads (16) and the hidden size (2048)"),  # planned
    (["--micro-batch-size", "2", "--batch-slices", "1,2"], "give --micro-batch-size (one batch slice) or "
     "--batch-slices (the sizes to try), not both"),  # --batch-slices won silently
]


@pytest.mark.parametrize("argv, says", SOLVE_REFUSED, ids=[" ".join(a) for a, _ in SOLVE_REFUSED])
def test_plan_solve_refuses_a_layout_in_one_line(capsys, argv, says):
    """Item 6: each was a traceback, ignored or planned; now one line, exit 2, as plan layout and the run
    command refuse (the layout judged by ours' own SystemSpec.validate)."""
    status = _exit_status(_main("ours.plan.__main__"), [*SOLVE, *argv])
    err = capsys.readouterr().err
    assert status == 2 and err == f"python -m ours.plan solve: error: {says}\n", err


def test_plan_layout_refuses_devices_that_disagree_with_its_matrix(tmp_path, capsys):
    """Item 20: --devices 4 beside a matrix of 2 devices was ignored (the matrix's 2 planned); the same
    number is honoured."""
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"delay_ms": [[0, 5], [5, 0]], "bandwidth_gbps": [[100, 1], [1, 100]]}))
    layout = ["layout", "--model", "tiny", "--batch-size", "2", "--matrix", str(matrix)]
    assert _exit_status(_main("ours.plan.__main__"), [*layout, "--devices", "4"]) == 2
    assert capsys.readouterr().err == (f"python -m ours.plan layout: error: --devices 4, but --matrix {matrix} is of "
                                       "2 devices (the matrix says how many: leave out --devices)\n")
    assert _exit_status(_main("ours.plan.__main__"), [*layout, "--devices", "2"]) == 0
    assert "tiny, 2 x V100 SXM2 16GB" in capsys.readouterr().out


def test_plan_solve_says_p_for_stages_and_k_for_token_slices(capsys):
    """Item 20: solve printed K=2 for two stages beside '6 slices'; K means token slices everywhere."""
    import re

    assert _main("ours.plan.__main__")(["solve", "--model", "cpu-small", "--pp", "2", "--batch-size", "2",
                                        "--micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    found = re.match(r"P=2 B=2 b=1 g=\d+: K=(\d+) token slices \[([\d,]+)\]", out)
    assert found and int(found[1]) == len(found[2].split(",")), out


# (argv after `pipebench`, what the usage or the one line begins with): before, each named python -m ...
NAMED = [
    (["run", "--help"], "usage: pipebench run "),
    (["run", "--bogus"], "pipebench run: error: "),
    (["sweep", "--help"], "usage: pipebench sweep "),
    (["sweep", "--bogus"], "pipebench sweep: error: "),
    (["report", "--help"], "usage: pipebench report "),
    (["predict", "--help"], "usage: pipebench predict "),
    (["predict", "scenario", "--help"], "usage: pipebench predict scenario "),
    (["predict", "scenario", "/nonexistent.toml"], "pipebench predict scenario: error: "),
    (["predict", "sweep", "--help"], "usage: pipebench predict sweep "),
    (["predict", "run", "--help"], "usage: pipebench predict run "),
    (["predict", "--system", "nope"], "pipebench predict run: error: argument --system: invalid choice"),
    (["predict", "validate-seed", "--calibrate", "--sensitivity"], "pipebench predict validate-seed: error: "),
    (["plan", "--help"], "usage: pipebench plan "),
    (["plan", "layout", "--help"], "usage: pipebench plan layout "),
    (["plan", "solve", *SOLVE[1:], "--tp", "3"], "pipebench plan solve: error: --tp 3 must divide"),
]


@pytest.mark.parametrize("argv, begins", NAMED, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in enumerate(NAMED)])
def test_every_usage_and_error_names_the_command_typed(capsys, argv, begins):
    """Item 23: every subcommand's usage and errors named python -m runners.run, python -m predict, ...
    where pipebench was typed; python -m still names itself."""
    import pipebench

    status = _exit_status(pipebench.main, argv)
    out, err = capsys.readouterr()
    said = out if "--help" in argv else err
    assert status == (0 if "--help" in argv else 2) and said.startswith(begins), said[:300]


def test_python_m_keeps_its_own_name(capsys):
    """Item 23, the other way: run as python -m, a command names itself so."""
    for module, argv, prog in (("runners.run", ["--bogus"], "python -m runners.run"),
                               ("runners.sweep.__main__", ["--bogus"], "python -m runners.sweep"),
                               ("predict.__main__", ["scenaro"], "python -m predict"),
                               ("predict.__main__", ["--system", "nope"], "python -m predict run"),
                               ("ours.plan.__main__", [*SOLVE, "--pp", "5"], "python -m ours.plan solve")):
        assert _exit_status(_main(module), argv) == 2
        assert capsys.readouterr().err.startswith(f"{prog}: error: "), module


# ---- issue #54, the simulator's side: scenarios, device files, predict's commands ----------------------
def _scenario_text(run: str = "", cluster: str = "", extra: str = "") -> str:
    """A small valid scenario (megatron T-2 P-2 on two A100 nodes), with lines added to its tables."""
    return ('[run]\nsystem = "megatron"\nmodel = "gpt3-xl"\nnum_layers = 8\ntp = 2\npp = 2\nbatch_size = 8\n'
            f'micro_batch_size = 1\nprecision = "bf16"\n{run}\n[cluster]\ngpu = "A100 SXM4 80GB"\nnodes = 2\n'
            f'gpus_per_node = 4\n{cluster}\n{extra}')


INTER = "inter_gbps = 100\ninter_delay_ms = 0.01\n"
MATRIX = '[cluster.matrix]\ndelay_ms = [[0, 1], [1, 0]]\nbandwidth_gbps = [[0, 10], [10, 0]]\n'
SCENARIOS_54 = [
    (3, _scenario_text(extra=MATRIX + "loss_pct = [[0, 1], [1, 0]]\n"), "matrix loss_pct: not modelled"),
    (3, _scenario_text(extra=MATRIX + "jitter_ms = [[0, 1], [1, 0]]\n"), "matrix jitter_ms: not modelled"),
    (3, _scenario_text(extra=MATRIX + "colour = 1\n"), "matrix colour: unknown"),
    (4, '[run]\nsystem = "megatron"\nmodel = "gpt3-xl"\npp = 6\nschedule = "interleaved"\nvirtual_pp = 2\n'
        'batch_size = 64\nmicro_batch_size = 1\n' + _scenario_text(cluster=INTER)[_scenario_text().index("[cluster]"):],
     "interleaved schedule needs the micro-batch count (64) to divide by --pp 6"),
    (16, _scenario_text(cluster="inter_gbps = 10\ninter_delay_ms = 1e300\n"), "delay 1e+300 ms is absurd"),
    (16, _scenario_text(cluster="intra_gbps = 1e-9\n"), "bandwidth 1e-09 Gbit/s is absurd"),
    (17, _scenario_text('n_slices = true', INTER).replace('"megatron"', '"ours"'), "'n_slices' must be a string"),
    (17, _scenario_text(extra="[cluster.matrix]\ndelay_ms = 5\nbandwidth_gbps = 1\n"), "matrix must be 2 x 2"),
]


@pytest.mark.parametrize("item, text, says", SCENARIOS_54, ids=[f"item{c[0]}-{i}" for i, c in enumerate(SCENARIOS_54)])
def test_54_a_bad_scenario_is_one_line(tmp_path, capsys, item, text, says):
    f = tmp_path / "s.toml"
    f.write_text(text)
    assert _exit_status(_main("predict.__main__"), ["scenario", str(f)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err


DEVICE_FIELDS = [("bandwidth_gbs", 0, "bandwidth_gbs must be a finite number > 0"),
                 ("memory_efficiency", 0, "memory_efficiency must be a finite number > 0"),
                 ("sms", 0, "sms must be a whole number >= 1"), ("sms", -3, "sms must be a whole number >= 1"),
                 ("gemm", {"fp32": {"efficiency": "0.8"}}, "gemm 'fp32': a precision"),
                 ("gemm", [1, 2], "gemm must map each precision"),
                 ("memory_gb", "80", "memory_gb must be a finite number > 0"),
                 ("memory_gb", -5, "memory_gb must be a finite number > 0"),
                 ("kernel_us", -5, "kernel_us must be a finite number >= 0")]


@pytest.mark.parametrize("key, value, says", DEVICE_FIELDS, ids=[f"{k}={v!r}" for k, v, _ in DEVICE_FIELDS])
def test_54_item5_a_device_files_bad_field_is_one_line_in_predict_and_plan(tmp_path, capsys, key, value, says):
    d = json.loads((REPO / "workload" / "devices" / "h100-sxm.json").read_text())
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({**d, key: value}))
    for module, argv in (("predict.__main__", [*OURS, "--gpu", str(f)]),
                         ("ours.plan.__main__", [*LAYOUT, "--devices", "8", "--gpus-per-node", "8", "--intra",
                                                 "5us,300GB/s", "--gpu", str(f)])):
        assert _exit_status(_main(module), argv) == 2, module
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, (module, err)


def test_54_item1_fairscale_is_predicted_on_a_gpu_and_a_sweep_lists_what_it_cannot(tmp_path, capsys):
    predict = _main("predict.__main__")
    argv = ["--system", "fairscale_fsdp", "--pp", "2", "--model", "cpu-small", "--batch-size", "2",
            "--micro-batch-size", "1", "--gpu", "H100 SXM"]
    assert predict(argv) == 0 and "predicted step" in capsys.readouterr().out
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP.replace('"tiny"', '"cpu-small"').replace('layouts = ["1"]', 'layouts = ["P-2"]')
                     .replace('name = "reference"', 'name = "fairscale_fsdp"\n  [[experiment.systems]]\n'
                                                    '  name = "ours"\n  n_slices = "search"'))
    assert predict(["sweep", str(sweep), "--gpu", "H100 SXM"]) == 0
    out = capsys.readouterr()
    row = next(line.split("|") for line in out.out.splitlines() if line.startswith("| fairscale_fsdp "))
    assert [c.strip() for c in row][3:5] == ["fp32", "P-2"] and "Traceback" not in out.err
    assert "not predicted: [a] --system ours" in out.err and "--n-slices search keeps the K" in out.err


def test_54_item9_predict_records_keeps_predictions_it_does_not_replace(tmp_path, capsys):
    from contract.records import predictions_path

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    predictions_path(empty).write_text('{"x": {"not_modelled": "made earlier"}}\n')
    assert _main("predict.__main__")(["records", str(empty)]) == 0
    out = capsys.readouterr()
    assert predictions_path(empty).read_text() == '{"x": {"not_modelled": "made earlier"}}\n'
    assert "kept as it was" in out.out and "earlier predictions are kept" in out.err
    assert "nothing written" not in out.out


def test_54_items11_24_predict_refuses_an_output_it_cannot_write_before_any_work(tmp_path, capsys, monkeypatch):
    import predict.seed_tables as seed

    monkeypatch.setattr(seed, "validate", lambda *a, **k: pytest.fail("validate-seed worked before refusing"))
    f = tmp_path / "out"
    f.write_text("mine")
    assert _main("predict.__main__")(["validate-seed", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "is a file: give a folder" in err and f.read_text() == "mine"
    monkeypatch.chdir(tmp_path)
    for name in ("../../x", "/tmp/x", ".hidden", "a/b"):
        assert _main("predict.__main__")(["validate", "--name", name, str(f)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "a plain name" in err, err


def test_54_item14_a_v100_runs_bf16_gemms_at_its_fp32_rate():
    """V100 has no bf16 units: its bf16 GEMMs run at the fp32 peak and curve, never slower than fp32."""
    from workload.compute import find_device, gpu_compute
    from workload.configs import get_model_config

    v100, model = find_device("V100 SXM2 16GB"), get_model_config("gpt3-xl")
    assert v100.gemm_curve("bf16") == v100.gemm_curve("fp32") and v100.peak_flops("bf16") == v100.peak_flops("fp32")
    g = {p: gpu_compute(v100, model, p).gemm(2048, 8192, 2048) for p in ("fp32", "bf16")}
    assert g["bf16"] <= g["fp32"]


def test_54_item15_the_calibration_scenario_is_the_calibration_cell():
    from predict.scenario import load, memory_of
    from predict.seed_tables import CALIBRATION, calibration_cells

    sc = load(REPO / "predict" / "scenarios" / "seed-gpipe-default.toml")
    cell = calibration_cells()["fp32"].load()
    assert CALIBRATION["fp32"] == "gpipe default" and sc.config == cell.config and sc.head == cell.head
    assert sc.config.optimizer.kind == "sgd" and memory_of(sc).total == memory_of(cell).total


def test_54_items19_26_a_one_run_prediction_names_its_precision_and_the_hosts_speed(capsys, monkeypatch):
    """A one-run prediction on this machine probes the host's speed first (predict records' probe): where
    it moved beyond the bound from the calibration's, the prediction is stretched and a warning says so."""
    import predict.this_machine as here

    then = here.load_calibration().identity["speed_tflops"]
    run = ["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1",
           "--n-slices", "4"]
    steps = {}
    for speed in (1.0, 1 / 3):
        monkeypatch.setattr(here, "speed_probe", lambda s=speed: then * s)
        assert _main("predict.__main__")(run) == 0
        out = capsys.readouterr()
        assert out.out.startswith("ours tiny fp32 pp=2"), out.out
        steps[speed] = float(out.out.split("predicted step ")[1].split()[0])
        assert ("warning: this host runs at 0.33x the speed of its calibration" in out.err) == (speed < 1), out.err
    assert 2.5 < steps[1 / 3] / steps[1.0] < 3.5


# ---- issue #54, the run side's faults (items 2, 4, 5, 7, 8, 13, 22, 25): the requests refused here; the
# records, the cache, the terminal and the rejoin are tested beside their modules (tests/runners/test_records.py,
# tests/runners/test_output.py, tests/workload/test_tokens.py, tests/runners/test_injected_faults.py)

DILOCO_KILL = [*DILOCO, "--dp", "2", "--inner-steps", "2", "--steps", "8"]
RUN_SIDE_REFUSED = [
    (7, "runners.run", [*OURS, "--network", "{BINARY}"], "matrix profile '{BINARY}' is not UTF-8 text (byte 0xff"),
    (7, "predict.__main__", [*OURS, "--network", "{BINARY}"], "matrix profile '{BINARY}' is not UTF-8 text"),
    (7, "runners.run", [*OURS, "--network", "delay 1ms bandwidth 1Gbps", "--network-trace", "{BINARY}"],
     "trace '{BINARY}' is not UTF-8 text"),
    (13, "runners.run", [*DILOCO_KILL, "--kill-replica", "1@3", "--kill-replica", "0@5"],
     "--kill-replica given twice (1@3 and 0@5): a run takes one --kill-replica"),
    (13, "runners.run", [*OURS, "--slow-rank", "1:2", "--slow-rank", "0:3"], "--slow-rank given twice"),
    (4, "runners.run", [*DILOCO_KILL, "--kill-replica", "1@1", "--rejoin"],
     "replica 1 dies before the first outer step (after step 2)"),
    (4, "runners.run", [*DILOCO_KILL, "--kill-replica", "1@9", "--rejoin"],
     "the others' next quorum after it dies comes at step 10 of 10, too late to rejoin"),
]


@pytest.mark.parametrize("item, module, argv, says", RUN_SIDE_REFUSED,
                         ids=[f"item{c[0]}-{c[1].split('.')[0]}-{i}" for i, c in enumerate(RUN_SIDE_REFUSED)])
def test_run_side_requests_are_refused_in_one_line(tmp_path, capsys, monkeypatch, item, module, argv, says):
    """Item 7: a --network or --network-trace file that is not UTF-8 was a UnicodeDecodeError before
    launch; item 13: a second --kill-replica replaced the first without a word; item 4: a --rejoin that
    could not happen was run and reported as rejoining."""
    binary = tmp_path / "x.json"
    binary.write_bytes(b'\xff\xfe{"delay_ms": 1}')
    monkeypatch.chdir(REPO)
    status = _exit_status(_main(module), [a.format(BINARY=binary) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and says.format(BINARY=binary) in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]

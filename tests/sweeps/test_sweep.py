"""Sweep files into run commands, skipping what is recorded, dry runs, and the cluster mode's quoting.

Nothing here trains or ssh-es anywhere: runs go to a fake executor, ssh commands are only built."""
from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from contract.records import read_records
from runners.record import build_record
from runners.request import parse_request
from runners.sweep.__main__ import _transform, build_parser, main
from runners.sweep.cluster import ClusterExecutor
from runners.sweep.hostfile import Host, NodePlacement
from runners.sweep.execute import recorded_keys, run_sweep
from runners.sweep.plan import (SWEEPS_DIR, PlannedRun, SweepError, adhoc_sweep, fixed_settings, load_sweep,
                                parse_layout,
                                sweep_from_dict)

REPO = Path(__file__).resolve().parents[2]

SMALL = """
name = "t"
[fixed]
model = "tiny"
seq_length = 32
batch_size = 4
steps = 2
warmup = 0

[[experiment]]
name = "net"
micro_batch_sizes = [1]
networks = ["none", "d10-1g"]
layouts = ["P-2", "P-2 D-2"]
  [[experiment.systems]]
  name = "ours"
  n_slices = 4
  schedule = "gpipe"
  [[experiment.systems]]
  name = "torch_pipe"
  schedule = ["gpipe", "1f1b"]

[[experiment]]
name = "layout"
micro_batch_sizes = [1, 2]
systems = ["megatron"]
layouts = ["T-2", {pp = 2, tp = 2}]
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def flags(run: PlannedRun) -> dict[str, str]:
    a = list(run.args)
    return {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--") and not a[i + 1].startswith("--")}


def test_a_list_setting_is_one_more_axis():
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "micro_batch_size": 1, "batch_size": [1, 2], "steps": [2, 3]},
                             "systems": ["reference"]})
    assert sorted((flags(r)["--batch-size"], flags(r)["--steps"]) for r in sweep.runs) == [
        ("1", "2"), ("1", "3"), ("2", "2"), ("2", "3")]


def test_a_system_table_sets_its_own_runs_settings_and_set_overrides_fixed(tmp_path, capsys):
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "micro_batch_size": 1, "batch_size": 2, "eval_every": 4},
                             "systems": [{"name": "reference", "batch_size": 4, "eval_every": 2},
                                         {"name": "ours", "n_slices": 2}]})
    ref, ours = (flags(r) for r in sweep.runs)
    assert (ref["--batch-size"], ref["--eval-every"]) == ("4", "2")
    assert list(sweep.runs[0].args).count("--batch-size") == 1
    assert (ours["--batch-size"], ours["--eval-every"], ours["--n-slices"]) == ("2", "4", "2")
    with pytest.raises(SweepError, match="one value, not a list"):
        sweep_from_dict({"fixed": {"model": "tiny", "micro_batch_size": 1, "batch_size": 2},
                         "systems": [{"name": "reference", "steps": [2, 3]}]})
    assert fixed_settings(["target_loss=5.95", "data=stdlib", "recompute=true"]) == \
        {"target_loss": 5.95, "data": "stdlib", "recompute": True}
    f = write(tmp_path, 'name = "s"\n[fixed]\nmodel = "tiny"\nbatch_size = 1\nmicro_batch_size = 1\nsteps = 2\n'
                        '[[experiment]]\nsystems = ["reference"]\n')
    args = build_parser().parse_args([str(f), "--set", "steps=3", "--set", "target_loss=2.5", "--set", "eval_every=1"])
    (run,) = load_sweep(f, _transform(args)).runs
    assert (flags(run)["--steps"], flags(run)["--target-loss"]) == ("3", "2.5")
    assert main([str(f), "--dry-run", "--set", "steps", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--set 'steps': expected KEY=VALUE" in capsys.readouterr().err


def test_cross_product_and_system_options(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    net = [r for r in sweep.runs if r.experiment == "net"]
    # 2 networks x (ours 1 option combo + torch_pipe 2 schedules) x 2 layouts x 1 micro-batch
    assert len(net) == 2 * 3 * 2
    assert all(r.valid for r in net), [r.error for r in net if not r.valid]
    ours = [flags(r) for r in net if r.system == "ours"]
    assert all(f["--n-slices"] == "4" and f["--schedule"] == "gpipe" for f in ours)
    assert {(f["--pp"], f["--dp"], f["--network"]) for f in ours} == {("2", "1", "none"), ("2", "2", "none"),
                                                                       ("2", "1", "d10-1g"), ("2", "2", "d10-1g")}
    tp = [flags(r) for r in net if r.system == "torch_pipe"]
    assert sorted({f["--schedule"] for f in tp}) == ["1f1b", "gpipe"]
    assert all("--n-slices" not in f for f in tp)
    for r in net:  # argument lists of plain strings, fixed settings in every one
        assert all(isinstance(a, str) for a in r.args)
        f = flags(r)
        assert (f["--model"], f["--seq-length"], f["--batch-size"], f["--steps"], f["--warmup"]) == ("tiny", "32", "4",
                                                                                                     "2", "0")
        assert r.command("o.jsonl")[:3] == [sys.executable, "-m", "runners.run"]
        assert r.command("o.jsonl")[-2:] == ["--out", "o.jsonl"]
    assert len({r.key for r in net}) == len(net)


def test_a_bad_combination_makes_the_sweep_file_bad(tmp_path):
    """A combination the run command would refuse is a mistake in the sweep file, refused before
    anything runs (as an unknown key is), naming the run and why."""
    text = SMALL.replace("micro_batch_sizes = [1, 2]", "micro_batch_sizes = [1, 2, 3]")
    with pytest.raises(SweepError, match=r"s.toml: bad combination \(and 1 more\): \[layout\] --system megatron .*"
                                         r"--micro-batch-size 3 .*not divisible"):
        load_sweep(write(tmp_path, text))
    with pytest.raises(SweepError, match="does not support --tp"):
        sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1},
                         "systems": ["reference", "torch_pipe"], "layouts": ["T-2"]})


def _sweep_with(tmp_path, fixed: str = "", exp: str = "", system: str = "ours", opts: str = "") -> Path:
    return write(tmp_path, f'name = "s"\n[fixed]\nmodel = "tiny"\nbatch_size = 2\n{fixed}\n[[experiment]]\n'
                           f'name = "x"\nmicro_batch_sizes = [1]\n{exp}\n'
                           f'  [[experiment.systems]]\n  name = "{system}"\n'
                           f'  layouts = ["P-2"]\n{opts}\n  [[experiment.systems]]\n  name = "torch_pipe"\n'
                           f'  layouts = ["P-2"]\n')


@pytest.mark.faults
def test_mistakes_in_a_sweep_file_exit_2_with_one_line(tmp_path, capsys):
    """Issue #31, item 7: each of these used to be skipped (or planned 0 runs) with exit status 0."""
    matrix = tmp_path / "m4.json"
    matrix.write_text(json.dumps({"delay_ms": [[0 if i == j else 5 for j in range(4)] for i in range(4)],
                                  "bandwidth_gbps": [[0 if i == j else 1 for j in range(4)] for i in range(4)]}))
    cases = [
        (dict(system="ourz"), "--system: invalid choice: 'ourz'"),
        (dict(system="torch_pipe", opts="  n_slices = 4"),
         "--n-slices is an option of ours and diloco, not of torch_pipe"),
        (dict(fixed="prefetch = 1"), "--prefetch is an option of ours, not of torch_pipe"),
        (dict(exp=f'networks = ["{matrix}"]'), "is 4x4, cluster has 2 hosts"),
        (dict(opts="  dp_mode = []"), "'dp_mode' must be a non-empty list"),
    ]
    for case, message in cases:
        assert main([str(_sweep_with(tmp_path, **case)), "--dry-run", "--out", str(tmp_path / "o.jsonl")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (case, err)


def test_a_layout_this_machine_cannot_hold_is_refused_for_a_local_sweep(tmp_path, capsys):
    """Issue #31, item 11: P-4 D-64 (256 ranks) and P-2 D-512 (1,024) were planned as runnable on 2 cores.
    A cluster sweep (--hostfile) places its runs on the hosts instead."""
    f = write(tmp_path, 'name = "big"\n[fixed]\nmodel = "tiny"\nbatch_size = 4\n[[experiment]]\nname = "x"\n'
                        'micro_batch_sizes = [1]\nlayouts = ["P-4 D-64", "P-2 D-512"]\n'
                        '  [[experiment.systems]]\n  name = "ours"\n')
    assert main([str(f), "--dry-run", "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pp 4 --tp 1 --dp 64 starts 256 ranks on this machine" in err[0], err
    assert len(load_sweep(f).runs) == 2  # planned for a cluster: nothing refused


@pytest.mark.parametrize("text, message", [
    ("name = 'x'\n[fixed\nmodel='tiny'", "invalid TOML"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]\nlayouts=['Q-2']",
     "cannot read layout 'Q-2'"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\nwarp=3\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "unknown setting 'warp'"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\nout='x.jsonl'\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "set by the sweep itself"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\npp=2\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "through the 'layouts' list"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\nrecompute='yes'\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "is a switch"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]\nnetworks=['d7-fast']",
     "network 'd7-fast'"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\n[[experiment]]\nsystems=['ours']", "micro_batch_sizes"),
    ("[fixed]\nbatch_size=2\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]", "no 'model'"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\n[[experiment]]\nsystems=[]\nmicro_batch_sizes=[1]", "non-empty list"),
    ("[fixed]\nmodel='tiny'\nbatch_size=2\nsteps={a=1}\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "must be a string, a number or a list of whole numbers"),
    ("[fixed]\nmodel='tiny'\nbatch_size=[]\n[[experiment]]\nsystems=['ours']\nmicro_batch_sizes=[1]",
     "non-empty list"),
    ("stray = 1\n[[experiment]]\nsystems=['ours']", "unexpected top-level key"),
])
def test_bad_sweep_files_fail_clearly(tmp_path, text, message):
    with pytest.raises(SweepError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_sweep(write(tmp_path, text))


def test_bad_sweep_file_exits_2_with_one_line(tmp_path, capsys):
    assert main([str(write(tmp_path, "[fixed\n")), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid TOML" in err[0] and "line 1" in err[0]
    assert main([str(tmp_path / "missing.toml")]) == 2
    assert "no such sweep file" in capsys.readouterr().err


def test_layout_notation():
    assert parse_layout("T-4 P-2", "x") == {"pp": 2, "tp": 4, "dp": 1}
    assert parse_layout("P-12 D-4", "x") == {"pp": 12, "tp": 1, "dp": 4}
    assert parse_layout("1", "x") == {"pp": 1, "tp": 1, "dp": 1}
    assert parse_layout({"tp": 2}, "x") == {"pp": 1, "tp": 2, "dp": 1}
    for bad in ("P-2 P-4", "X-2", "", {"pp": "2"}, 3):
        with pytest.raises(SweepError):
            parse_layout(bad, "x")


def _fake_record(run: PlannedRun, status: str = "ok", **config_changes) -> str:
    cfg, spec = parse_request(run.args)
    # what the run command would write, with volatile fields changed: still the same run
    cfg = cfg.replace(timeout=12.0, verify=True, **config_changes)
    rec = build_record(cfg, spec, status, None, None, {})
    rec.median_step_time = 1.0
    return rec.to_json()


def test_recorded_runs_are_skipped(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    valid = sweep.valid_runs
    out = tmp_path / "o.jsonl"
    out.write_text(_fake_record(valid[0]) + "\n" + _fake_record(valid[1], status="error") + "\n"
                   + _fake_record(valid[2], seed=7) + "\n" + "not json\n")
    keys = recorded_keys(out)
    assert valid[0].key in keys and valid[1].key in keys and valid[2].key not in keys and len(keys) == 3
    assert recorded_keys(out, retry_failed=True) & {valid[0].key, valid[1].key} == {valid[0].key}
    calls = []
    res = run_sweep(sweep, out, executor=lambda r, o: calls.append(r.key) or (1, "boom"), probe=False, report=False,
                    need_root_for_network=False, stream=io.StringIO())
    assert valid[0].key not in calls and valid[1].key not in calls
    assert valid[2].key in calls  # a different seed is a different run
    assert res.skipped == 2 and res.failed == len(valid) - 2 and res.ok == 0
    # --retry-failed runs the failed one again, never the ok one
    calls.clear()
    run_sweep(sweep, out, executor=lambda r, o: calls.append(r.key) or (0, ""), retry_failed=True, probe=False,
              report=False, need_root_for_network=False, stream=io.StringIO())
    assert valid[1].key in calls and valid[0].key not in calls


def test_a_run_recorded_on_other_hardware_is_not_recorded_here(tmp_path):
    """CPU and GPU records of one config are different runs: a local sweep (on this CPU machine) skips
    the one recorded on cpu only; a cluster sweep, which cannot see its nodes' hardware, skips both."""
    sweep = load_sweep(write(tmp_path, SMALL))
    valid = sweep.valid_runs
    out = tmp_path / "o.jsonl"
    out.write_text(_fake_record(valid[0], hardware="cpu") + "\n"
                   + _fake_record(valid[1], hardware="cuda:NVIDIA H100 80GB HBM3") + "\n")
    assert recorded_keys(out) >= {valid[0].key, valid[1].key}  # as planned runs' keys, on any hardware
    calls = []
    run_sweep(sweep, out, executor=lambda r, o: calls.append(r.key) or (0, ""), probe=False, report=False,
              need_root_for_network=False, stream=io.StringIO())
    assert valid[0].key not in calls and valid[1].key in calls

    class Cluster:
        cluster = True

        def __call__(self, r, o):
            calls.append(r.key)
            return 0, ""

    calls.clear()
    run_sweep(sweep, out, executor=Cluster(), probe=False, report=False, need_root_for_network=False,
              stream=io.StringIO())
    assert valid[0].key not in calls and valid[1].key not in calls


def test_exit_2_at_run_time_counts_as_invalid(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    res = run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: (2, "python -m runners.run: error: nope"),
                    probe=False, report=False, need_root_for_network=False, stream=io.StringIO())
    assert res.ok == 0 and res.failed == 0 and res.invalid == len(sweep.runs)


def test_without_root_emulated_runs_are_skipped(tmp_path, monkeypatch):
    import runners.sweep.execute as sw

    monkeypatch.setattr(sw, "is_root", lambda: False)
    sweep = load_sweep(write(tmp_path, SMALL))
    calls, out = [], io.StringIO()
    res = run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r) or (0, ""), probe=False,
                    report=False, stream=out)
    assert calls and all(r.network == "none" for r in calls)
    assert res.not_run == sum(1 for r in sweep.valid_runs if r.emulated)
    assert "need root" in out.getvalue() and "d10-1g" in out.getvalue()


def test_only_selects_systems(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    calls = []
    run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r.system) or (0, ""), only=["ours"],
              probe=False, report=False, need_root_for_network=False, stream=io.StringIO())
    assert set(calls) == {"ours"}
    assert main([str(write(tmp_path, SMALL)), "--only", "nosuch", "--dry-run"]) == 2


def test_dry_run_prints_the_commands(tmp_path):
    out = tmp_path / "o.jsonl"
    p = subprocess.run([sys.executable, "-m", "runners.sweep", str(write(tmp_path, SMALL)), "--dry-run", "--out",
                        str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    cmds = [shlex.split(l) for l in p.stdout.splitlines() if "runners.run" in l]
    assert len(cmds) == len(load_sweep(write(tmp_path, SMALL)).valid_runs)
    assert all(c[-2:] == ["--out", str(out)] for c in cmds)
    assert not out.exists()


def test_shipped_sweep_files_expand():
    local = load_sweep(SWEEPS_DIR / "local.toml")
    assert not local.invalid_runs, [(r.label(), r.error) for r in local.invalid_runs]
    net = [r for r in local.runs if r.emulated]
    settings = ["default", "d1-5g", "d5-2g", "d10-1g"]  # four of the seed's five (50 ms: for time)
    assert sorted({r.network for r in net}) == sorted(settings)
    one = [r for r in net if flags(r)["--dp"] == "1"]
    per_setting = {s: sorted(r.label().replace(s, "") for r in one if r.network == s) for s in settings}
    assert all(v == per_setting["default"] for v in per_setting.values())  # P-2: the same runs under every setting
    assert any(r.system == "torch_pipe" for r in net)
    # P-2 D-2 of 4 ranks (no claim on 2 cores) is a sweep of its own; fairscale's (2 ranks) stays
    assert {r.system for r in net if flags(r)["--dp"] == "2"} == {"fairscale_fsdp"}
    assert len({r.key for r in local.valid_runs}) == 21  # 21 runs a round: about 25 minutes (the file says why)
    llama = [flags(r) for r in local.runs if r.experiment.startswith("llama")]
    assert {(f["--model"], f["--seq-length"], f["--system"]) for f in llama} == {
        ("llama-cpu-small", "4096", "torch_pipe"), ("llama-cpu-small", "4096", "ours")}  # today's shape, long
    dp = load_sweep(SWEEPS_DIR / "local-dp.toml")
    assert not dp.invalid_runs and dp.repeats == 3 and {r.network for r in dp.runs} == {"default", "d10-1g"}
    assert {flags(r).get("--dp-mode") for r in dp.runs if r.system == "ours"} == {"allreduce", "sharded_ps"}
    assert {r.system for r in dp.runs} == {"ours", "torch_pipe", "fairscale_fsdp"}
    layout = [r for r in local.runs if r.experiment.startswith("layout")]
    assert {flags(r)["--seq-length"] for r in layout} == {"1024"}
    assert {flags(r)["--batch-size"] for r in layout} == {"1", "2"}
    assert {r.system for r in layout} >= {"torch_pipe", "ours", "megatron", "fairscale_fsdp"}
    # like for like: each launch of a round beside the others of its own kind (pipelines, then T-2)
    first = [flags(r) for r in layout if flags(r)["--batch-size"] == "1"]
    assert [(f["--pp"], f["--tp"]) for f in first] == [("2", "1")] * 3 + [("1", "2")] * 2
    assert any(r.system == "fairscale_fsdp" and flags(r)["--dp"] == "2" for r in net)  # Pipe + FSDP
    assert local.repeats == 4  # every claim of the main job rests on four pairs of neighbouring launches
    check = load_sweep(SWEEPS_DIR / "predict-check.toml")
    assert not check.invalid_runs and not {r.network for r in check.runs} & ({r.network for r in net} | {"none"})
    xl = load_sweep(SWEEPS_DIR / "gpt3-xl-cluster.toml")
    assert not xl.invalid_runs, [(r.label(), r.error) for r in xl.invalid_runs]
    ours_dp4 = [flags(r) for r in xl.runs if r.system == "ours" and flags(r)["--dp"] == "4"]
    assert len(ours_dp4) == 5 and all(f["--pp"] == "12" and f["--dp-mode"] == "central_ps" for f in ours_dp4)
    assert all(flags(r)["--model"] == "gpt3-xl" and "--recompute" in r.args for r in xl.runs)
    meg = [flags(r) for r in xl.runs if r.system == "megatron"]
    assert len(meg) == 4 * 5 and {f["--micro-batch-size"] for f in meg} == {"1", "2", "4", "8", "16"}
    ours_tp = {(f["--tp"], f["--pp"]) for f in map(flags, xl.runs) if f["--system"] == "ours" and f["--tp"] != "1"}
    assert ours_tp == {("4", "2"), ("2", "4")}  # beside megatron's mixed layouts
    assert any(r.system == "ours" and flags(r)["--tp"] == "2" for r in layout)  # beside megatron T-2
    target, race = load_sweep(SWEEPS_DIR / "quality-target.toml"), load_sweep(SWEEPS_DIR / "quality.toml")
    assert not target.invalid_runs and not race.invalid_runs
    assert {r.system for r in target.runs} == {"reference"}
    assert {flags(r)["--seed"] for r in target.runs} == {"0", "1", "2"}
    shared = ("--model", "--num-layers", "--hidden-size", "--vocab-size", "--data", "--tokenizer", "--lr",
              "--seq-length")
    assert {tuple(flags(r).get(k) for k in shared) for r in target.runs + race.runs} == \
        {tuple(flags(target.runs[0]).get(k) for k in shared)}  # the race's model, text and optimizer
    assert {int(flags(r)["--batch-size"]) * int(flags(r)["--dp"]) for r in target.runs + race.runs} == {8}
    assert [flags(r)["--seed"] for r in race.runs] == sorted(flags(r)["--seed"] for r in race.runs)  # round-robin
    labels = {" ".join(f"{k}={flags(r).get(k)}" for k in ("--system", "--inner-steps", "--fragments"))
              for r in race.runs}
    assert "--system=diloco --inner-steps=32 --fragments=2" in labels
    assert all("--no-link-probe" in r.args for r in race.runs)
    assert len({r.network for r in race.runs}) == 4 and len(race.runs) == len(labels) * 4 * 3


def test_adhoc_network_sweep(tmp_path):
    s = adhoc_sweep(["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "4", "--micro-batch-size",
                     "1"],
                    ["default", "delay 3ms bandwidth 500Mbps"])
    assert [r.network for r in s.runs] == ["default", "delay 3ms bandwidth 500Mbps"]
    assert all(r.valid for r in s.runs)
    assert s.runs[1].args[-2:] == ("--network", "delay 3ms bandwidth 500Mbps")
    with pytest.raises(SweepError, match="--out is set by the sweep"):
        adhoc_sweep(["--system", "ours", "--out", "x"], ["default"])


def test_netem_sweep_sh_dry_run(tmp_path):
    out = tmp_path / "n.jsonl"
    p = subprocess.run(["bash", "runners/netem_sweep.sh", "d10-1g", "delay 3ms bandwidth 500Mbps", "--dry-run", "--out",
                        str(out), "--", "--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "4",
                        "--micro-batch-size", "1"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0, p.stderr
    cmds = [shlex.split(l) for l in p.stdout.splitlines() if "runners.run" in l]
    assert [c[c.index("--network") + 1] for c in cmds] == ["d10-1g", "delay 3ms bandwidth 500Mbps"]
    p = subprocess.run(["bash", "runners/netem_sweep.sh", "--dry-run", "--", "--system", "ours", "--model", "tiny",
                        "--pp", "2", "--batch-size", "4", "--micro-batch-size", "1"], cwd=REPO, capture_output=True,
                       text=True,
                       timeout=60, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("runners.run") == 5 and "results/netem_sweep.jsonl" in p.stdout
    p = subprocess.run(["bash", "runners/netem_sweep.sh", "d10-1g"], cwd=REPO, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "usage" in p.stderr


# ----------------------------------------------------------------------------------- cluster mode


def _remote_words(argv: list[str]) -> list[str]:
    """What the remote side executes: ssh ... HOST -- LINE; LINE is 'sh -c SCRIPT' (shlex-quoted)."""
    assert argv[0] == "ssh" and "--" in argv
    line = argv[argv.index("--") + 1]
    outer = shlex.split(line)
    assert outer[:2] == ["sh", "-c"] and len(outer) == 3
    return outer


def test_ssh_commands_keep_hostile_values_quoted(tmp_path):
    hostile_host = "a;rm -rf /"
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 4, "micro_batch_size": 1,
                                       "data": "my data; rm -rf ~/$(whoami) `x`.txt"},
                             "systems": ["ours"], "layouts": ["P-2"], "networks": ["d10-1g"]})
    run = sweep.runs[0]
    ex = ClusterExecutor([Host(hostile_host), Host("node1")], iface="eth0; reboot", ssh_user="bob",
                         ssh_config="/etc/my ssh config", remote_dir="/srv/{host}/my suite's dir",
                         remote_python="/opt/py 3/bin/python")
    nodes = NodePlacement((hostile_host, "node1"), 1)
    argv = ex.node_argv(run, nodes, 1, "/srv/my suite's dir/results/.x.jsonl")
    assert argv[:6] == ["ssh", "-o", "BatchMode=yes", "-F", "/etc/my ssh config", "bob@node1"]  # one argument each
    script = _remote_words(argv)[2]
    # The script: echo MARK$$ && cd DIR && mkdir -p results && exec ARGV...; every value a single shell word.
    first, cd, mkdir, exec_part = script.split(" && ", 3)
    assert shlex.split(cd) == ["cd", "/srv/node1/my suite's dir"]                # {host}: the node's own directory
    words = shlex.split(exec_part)
    assert words[0] == "exec"
    assert words[1:] == ex.run_argv(run, nodes, 1, "/srv/my suite's dir/results/.x.jsonl")
    assert words[1:4] == ["env", "GLOO_SOCKET_IFNAME=eth0; reboot", "NCCL_SOCKET_IFNAME=eth0; reboot"]
    assert words[4:6] == ["NCCL_IB_DISABLE=1", "NCCL_NET=Socket"]  # shaped: NCCL kept on the shaped interface
    unshaped = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 4, "micro_batch_size": 1},
                                "systems": ["ours"], "layouts": ["P-2"], "networks": ["none"]}).runs[0]
    assert "NCCL_NET=Socket" not in ex.run_argv(unshaped, nodes, 1, "/x.jsonl")
    assert words[words.index("--rdzv-endpoint") + 1] == "a;rm -rf /:29500"
    assert words[words.index("--data") + 1] == "my data; rm -rf ~/$(whoami) `x`.txt"
    assert words[words.index("--node-rank") + 1] == "1" and words[words.index("--nnodes") + 1] == "2"
    # node 0's ssh target is the hostile name, as one argv element
    argv0 = ex.node_argv(run, nodes, 0, "/tmp/x.jsonl")
    assert argv0[argv0.index("--") - 1] == "bob@a;rm -rf /"
    # stopping an interrupted node: kill -INT PID, quoted
    stop = ex.stop_argv("node1", "1234")
    assert shlex.split(stop[-1]) == ["kill", "-INT", "1234"]


def test_cluster_dry_run_prints_shaping_and_ssh(tmp_path):
    hf = write(tmp_path, "n0\nn1\n", "hosts")
    sf = write(tmp_path, "[fixed]\nmodel='tiny'\nbatch_size=4\nmicro_batch_size=1\n[[experiment]]\n"
                         "systems=[{name='ours', n_slices=2}]\nlayouts=['P-2', 'P-4']\nnetworks=['d10-1g']\n")
    p = subprocess.run([sys.executable, "-m", "runners.sweep", str(sf), "--hostfile", str(hf), "--iface", "ens5",
                        "--nproc-per-node", "1", "--dry-run", "--out", str(tmp_path / "o.jsonl")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    agents = [shlex.split(l) for l in lines if "network_emulation.shaping_agent" in l]
    assert [a[3] for a in agents] == ["n0", "n1"]                                   # a shaping agent on each node
    assert any("netem delay 10ms rate 1gbit" in l and "ens5" in l for l in lines)   # netem where the node has it
    assert any("tbf rate 1gbit" in l for l in lines)                                # else tbf + the delayer
    runs = [l for l in lines if "runners.run" in l]
    assert len(runs) == 2 and "--node-rank 1" in runs[1] and "GLOO_SOCKET_IFNAME=ens5" in runs[0]
    assert "does not fit: needs 4 GPUs, hostfile has 2" in p.stdout                 # P-4 on two 1-slot hosts
    assert not (tmp_path / "o.jsonl").exists()


def test_cluster_failure_without_record_is_recorded(tmp_path, monkeypatch):
    """ssh cannot reach anything: the run is recorded as an error (nothing is ssh-ed: Popen is faked)."""
    import runners.sweep.cluster as cl

    sweep = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 4, "micro_batch_size": 1},
                             "systems": ["ours"], "layouts": ["P-2"]})
    seen = []

    class FakeProc:
        def __init__(self, argv, **kw):
            seen.append(argv)
            self.stdout = io.StringIO("ssh: Could not resolve hostname n0\n")
            self.returncode = 255

        def poll(self):
            return self.returncode

    monkeypatch.setattr(cl.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(cl.subprocess, "run",
                        lambda argv, **kw: (seen.append(argv), subprocess.CompletedProcess(argv, 255, "", "no"))[1])
    out = tmp_path / "o.jsonl"
    rc, tail = ClusterExecutor([Host("n0"), Host("n1")])(sweep.runs[0], out)
    assert rc == 1 and "Could not resolve" in tail
    rec = json.loads(out.read_text())
    assert rec["status"] == "error" and rec["error"].startswith("n0 failed first: it did not answer ssh")
    assert "Could not resolve" in rec["error"] and rec["environment"]["cluster"]["hosts"] == ["n0", "n1"]
    assert rec["environment"]["cluster"]["nccl_env"] == {"NCCL_SOCKET_IFNAME": "eth0"}  # unshaped: no forcing
    assert rec["key"] == sweep.runs[0].key  # so a re-run of the sweep skips it
    assert all(a[0] == "ssh" for a in seen)


def test_run_all_sh_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", "runners/run_all.sh", "--dry-run", "--out", str(tmp_path / "l.jsonl")], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    local = load_sweep("local.toml")
    runs = len({r.key for r in local.valid_runs})
    assert p.stdout.count("runners.run") == runs * local.repeats and "sweep local" in p.stdout  # every launch
    p = subprocess.run(["bash", "runners/run_all.sh", "--dry-run", "--repeats", "1", "--out",
                        str(tmp_path / "l.jsonl")],
                       cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and p.stdout.count("runners.run") == runs, p.stderr
    hf = write(tmp_path, "n0\nn1\n", "hosts")
    p = subprocess.run(["bash", "runners/run_all.sh", "--hostfile", str(hf), "--iface", "ens5", "--dry-run",
                        "--only", "ours", "--out", str(tmp_path / "c.jsonl")], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert "gpt3-xl-cluster on 2 host(s)" in p.stdout and "does not fit: needs 12 GPUs, hostfile has 2" in p.stdout
    p = subprocess.run(["bash", "runners/run_all.sh", "--iface", "eth0"], cwd=REPO, capture_output=True, text=True,
                       timeout=30, env=env)
    assert p.returncode == 2 and "needs --hostfile" in p.stderr


def test_the_same_run_twice_in_a_sweep_is_refused():
    """torch_pipe written with and without its default schedule is one run, and so are two identical
    experiments: planned twice, the sweep file is bad (one line naming both), never one launch and a
    second "skipped (already recorded)"; an option of another system (ours' n_slices, trace) makes the
    sweep file bad instead of a second identity."""
    with pytest.raises(SweepError, match="the same run planned twice in experiment 'sweep'"):
        sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1}, "layouts": ["P-2"],
                         "systems": ["torch_pipe", {"name": "torch_pipe", "schedule": "gpipe"}]})
    experiment = {"name": "a", "layouts": ["1"], "systems": ["reference"]}
    with pytest.raises(SweepError, match="the same run planned twice in experiment 'a'"):
        sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1},
                         "experiment": [experiment, dict(experiment)]})
    for system, message in (({"name": "torch_pipe", "n_slices": 4, "dp_mode": "sharded_ps"},
                             "--dp-mode is an option of ours, not of torch_pipe"),
                            ({"name": "torch_pipe", "trace": "t.json"},
                             "--trace is an option of ours, not of torch_pipe")):
        with pytest.raises(SweepError, match=message):
            sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1}, "layouts": ["P-2"],
                             "systems": ["torch_pipe", system]})


@pytest.mark.faults
def test_a_second_sweep_on_the_same_records_is_refused(tmp_path, capsys):
    from runners.sweep.execute import records_lock

    out = tmp_path / "o.jsonl"
    sweep_file = write(tmp_path, SMALL)
    with records_lock(out):  # a sweep running (or a run command of a killed one, which inherits the lock)
        assert main([str(sweep_file), "--out", str(out), "--no-probe", "--no-report", "--only", "megatron"]) == 2
    assert "another sweep or run command is writing to" in capsys.readouterr().err


@pytest.mark.faults
@pytest.mark.parametrize("hostfile, message", [
    (None, "cannot read hostfile"),
    ("# nothing\n\n", "lists no hosts"),
    ("-oProxyCommand=x\n", "bad host name"),
])
def test_hostfile_errors_exit_2_with_one_line(tmp_path, hostfile, message):
    path = tmp_path / "hosts"
    if hostfile is not None:
        path.write_text(hostfile)
    p = subprocess.run([sys.executable, "-m", "runners.sweep", "local.toml", "--hostfile", str(path), "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr


def _matrix(path: Path, delay_ms: float, gbps: float) -> None:
    path.write_text(json.dumps({"delay_ms": [[0, delay_ms], [delay_ms, 0]], "bandwidth_gbps": [[0, gbps], [gbps, 0]]}))


def test_a_run_under_a_matrix_is_identified_by_the_matrix_it_ran(tmp_path):
    """Issue #31, item 3: a sweep under net.json, edited from 5 ms / 1 Gbit/s to 40 ms / 0.1 Gbit/s,
    skipped its run as already recorded, and the record's setting was read from the file afterwards."""
    net = tmp_path / "net.json"
    _matrix(net, 5, 1)
    sweep_file = write(tmp_path, f'name = "m"\nnetworks = ["{net}"]\nlayouts = ["P-2"]\nsystems = ["torch_pipe"]\n'
                                 f'[fixed]\nmodel = "tiny"\nbatch_size = 2\nmicro_batch_size = 1\n')
    (run,) = load_sweep(sweep_file).runs
    cfg, spec = parse_request(run.args)
    out = tmp_path / "o.jsonl"
    _matrix(net, 40, 0.1)  # edited while (or after) the run ran: the record says what it ran under
    out.write_text(build_record(cfg, spec, "ok", None, None, {}).to_json() + "\n")
    (rec,) = read_records(out)
    assert rec["key"] == run.key and rec["config"]["network_matrix"]["delay_ms"] == [[0, 5], [5, 0]]
    digest = cfg.network_digest()
    assert rec["network_setting"] == {"label": f"{net} (2 hosts, 5 ms, 1 Gbit/s) [{digest[:8]}]", "delay_ms": 5,
                                      "bandwidth_gbps": 1, "slowest_link": [0, 1], "link_classes": 1, "uniform": True,
                                      "digest": digest}
    (resumed,) = load_sweep(sweep_file).runs
    assert resumed.key != run.key and json.loads(resumed.key)["network_matrix"] != digest
    calls = []
    res = run_sweep(load_sweep(sweep_file), out, executor=lambda r, o: calls.append(r.key) or (0, ""), probe=False,
                    report=False, need_root_for_network=False, stream=io.StringIO())
    assert calls == [resumed.key] and res.skipped == 0
    plain, _ = parse_request(["--system", "torch_pipe", "--model", "tiny", "--pp", "2", "--batch-size", "2",
                              "--micro-batch-size", "1", "--network", "d10-1g"])
    assert "network_matrix" not in plain.key()  # every other run keeps the identity it had


def test_repeats_launch_every_run_round_robin_and_a_resumed_sweep_makes_only_the_missing_ones(tmp_path):
    sweep = load_sweep(write(tmp_path, 'repeats = 3\n' + SMALL))
    assert sweep.repeats == 3
    valid = [r for r in sweep.valid_runs if not r.emulated]
    net = [r for r in valid if r.experiment == "net"]
    out = tmp_path / "o.jsonl"
    out.write_text(_fake_record(net[0]) + "\n" + _fake_record(net[0]) + "\n"
                   + _fake_record(net[1], status="error") + "\n")
    calls: list[PlannedRun] = []

    def executor(r, o):
        calls.append(r)
        with open(o, "a") as f:
            f.write(_fake_record(r) + "\n")
        return 0, ""

    res = run_sweep(sweep, out, executor=executor, probe=False, report=False, need_root_for_network=False,
                    stream=io.StringIO(), only=["ours", "torch_pipe"])
    ran = [(r.key, r.repetition) for r in calls if not r.emulated]
    # net[0] had two launches: one more; net[1] failed: not repeated; the others three each
    assert ran.count((net[0].key, 3)) == 1 and not any(k == net[1].key for k, _ in ran)
    others = [r for r in net[2:]]
    assert all(sum(k == r.key for k, _ in ran) == 3 for r in others)
    # round-robin: every run's first launch before any second launch, within the experiment
    firsts = [i for i, (k, rep) in enumerate(ran) if rep == 1]
    seconds = [i for i, (k, rep) in enumerate(ran) if rep == 2]
    assert max(firsts) < min(seconds)
    assert res.skipped == 2 + 3  # net[0]'s two launches, net[1]'s failure (counted as every launch)
    # resumed: nothing left (the emulated runs ran too: need_root_for_network=False)
    calls.clear()
    res = run_sweep(sweep, out, executor=executor, probe=False, report=False, need_root_for_network=False,
                    stream=io.StringIO(), only=["ours", "torch_pipe"])
    assert calls == [] and res.ok == 0
    # --repeats 4 on the command line: one more launch of every run that did not fail
    calls.clear()
    run_sweep(sweep, out, executor=executor, probe=False, report=False, need_root_for_network=False,
              stream=io.StringIO(), only=["ours", "torch_pipe"], repeats=4)
    assert {r.repetition for r in calls} == {4} and net[1].key not in {r.key for r in calls}


def test_a_run_that_fails_is_not_launched_again_in_the_same_sweep(tmp_path):
    sweep = load_sweep(write(tmp_path, 'repeats = 2\n' + SMALL))
    calls = []
    res = run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r.key) or (1, "boom"), probe=False,
                    report=False, need_root_for_network=False, stream=io.StringIO())
    assert len(calls) == len({r.key for r in sweep.valid_runs}) and res.failed == len(calls)
    assert res.not_run == len(calls)  # the second launches


@pytest.mark.parametrize("value", [0, -1, "3", 1.5, True])
def test_repeats_must_be_a_positive_integer(tmp_path, value, capsys):
    with pytest.raises(SweepError, match="'repeats' must be a positive integer"):
        sweep_from_dict({"repeats": value, **{"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1},
                                              "systems": ["reference"]}})
    assert main([str(write(tmp_path, SMALL)), "--repeats", "0", "--dry-run"]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_speed_probes_are_taken_before_each_experiment_and_after_the_last(tmp_path):
    """``--speed-probes``: the host's speed (``python -m predict probe``, a real one) before each experiment's
    first launch and after the last launch, kept in OUT.speed for ``predict records``; none in cluster mode."""
    from runners.sweep.execute import speed_probes_path

    sweep = load_sweep(write(tmp_path, SMALL))
    out, said, order = tmp_path / "o.jsonl", io.StringIO(), []
    probes = speed_probes_path(out)

    def executor(r, o):
        order.append((r.experiment, len(probes.read_text().splitlines())))
        return 0, ""

    run_sweep(sweep, out, executor=executor, probe=False, report=False, need_root_for_network=False, stream=said,
              speed_probes=True)
    kept = [json.loads(line) for line in probes.read_text().splitlines()]
    assert [p["label"] for p in kept] == ["before net", "before layout", "after the runs"]
    assert all(p["speed_tflops"] > 0 for p in kept)
    assert {e: n for e, n in order} == {"net": 1, "layout": 2}  # each experiment's launches after its probe
    assert said.getvalue().count("speed probe (before ") == 2

    class Cluster:
        cluster = True

        def __call__(self, r, o):
            return 0, ""

    run_sweep(sweep, tmp_path / "c.jsonl", executor=Cluster(), probe=False, report=False, need_root_for_network=False,
              stream=io.StringIO(), speed_probes=True)
    assert not speed_probes_path(tmp_path / "c.jsonl").exists()

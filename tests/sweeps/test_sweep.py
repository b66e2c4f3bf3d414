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

from runners.record import build_record
from runners.request import parse_request
from runners.sweep.__main__ import main
from runners.sweep.cluster import ClusterExecutor
from runners.sweep.hostfile import Host, NodePlacement, parse_hostfile
from runners.sweep.execute import recorded_keys, run_sweep
from runners.sweep.plan import (SWEEPS_DIR, PlannedRun, SweepError, adhoc_sweep, load_sweep, parse_layout,
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
  dp_mode = "central_ps"
  [[experiment.systems]]
  name = "torch_pipe"
  schedule = ["gpipe", "1f1b"]

[[experiment]]
name = "layout"
micro_batch_sizes = [1, 2, 3]
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


def test_cross_product_and_system_options(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    net = [r for r in sweep.runs if r.experiment == "net"]
    # 2 networks x (ours 1 option combo + torch_pipe 2 schedules) x 2 layouts x 1 micro-batch
    assert len(net) == 2 * 3 * 2
    assert all(r.valid for r in net), [r.error for r in net if not r.valid]
    ours = [flags(r) for r in net if r.system == "ours"]
    assert all(f["--n-slices"] == "4" and f["--dp-mode"] == "central_ps" for f in ours)
    assert {(f["--pp"], f["--dp"], f["--network"]) for f in ours} == {("2", "1", "none"), ("2", "2", "none"),
                                                                       ("2", "1", "d10-1g"), ("2", "2", "d10-1g")}
    tp = [flags(r) for r in net if r.system == "torch_pipe"]
    assert sorted({f["--schedule"] for f in tp}) == ["1f1b", "gpipe"]
    assert all("--n-slices" not in f for f in tp)
    for r in net:  # argument lists of plain strings, fixed settings in every one
        assert all(isinstance(a, str) for a in r.args)
        f = flags(r)
        assert (f["--model"], f["--seq-length"], f["--batch-size"], f["--steps"], f["--warmup"]) == ("tiny", "32", "4", "2", "0")
        assert r.command("o.jsonl")[:3] == [sys.executable, "-m", "runners.run"]
        assert r.command("o.jsonl")[-2:] == ["--out", "o.jsonl"]
    assert len({r.key for r in net}) == len(net)


def test_invalid_combinations_are_reported_not_run(tmp_path):
    sweep = load_sweep(write(tmp_path, SMALL))
    layout = [r for r in sweep.runs if r.experiment == "layout"]
    assert len(layout) == 2 * 3
    bad = [r for r in layout if not r.valid]
    # micro-batch 3 does not divide the batch of 4
    assert {flags(r)["--micro-batch-size"] for r in bad} == {"3"}
    assert all("not divisible" in r.error for r in bad)
    assert {r.world for r in layout if r.valid} == {2, 4}
    calls = []
    out = io.StringIO()
    res = run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r) or (0, "done"),
                    probe=False, report=False, need_root_for_network=False, stream=out)
    assert res.invalid == len(bad) and res.ok == len(sweep.runs) - len(bad)
    assert all(r.valid for r in calls)
    assert "skip (bad combination)" in out.getvalue() and "not divisible" in out.getvalue()


def test_unsupported_dimension_is_invalid():
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1},
                             "systems": ["reference", "torch_pipe"], "layouts": ["T-2"]})
    assert [r.valid for r in sweep.runs] == [False, False]
    assert "does not support --tp" in sweep.runs[0].error


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
     "must be a string or a number"),
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
    p = subprocess.run([sys.executable, "-m", "runners.sweep", str(write(tmp_path, SMALL)), "--dry-run", "--out", str(out)],
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
    settings = ["default", "d10-1g"]  # two of the seed's settings (for time)
    assert sorted({r.network for r in net}) == sorted(settings)
    per_setting = {s: sorted(r.label().replace(s, "") for r in net if r.network == s) for s in settings}
    assert all(v == per_setting["default"] for v in per_setting.values())  # the same runs under every setting
    modes = {flags(r).get("--dp-mode") for r in net if r.system == "ours" and flags(r)["--dp"] == "2"}
    assert modes == {"allreduce", "sharded_ps"} and any(r.system == "torch_pipe" for r in net)
    layout = [r for r in local.runs if r.experiment.startswith("layout")]
    assert {flags(r)["--seq-length"] for r in layout} == {"1024"} and {flags(r)["--batch-size"] for r in layout} == {"1", "2"}
    assert {r.system for r in layout} >= {"reference", "torch_pipe", "ours", "megatron", "fairscale_fsdp"}
    assert any(r.system == "fairscale_fsdp" and flags(r)["--dp"] == "2" for r in net)  # Pipe + FSDP
    assert local.repeats == 3  # every claim of the main job rests on three launches
    check = load_sweep(SWEEPS_DIR / "predict-check.toml")
    assert not check.invalid_runs and not {r.network for r in check.runs} & ({r.network for r in net} | {"none"})
    xl = load_sweep(SWEEPS_DIR / "gpt3-xl-cluster.toml")
    assert not xl.invalid_runs, [(r.label(), r.error) for r in xl.invalid_runs]
    ours_dp4 = [flags(r) for r in xl.runs if r.system == "ours" and flags(r)["--dp"] == "4"]
    assert len(ours_dp4) == 5 and all(f["--pp"] == "12" and f["--dp-mode"] == "central_ps" for f in ours_dp4)
    assert all(flags(r)["--model"] == "gpt3-xl" and "--recompute" in r.args for r in xl.runs)
    meg = [flags(r) for r in xl.runs if r.system == "megatron"]
    assert len(meg) == 4 * 5 and {f["--micro-batch-size"] for f in meg} == {"1", "2", "4", "8", "16"}


def test_adhoc_network_sweep(tmp_path):
    s = adhoc_sweep(["--system", "ours", "--model", "tiny", "--pp", "2", "--batch-size", "4", "--micro-batch-size", "1"],
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
                        "--batch-size", "4", "--micro-batch-size", "1"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("runners.run") == 5 and "results/netem_sweep.jsonl" in p.stdout
    p = subprocess.run(["bash", "runners/netem_sweep.sh", "d10-1g"], cwd=REPO, capture_output=True, text=True, timeout=30)
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
    monkeypatch.setattr(cl.subprocess, "run", lambda argv, **kw: (seen.append(argv), subprocess.CompletedProcess(argv, 255, "", "no"))[1])
    out = tmp_path / "o.jsonl"
    rc, tail = ClusterExecutor([Host("n0"), Host("n1")])(sweep.runs[0], out)
    assert rc == 1 and "Could not resolve" in tail
    rec = json.loads(out.read_text())
    assert rec["status"] == "error" and rec["error"].startswith("n0 failed first: it did not answer ssh")
    assert "Could not resolve" in rec["error"] and rec["environment"]["cluster"]["hosts"] == ["n0", "n1"]
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
    p = subprocess.run(["bash", "runners/run_all.sh", "--dry-run", "--repeats", "1", "--out", str(tmp_path / "l.jsonl")],
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


def test_the_same_run_twice_in_a_sweep_runs_once(tmp_path):
    """torch_pipe written with and without its default schedule is one run; an option of another
    system (ours' n_slices, trace) makes the combination invalid instead of a second identity."""
    sweep = sweep_from_dict({"fixed": {"model": "tiny", "batch_size": 2, "micro_batch_size": 1},
                             "layouts": ["P-2"],
                             "systems": ["torch_pipe", {"name": "torch_pipe", "schedule": "gpipe"},
                                         {"name": "torch_pipe", "n_slices": 4, "dp_mode": "sharded_ps"},
                                         {"name": "torch_pipe", "trace": "t.json"}]})
    valid, invalid = sweep.valid_runs, sweep.invalid_runs
    assert len(valid) == 2 and valid[0].key == valid[1].key
    assert [r.error for r in invalid] == ["--dp-mode is an option of ours, not of torch_pipe",
                                          "--trace is an option of ours, not of torch_pipe"]
    calls = []
    res = run_sweep(sweep, tmp_path / "o.jsonl", executor=lambda r, o: calls.append(r.key) or (0, ""), probe=False,
                    report=False, need_root_for_network=False, stream=io.StringIO())
    assert len(calls) == 1 and res.skipped == 1 and res.invalid == 2


@pytest.mark.faults
def test_a_second_sweep_on_the_same_records_is_refused(tmp_path, capsys):
    from runners.sweep.execute import records_lock

    out = tmp_path / "o.jsonl"
    sweep_file = write(tmp_path, SMALL)
    with records_lock(out):  # a sweep running (or a run command of a killed one, which inherits the lock)
        assert main([str(sweep_file), "--out", str(out), "--no-probe", "--no-report", "--only", "megatron"]) == 2
    assert "another sweep (or a run it started) is writing to" in capsys.readouterr().err


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


def test_repeats_launch_every_run_round_robin_and_a_resumed_sweep_makes_only_the_missing_ones(tmp_path):
    sweep = load_sweep(write(tmp_path, 'repeats = 3\n' + SMALL))
    assert sweep.repeats == 3
    valid = [r for r in sweep.valid_runs if not r.emulated]
    net = [r for r in valid if r.experiment == "net"]
    out = tmp_path / "o.jsonl"
    out.write_text(_fake_record(net[0]) + "\n" + _fake_record(net[0]) + "\n" + _fake_record(net[1], status="error") + "\n")
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

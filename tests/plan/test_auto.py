"""auto_slicing: one rule, the planner over the run's compute model (this CPU's profile at the layer
shape, else the host as a device of its own); the CLI end to end on a small shape."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract import RunConfig
from ours import OursOptions, describe_slicing, uniform_slices
from ours.plan.auto import PROFILES, auto_slicing, cache_key, compute_model, host_device, profile_path
from ours.plan.planner import default_granularity, pipeline_time
from workload.compute import GpuCompute
from workload.configs import MODEL_CONFIGS

REPO = Path(__file__).resolve().parents[2]
TINY_PROFILE = PROFILES / "cpu-h128-a4-s128-v512.json"


def _config(model="tiny", pp=2, batch=2, micro=1, **over):
    m = MODEL_CONFIGS[model].with_overrides(**over)
    return RunConfig(system="ours", model=m, batch_size=batch, micro_batch_size=micro, pp=pp,
                     options=OursOptions(n_slices="auto"))


def test_the_planner_over_this_hosts_profile_slices_a_pipeline_and_not_one_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    shutil.copy(TINY_PROFILE, tmp_path / TINY_PROFILE.name)
    two = auto_slicing(_config(pp=2), torch.device("cpu"))
    assert sum(two.slices) == 128 and len(two.slices) > 1 and two.source == f"planner (profile {TINY_PROFILE.name})"
    cm, link, _ = compute_model(_config(pp=2), "cpu")  # no worse than equal slices by the planner's own cost
    cost = {k: pipeline_time(cm, _config().model, uniform_slices(128, k), b=1, batch_size=2, n_stages=2, link=link)
            for k in (1, 2, 4, 8)}
    assert pipeline_time(cm, _config().model, two.slices, b=1, batch_size=2, n_stages=2, link=link) <= min(
        cost.values()) * (1 + 1e-9)
    one = auto_slicing(_config(pp=1), torch.device("cpu"))
    assert one.slices == (128,)  # nothing to fill: every slice only adds its own costs
    assert describe_slicing({"n_slices": "auto", "slices": [128], "slicing": one.source}) == "auto, planner: K=1 (128)"
    assert two.slices == auto_slicing(_config(pp=2), torch.device("cpu")).slices  # deterministic


def test_a_profile_at_a_longer_sequence_covers_shorter_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    for s in (256, 512):
        shutil.copy(TINY_PROFILE, tmp_path / f"cpu-h128-a4-s{s}-v512.json")
    assert profile_path(_config().model, "cpu").name == "cpu-h128-a4-s256-v512.json"  # shortest that covers
    assert profile_path(_config(seq_len=512).model, "cpu").name == "cpu-h128-a4-s512-v512.json"
    assert profile_path(_config(seq_len=1024).model, "cpu") is None
    assert profile_path(_config(vocab_size=1024).model, "cpu") is None


def test_a_llama_model_reads_only_a_profile_of_its_family_and_heads(tmp_path, monkeypatch):
    """llama-tiny has tiny's hidden size, heads, sequence and vocabulary: a gpt profile of that shape is not
    its own; its file name says the family, the key/value heads and the MLP's width."""
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    shutil.copy(TINY_PROFILE, tmp_path / TINY_PROFILE.name)
    llama = _config("llama-tiny").model
    assert profile_path(llama, "cpu") is None
    assert cache_key(llama, "cpu") == "cpu-llama-h128-a4-kv2-f512-s128-v512"
    shutil.copy(TINY_PROFILE, tmp_path / f"{cache_key(llama, 'cpu')}.json")
    assert profile_path(llama, "cpu").name == "cpu-llama-h128-a4-kv2-f512-s128-v512.json"
    assert profile_path(_config("llama-tiny", kv_heads=4).model, "cpu") is None
    assert profile_path(_config().model, "cpu").name == TINY_PROFILE.name


def test_without_a_profile_the_host_is_a_device_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("OURS_PLAN_DIR", str(tmp_path))
    monkeypatch.setattr("workload.cpu_peak.cpu_peak_tflops", lambda m, b: (0.05, "a test"))
    chosen = auto_slicing(_config(pp=2, seq_len=512), torch.device("cpu"))
    assert sum(chosen.slices) == 512 and "measured peak (0.050 TFLOP/s)" in chosen.source
    dev = host_device(0.05)
    g = GpuCompute(dev, _config().model)
    assert dev.peak_flops("fp32") == 5e10 and g.layer_step(1, 64, 0) > 0
    assert default_granularity(2048) == 32 and default_granularity(256) == 8


@pytest.mark.multiprocess  # the profile's point-to-point part starts two gloo processes
def test_a_profile_that_cannot_be_written_is_refused_before_profiling(tmp_path, monkeypatch, capsys):
    """``profile --out`` (or the profile directory) where no file can be made was a traceback after the
    minutes of profiling; now one line and exit status 2, and nothing is profiled."""
    from ours.plan import __main__ as cli
    from ours.plan import profile as profiling

    monkeypatch.setattr(profiling, "profile", lambda *a, **k: pytest.fail("profiled"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for args, env in ((["--out", str(blocker / "p.json")], None), ([], str(blocker / "profiles"))):
        if env:
            monkeypatch.setenv("OURS_PLAN_DIR", env)
        assert cli.main(["profile", "--model", "tiny", "--quick", "--no-progress", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{blocker} is not a directory" in err[0], err


def test_cli_profile_solve(tmp_path):
    env = {"OURS_PLAN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def run(*a):
        return subprocess.run([sys.executable, "-m", "ours.plan", *a], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)

    p = run("profile", "--model", "tiny", "--seq-len", "64", "--quick", "--no-progress")
    assert p.returncode == 0, p.stderr
    (prof,) = tmp_path.glob("cpu-h128-a4-s64-v512.json")
    d = json.loads(prof.read_text())
    assert d["model"]["seq_len"] == 64 and d["torch"] == torch.__version__
    assert {x["c"] for x in d["layer"]} > {0} and d["p2p_fit"]["latency"] > 0
    p = run("solve", "--model", "tiny", "--seq-len", "64", "--pp", "2", "--batch-size", "2", "--json",
            "--out", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert sum(plan["slices"]) == 64 and plan["batch_slice"] in (1, 2) and plan["predicted_pipeline"] > 0
    assert "slices [" in p.stdout.splitlines()[-1]
    p = run("solve", "--model", "tiny", "--seq-len", "32", "--pp", "2", "--batch-size", "2")
    assert p.returncode == 0 and "cpu-h128-a4-s64-v512.json" not in p.stdout  # a longer profile covers it

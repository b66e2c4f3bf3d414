import json
import os
import threading

import pytest
import torch

from baselines.torch_pipe import SPEC as TORCH_PIPE, TorchPipeOptions
from contract import RunConfig
from runners import record as record_mod
from runners.launcher import LaunchResult
from contract.records import read_records
from runners.record import append_record, build_record
from runners.run import compare
from runners.tolerance import FP32_TOLERANCE
from workload.configs import get_model_config


def _cfg(**kw) -> RunConfig:
    base = dict(system="torch_pipe", model=get_model_config("tiny"), batch_size=4, micro_batch_size=1, pp=2,
                options=TorchPipeOptions())
    base.update(kw)
    return RunConfig(**base)


def _rank(rank, times, losses=None, busy=None):
    return {"rank": rank, "step_times": times, "losses": losses, "dp_sync_times": [0.0] * len(times),
            "busy_times": busy or [],
            "gpu_memory": [], "cpu_rss_bytes": 100 + rank, "extra": {}, "hostname": "h", "device": "cpu",
            "device_name": "cpu",
            "backend": "gloo", "peak_tflops": 0.1, "peak_source": "measured-matmul:fp32"}


def test_record_aggregates_ranks():
    ranks = [_rank(0, [1.0, 2.0, 3.0]), _rank(1, [1.5, 1.0, 3.5], [5.0, 4.0, 3.0])]
    rec = build_record(_cfg(), TORCH_PIPE, "ok", None, ranks, {"torch_version": "x"})
    assert rec.step_times == [1.5, 2.0, 3.5]  # slowest rank per step
    assert rec.median_step_time == 2.0
    assert rec.losses == [5.0, 4.0, 3.0]
    assert rec.tokens_per_s == 4 * 128 / 2.0
    assert rec.peak_memory_bytes == [100, 101]
    assert rec.mfu == pytest.approx(rec.tflops_per_device / 0.1)
    assert rec.busy_fraction == []  # no CPU times (a GPU run): no busy share


def test_record_barrier_on_the_last_and_the_first_rank_to_arrive():
    ranks = [_rank(0, [1.0, 1.0]), _rank(1, [1.0, 1.0])]
    ranks[0]["barrier_times"], ranks[1]["barrier_times"] = [0.001, 0.002], [0.030, 0.025]
    rec = build_record(_cfg(), TORCH_PIPE, "ok", None, ranks, {})
    assert rec.barrier_time == pytest.approx(0.0015) and rec.barrier_time_first == pytest.approx(0.0275)


def test_record_busy_share_per_rank():
    ranks = [_rank(0, [1.0, 3.0], busy=[0.5, 1.5]), _rank(1, [2.0, 2.0], busy=[1.9, 1.7])]
    rec = build_record(_cfg(), TORCH_PIPE, "ok", None, ranks, {})
    assert rec.busy_fraction == pytest.approx([0.5, 0.9])  # CPU time over the rank's own step times


def test_failed_run_still_records():
    rec = build_record(_cfg(), TORCH_PIPE, "oom", "rank 1: out of memory", None, {})
    assert rec.status == "oom" and rec.median_step_time is None and rec.step_times == []


def test_append_is_atomic_under_concurrency_and_failure(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    recs = [build_record(_cfg(seed=i), TORCH_PIPE, "ok", None, None, {}) for i in range(20)]
    threads = [threading.Thread(target=append_record, args=(path, r)) for r in recs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(r["config"]["seed"] for r in read_records(path)) == list(range(20))
    before = path.read_bytes()

    def broken_replace(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(record_mod.os, "replace", broken_replace)
    with pytest.raises(OSError):
        append_record(path, recs[0])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".r.jsonl.")] == []


def test_verification_detects_differences():
    g = {"a": torch.ones(3)}
    ok = LaunchResult("ok", None, [_rank(0, [1.0], [2.0, 1.0])], g)
    same = LaunchResult("ok", None, [_rank(0, [1.0], [2.0, 1.0 + 5e-6])], {"a": torch.ones(3) + 5e-6})
    assert compare(same, ok, FP32_TOLERANCE).passed
    off_loss = LaunchResult("ok", None, [_rank(0, [1.0], [2.0, 1.1])], g)
    assert not compare(off_loss, ok, FP32_TOLERANCE).passed
    off_grad = LaunchResult("ok", None, [_rank(0, [1.0], [2.0, 1.0])], {"a": torch.tensor([1.0, 1.0, 1.001])})
    assert not compare(off_grad, ok, FP32_TOLERANCE).passed
    missing = LaunchResult("ok", None, [_rank(0, [1.0], [2.0, 1.0])], {})
    v = compare(missing, ok, FP32_TOLERANCE)
    assert not v.passed and "no gradient" in v.reason
    assert "FAIL" in v.line()


def test_append_keeps_the_mode_and_writes_through_a_symlink(tmp_path):
    target = tmp_path / "real.jsonl"
    target.write_text("")
    os.chmod(target, 0o644)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    append_record(link, build_record(_cfg(), TORCH_PIPE, "ok", None, None, {}))
    assert link.is_symlink() and len(read_records(target)) == 1
    assert os.stat(target).st_mode & 0o777 == 0o644
    fresh = tmp_path / "new.jsonl"
    append_record(fresh, build_record(_cfg(), TORCH_PIPE, "ok", None, None, {}))
    assert os.stat(fresh).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_record_is_strict_json_with_label_key_and_options_from_the_spec():
    rec = build_record(_cfg(), TORCH_PIPE, "error", "x", None, {}, verify={"max_abs_loss_diff": float("nan")})
    d = json.loads(rec.to_json())  # a NaN would not be valid JSON: it becomes null
    assert d["verify"]["max_abs_loss_diff"] is None
    assert d["label"] == "torch_pipe gpipe" and d["role"] == "baseline"
    assert d["options"] == {"schedule": "gpipe", "virtual_pp": 1, "layers_per_stage": None} and d["key"] == _cfg().key()
    assert json.loads(d["key"])["options"] == {"schedule": "gpipe", "virtual_pp": 1}  # equal stages: as it always was
    assert _cfg(timeout=5.0, verify=True).key() == _cfg().key() != _cfg(steps=3).key()


@pytest.mark.faults
def test_one_writer_of_a_records_file_at_a_time(tmp_path):
    """Issue #31, item 13: two run commands writing the same --out at once both succeeded, each timing
    the other's load. The second is refused before it launches anything; the run command a sweep
    starts holds the sweep's lock with it."""
    import subprocess
    import sys

    from runners.record import HELD_LOCK_ENV, hold_records
    from tests.conftest import REPO, TINY, run_cli

    out = tmp_path / "r.jsonl"
    fd = hold_records(out)  # a run command or a sweep writing to it
    try:
        proc = run_cli("--system", "reference", *TINY, "--batch-size", "1", "--micro-batch-size", "1",
                       "--out", str(out), timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"--out {out}: another run command or sweep is writing to it now" in lines[0]
        hold = "import sys; from runners.record import hold_records; hold_records(sys.argv[1]); print('held')"
        inherited = subprocess.run([sys.executable, "-c", hold, str(out)], cwd=REPO, capture_output=True, text=True,
                                   pass_fds=(fd,), env={**os.environ, HELD_LOCK_ENV: str(fd)})
        assert inherited.stdout.strip() == "held", inherited.stderr
        alone = subprocess.run([sys.executable, "-c", hold, str(out)], cwd=REPO, capture_output=True, text=True)
        assert alone.returncode == 1 and "BlockingIOError" in alone.stderr
    finally:
        os.close(fd)
    os.close(hold_records(out))  # released with its holder
    assert not out.exists()


def test_every_record_says_what_produced_it(tmp_path, monkeypatch, request):
    """The code's commit, whether tracked files outside results/ differed from it, and the versions."""
    import subprocess

    rec = json.loads(build_record(_cfg(), TORCH_PIPE, "error", "x", None, {}).to_json())
    env = rec["environment"]
    assert len(env["git_commit"]) == 40 and isinstance(env["git_dirty"], bool)
    assert set(env["versions"]) == {"python", "torch", "megatron-core", "fairscale", "torchft"}

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (tmp_path / "results").mkdir()
    for name in ("code.py", "results/r.jsonl"):
        (tmp_path / name).write_text("1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    monkeypatch.setattr(record_mod, "_ROOT", tmp_path)
    request.addfinalizer(record_mod.provenance.cache_clear)
    seen = []
    for change in (None, "results/r.jsonl", "code.py"):
        if change:
            (tmp_path / change).write_text("2\n")
        record_mod.provenance.cache_clear()
        seen.append((record_mod.provenance()["git_dirty"], record_mod.provenance()["git_changed"]))
    assert seen == [(False, []), (False, []), (True, ["code.py"])]
    monkeypatch.setattr(record_mod, "_ROOT", tmp_path.parent / "nowhere")
    record_mod.provenance.cache_clear()
    assert record_mod.provenance()["git_commit"] is None and record_mod.provenance()["git_dirty"] is None


# -- issue #54 items 2 and 5: a record counts only the work that ran, and says when a trace was not reached

def _diloco_cfg(**kw) -> RunConfig:
    from ours.diloco import DiLoCoOptions

    base = dict(system="diloco", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1, dp=2,
                steps=4, warmup=1, kill_replica="1@3", options=DiLoCoOptions(inner_steps=2))
    base.update(kw)
    return RunConfig(**base)


def test_a_killed_replica_counts_only_the_steps_it_ran():
    """Item 2: replica 1 of 2 ran steps 0-2 of 5 (one warm-up): the measured steps 1..4 were run by 2, 2, 1,
    1 replicas; tokens/s is their mean work over the median step time, per device over the devices
    that ran (one a replica: the survivor's rank), so the MFU is one replica's, not two's."""
    from ours.diloco import SPEC as DILOCO

    faults = {"replicas": [{"replica": 0, "lives": [{"steps": [0, 4], "ended": "finished"}]},
                           {"replica": 1, "lives": [{"steps": [0, 2], "ended": "killed after 3 steps"}]}]}
    rec = build_record(_diloco_cfg(), DILOCO, "ok", None, [_rank(0, [1.0, 1.0, 2.0, 2.0])], {"faults": faults})
    assert rec.replicas_per_step == [2, 2, 1, 1]
    assert rec.median_step_time == 1.5 and rec.tokens_per_s == pytest.approx(1.5 * 2 * 128 / 1.5)
    assert rec.environment["device_count"] == 2  # the run's devices, one a replica
    assert rec.tokens_per_s_per_device == pytest.approx(2 * 128 / 1.5)  # one replica's pace, per device
    healthy = build_record(_diloco_cfg(kill_replica=None), DILOCO, "ok", None,
                           [_rank(0, [1.0, 1.0, 2.0, 2.0]), _rank(1, [1.0, 1.0, 2.0, 2.0])], {})
    assert healthy.replicas_per_step == [] and healthy.tokens_per_s == 2 * 2 * 128 / 1.5
    assert healthy.mfu == pytest.approx(rec.mfu)  # per device the same pace: the same MFU


def test_an_old_record_of_a_killed_replica_is_counted_again_from_its_own_fields(tmp_path):
    """Item 2: a record written when a killed replica's tokens still counted (the committed D-3 kill
    records) is counted again from its step times, warm-up and replicas' lives (``recount``); other
    records stay byte for byte."""
    from ours.diloco import SPEC as DILOCO

    faults = {"replicas": [{"replica": 0, "lives": [{"steps": [0, 4], "ended": "finished"}]},
                           {"replica": 1, "lives": [{"steps": [0, 2], "ended": "killed after 3 steps"}]}]}
    now = build_record(_diloco_cfg(), DILOCO, "ok", None, [_rank(0, [1.0, 1.0, 2.0, 2.0])], {"faults": faults})
    old = json.loads(now.to_json())
    del old["replicas_per_step"]
    old["environment"]["device_count"] = 1  # the survivors' ranks, as such a record said
    old.update(tokens_per_s=2 * 2 * 128 / 1.5, mfu=2 * now.mfu)  # both replicas' tokens, as it counted them
    plain = build_record(_diloco_cfg(kill_replica=None), DILOCO, "ok", None, [_rank(0, [1.0] * 4)] * 2, {})
    f = tmp_path / "old.jsonl"
    f.write_bytes(plain.to_json().encode() + b"\n" + json.dumps(old).encode() + b"\n")
    assert record_mod.recount_file(f) == 1 and record_mod.recount_file(f) == 0
    first, second = f.read_bytes().splitlines()
    assert first == plain.to_json().encode()
    again = json.loads(second)
    for name in ("replicas_per_step", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu"):
        assert again[name] == pytest.approx(getattr(now, name)), name
    assert again["environment"]["device_count"] == 2


def test_trace_points_no_measured_step_ran_under_are_warned_and_not_claimed():
    """Item 5: a trace point applied after the last measured step (or never: the run ended first) is
    named in the record's warnings; where no point had a step run under it, the label says the trace
    was not reached instead of '+ trace'."""
    from network_emulation.traces import trace_from

    contents = {"links": "all", "points": [{"at_s": 0.5, "delay_ms": 5}, {"at_s": 60, "delay_ms": 20}]}
    cfg = _cfg(network="delay 10ms bandwidth 1Gbps", network_trace="/x/late.json",
               network_trace_contents=trace_from(contents, "late").contents())
    ranks = [dict(_rank(0, [0.2, 0.2, 0.2]), step_starts=[0.0, 0.2, 0.4]), _rank(1, [0.2, 0.2, 0.2])]

    def record(applied):
        trace = {"name": "late", **contents, "applied": applied}
        return build_record(cfg, TORCH_PIPE, "ok", None, ranks, {"network": {"trace": trace}})

    reached = record([{"at_s": 0.5, "delay_ms": 5, "applied_s": 0.51}])  # during the last step: it ran under it
    assert reached.environment["network"]["trace"]["applied"][0]["measured_steps"] == 1
    assert "+ trace late" in reached.network_setting["label"]
    assert len(reached.warnings) == 1 and "at 60 s" in reached.warnings[0]  # never applied: the run had ended
    late = record([{"at_s": 0.5, "delay_ms": 5, "applied_s": 0.7}])  # after the last step ended
    assert "+ trace" not in late.network_setting["label"] and "not reached" in late.network_setting["label"]
    assert late.network_setting["trace"]["reached"] is False and "at 0.5 s, 60 s" in late.warnings[0]

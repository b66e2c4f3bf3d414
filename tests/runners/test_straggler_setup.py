"""A straggler's set-up without ranks: the CPU quota where a cgroup can be made, the pause elsewhere."""
from __future__ import annotations

import time

from runners import faults
from runners.faults import RankHooks, Straggler
from runners.request import parse_request
from tests.conftest import TINY

OURS = ["--system", "ours", *TINY, "--pp", "2", "--batch-size", "2", "--micro-batch-size", "1"]


def test_a_quota_where_a_cgroup_can_be_made_and_nothing_left_after(monkeypatch):
    cfg, _ = parse_request([*OURS, "--slow-rank", "1:2"])
    with Straggler(cfg.replace(hardware="cpu")) as slow:
        made = slow.procs
        if made is None:  # no CPU cgroup here: the pause, and the record says so
            assert slow.method.startswith("pause") and slow.env() == {faults.SLOW_ENV: "pause:2"}
        else:
            assert slow.method.startswith("CPU quota: 1/2 of") and made.exists()
            assert slow.env() == {faults.SLOW_ENV: f"cgroup:{made}"}
    assert made is None or not made.parent.exists()


def test_the_pause_where_no_quota_can_be_set_and_on_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(faults, "_cpu_hierarchy", lambda: None)
    cfg, _ = parse_request([*OURS, "--slow-rank", "1:3"])
    with Straggler(cfg.replace(hardware="cpu")) as slow:
        assert slow.procs is None and "CPU time of the rank's process" in slow.method
        assert slow.describe() == {"rank": 1, "factor": 3.0, "method": slow.method}
        env = slow.env()
    with Straggler(cfg.replace(hardware="cuda:NVIDIA H100")) as gpu:
        assert gpu.procs is None and "own step time" in gpu.method
    monkeypatch.setenv(faults.SLOW_ENV, env[faults.SLOW_ENV])
    slow_rank = RankHooks.of(cfg, tmp_path, 1, 2, on_gpu=False)
    assert RankHooks.of(cfg, tmp_path, 0, 2, on_gpu=False).pause_factor == 1
    start = time.perf_counter()
    slow_rank.after_step(0, own_s=1.0, busy_s=0.05)  # pauses (3 - 1) x 0.05 s of CPU time
    assert 0.1 <= time.perf_counter() - start < 0.5


def test_a_killed_rank_says_so_before_it_dies(tmp_path):
    cfg, _ = parse_request([*OURS, "--kill-replica", "1@3"])
    hooks = RankHooks.of(cfg, tmp_path, 1, 2, on_gpu=False)
    assert hooks.kill_after == 3 and RankHooks.of(cfg, tmp_path, 0, 2, on_gpu=False).kill_after is None
    hooks.before_step(2)  # not yet
    hooks.started()
    hooks.started()  # the first rank to start marks it; the others find it marked
    assert (tmp_path / faults.STARTED).exists() and faults.killed_ranks(tmp_path) == []

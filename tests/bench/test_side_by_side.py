"""The side-by-side benchmark script and its machine check (run for real, on the tiny model)."""
import os
import subprocess
import sys

import pytest

from bench.machine import Capacity, parallel_capacity
from tests.conftest import REPO


@pytest.mark.extended
@pytest.mark.multiprocess
def test_parallel_capacity_measures_processes_at_once():
    cap = parallel_capacity(2, seconds=0.3)
    assert cap.n == 2 and cap.alone_gflops > 0 and cap.together_gflops > 0
    assert 0 < cap.effective_cores <= 2 * 1.5  # noise can make "together" a little faster than "alone"
    assert "effective cores" in cap.describe()
    assert Capacity(2, 100.0, 50.0).effective_cores == 1.0


@pytest.mark.extended
@pytest.mark.multiprocess
def test_ours_vs_gpipe_runs_both_systems_and_prints_ratios():
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "ours-vs-gpipe", "--model", "tiny", "--batch", "1", "--reps", "1",
         "--slices", "2", "--steps", "2", "--warmup", "1", "--no-reference", "--no-capacity-check"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed" not in proc.stdout, proc.stdout + proc.stderr
    rows = [l for l in proc.stdout.splitlines() if l.strip().startswith("1 |")]
    assert any("torch_pipe GPipe" in r for r in rows) and any("ours K=2" in r for r in rows), proc.stdout
    assert "best: ours K=2, torch_pipe GPipe / ours = " in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.extended
def test_ours_vs_best_runs_the_schedules_that_fit_and_prints_the_best_of_each_side(tmp_path):
    # batch 1 on P = 2: 1f1b and dualpipev cannot run it (judged before launching, not run)
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "ours-vs-best", "--model", "tiny", "--batch", "1", "--reps", "1",
         "--slices", "2", "--schedules", "gpipe", "1f1b", "dualpipev", "--steps", "2", "--warmup", "1",
         "--no-capacity-check"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "failed" not in proc.stdout, proc.stdout + proc.stderr
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own compile cache
    assert not left, left  # the runs' temporary records, their locks and run directories removed
    assert "torch_pipe 1f1b skipped: " in proc.stderr and "torch_pipe dualpipev skipped: " in proc.stderr
    assert "batch 1 done: torch_pipe gpipe " in proc.stderr  # each batch's result as soon as its launches end
    rows = [l.split("|") for l in proc.stdout.splitlines() if l.strip().startswith("1 |")]
    configs = [r[1].strip() for r in rows if len(r) == 8]
    assert configs == ["torch_pipe gpipe", "ours K=2"], proc.stdout
    for r in rows[:2]:
        assert all(int(mb) > 0 for mb in r[5].strip().split("/")) and len(r[5].strip().split("/")) == 2  # MB per rank
        busy = [int(b) for b in r[6].strip().split("/")]  # busy % per rank: computing, not waiting
        assert len(busy) == 2 and all(0 < b <= 105 for b in busy), r
    (best,) = [r for r in rows if len(r) == 11]  # the per-batch summary
    assert best[1].strip() == "GPipe" and best[3].strip() == "K=2"
    assert float(best[5].strip().rstrip("x")) > 0 and best[7].strip().startswith("1.45x ")
    # one repetition: a step time without an interval, and no claim beyond noise
    assert best[2].strip().endswith("(1 run)") and best[10].strip() == "no claim: a single run has no interval"


def test_the_paired_ratio_is_the_reports():
    """Issue #53, item 3: the benchmarks paired launches by repetition index, a second definition of the
    report's paired ratio; now they pair neighbouring launches as ``contract.estimate.paired`` does."""
    from bench.__main__ import Run, Sitting
    from contract.estimate import paired

    def run(median: float, launched: int) -> Run:
        return Run(median, median, (), launched=launched)

    # launched a b | b a | a b: the neighbours' ratios a / b are 1.25, 1.2 and 9 / 7
    s = Sitting(1, {"a": [run(1.0, 0), run(1.2, 3), run(0.9, 4)], "b": [run(0.8, 1), run(1.0, 2), run(0.7, 5)]})
    p = s.paired("a", "b")
    assert p.ratio.median == pytest.approx(1.25) and p.ratio.low == pytest.approx(1.2) and p.ratio.n == 3
    assert p == paired([(0, 1.0), (3, 1.2), (4, 0.9)], [(1, 0.8), (2, 1.0), (5, 0.7)])
    assert s.paired_text("a", "b") == "1.25x" and Sitting(1, {"a": [], "b": []}).paired_text("a", "b") == "-"


def test_ours_batch_slices_are_ours_micro_batch_where_they_divide_the_batch():
    import argparse

    from bench.__main__ import ours_configs

    opts = argparse.Namespace(pp=2, slices=["auto"], ours_prefetch=["auto"], ours_batch_slices=[1, 2, 4],
                              ours_schedules=["1f1b", "gpipe"])
    configs = ours_configs(opts, 2)
    assert list(configs) == ["ours K=auto b=1", "ours K=auto b=2", "ours gpipe K=auto b=1"]
    mb = {n: a[a.index("--micro-batch-size") + 1] for n, a in configs.items()}
    assert mb == {"ours K=auto b=1": "1", "ours K=auto b=2": "2", "ours gpipe K=auto b=1": "1"}
    opts.ours_batch_slices, opts.ours_schedules = [1], ["1f1b"]
    assert list(ours_configs(opts, 1)) == ["ours K=auto"]  # the default names as before


def test_each_batch_says_its_best_of_each_side_as_soon_as_it_ends(capsys):
    """A long bench stopped early keeps the batches that ended: each one's fastest baseline and fastest
    ours, their ratio and paired ratio, on stderr (the same choice as the final summary's)."""
    from bench.__main__ import Run, Sitting, _say_best, best_of_each

    def run(median: float, launched: int) -> Run:
        return Run(median, median, (), launched=launched)

    s = Sitting(2, {"torch_pipe zbv": [run(1.2, 0), run(1.3, 5)], "torch_pipe gpipe": [run(1.5, 1), run(1.6, 4)],
                    "ours K=auto": [run(1.0, 2), run(1.0, 3)], "ours K=2": [None, None]})
    assert best_of_each(s) == ((1.25, "torch_pipe zbv"), (1.0, "ours K=auto"))
    _say_best(s)
    err = capsys.readouterr().err
    assert err.startswith("batch 2 done: torch_pipe zbv 1250 ") and "ours K=auto 1000 " in err
    assert ": 1.25x, paired " in err
    assert best_of_each(Sitting(1, {"ours K=2": [None]})) == ((None, None), (None, None))
    _say_best(Sitting(1, {"ours K=2": [run(1.0, 0)]}))  # no baseline ran: nothing to say
    assert capsys.readouterr().err == ""

"""The breakdown's accounting (``bench.breakdown``): on a made-up profile whose parts are known, and on a
real profile of one engine step in this process (single-process: no ranks are launched)."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench import breakdown
from bench.breakdown import (ATTENTION, GEMM, IDLE, KV, OPTIMIZER, OTHER, PARTS, PYTHON, WAIT, Op, account, medians,
                             op_tree, step_parts)
from ours.engine import StageEngine
from ours.trace import Tracer
from workload.configs import ModelConfig
from workload.model import build_gpt
from workload.partition import stage_specs


def test_each_operations_own_time_goes_to_the_innermost_range_that_names_a_part():
    step = Op("pipebench::step", 0, 1000, [
        Op("ours::forward", 0, 400, [
            Op("aten::linear", 10, 110, [Op("aten::t", 10, 15), Op("aten::addmm", 15, 105)]),  # 100 GEMM
            Op("SliceAttention", 120, 320, [  # 30 of its own Python
                Op("aten::copy_", 125, 145),  # key/value
                Op("aten::_scaled_dot_product_flash_attention_for_cpu", 150, 280,
                   [Op("aten::empty", 150, 160)]),  # attention, its allocation too
                Op("aten::mul", 280, 300),  # the merge: attention
            ]),
            Op("aten::layer_norm", 330, 380, [Op("aten::native_layer_norm", 331, 379)]),  # other
        ]),  # 400 - 100 - 200 - 50 = 50 of the engine's Python
        Op("pipebench::wait", 400, 700),  # comm wait
        Op("autograd::engine::evaluate_function: AddmmBackward0", 700, 800,
           [Op("AddmmBackward0", 705, 795, [Op("aten::mm", 710, 790)])]),  # 80 GEMM, 20 of autograd's own
        Op("Optimizer.step#Adam.step", 800, 950, [Op("aten::add_", 810, 900)]),  # optimizer
    ])  # 50 between the ranges: Python
    parts = {k: round(v * 1e6, 6) for k, v in account(step).items()}
    assert parts == {GEMM: 180, ATTENTION: 150, KV: 20, OTHER: 50, WAIT: 300, PYTHON: 30 + 50 + 20 + 50,
                     OPTIMIZER: 150, IDLE: 0}
    assert sum(parts.values()) == 1000


def test_idle_is_the_step_less_its_window_and_medians_are_per_part():
    parts = [dict.fromkeys(PARTS, 0.0) | {GEMM: 0.3, WAIT: 0.1}, dict.fromkeys(PARTS, 0.0) | {GEMM: 0.5, WAIT: 0.1}]
    steps = step_parts({"parts": parts, "step_times": [0.5, 0.7], "barrier_times": [0.1, 0.1]})
    assert [s[IDLE] for s in steps] == pytest.approx([0.1, 0.1])
    assert medians(steps)["step"] == pytest.approx(0.6) and medians(steps)[GEMM] == pytest.approx(0.4)


def test_a_profiled_engine_step_splits_into_its_parts(monkeypatch):
    """One stage's step of ours' engine on a small model (3 token slices), profiled as a rank of the
    breakdown profiles it: the parts cover the window, and each of GEMM, attention, key/value, other
    compute and the engine's Python is there."""
    cfg = ModelConfig("unit", n_layer=2, n_embd=32, n_head=4, seq_len=24, vocab_size=64)
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model = build_gpt(cfg, 0)
    eng = StageEngine(model, stage_specs(cfg.n_layer, 1)[0], slices=(8, 8, 8), batch_size=2, micro_batch_size=1,
                      device=torch.device("cpu"), rank=0, prev_rank=None, next_rank=None, tracer=Tracer(0, False))
    monkeypatch.setattr(Tracer, "to_profiler", True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("pipebench::step"):
            eng.step(x, x)
    root = next(e for e in prof.events() if e.name == "pipebench::step")
    tree = op_tree(root)
    parts, window = account(tree), (tree.end - tree.start) * 1e-6
    assert sum(parts.values()) == pytest.approx(window, rel=1e-9)
    assert all(parts[p] > 0 for p in (GEMM, ATTENTION, KV, OTHER, PYTHON)), parts
    assert parts[OPTIMIZER] == parts[IDLE] == 0  # no optimizer in an engine step; idle is outside the window
    assert parts[WAIT] < 0.05 * window  # one stage: no messages, only its (empty) wait for sends


@pytest.mark.parametrize("bench", ["breakdown", "seq-sweep"])
def test_an_out_file_that_cannot_be_written_is_refused_before_any_run(bench, tmp_path, capsys, monkeypatch):
    """The table was written only after the benchmark's minutes of runs, where an unwritable ``--out``
    was a traceback; now one line and exit status 2, and nothing is launched."""
    from bench import __main__ as cli

    monkeypatch.setattr(breakdown, "run", lambda opts: pytest.fail("breakdown ran"))
    monkeypatch.setattr(cli.seq_sweep, "run", lambda opts: pytest.fail("seq-sweep ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli.main([bench, "--out", str(blocker / "table.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m bench: error: --out {blocker / 'table.txt'}: {blocker} is not a directory"]


@pytest.mark.parametrize("argv", [
    ["ours-vs-best", "--batch", "0"], ["ours-vs-best", "--reps", "0"], ["ours-vs-best", "--slices", "0"],
    ["ours-vs-best", "--ours-prefetch", "-1"], ["ours-vs-gpipe", "--steps", "0"], ["ours-vs-megatron-tp", "--tp", "0"],
    ["attention", "--reps", "-1"], ["breakdown", "--batch", "-2"], ["breakdown", "--warmup", "0"],
    ["breakdown", "--ours-slices", "0"], ["seq-sweep", "--seq", "0"], ["seq-sweep", "--timeout", "0"],
    ["network-slope", "--delays", "-1"], ["network-slope", "--bandwidth", "0"],
    ["plan-evaluation", "--model", "tiny", "--pp", "0", "--batch-size", "1"],
    ["plan-evaluation", "--model", "tiny", "--pp", "2", "--batch-size", "1", "--ks", "a,b"],
    ["plan-evaluation", "--model", "tiny", "--pp", "2", "--batch-size", "1", "--ks", "4,0"],
])
def test_a_count_or_time_that_cannot_be_is_refused_before_any_run(argv, capsys):
    """A batch of 0, reps of 0 or a negative repetition count launched runs (or raised a traceback after
    them); each is now refused by the parser, one line naming the flag."""
    from bench import __main__ as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    flag = argv[-2] if argv[0] != "plan-evaluation" else "--ks" if "--ks" in argv else "--pp"
    assert f"argument {flag}: takes" in last, last


def test_plan_evaluations_out_dir_is_judged_before_the_planner_or_any_run(tmp_path, capsys, monkeypatch):
    from bench import __main__ as cli
    from bench import plan_evaluation

    monkeypatch.setattr(plan_evaluation, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli.main(["plan-evaluation", "--model", "tiny", "--pp", "2", "--batch-size", "1", "--profile",
                     str(blocker), "--out-dir", str(blocker / "d")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"--out-dir {blocker / 'd'}: {blocker} is not a "
                                                                     "directory")


def test_a_zero_where_zero_means_something_is_taken():
    """--start-rep 0 (network-slope's default), --warmup 0 and an attention context of 0 stay accepted."""
    import argparse

    from bench import attention, network_slope

    p = argparse.ArgumentParser()
    network_slope.fill_parser(p)
    assert p.parse_args(["--start-rep", "0", "--warmup", "0", "--delays", "0"]).start_rep == 0
    p = argparse.ArgumentParser()
    attention.fill_parser(p)
    assert p.parse_args(["--contexts", "0", "128"]).contexts == [0, 128]

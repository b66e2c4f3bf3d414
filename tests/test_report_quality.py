"""The time-to-quality section of the report (``reporting.quality``), from records with eval points."""
from __future__ import annotations

import json

from contract import RunConfig
from contract.registry import get_system
from report import main
from reporting import (against_synchronous, crossing, plot_quality, quality_frame, quality_section,
                       quality_target_lines, quality_targets, render)
from runners.record import build_record
from workload.configs import get_model_config


def _rec(system: str, network: str, seed: int, losses: list[float], seconds_per_eval: float, bytes_per_eval: int,
         dp: int = 2, pp: int = 2, batch: int = 2, extra: dict | None = None, target: float | None = 3.5,
         **options) -> dict:
    spec = get_system(system)
    cfg = RunConfig(system=system, model=get_model_config("tiny"), batch_size=batch, micro_batch_size=1, pp=pp,
                    dp=dp, network=network, seed=seed, eval_every=4, target_loss=target, data="stdlib",
                    options=spec.options(**options))
    n = pp * dp
    evals = [{"step": 4 * i, "tokens": 4 * i * cfg.global_batch_size * 128, "wall_time": seconds_per_eval * i,
              "loss": loss, "bytes_sent": [bytes_per_eval * i] * n} for i, loss in enumerate(losses)]
    ranks = [{"rank": r, "step_times": [0.1] * 8, "losses": [4.0] * 8, "dp_sync_times": [0.0] * 8,
              "cpu_rss_bytes": 1, "gpu_memory": [], "extra": extra or {}, "hostname": "h", "device": "cpu",
              "device_name": "cpu", "backend": "gloo", "peak_tflops": 1.0, "peak_source": "measured",
              "evals": evals if r == 0 else []} for r in range(n)]
    env = {"device_count": n, "corpus": {"sha256": "ab" * 32, "unigram_nats": {"heldout": 4.1, "eval_batch": 4.0}}}
    return build_record(cfg, spec, "ok", None, ranks, env).__dict__


def test_crossing_is_interpolated_unless_the_weights_change_only_at_syncs():
    evals = [{"step": 4 * i, "tokens": 400 * i, "wall_time": 2.0 * i, "loss": loss, "bytes_sent": [10 * i, 30 * i]}
             for i, loss in enumerate([5.0, 4.0, 3.0])]
    hit = crossing(evals, 3.5)  # halfway between the evals after steps 4 and 8
    assert hit == {"step": 6.0, "tokens": 600.0, "wall_time": 3.0, "bytes": 60.0}
    assert crossing(evals, 3.5, every=4) == {"step": 8, "tokens": 800, "wall_time": 4.0, "bytes": 80}
    assert crossing(evals, 2.0) is None and crossing(evals, 6.0)["step"] == 0


def test_time_tokens_and_bytes_to_the_target_with_intervals(tmp_path):
    recs = []
    for seed, jitter in ((0, 0.0), (1, 0.2), (2, 0.1)):
        recs.append(_rec("ours", "d50-1g", seed, [5.6, 4.0, 3.4, 3.2], 2.0 + jitter, 1000, dp_mode="sharded_ps"))
        recs.append(_rec("diloco", "d50-1g", seed, [5.6, 4.2, 3.6, 3.4], 0.5 + jitter, 100, inner_steps=4,
                         extra={"eval_weights_every": 4}))
        recs.append(_rec("torch_pipe", "d50-1g", seed, [5.6, 4.0, 3.6, 3.6], 3.0, 2000))
    text = quality_section(recs)
    rows = [line for line in text.splitlines() if line.startswith("| delay 50ms")]
    time_row, tokens_row, bytes_row, per_token = ([c.strip() for c in r.split("|")[2:-1]] for r in rows)
    header = next(line for line in text.splitlines() if line.startswith("| Network setting"))
    cols = [c.strip() for c in header.split("|")[2:-1]]
    assert cols == ["ours sharded_ps P-2 D-2", "diloco H=4 P-2 D-2", "torch_pipe gpipe P-2 D-2"]
    # ours: 5/6 of the way from the eval after step 4 to the one after 8 (loss 4.0 -> 3.4), 1 5/6 evals of 2.0-2.2 s
    assert time_row[0] == "3.85 s [3.67 s-4.03 s]" and tokens_row[0] == "3.8k [3.8k-3.8k]"
    assert time_row[1] == "1.80 s [1.50 s-2.10 s]"  # diloco: the third eval, where its weights last changed
    assert tokens_row[1] == "6.1k [6.1k-6.1k]" and bytes_row[1] == "1.2 kB [1.2 kB-1.2 kB]"  # 3 x 100 x 4 ranks
    assert time_row[2] == "not reached in 12 steps (3 runs)" and tokens_row[2] == time_row[2]
    assert per_token == ["1.95 [1.95-1.95]", "0.20 [0.20-0.20]", "3.91 [3.91-3.91]"]  # 4 ranks' bytes / tokens
    win = next(line for line in text.splitlines() if line.startswith("- delay 50ms"))
    assert "`diloco H=4 P-2 D-2` 1.80 s" in win and "faster than `ours sharded_ps P-2 D-2` 3.85 s" in win
    assert "not reached in every run: `torch_pipe gpipe P-2 D-2`" in win
    assert [p.name for p in plot_quality(recs, tmp_path)] == ["quality-0-time.png", "quality-0-bytes.png"]


def test_every_diloco_column_against_the_synchronous_one():
    recs = []
    for seed in (0, 1, 2):
        recs.append(_rec("ours", "d50-1g", seed, [5.6, 4.0, 3.4], 2.0 + 0.1 * seed, 1000, dp_mode="sharded_ps"))
        recs.append(_rec("diloco", "d50-1g", seed, [5.6, 4.2, 3.4], 1.0 + 0.1 * seed, 100, inner_steps=4,
                         extra={"eval_weights_every": 4}))
        recs.append(_rec("diloco", "d50-1g", seed, [5.6, 4.2, 3.4], 1.9 + 0.2 * seed, 100, inner_steps=8,
                         extra={"eval_weights_every": 8}))
    (line,) = against_synchronous(quality_frame(recs))
    assert line.startswith("- delay 50ms  bandwidth 1Gbps, against `ours sharded_ps P-2 D-2` 3.85 s ±5 %")
    assert "`diloco H=4 P-2 D-2` 2.20 s ±10 %: **1.75x** (1.53-2.02x) faster" in line  # 3.85/2.2; 3.67/2.4, 4.03/2.0
    assert "`diloco H=8 P-2 D-2` 4.20 s" in line and "no difference beyond noise" in line
    torch_pipe = [_rec("torch_pipe", "d50-1g", 0, [5.6, 3.4], 3.0, 10)]
    assert against_synchronous(quality_frame(recs + torch_pipe)) == []  # two synchronous columns: no base


def test_the_target_line_says_where_synchronous_training_is_and_the_unigram():
    race = [_rec("ours", "d10-1g", seed, [5.6, 4.0, 3.4], 1.0, 10, dp_mode="sharded_ps") for seed in (0, 1, 2)]
    refs = [_rec("reference", "none", seed, [5.6, 4.0, 3.5 + 0.01 * seed], 1.0, 0, dp=1, pp=1, batch=4, target=None)
            for seed in (0, 1, 2)]
    line, detail = quality_target_lines(race + refs)[0].split("\n\n")
    assert line == "target: 3.500 nats (unigram: 4.000 nats; synchronous at 4,096 tokens)"
    assert "seeds 0, 1, 2: 3.500, 3.510, 3.520 (median 3.510)" in detail and "not 0.5 nats below" not in detail
    assert render(race + refs).index(line) < render(race + refs).index("| Network setting")  # before the tables
    assert quality_targets(refs)[next(iter(quality_targets(refs)))]["loss"] == 3.51
    high = [_rec("ours", "d10-1g", 0, [5.6, 3.9], 1.0, 10, target=3.9)]
    assert "**the target is not 0.5 nats below the unigram figure**" in quality_target_lines(high)[0]
    assert "no reference run" in quality_target_lines(high)[0]


def test_quality_target_prints_the_references_median(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(_rec("reference", "none", seed, [5.6, 4.0 + 0.1 * seed], 1.0, 0, dp=1, pp=1,
                                           batch=4, target=None)) + "\n" for seed in (0, 1, 2)))
    assert main([str(out), "--quality-target"]) == 0
    assert capsys.readouterr().out.strip() == "4.100"


def test_runs_without_evals_or_target_are_left_out():
    rec = _rec("ours", "none", 0, [5.6, 3.0], 1.0, 10)
    rec["config"]["target_loss"] = None
    assert quality_section([rec]) == ""
    assert "| none (no emulation)" in quality_section([rec], target=4.0)


def test_a_winner_is_claimed_only_where_the_intervals_separate():
    recs = [_rec("ours", "d10-1g", seed, [5.6, 4.0, 3.4], 1.0 + 0.6 * seed, 10, dp_mode="sharded_ps")
            for seed in (0, 1)]
    recs += [_rec("diloco", "d10-1g", seed, [5.6, 4.0, 3.4], 1.2 + 0.6 * seed, 10, inner_steps=4) for seed in (0, 1)]
    (win,) = [line for line in quality_section(recs).splitlines() if line.startswith("- delay 10ms")]
    assert "faster" not in win and "no difference beyond noise" in win, win
    single = quality_section([_rec("ours", "d10-1g", 0, [5.6, 3.4], 1.0, 10), _rec("torch_pipe", "d10-1g", 0,
                                                                                    [5.6, 3.4], 3.0, 10)])
    (win,) = [line for line in single.splitlines() if line.startswith("- delay 10ms")]
    assert "a single run has no interval" in win, win

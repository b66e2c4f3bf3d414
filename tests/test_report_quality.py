"""The time-to-quality section of the report (``report.quality_section``), from records with eval points."""
from __future__ import annotations

from contract import RunConfig
from report import plot_quality, quality_section
from runners.record import build_record
from contract.registry import get_system
from workload.configs import get_model_config


def _rec(system: str, network: str, seed: int, losses: list[float], seconds_per_eval: float, bytes_per_eval: int,
         dp: int = 2, pp: int = 2, batch: int = 2, **options) -> dict:
    spec = get_system(system)
    cfg = RunConfig(system=system, model=get_model_config("tiny"), batch_size=batch, micro_batch_size=1, pp=pp,
                    dp=dp, network=network, seed=seed, eval_every=4, target_loss=3.5, data="stdlib",
                    options=spec.options(**options))
    n = pp * dp
    evals = [{"step": 4 * i, "tokens": 4 * i * cfg.global_batch_size * 128, "wall_time": seconds_per_eval * i,
              "loss": loss, "bytes_sent": [bytes_per_eval * i] * n} for i, loss in enumerate(losses)]
    ranks = [{"rank": r, "step_times": [0.1] * 8, "losses": [4.0] * 8, "dp_sync_times": [0.0] * 8,
              "cpu_rss_bytes": 1, "gpu_memory": [], "extra": {}, "hostname": "h", "device": "cpu", "device_name": "cpu",
              "backend": "gloo", "peak_tflops": 1.0, "peak_source": "measured", "evals": evals if r == 0 else []}
             for r in range(n)]
    return build_record(cfg, spec, "ok", None, ranks, {"device_count": n}).__dict__


def test_time_to_quality_table_winner_and_bytes(tmp_path):
    recs = []
    for seed, jitter in ((0, 0.0), (1, 0.2)):
        recs.append(_rec("ours", "d50-1g", seed, [5.6, 4.0, 3.4, 3.2], 2.0 + jitter, 1000, dp_mode="sharded_ps"))
        recs.append(_rec("diloco", "d50-1g", seed, [5.6, 4.2, 3.6, 3.4], 0.5 + jitter, 100, inner_steps=4))
        recs.append(_rec("torch_pipe", "d50-1g", seed, [5.6, 4.0, 3.6, 3.6], 3.0, 2000))
    text = quality_section(recs)
    row, per_token = [line for line in text.splitlines() if line.startswith("| delay 50ms")]  # time, bytes
    header = next(line for line in text.splitlines() if line.startswith("| Network setting"))
    cols = [c.strip() for c in header.split("|")[2:-1]]
    assert cols == ["ours sharded_ps P-2 D-2", "diloco H=4 P-2 D-2", "torch_pipe gpipe P-2 D-2"]
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[0] == "4.20 s ±5 %, 4.1k tokens"  # reached 3.4 at the second eval: 2 x 2.0-2.2 s (min-max)
    assert cells[1] == "1.80 s ±17 %, 6.1k tokens"  # the third eval: 3 x 0.5-0.7 s
    assert cells[2] == "not reached in 12 steps (2 runs)"
    win = next(line for line in text.splitlines() if line.startswith("- delay 50ms"))
    # the intervals (1.50-2.10 s, 4.00-4.40 s) separate: the ratio of medians and its range over them
    assert ("`diloco H=4 P-2 D-2` 1.80 s ±17 %, **2.33x** (1.90-2.93x) faster than `ours sharded_ps P-2 D-2` 4.20 s"
            in win)
    assert "not reached in every run: `torch_pipe gpipe P-2 D-2`" in win
    assert [c.strip() for c in per_token.split("|")[2:-1]] == ["1.95", "0.20", "3.91"]  # 4 ranks' bytes / tokens
    assert [p.name for p in plot_quality(recs, tmp_path)] == ["quality-0-d50-1g.png"]


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

"""Benchmarks that compare systems side by side: python -m bench NAME [options].

ours-vs-gpipe: Torch Pipe's GPipe schedule against ours (token-level pipeline) on cpu-small with
P = 2, at each batch size per pipeline, with repetitions alternating between the systems (so that
drifts of a shared machine hit every system alike). Each run is the real run command in a
subprocess, writing its record to a temporary file; the step time of a configuration is the median
over repetitions of each run's median_step_time, with its interval (``contract.estimate``, the
report's statistics: min-max below 8 repetitions, bootstrap from 8), and a difference is claimed only
where the intervals separate. Prints the step times, the ratio GPipe / ours (of the medians, and
paired: the median of the ratios of neighbouring launches, the report's comparison,
``contract.estimate.paired``), and the pipeline efficiency T_ref / (P * T) against the single-process
reference. Before each repetition it measures how many cores the machine really gives P processes at once
(``bench.machine``) and warns when that is short of P: on a shared host that hurts a pipeline that
keeps every rank busy more than GPipe at batch 1, which keeps one rank busy at a time.

ours-vs-best: the same discipline against every Torch Pipe schedule (GPipe, 1F1B, interleaved 1F1B,
interleaved zero bubble, ZBV, DualPipeV) that can run the batch (the run command's own judgement
decides), and ours at several K; per batch, the fastest schedule against ours at its fastest K (by
median step time, and paired), with each rank's peak memory beside, and the goal of issue #52.

network-slope: how many one-way network delays each system pays per training step, split into the
schedule, the DP sync and the closing barrier (``bench.network_slope``).

plan-evaluation: ours' latency model (``ours.plan``) against measured runs of uniform slicings and the
planner's optimal one (``bench.plan_evaluation``).

attention: one layer's attention over a token slice and its cached context, ours' kernel against the
plain masked attention, in one process (``bench.attention``).

breakdown: where each rank's step time goes (GEMMs, attention, key/value handling, other compute,
communication waits, Python and the engine, optimizer, idle) for ours and every Torch Pipe schedule,
from torch's profiler with the benchmark's own hooks (``bench.breakdown``).
seq-sweep: ours against the fastest Torch Pipe schedule across sequence lengths (1k to 32k), both
families at a tiny width, with paired ratios: where slicing along the tokens starts to pay
(``bench.seq_sweep``).

ours-vs-megatron-tp: ours with tensor parallelism (``--tp``, ``ours.tp``) against Megatron at the same
T (P = 1), on cpu-small, alternating repetitions as above; per batch the step times with their
intervals, the ratio megatron / ours (of the medians, and paired) and whether the intervals separate.
"""
from __future__ import annotations

import argparse
import itertools
import sys

from baselines.torch_pipe import SCHEDULES
from contract.cli import NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, cannot_write_file, count_or_word
from contract.estimate import INTERVAL_RULE
from ours import prefetch_count, slice_count
from ours.schedule import SCHEDULES as OURS_SCHEDULES
from bench import attention, breakdown, cannot_run, network_slope, plan_evaluation, seq_sweep
from bench.sittings import (Run, Sitting, megabytes, percents, print_machine, print_table,  # noqa: F401 (Run: the tests')
                            run_alternating)


def ours_args(P: int, batch: int, k: int | str | None = None, slices: str | None = None, mb: int = 1) -> list[str]:
    args = ["--system", "ours", "--pp", str(P), "--batch-size", str(batch), "--micro-batch-size", str(mb)]
    return args + (["--n-slices", str(k)] if k is not None else ["--slices", slices])


def ours_vs_gpipe(opts: argparse.Namespace) -> int:
    P = opts.pp
    common = ["--model", opts.model, "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    sittings: dict[int, Sitting] = {}
    capacities: list[float] = []
    for batch in opts.batch:
        mb = 1
        configs: dict[str, list[str]] = {}
        if not opts.no_reference:
            configs["reference"] = ["--system", "reference", "--batch-size", str(batch), "--micro-batch-size", str(mb)]
        gp = ["--system", opts.gpipe_system, "--batch-size", str(batch), "--micro-batch-size", str(mb)]
        if opts.gpipe_system != "reference":
            gp += ["--pp", str(P), "--schedule", "gpipe"]
        configs["gpipe"] = gp
        for k in opts.slices:
            configs[f"ours K={k}"] = ours_args(P, batch, k=k)
        for sl in opts.ours_slices:
            configs[f"ours {sl}"] = ours_args(P, batch, slices=sl)
        sittings[batch] = run_alternating(batch, configs, common, opts, capacities)

    gp_label = ("torch_pipe GPipe" if opts.gpipe_system == "torch_pipe"
                else f"{opts.gpipe_system} (standing in for GPipe)")
    print(f"\nours vs {gp_label} on {opts.model}, P={P}, micro-batch 1, {opts.reps} alternating reps "
          f"(step ms: {INTERVAL_RULE}; min: fastest step of any run; efficiency = T_ref / (P * T))")
    rows, best = [], []
    ours_names = [f"ours K={k}" for k in opts.slices] + [f"ours {sl}" for sl in opts.ours_slices]
    for batch in opts.batch:
        s = sittings[batch]
        ref, gp = s.median("reference"), s.median("gpipe")
        for name in ([] if opts.no_reference else ["reference"]) + ["gpipe"] + ours_names:
            t = s.median(name)
            n = len(s.ok(name))
            label = gp_label if name == "gpipe" else name
            if t is None:
                rows.append([batch, label, "failed", "", n, "", "", "", ""])
                continue
            p = 1 if name == "reference" or (name == "gpipe" and opts.gpipe_system == "reference") else P
            mine = name.startswith("ours")
            rows.append([batch, label, s.ms(name), f"{s.best(name) * 1e3:.0f}", n,
                         f"{ref / (p * t):.2f}" if ref else "-", f"{gp / t:.2f}x" if gp and mine else "-",
                         s.paired_text("gpipe", name) if mine else "-", s.versus("gpipe", name) if mine else ""])
        ours = [(s.median(n), n) for n in ours_names if s.median(n)]
        if ours and gp:
            t, n = min(ours)
            best.append(f"batch {batch} best: {n}, {gp_label} / ours = {gp / t:.2f}x (by median step time; "
                        f"{s.versus('gpipe', n)})")
    print_table(rows, ["batch", "config", "step ms", "min ms", "runs", "efficiency", "gpipe / this", "paired",
                       "against gpipe"])
    print("\n".join(best))
    print("paired: GPipe's / this configuration's step time, the median over their neighbouring launches "
          "(contract.estimate.paired)")
    print_machine(capacities, P, "GPipe at batch 1, which keeps one rank busy at a time")
    return 0


# best baseline / ours the project aims at, by batch per pipeline (issue #52): at batch 4 "at least level",
# met where the paired interval reaches 1.0
GOALS = {1: 1.45, 2: 1.15, 4: 1.0}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb": "interleaved zero bubble",
                  "zbv": "ZBV zero bubble", "dualpipev": "DualPipeV"}


def goal_met(s: Sitting, base: str, name: str, goal: float) -> bool:
    """Ours at least ``goal`` times faster than ``base`` by the medians; at a goal of 1.0 ("at least
    level") also where the paired interval reaches 1.0."""
    if s.median(base) / s.median(name) >= goal:
        return True
    p = s.paired(base, name)
    return goal <= 1.0 and p is not None and p.ratio.high >= 1.0


def ours_configs(opts: argparse.Namespace, batch: int) -> dict[str, list[str]]:
    """ours' configurations of ours-vs-best at one batch: each order of its units, K, --prefetch and
    batch slice size (--micro-batch-size) asked, but for the batch slices that do not divide the batch
    and gpipe where the batch is one batch slice (there it is 1f1b)."""
    configs = {}
    for schedule in opts.ours_schedules if batch > 1 else opts.ours_schedules[:1]:  # the same at one row
        for k, ahead, mb in itertools.product(opts.slices, opts.ours_prefetch, opts.ours_batch_slices):
            if batch % mb or (schedule == "gpipe" and mb == batch):
                continue
            name = f"ours K={k}" if schedule == "1f1b" else f"ours {schedule} K={k}"
            name += f" prefetch {ahead}" if len(opts.ours_prefetch) > 1 else ""
            name += f" b={mb}" if opts.ours_batch_slices != [1] else ""
            configs[name] = ours_args(opts.pp, batch, k=k, mb=mb) + ["--schedule", schedule, "--prefetch", str(ahead)]
    return configs


def best_of_each(s: Sitting) -> tuple[tuple[float | None, str | None], tuple[float | None, str | None]]:
    """((median, name) of the fastest Torch Pipe schedule, the same of ours' fastest configuration) of a
    batch's sitting, by median step time; (None, None) for a side with no run."""
    def best(prefix: str):
        runs = [(s.median(n), n) for n in s.runs if n.startswith(prefix) and s.median(n)]
        return min(runs) if runs else (None, None)

    return best("torch_pipe"), best("ours")


def _say_best(s: Sitting) -> None:
    """A batch's result on stderr as soon as its launches end, so that a long run stopped early keeps it."""
    (base_t, base), (t, name) = best_of_each(s)
    if base and name:
        print(f"batch {s.batch} done: {base} {s.ms(base)}, {name} {s.ms(name)}: {base_t / t:.2f}x, paired "
              f"{s.paired_text(base, name)}", file=sys.stderr, flush=True)


def ours_vs_best(opts: argparse.Namespace) -> int:
    """Ours at each K against every Torch Pipe schedule that can run the batch, side by side; per
    batch, the fastest of each side by median step time, their ratio (and paired), peak memory."""
    P = opts.pp
    common = ["--model", opts.model, "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    sittings: dict[int, Sitting] = {}
    capacities: list[float] = []
    for batch in opts.batch:
        configs: dict[str, list[str]] = {}
        for schedule in opts.schedules:
            args = ["--system", "torch_pipe", "--pp", str(P), "--schedule", schedule, "--batch-size", str(batch),
                    "--micro-batch-size", "1"]
            why = cannot_run(args + common)
            if why:
                print(f"batch {batch}: torch_pipe {schedule} skipped: {why}", file=sys.stderr, flush=True)
                continue
            configs[f"torch_pipe {schedule}"] = args
        configs.update(ours_configs(opts, batch))
        sittings[batch] = run_alternating(batch, configs, common, opts, capacities)
        _say_best(sittings[batch])

    print(f"\nours vs the fastest Torch Pipe schedule on {opts.model}, P={P}, micro-batch 1, {opts.reps} alternating "
          f"reps (step ms: {INTERVAL_RULE}; min: fastest step of any run; peak MB: peak memory of each rank, RSS on "
          f"CPU, largest over the reps)")
    rows, summary = [], []
    for batch in opts.batch:
        s = sittings[batch]
        (base_t, base), best_ours = best_of_each(s)
        for name in s.runs:
            t = s.median(name)
            if t is None:
                rows.append([batch, name, "failed", "", len(s.ok(name)), "", "", ""])
                continue
            rows.append([batch, name, s.ms(name), f"{s.best(name) * 1e3:.0f}", len(s.ok(name)),
                         megabytes(s.peak_memory(name)), percents(s.busy(name)),
                         f"{base_t / t:.2f}x" if base_t and name.startswith("ours") else "-"])
        if base and best_ours[1]:
            t, name = best_ours
            goal = GOALS.get(batch)
            schedule = base.removeprefix("torch_pipe ")
            summary.append([batch, SCHEDULE_NAMES.get(schedule, schedule), s.ms(base), name.removeprefix("ours "),
                            s.ms(name), f"{base_t / t:.2f}x", s.paired_text(base, name),
                            "" if goal is None else
                            f"{goal:.2f}x " + ("met" if goal_met(s, base, name, goal) else "missed"),
                            megabytes(s.peak_memory(base)), megabytes(s.peak_memory(name)), s.versus(base, name)])
    print_table(rows, ["batch", "config", "step ms", "min ms", "runs", "peak MB per rank", "busy % per rank",
                       "best baseline / this"])
    if summary:  # none where no baseline schedule ran (``--schedules`` with none)
        print("\nper batch: the fastest baseline schedule against ours at its fastest K (by median step time)")
        print_table(summary, ["batch", "best baseline", "ms", "ours", "ms", "ratio", "paired", "goal",
                              "peak MB baseline", "peak MB ours", "beyond noise?"])
    auto_against_fixed(sittings)
    prefetch_against_none(sittings)
    print("ratio: best baseline's / ours' median step time; paired: the same ratio, the median over their "
          "neighbouring launches (contract.estimate.paired); goal: the ratio issue #52 asks for (1.0: the paired "
          "interval reaching it); "
          "busy %: the share "
          "of each rank's step time it was computing (its process's CPU time over its step time; the rest is "
          "bubbles, messages, the barrier)")
    print_machine(capacities, P, "a schedule that leaves ranks idle")
    return 0


def auto_against_fixed(sittings: dict[int, Sitting]) -> None:
    """Per batch and order of units, ``--n-slices auto`` against the fastest fixed K it ran beside: within
    noise, or slower or faster beyond it (the done-when of issue #26); then auto against every fixed K,
    paired (neighbouring launches), with the spread of the pairs."""
    rows, pairs = [], []
    for batch, s in sittings.items():
        for auto in [n for n in s.runs if n.startswith("ours") and n.endswith("K=auto") and s.median(n)]:
            prefix = auto.removesuffix("auto")
            fixed = [(s.median(n), n) for n in s.runs if n.startswith(prefix) and n != auto and s.median(n)]
            if fixed:
                _, best = min(fixed)
                chosen = {r.details for r in s.ok(auto)}
                rows.append([batch, auto, ", ".join(sorted(chosen)), s.ms(auto), best, s.ms(best),
                             s.versus(best, auto)])
            for _, name in sorted(fixed, key=lambda x: x[1]):
                p = s.paired(name, auto)
                if p is not None:
                    spread = p.interval() if p.ratio.has_interval else "1 pair"
                    pairs.append([batch, name, f"{p.ratio.median:.3f}x", spread])
    if rows:
        print("\nauto (the planner's slicing, ours.plan.auto) against the best fixed K")
        print_table(rows, ["batch", "auto", "auto ran", "step ms", "best fixed", "step ms", "against it"])
    if pairs:
        print("\nauto against each fixed K, paired: the fixed K's / auto's step time over neighbouring launches "
              "(above 1: auto faster)")
        print_table(pairs, ["batch", "fixed", "paired ratio", "pairs"])


def prefetch_against_none(sittings: dict[int, Sitting]) -> None:
    """Per batch and configuration of ours run with several ``--prefetch`` (``--ours-prefetch``), each
    against the same without it (``--prefetch 0``), paired: the medians, the ratio of neighbouring
    launches with its spread, and the last stage's busy share beside."""
    rows = []
    for batch, s in sittings.items():
        for off in [n for n in s.runs if n.startswith("ours") and n.endswith(" prefetch 0") and s.median(n)]:
            stem = off.removesuffix("0")
            for on in [n for n in s.runs if n.startswith(stem) and n != off and s.median(n)]:
                p = s.paired(off, on)
                spread = (p.interval() if p.ratio.has_interval else "1 pair") if p else "-"
                rows.append([batch, on.removeprefix("ours "), s.ms(on), s.ms(off),
                             f"{p.ratio.median:.3f}x" if p else "-", spread, percents(s.busy(on)),
                             percents(s.busy(off)),
                             ("yes: " + ("faster" if p.ratio.median > 1 else "slower") + " with") if p and p.separated
                             else "no"])
    if rows:
        print("\nthe next step's first forwards run ahead (--prefetch) against none (--prefetch 0), paired: the "
              "step time without over the step time with (above 1: faster with)")
        print_table(rows, ["batch", "ours", "step ms", "without: ms", "paired ratio", "pairs", "busy % per rank",
                           "without: busy %", "beyond noise?"])


def ours_vs_megatron_tp(opts: argparse.Namespace) -> int:
    """ours --tp T against megatron --tp T, side by side (module docstring)."""
    T = opts.tp
    common = ["--model", opts.model, "--tp", str(T), "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    sittings: dict[int, Sitting] = {}
    capacities: list[float] = []
    opts.pp = T  # the machine check: T processes at once
    for batch in opts.batch:
        configs = {"megatron": ["--system", "megatron", "--batch-size", str(batch), "--micro-batch-size", "1"]}
        for k in opts.slices:
            configs[f"ours K={k}"] = ["--system", "ours", "--batch-size", str(batch), "--micro-batch-size", "1",
                                      "--n-slices", str(k)]
        sittings[batch] = run_alternating(batch, configs, common, opts, capacities)
    print(f"\nours T-{T} vs megatron T-{T} on {opts.model}, P=1, micro-batch 1, {opts.reps} alternating reps "
          f"(step ms: {INTERVAL_RULE})")
    rows = []
    for batch, s in sittings.items():
        meg = s.median("megatron")
        for name in s.runs:
            t = s.median(name)
            if t is None:
                rows.append([batch, name, "failed", "", len(s.ok(name)), "", "", ""])
                continue
            ours = name.startswith("ours")
            rows.append([batch, name, s.ms(name), f"{s.best(name) * 1e3:.0f}", len(s.ok(name)),
                         f"{meg / t:.2f}x" if meg and ours else "-", s.paired_text("megatron", name) if ours else "-",
                         s.versus("megatron", name) if ours else ""])
    print_table(rows, ["batch", "config", "step ms", "min ms", "runs", "megatron / this", "paired",
                       "against megatron"])
    print("paired: megatron's / ours' step time, the median over their neighbouring launches "
          "(contract.estimate.paired)")
    print_machine(capacities, T, "megatron")
    return 0


def _fill_ours_vs_gpipe(b: argparse.ArgumentParser) -> None:
    b.add_argument("--batch", type=POSITIVE_INT, nargs="+", default=[1, 2], help="batch sizes per pipeline")
    b.add_argument("--reps", type=POSITIVE_INT, default=5, help="alternating repetitions of every configuration")
    b.add_argument("--slices", type=POSITIVE_INT, nargs="+", default=[4, 8], help="token slice counts K of ours to run")
    b.add_argument("--ours-slices", nargs="*", default=[], metavar="L1,L2,...",
                   help="also run ours with these explicit token slicings (each comma-separated lengths)")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--pp", type=POSITIVE_INT, default=2)
    b.add_argument("--steps", type=POSITIVE_INT, default=5, help="measured steps per run")
    b.add_argument("--warmup", type=NONNEGATIVE_INT, default=2)
    b.add_argument("--gpipe-system", default="torch_pipe",
                   help="the GPipe system (default torch_pipe; 'reference' to try the script without it)")
    b.add_argument("--no-reference", action="store_true", help="skip the single-process reference runs")
    b.add_argument("--timeout", type=POSITIVE, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")


def _fill_ours_vs_best(b: argparse.ArgumentParser) -> None:
    b.add_argument("--batch", type=POSITIVE_INT, nargs="+", default=[1, 2, 4], help="batch sizes per pipeline")
    b.add_argument("--reps", type=POSITIVE_INT, default=3, help="alternating repetitions of every configuration")
    b.add_argument("--slices", type=count_or_word(slice_count, 1), nargs="+", default=[2, 4, 8], metavar="K|auto",
                   help="token slice counts K of ours to run ('auto': the planner's slicing)")
    b.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=SCHEDULES,
                   help="the Torch Pipe schedules to run (each where it can run the batch; none given: ours "
                        "alone, for auto against the fixed K)")
    b.add_argument("--ours-prefetch", type=count_or_word(prefetch_count, 0), nargs="+", default=["auto"],
                   metavar="N|auto",
                   help="ours' --prefetch values to run each configuration of ours with (with 0 among several: "
                        "each against it, paired)")
    b.add_argument("--ours-batch-slices", type=POSITIVE_INT, nargs="+", default=[1], metavar="b",
                   help="the sequences in each of ours' batch slices (its --micro-batch-size; each that divides the "
                        "batch; the baselines run micro-batch 1)")
    b.add_argument("--ours-schedules", nargs="+", default=["1f1b"], choices=OURS_SCHEDULES,
                   help="the orders of ours' units to run (ours.schedule; gpipe only where the batch has several "
                        "batch slices: with one they are the same)")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--pp", type=POSITIVE_INT, default=2)
    b.add_argument("--steps", type=POSITIVE_INT, default=5, help="measured steps per run")
    b.add_argument("--warmup", type=NONNEGATIVE_INT, default=2)
    b.add_argument("--timeout", type=POSITIVE, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")


def _fill_ours_vs_megatron_tp(b: argparse.ArgumentParser) -> None:
    b.add_argument("--batch", type=POSITIVE_INT, nargs="+", default=[1, 2], help="batch sizes")
    b.add_argument("--reps", type=POSITIVE_INT, default=4, help="alternating repetitions of every configuration")
    b.add_argument("--tp", type=POSITIVE_INT, default=2)
    b.add_argument("--slices", type=count_or_word(slice_count, 1), nargs="+", default=[1], metavar="K|auto",
                   help="token slice counts K of ours to run")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--steps", type=POSITIVE_INT, default=3, help="measured steps per run")
    b.add_argument("--warmup", type=NONNEGATIVE_INT, default=1)
    b.add_argument("--timeout", type=POSITIVE, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)
    b = sub.add_parser("ours-vs-gpipe", help="Torch Pipe GPipe against ours on cpu-small, P=2")
    _fill_ours_vs_gpipe(b)
    b = sub.add_parser("ours-vs-best", help="the fastest Torch Pipe schedule that can run each batch against ours "
                                            "at its best K, on cpu-small, P=2")
    _fill_ours_vs_best(b)
    b = sub.add_parser("ours-vs-megatron-tp", help="ours --tp T against megatron --tp T on cpu-small, P=1")
    _fill_ours_vs_megatron_tp(b)
    b = sub.add_parser("network-slope", help="how many one-way delays each system pays per step (virtual cluster; "
                                             "root); the same as python -m bench.network_slope")
    network_slope.fill_parser(b)
    b = sub.add_parser("plan-evaluation", help="ours' latency model against runs of uniform and optimal slicings")
    plan_evaluation.fill_parser(b)
    b = sub.add_parser("attention", help="one layer's attention over a slice and its context: ours' kernel against "
                                         "the masked attention, one process")
    attention.fill_parser(b)
    b = sub.add_parser("breakdown", help="where each rank's step time goes, ours and every Torch Pipe schedule, "
                                         "cpu-small P=2")
    breakdown.fill_parser(b)
    b = sub.add_parser("seq-sweep", help="ours against the fastest Torch Pipe schedule across sequence lengths, "
                                         "both families at a tiny width, P=2: where token slicing starts to pay")
    seq_sweep.fill_parser(b)
    opts = p.parse_args(argv)
    if getattr(opts, "out", None) and (why := cannot_write_file(opts.out, "--out")):
        print(f"{p.prog}: error: {why}", file=sys.stderr)  # judged before the minutes of runs, not at the end
        return 2
    runs = {"seq-sweep": seq_sweep.run, "breakdown": breakdown.run, "attention": attention.run,
            "network-slope": network_slope.run, "plan-evaluation": plan_evaluation.run, "ours-vs-gpipe": ours_vs_gpipe,
            "ours-vs-best": ours_vs_best, "ours-vs-megatron-tp": ours_vs_megatron_tp}
    return runs[opts.bench](opts)


if __name__ == "__main__":
    sys.exit(main())

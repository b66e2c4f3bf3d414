"""Benchmarks that compare systems side by side: python -m bench NAME [options].

ours-vs-gpipe: Torch Pipe's GPipe schedule against ours (token-level pipeline) on cpu-small with
P = 2, at each batch size per pipeline, with repetitions alternating between the systems (so that
drifts of a shared machine hit every system alike). Each run is the real run command in a
subprocess, writing its record to a temporary file; the step time of a configuration is the median
over repetitions of each run's median_step_time, with its interval (``contract.estimate``, the
report's statistics: min-max below 8 repetitions, bootstrap from 8), and a difference is claimed only
where the intervals separate. Prints the step times, the ratio
GPipe / ours (of the medians, and paired: the median over repetitions of the ratio within one
repetition), and the pipeline efficiency T_ref / (P * T) against the single-process reference. Before
each repetition it measures how many cores the machine really gives P processes at once
(``bench.machine``) and warns when that is short of P: on a shared host that hurts a pipeline that
keeps every rank busy more than GPipe at batch 1, which keeps one rank busy at a time.

ours-vs-best: the same discipline against every Torch Pipe schedule (GPipe, 1F1B, interleaved 1F1B,
interleaved zero bubble, ZBV, DualPipeV) that can run the batch (the run command's own judgement
decides), and ours at several K; per batch, the fastest schedule against ours at its fastest K (by
median step time, and paired), with each rank's peak memory beside, and the goal of issue #15.

network-slope: how many one-way network delays each system pays per training step, split into the
schedule, the DP sync and the closing barrier (``bench.network_slope``).

plan-evaluation: ours' latency model (``ours.plan``) against measured runs of uniform slicings and the
planner's optimal one (``bench.plan_evaluation``).
ours-vs-megatron-tp: ours with tensor parallelism (``--tp``, ``ours.tp``) against Megatron at the same
T (P = 1), on cpu-small, alternating repetitions as above; per batch the step times with their
intervals, the ratio megatron / ours (of the medians, and paired) and whether the intervals separate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field

from baselines.torch_pipe import SCHEDULES
from contract.estimate import INTERVAL_RULE, Estimate, estimate, no_difference, separated
from ours import slice_count
from ours.schedule import SCHEDULES as OURS_SCHEDULES
from bench import network_slope, plan_evaluation
from runners.invoke import run_command
from bench.machine import parallel_capacity


@dataclass(frozen=True)
class Run:
    """One run command's record, as the benchmarks use it."""

    median: float  # median step time (s)
    minimum: float  # fastest step (s)
    peak_memory: tuple[int, ...]  # peak memory of every rank (bytes; peak RSS on CPU)
    busy: tuple[float, ...] = ()  # every rank's busy share of its step time (CPU runs; the rest is waiting)
    details: str = ""  # the record's details (ours' auto: the K it kept, 'auto, tuned: K=8 (128x8)')


def run_once(args: list[str], timeout: float) -> Run | None:
    """One run command; its record's step times and peak memory (None if the run failed)."""
    inv = run_command(args, timeout=timeout)
    rec = inv.record or {}
    if rec.get("status") != "ok" or rec.get("median_step_time") is None:
        why = rec.get("error") or inv.last_line
        print(f"  run failed ({' '.join(args)}): {str(why)[:500]}", file=sys.stderr)
        return None
    return Run(rec["median_step_time"], rec.get("min_step_time") or rec["median_step_time"],
               tuple(rec.get("peak_memory_bytes") or ()), tuple(rec.get("busy_fraction") or ()),
               rec.get("details") or "")


@dataclass
class Sitting:
    """Every configuration's runs at one batch size, repetition by repetition (None: failed)."""

    batch: int
    runs: dict[str, list[Run | None]] = field(default_factory=dict)

    def ok(self, name: str) -> list[Run]:
        return [r for r in self.runs.get(name, []) if r is not None]

    def estimate(self, name: str) -> Estimate | None:
        """The median over repetitions of each run's median step time, and its interval."""
        v = [r.median for r in self.ok(name)]
        return estimate(v) if v else None

    def median(self, name: str) -> float | None:
        e = self.estimate(name)
        return e.median if e else None

    def ms(self, name: str) -> str:
        """'1234 ±4 %': the median step time in ms and its interval."""
        e = self.estimate(name)
        return f"{e.median * 1e3:.0f} {e.plus_minus()}" if e else "failed"

    def versus(self, base: str, name: str) -> str:
        """base against name: which is faster and by how much where their intervals separate, else that they do not."""
        a, b = self.estimate(base), self.estimate(name)
        if a is None or b is None:
            return "-"
        if not separated(a, b):
            return no_difference(a, b)
        return f"{name} faster" if b.median < a.median else f"{base} faster"

    def best(self, name: str) -> float | None:
        """The fastest step of any run."""
        v = [r.minimum for r in self.ok(name)]
        return min(v) if v else None

    def paired(self, base: str, name: str) -> float | None:
        """The median over repetitions of base's / name's step time within the same repetition."""
        pairs = zip(self.runs.get(base, []), self.runs.get(name, []))
        v = [a.median / b.median for a, b in pairs if a is not None and b is not None]
        return statistics.median(v) if v else None

    def peak_memory(self, name: str) -> tuple[int, ...]:
        """Every rank's peak memory, the largest over the repetitions."""
        runs = self.ok(name)
        return tuple(max(per_rank) for per_rank in zip(*(r.peak_memory for r in runs))) if runs else ()

    def busy(self, name: str) -> tuple[float, ...]:
        """Every rank's busy share of its step time, the median over the repetitions."""
        runs = [r for r in self.ok(name) if r.busy]
        return tuple(statistics.median(per_rank) for per_rank in zip(*(r.busy for r in runs))) if runs else ()


def run_alternating(batch: int, configs: dict[str, list[str]], common: list[str], opts: argparse.Namespace,
                    capacities: list[float]) -> Sitting:
    """``opts.reps`` repetitions of every configuration, in alternating order (so that drifts of a
    shared machine hit every configuration alike), each preceded by the machine check (appended to
    ``capacities``) unless ``opts.no_capacity_check``."""
    sitting = Sitting(batch, {name: [] for name in configs})
    names = list(configs)
    for rep in range(opts.reps):
        if not opts.no_capacity_check:
            cap = parallel_capacity(opts.pp)
            capacities.append(cap.effective_cores)
            print(f"batch {batch} rep {rep + 1}/{opts.reps} machine: {cap.describe()}", file=sys.stderr, flush=True)
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            r = run_once(configs[name] + common, opts.timeout)
            sitting.runs[name].append(r)
            print(f"batch {batch} rep {rep + 1}/{opts.reps} {name}: "
                  f"{'failed' if r is None else f'median {r.median * 1e3:.0f} ms, min {r.minimum * 1e3:.0f} ms'}"
                  f"{f' ({r.details})' if r is not None and r.details else ''}",
                  file=sys.stderr, flush=True)
    return sitting


def print_machine(capacities: list[float], P: int, what: str) -> None:
    """The machine check's summary, and a warning when the P ranks did not always get P cores."""
    if not capacities:
        return
    lo, med_c = min(capacities), statistics.median(capacities)
    print(f"machine: {med_c:.2f} effective cores of {P} (median over repetitions; lowest {lo:.2f}), "
          f"from single-thread matmuls run {P} at once against one alone")
    if lo < 0.9 * P:
        print(f"warning: in some repetitions the {P} ranks did not get {P} full cores (shared host); a pipeline "
              f"that keeps every rank busy loses more from that than {what}, so the ratios above understate ours "
              f"on a machine with {P} free cores")


def ours_args(P: int, batch: int, k: int | str | None = None, slices: str | None = None) -> list[str]:
    args = ["--system", "ours", "--pp", str(P), "--batch-size", str(batch), "--micro-batch-size", "1"]
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
    print(f"{'batch':>5} | {'config':<34} | {'step ms':>12} | {'min ms':>7} | {'runs':>4} | {'efficiency':>10} | "
          f"{'gpipe / this':>12} | {'paired':>6} | against gpipe")
    print("-" * 140)
    for batch in opts.batch:
        s = sittings[batch]
        ref, gp = s.median("reference"), s.median("gpipe")
        ours_names = [f"ours K={k}" for k in opts.slices] + [f"ours {sl}" for sl in opts.ours_slices]
        for name in ([] if opts.no_reference else ["reference"]) + ["gpipe"] + ours_names:
            t = s.median(name)
            n = len(s.ok(name))
            label = gp_label if name == "gpipe" else name
            if t is None:
                print(f"{batch:>5} | {label:<34} | {'failed':>12} | {'':>7} | {n:>4} |")
                continue
            p = 1 if name == "reference" or (name == "gpipe" and opts.gpipe_system == "reference") else P
            eff = f"{ref / (p * t):.2f}" if ref else "-"
            ratio = f"{gp / t:.2f}x" if gp and name.startswith("ours") else "-"
            pr = s.paired("gpipe", name) if name.startswith("ours") else None
            pr = f"{pr:.2f}x" if pr else "-"
            vs = s.versus("gpipe", name) if name.startswith("ours") else ""
            print(f"{batch:>5} | {label:<34} | {s.ms(name):>12} | {s.best(name) * 1e3:7.0f} | {n:>4} | {eff:>10} | "
                  f"{ratio:>12} | {pr:>6} | {vs}")
        ours = [(s.median(n), n) for n in ours_names if s.median(n)]
        if ours and gp:
            t, n = min(ours)
            print(f"{batch:>5} | best: {n}, {gp_label} / ours = {gp / t:.2f}x (by median step time; "
                  f"{s.versus('gpipe', n)})")
    print("paired: median over repetitions of GPipe's / this configuration's step time within the same repetition")
    print_machine(capacities, P, "GPipe at batch 1, which keeps one rank busy at a time")
    return 0


GOALS = {1: 1.3, 2: 1.1, 4: 1.0}  # best baseline / ours the project aims at, by batch per pipeline (issue #15)
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb": "interleaved zero bubble",
                  "zbv": "ZBV zero bubble", "dualpipev": "DualPipeV"}


def cannot_run(args: list[str]) -> str | None:
    """Why the run command would refuse ``args`` (its own judgement), or None."""
    from contract import ConfigError
    from runners.request import judge, parse_request

    try:
        judge(*parse_request(args))
    except ConfigError as exc:
        return str(exc)
    return None


def percents(shares: tuple[float, ...]) -> str:
    return "/".join(f"{100 * b:.0f}" for b in shares) if shares else "-"


def megabytes(peaks: tuple[int, ...]) -> str:
    return "/".join(f"{b / 2**20:.0f}" for b in peaks) if peaks else "-"


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
        for schedule in opts.ours_schedules if batch > 1 else opts.ours_schedules[:1]:  # the same at one row
            for k in opts.slices:
                name = f"ours K={k}" if schedule == "1f1b" else f"ours {schedule} K={k}"
                configs[name] = ours_args(P, batch, k=k) + ["--schedule", schedule]
        sittings[batch] = run_alternating(batch, configs, common, opts, capacities)

    print(f"\nours vs the fastest Torch Pipe schedule on {opts.model}, P={P}, micro-batch 1, {opts.reps} alternating "
          f"reps (step ms: {INTERVAL_RULE}; min: fastest step of any run; peak MB: peak memory of each rank, RSS on "
          f"CPU, largest over the reps)")
    print(f"{'batch':>5} | {'config':<26} | {'step ms':>12} | {'min ms':>7} | {'runs':>4} | {'peak MB per rank':>16} | "
          f"{'busy % per rank':>15} | {'best baseline / this':>20}")
    print("-" * 126)
    summary = []
    for batch in opts.batch:
        s = sittings[batch]
        baselines = [(s.median(n), n) for n in s.runs if n.startswith("torch_pipe") and s.median(n)]
        ours = [(s.median(n), n) for n in s.runs if n.startswith("ours") and s.median(n)]
        base_t, base = min(baselines) if baselines else (None, None)
        for name in s.runs:
            t = s.median(name)
            if t is None:
                print(f"{batch:>5} | {name:<26} | {'failed':>12} |")
                continue
            ratio = f"{base_t / t:.2f}x" if base_t and name.startswith("ours") else "-"
            print(f"{batch:>5} | {name:<26} | {s.ms(name):>12} | {s.best(name) * 1e3:7.0f} | {len(s.ok(name)):>4} | "
                  f"{megabytes(s.peak_memory(name)):>16} | {percents(s.busy(name)):>15} | {ratio:>20}")
        if baselines and ours:
            t, name = min(ours)
            summary.append((batch, base, base_t, name, t, s.paired(base, name), s.peak_memory(base),
                            s.peak_memory(name)))
    print("\nper batch: the fastest baseline schedule against ours at its fastest K (by median step time)")
    print(f"{'batch':>5} | {'best baseline':<26} | {'ms':>11} | {'ours':<10} | {'ms':>11} | {'ratio':>6} | "
          f"{'paired':>6} | "
          f"{'goal':>5} | {'peak MB baseline':>16} | {'peak MB ours':>12} | beyond noise?")
    for batch, base, base_t, name, t, paired, base_mem, ours_mem in summary:
        s = sittings[batch]
        goal = GOALS.get(batch)
        verdict = "" if goal is None else f"{goal:.1f}x " + ("met" if base_t / t >= goal else "missed")
        schedule = base.removeprefix("torch_pipe ")
        print(f"{batch:>5} | {SCHEDULE_NAMES.get(schedule, schedule):<26} | {s.ms(base):>11} | "
              f"{name.removeprefix('ours '):<10} | {s.ms(name):>11} | {base_t / t:5.2f}x | "
              f"{f'{paired:.2f}x' if paired else '-':>6} | {verdict:>5} | {megabytes(base_mem):>16} | "
              f"{megabytes(ours_mem):>12} | {s.versus(base, name)}")
    auto_against_fixed(sittings)
    print("ratio: best baseline's / ours' median step time; paired: the median over repetitions of the same ratio "
          "within one repetition; goal: the ratio issue #15 asks for; busy %: the share of each rank's step time it "
          "was computing (its process's CPU time over its step time; the rest is bubbles, messages, the barrier)")
    print_machine(capacities, P, "a schedule that leaves ranks idle")
    return 0


def auto_against_fixed(sittings: dict[int, Sitting]) -> None:
    """Per batch and order of units, ``--n-slices auto`` against the fastest fixed K it ran beside: within
    noise, or slower or faster beyond it (the done-when of issue #26)."""
    lines = []
    for batch, s in sittings.items():
        for auto in [n for n in s.runs if n.startswith("ours") and n.endswith("K=auto") and s.median(n)]:
            prefix = auto.removesuffix("auto")
            fixed = [(s.median(n), n) for n in s.runs if n.startswith(prefix) and n != auto and s.median(n)]
            if fixed:
                _, best = min(fixed)
                lines.append(f"{batch:>5} | {auto:<22} {s.ms(auto):>11} | best fixed {best:<14} {s.ms(best):>11} | "
                             f"{s.versus(best, auto)}")
    if lines:
        print("\nauto against the best fixed K (auto times a few K during warm-up and keeps the fastest; "
              "ours.plan.tune)")
        print("\n".join(lines))


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
    print(f"{'batch':>5} | {'config':<12} | {'step ms':>12} | {'min ms':>7} | {'runs':>4} | {'megatron / this':>15} | "
          f"{'paired':>6} | against megatron")
    print("-" * 100)
    for batch, s in sittings.items():
        meg = s.median("megatron")
        for name in s.runs:
            t = s.median(name)
            if t is None:
                print(f"{batch:>5} | {name:<12} | {'failed':>12} |")
                continue
            ours = name.startswith("ours")
            ratio = f"{meg / t:.2f}x" if meg and ours else "-"
            pr = s.paired("megatron", name) if ours else None
            print(f"{batch:>5} | {name:<12} | {s.ms(name):>12} | {s.best(name) * 1e3:7.0f} | {len(s.ok(name)):>4} | "
                  f"{ratio:>15} | {f'{pr:.2f}x' if pr else '-':>6} | {s.versus('megatron', name) if ours else ''}")
    print("paired: the median over repetitions of megatron's / ours' step time within the same repetition")
    print_machine(capacities, T, "megatron")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)
    b = sub.add_parser("ours-vs-gpipe", help="Torch Pipe GPipe against ours on cpu-small, P=2")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="batch sizes per pipeline")
    b.add_argument("--reps", type=int, default=5, help="alternating repetitions of every configuration")
    b.add_argument("--slices", type=int, nargs="+", default=[4, 8], help="token slice counts K of ours to run")
    b.add_argument("--ours-slices", nargs="*", default=[], metavar="L1,L2,...",
                   help="also run ours with these explicit token slicings (each comma-separated lengths)")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--pp", type=int, default=2)
    b.add_argument("--steps", type=int, default=5, help="measured steps per run")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--gpipe-system", default="torch_pipe",
                   help="the GPipe system (default torch_pipe; 'reference' to try the script without it)")
    b.add_argument("--no-reference", action="store_true", help="skip the single-process reference runs")
    b.add_argument("--timeout", type=float, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")
    b = sub.add_parser("ours-vs-best", help="the fastest Torch Pipe schedule that can run each batch against ours "
                                            "at its best K, on cpu-small, P=2")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4], help="batch sizes per pipeline")
    b.add_argument("--reps", type=int, default=3, help="alternating repetitions of every configuration")
    b.add_argument("--slices", type=slice_count, nargs="+", default=[2, 4, 8], metavar="K|auto",
                   help="token slice counts K of ours to run ('auto': the planner's slicing)")
    b.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   help="the Torch Pipe schedules to run (each where it can run the batch)")
    b.add_argument("--ours-schedules", nargs="+", default=["1f1b"], choices=OURS_SCHEDULES,
                   help="the orders of ours' units to run (ours.schedule; gpipe only where the batch has several "
                        "batch slices: with one they are the same)")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--pp", type=int, default=2)
    b.add_argument("--steps", type=int, default=5, help="measured steps per run")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--timeout", type=float, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")
    b = sub.add_parser("ours-vs-megatron-tp", help="ours --tp T against megatron --tp T on cpu-small, P=1")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="batch sizes")
    b.add_argument("--reps", type=int, default=4, help="alternating repetitions of every configuration")
    b.add_argument("--tp", type=int, default=2)
    b.add_argument("--slices", type=slice_count, nargs="+", default=[1], metavar="K|auto",
                   help="token slice counts K of ours to run")
    b.add_argument("--model", default="cpu-small")
    b.add_argument("--steps", type=int, default=3, help="measured steps per run")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--timeout", type=float, default=900.0)
    b.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")
    b = sub.add_parser("network-slope", help="how many one-way delays each system pays per step (virtual cluster; "
                                             "root); the same as python -m bench.network_slope")
    network_slope.fill_parser(b)
    b = sub.add_parser("plan-evaluation", help="ours' latency model against runs of uniform and optimal slicings")
    plan_evaluation.fill_parser(b)
    opts = p.parse_args(argv)
    if opts.bench == "network-slope":
        return network_slope.run(opts)
    if opts.bench == "plan-evaluation":
        return plan_evaluation.run(opts)
    if opts.bench == "ours-vs-gpipe":
        return ours_vs_gpipe(opts)
    if opts.bench == "ours-vs-best":
        return ours_vs_best(opts)
    if opts.bench == "ours-vs-megatron-tp":
        return ours_vs_megatron_tp(opts)
    return 2


if __name__ == "__main__":
    sys.exit(main())

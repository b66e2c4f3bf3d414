"""Benchmarks that compare systems side by side: python -m runners.bench NAME [options].

ours-vs-gpipe: Torch Pipe's GPipe schedule against ours (token-level pipeline) on cpu-small with
P = 2, at each batch size per pipeline, with repetitions alternating between the systems (so that
drifts of a shared machine hit every system alike). Each run is the real run command in a
subprocess, writing its record to a temporary file; the median step time of a configuration is the
median over repetitions of each run's median_step_time. Prints the step times, the ratio
GPipe / ours (of the medians, and paired: the median over repetitions of the ratio within one
repetition), and the pipeline efficiency T_ref / (P * T) against the single-process reference. Before
each repetition it measures how many cores the machine really gives P processes at once
(``runners.machine``) and warns when that is short of P: on a shared host that hurts a pipeline that
keeps every rank busy more than GPipe at batch 1, which keeps one rank busy at a time.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from runners.invoke import run_command
from runners.machine import parallel_capacity


def run_once(args: list[str], timeout: float) -> tuple[float, float] | None:
    """One run command; its record's (median_step_time, min_step_time) (None if the run failed)."""
    inv = run_command(args, timeout=timeout)
    rec = inv.record or {}
    if rec.get("status") != "ok" or rec.get("median_step_time") is None:
        why = rec.get("error") or inv.last_line
        print(f"  run failed ({' '.join(args)}): {str(why)[:500]}", file=sys.stderr)
        return None
    return rec["median_step_time"], rec.get("min_step_time") or rec["median_step_time"]


def ours_vs_gpipe(opts: argparse.Namespace) -> int:
    P = opts.pp
    common = ["--model", opts.model, "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    results: dict[tuple[int, str], list[float]] = {}
    minima: dict[tuple[int, str], list[float]] = {}
    per_rep: dict[tuple[int, int, str], float] = {}
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
            configs[f"ours K={k}"] = ["--system", "ours", "--pp", str(P), "--batch-size", str(batch),
                                      "--micro-batch-size", str(mb), "--n-slices", str(k)]
        for sl in opts.ours_slices:
            configs[f"ours {sl}"] = ["--system", "ours", "--pp", str(P), "--batch-size", str(batch),
                                     "--micro-batch-size", str(mb), "--slices", sl]
        names = list(configs)
        for rep in range(opts.reps):
            if not opts.no_capacity_check:
                cap = parallel_capacity(P)
                capacities.append(cap.effective_cores)
                print(f"batch {batch} rep {rep + 1}/{opts.reps} machine: {cap.describe()}", file=sys.stderr, flush=True)
            order = names if rep % 2 == 0 else names[::-1]  # alternate, so drifts hit all alike
            for name in order:
                r = run_once(configs[name] + common, opts.timeout)
                print(f"batch {batch} rep {rep + 1}/{opts.reps} {name}: "
                      f"{'failed' if r is None else f'median {r[0] * 1e3:.0f} ms, min {r[1] * 1e3:.0f} ms'}",
                      file=sys.stderr, flush=True)
                if r is not None:
                    results.setdefault((batch, name), []).append(r[0])
                    minima.setdefault((batch, name), []).append(r[1])
                    per_rep[(batch, rep, name)] = r[0]

    def med(batch: int, name: str) -> float | None:
        v = results.get((batch, name))
        return statistics.median(v) if v else None

    def best(batch: int, name: str) -> float | None:
        v = minima.get((batch, name))
        return min(v) if v else None

    def paired(batch: int, name: str) -> float | None:
        """Median over repetitions of GPipe / this within the same repetition."""
        v = [per_rep[(batch, r, "gpipe")] / per_rep[(batch, r, name)] for r in range(opts.reps)
             if (batch, r, "gpipe") in per_rep and (batch, r, name) in per_rep]
        return statistics.median(v) if v else None

    gp_label = "torch_pipe GPipe" if opts.gpipe_system == "torch_pipe" else f"{opts.gpipe_system} (standing in for GPipe)"
    print(f"\nours vs {gp_label} on {opts.model}, P={P}, micro-batch 1, {opts.reps} alternating reps "
          f"(step ms: median of per-run median step times; min: fastest step of any run; efficiency = T_ref / (P * T))")
    print(f"{'batch':>5} | {'config':<34} | {'step ms':>8} | {'min ms':>7} | {'runs':>4} | {'efficiency':>10} | "
          f"{'gpipe / this':>12} | {'paired':>6}")
    print("-" * 107)
    for batch in opts.batch:
        ref, gp = med(batch, "reference"), med(batch, "gpipe")
        ours_names = [f"ours K={k}" for k in opts.slices] + [f"ours {sl}" for sl in opts.ours_slices]
        for name in ([] if opts.no_reference else ["reference"]) + ["gpipe"] + ours_names:
            t = med(batch, name)
            n = len(results.get((batch, name), []))
            label = gp_label if name == "gpipe" else name
            if t is None:
                print(f"{batch:>5} | {label:<34} | {'failed':>8} | {'':>7} | {n:>4} |")
                continue
            p = 1 if name == "reference" or (name == "gpipe" and opts.gpipe_system == "reference") else P
            eff = f"{ref / (p * t):.2f}" if ref else "-"
            ratio = f"{gp / t:.2f}x" if gp and name.startswith("ours") else "-"
            pr = paired(batch, name) if name.startswith("ours") else None
            pr = f"{pr:.2f}x" if pr else "-"
            print(f"{batch:>5} | {label:<34} | {t * 1e3:8.0f} | {best(batch, name) * 1e3:7.0f} | {n:>4} | {eff:>10} | "
                  f"{ratio:>12} | {pr:>6}")
        ours = [(med(batch, n), n) for n in ours_names if med(batch, n)]
        if ours and gp:
            t, n = min(ours)
            print(f"{batch:>5} | best: {n}, {gp_label} / ours = {gp / t:.2f}x (by median step time)")
    print("paired: median over repetitions of GPipe's / this configuration's step time within the same repetition")
    if capacities:
        lo, med_c = min(capacities), statistics.median(capacities)
        print(f"machine: {med_c:.2f} effective cores of {P} (median over repetitions; lowest {lo:.2f}), "
              f"from single-thread matmuls run {P} at once against one alone")
        if lo < 0.9 * P:
            print(f"warning: in some repetitions the {P} ranks did not get {P} full cores (shared host); a pipeline "
                  f"that keeps every rank busy loses more from that than GPipe at batch 1, which keeps one rank "
                  f"busy at a time, so the ratios above understate ours on a machine with {P} free cores")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runners.bench", description=__doc__.split("\n\n")[0])
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
    opts = p.parse_args(argv)
    if opts.bench == "ours-vs-gpipe":
        return ours_vs_gpipe(opts)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""What the side-by-side benchmarks share: one run command's record (``Run``), every configuration's
launches at one batch size (``Sitting``: medians with their intervals, paired ratios of neighbouring
launches, ``contract.estimate``), the round-robin that launches them (``run_alternating``), the machine
check's summary and the tables (``tabulate``)."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from dataclasses import dataclass, field

from tabulate import tabulate

from bench.machine import parallel_capacity
from contract.estimate import Estimate, Paired, estimate, no_difference, paired, separated
from runners.invoke import run_command


@dataclass(frozen=True)
class Run:
    """One run command's record, as the benchmarks use it."""

    median: float  # median step time (s)
    minimum: float  # fastest step (s)
    peak_memory: tuple[int, ...]  # peak memory of every rank (bytes; peak RSS on CPU)
    busy: tuple[float, ...] = ()  # every rank's busy share of its step time (CPU runs; the rest is waiting)
    details: str = ""  # the record's details (ours' auto: the K it kept, 'auto, tuned: K=8 (128x8)')
    launched: int = 0  # its place in the sitting's launches (neighbouring launches pair: ``Sitting.paired``)


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

    def paired(self, base: str, name: str) -> Paired | None:
        """``name`` against ``base`` from their neighbouring launches, the report's comparison
        (``contract.estimate.paired``): base's / name's step time, the median over the pairs."""
        return paired(*([(r.launched, r.median) for r in self.ok(n)] for n in (base, name)))

    def paired_text(self, base: str, name: str) -> str:
        """'1.23x': the paired ratio (``paired``), or '-' where no launches pair."""
        p = self.paired(base, name)
        return f"{p.ratio.median:.2f}x" if p else "-"

    def peak_memory(self, name: str) -> tuple[int, ...]:
        """Every rank's peak memory, the largest over the repetitions."""
        runs = self.ok(name)
        return tuple(max(per_rank) for per_rank in zip(*(r.peak_memory for r in runs))) if runs else ()

    def busy(self, name: str) -> tuple[float, ...]:
        """Every rank's busy share of its step time, the median over the repetitions."""
        runs = [r for r in self.ok(name) if r.busy]
        return tuple(statistics.median(per_rank) for per_rank in zip(*(r.busy for r in runs))) if runs else ()


def run_alternating(batch: int, configs: dict[str, list[str]], common: list[str], opts: argparse.Namespace,
                    capacities: list[float], label: str = "") -> Sitting:
    """``opts.reps`` repetitions of every configuration, in alternating order (so that drifts of a
    shared machine hit every configuration alike), each preceded by the machine check (appended to
    ``capacities``) unless ``opts.no_capacity_check``; ``label`` heads its progress lines."""
    sitting = Sitting(batch, {name: [] for name in configs})
    names = list(configs)
    where = f"{label}batch {batch}"
    for rep in range(opts.reps):
        if not opts.no_capacity_check:
            cap = parallel_capacity(opts.pp)
            capacities.append(cap.effective_cores)
            print(f"{where} rep {rep + 1}/{opts.reps} machine: {cap.describe()}", file=sys.stderr, flush=True)
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            r = run_once(configs[name] + common, opts.timeout)
            r = r and dataclasses.replace(r, launched=sum(map(len, sitting.runs.values())))
            sitting.runs[name].append(r)
            print(f"{where} rep {rep + 1}/{opts.reps} {name}: "
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


def percents(shares: tuple[float, ...]) -> str:
    """Every rank's share as whole per cents, '92/94' ('-': none)."""
    return "/".join(f"{100 * b:.0f}" for b in shares) if shares else "-"


def megabytes(peaks: tuple[int, ...]) -> str:
    """Every rank's peak memory in MB, '537/533' ('-': none)."""
    return "/".join(f"{b / 2**20:.0f}" for b in peaks) if peaks else "-"


def print_table(rows: list[list], headers: list[str]) -> None:
    """A benchmark's table as aligned text (``tabulate``), its first column (the batch) a number."""
    print(tabulate(rows, headers=headers, tablefmt="presto", disable_numparse=list(range(1, len(headers)))))

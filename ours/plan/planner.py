"""From a fitted latency model to the optimal (batch slice, token slicing) of a pipeline."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from ours.plan.latency import LatencyModel
from ours.plan.solve import solve_table


@dataclass(frozen=True)
class Plan:
    slices: tuple[int, ...]  # token lengths, summing to the sequence length
    batch_slice: int  # b: sequences per slice; batch_size / b batch slices share the token slicing
    n_stages: int
    batch_size: int
    granularity: int
    predicted_pipeline: float  # T = (B/b) * sum t_i + (K - 1) * max t_i, seconds
    predicted_step: float  # the whole training step (pipeline + head + optimizer + constant)
    solve_seconds: float
    candidates: int
    evaluated: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slices"] = list(self.slices)
        return d

    def summary(self) -> str:
        s = ",".join(map(str, self.slices))
        return (f"K={self.n_stages} B={self.batch_size} b={self.batch_slice} g={self.granularity}: "
                f"{len(self.slices)} slices [{s}] predicted pipeline {self.predicted_pipeline * 1e3:.1f} ms, "
                f"step {self.predicted_step * 1e3:.1f} ms (solved in {self.solve_seconds:.3f} s)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(model: LatencyModel, *, n_layer: int, n_stages: int, batch_size: int, seq_len: int | None = None,
         granularity: int = 8, batch_slices: list[int] | None = None) -> Plan:
    """The slicing minimising the pipeline latency over token slicings at ``granularity`` and batch
    slice sizes ``batch_slices`` (default: every divisor of ``batch_size``)."""
    seq_len = seq_len or model.seq_len
    if n_layer % n_stages:
        raise ValueError(f"{n_layer} layers do not divide into {n_stages} stages")
    if granularity < 1:
        raise ValueError("granularity must be >= 1")
    bs = batch_slices or divisors(batch_size)
    for b in bs:
        if b < 1 or batch_size % b:
            raise ValueError(f"batch slice {b} does not divide the batch size {batch_size}")
    start = time.perf_counter()
    best = None  # (T, b, solution, pos)
    cand = ev = 0
    for b in sorted(bs):
        pos, table = model.table(b, seq_len, granularity, n_layer // n_stages, n_stages)
        sol = solve_table(table, n_stages, batch_size // b, upper_bound=best[0] if best else math.inf,
                          fill_factor=model.fill_factor)
        if sol is None:
            continue
        cand += sol.candidates
        ev += sol.evaluated
        if best is None or sol.latency < best[0]:
            best = (sol.latency, b, sol, pos)
    elapsed = time.perf_counter() - start
    if best is None:
        raise ValueError("no feasible slicing")
    T, b, sol, pos = best
    slices = tuple(int(pos[e] - pos[s]) for s, e in zip(sol.cuts[:-1], sol.cuts[1:]))
    step = model.step_time(slices, b, batch_size, n_layer, n_stages)["total"]
    return Plan(slices=slices, batch_slice=b, n_stages=n_stages, batch_size=batch_size, granularity=granularity,
                predicted_pipeline=float(T), predicted_step=float(step), solve_seconds=elapsed, candidates=cand,
                evaluated=ev)

"""The optimal (batch slice, token slicing) of a pipeline, from the compute model: TeraPipe's
latency model (``ours.plan.latency``: each slice's time and fill by ours' cost of a slice) tabled over
slice boundaries and solved exactly (``ours.plan.solve``), for every batch slice size asked, so that
the batch split and the token slicing (one slice included) are chosen together."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from contract.links import Link
from ours.plan.latency import BYTES_PER_ELEMENT, hidden_at_end, slice_table, slice_times
from ours.plan.solve import pipeline_latency, solve_table
from workload.compute import ComputeModel
from workload.configs import ModelConfig


@dataclass(frozen=True)
class Plan:
    slices: tuple[int, ...]  # token lengths, summing to the sequence length
    batch_slice: int  # b: sequences per slice; batch_size / b batch slices share the token slicing
    n_stages: int
    batch_size: int
    granularity: int
    predicted_pipeline: float  # T = (B/b) * sum t_i + (P - 1) * max f_i - hidden at the end, seconds (K = len(slices))
    solve_seconds: float
    candidates: int
    evaluated: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slices"] = list(self.slices)
        return d

    def summary(self) -> str:
        s = ",".join(map(str, self.slices))
        return (f"P={self.n_stages} B={self.batch_size} b={self.batch_slice} g={self.granularity}: "
                f"K={len(self.slices)} token slices [{s}] predicted pipeline {self.predicted_pipeline * 1e3:.1f} ms "
                f"(solved in {self.solve_seconds:.3f} s)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_granularity(seq_len: int) -> int:
    """Slice boundaries every 8 tokens, coarser from 512 tokens on (at most 64 positions)."""
    return max(8, -(-seq_len // 64))


def pipeline_time(cm: ComputeModel, model: ModelConfig, slices, *, b: int, batch_size: int, n_stages: int, tp: int = 1,
                  recompute: bool = False, link: Link | None = None,
                  element_bytes: int = BYTES_PER_ELEMENT) -> float:
    """T of a given slicing (``ours.plan.latency``: ``ours.plan.solve.pipeline_latency`` over its slices'
    t and f, less what the deferred weight gradients hide at the step's end)."""
    ctx = 0
    parts = []
    for l in slices:
        parts.append(slice_times(cm, model.n_embd, b, int(l), ctx, layers=model.n_layer // n_stages,
                                 n_stages=n_stages, tp=tp, recompute=recompute, link=link, element_bytes=element_bytes))
        ctx += int(l)
    T = pipeline_latency([p.time for p in parts], n_stages, batch_size // b, fills=[p.fill for p in parts])
    first = int(slices[0])
    rest = 0.0
    if first < model.seq_len:  # the rest of the sequence as one slice (``end_of_step``)
        rest = slice_times(cm, model.n_embd, b, model.seq_len - first, first, layers=model.n_layer // n_stages,
                           n_stages=n_stages, tp=tp, recompute=recompute, link=link, element_bytes=element_bytes).wgrad
    return T - hidden_at_end(parts[0], rest, n_stages)


def plan(cm: ComputeModel, model: ModelConfig, *, n_stages: int, batch_size: int, tp: int = 1, recompute: bool = False,
         link: Link | None = None, granularity: int | None = None, batch_slices: list[int] | None = None,
         element_bytes: int = BYTES_PER_ELEMENT, tp_link: Link | None = None, act_bytes: int = 4) -> Plan:
    """The slicing minimising the pipeline latency over token slicings at ``granularity`` and batch slice
    sizes ``batch_slices`` (default: every divisor of ``batch_size``)."""
    seq_len = model.seq_len
    if model.n_layer % n_stages:
        raise ValueError(f"{model.n_layer} layers do not divide into {n_stages} stages")
    g = granularity or default_granularity(seq_len)
    if g < 1:
        raise ValueError("granularity must be >= 1")
    bs = batch_slices or divisors(batch_size)
    for b in bs:
        if b < 1 or batch_size % b:
            raise ValueError(f"batch slice {b} does not divide the batch size {batch_size}")
    start = time.perf_counter()
    best = None  # (T, b, solution, pos)
    cand = ev = 0
    for b in sorted(bs):
        pos, table, fill, hidden = slice_table(cm, model.n_embd, seq_len, g, b, layers=model.n_layer // n_stages,
                                               n_stages=n_stages, tp=tp, recompute=recompute, link=link,
                                               element_bytes=element_bytes, tp_link=tp_link, act_bytes=act_bytes)
        M = batch_size // b
        table[0, :] -= hidden / M  # with the first slice, once a step: M x (t_0 - hidden / M)
        sol = solve_table(table, n_stages, M, upper_bound=best[0] if best else math.inf, fill=fill)
        if sol is None:
            continue
        cand += sol.candidates
        ev += sol.evaluated
        if best is None or sol.latency < best[0]:
            best = (sol.latency, b, sol, pos)
    if best is None:
        raise ValueError("no feasible slicing")
    T, b, sol, pos = best
    slices = tuple(int(pos[e] - pos[s]) for s, e in zip(sol.cuts[:-1], sol.cuts[1:]))
    return Plan(slices=slices, batch_slice=b, n_stages=n_stages, batch_size=batch_size, granularity=g,
                predicted_pipeline=float(T), solve_seconds=time.perf_counter() - start, candidates=cand, evaluated=ev)


def plan_for(cm: ComputeModel, model: ModelConfig, *, tp: int, pp: int, batch: int, micro_batch: int,
             recompute: bool = False, link=None, element_bytes: int = BYTES_PER_ELEMENT, tp_link=None) -> Plan:
    """ours' slicing for a run: batch slices of ``micro_batch`` sequences, P stages; ``link`` / ``tp_link``:
    links (``contract.links.Link``), between stages and inside a stage's tensor-parallel group (None:
    free), of which the planner's model takes the latency and the bandwidth."""
    def stage(x: Link | None) -> Link | None:
        return Link(x.latency, x.bandwidth) if x is not None else None

    act = 4 if getattr(cm, "precision", "fp32") == "fp32" else 2
    return plan(cm, model, n_stages=pp, batch_size=batch, tp=tp, recompute=recompute, link=stage(link),
                batch_slices=[micro_batch], element_bytes=element_bytes, tp_link=stage(tp_link), act_bytes=act)

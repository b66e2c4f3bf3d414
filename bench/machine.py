"""How much parallel compute this machine gives right now: the check a side-by-side benchmark runs
before trusting a pipeline's speed-up.

A pipeline of P single-thread ranks is only faster than a sequential schedule if P cores really run at
once. On a shared host (a VM with noisy neighbours) two "cores" may deliver the work of one and a half;
a GPipe schedule at batch 1 keeps one rank busy at a time and hardly notices, a token-level pipeline
keeps both busy and loses its advantage. ``parallel_capacity`` measures it: single-thread matmul
throughput of one process alone, then of ``n`` processes at once, then of one alone again: the faster
of the two alone runs is the core's rate (one alone run caught by a neighbour or a clock still ramping
up would credit the host with more cores than it has).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    n: int
    alone_gflops: float  # one process alone
    together_gflops: float  # per process, n at once (mean)

    @property
    def efficiency(self) -> float:
        """Per-process throughput with n at once / alone (1.0 = n full cores)."""
        return self.together_gflops / self.alone_gflops if self.alone_gflops else 0.0

    @property
    def effective_cores(self) -> float:
        return self.n * self.efficiency

    def describe(self) -> str:
        return (f"{self.n} single-thread processes at once ran at {self.together_gflops:.0f} GFLOP/s each against "
                f"{self.alone_gflops:.0f} alone: {self.effective_cores:.2f} effective cores")


def _matmul_rate(seconds: float, start, out) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    start.wait()
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        a @ b
        n += 1
    out.put(2 * 512**3 * n / dt / 1e9)


def _run(n: int, seconds: float) -> list[float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_matmul_rate, args=(seconds, start, out), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return rates


def parallel_capacity(n: int = 2, seconds: float = 1.5) -> Capacity:
    before = _run(1, seconds)[0]
    together = _run(n, seconds)
    after = _run(1, seconds)[0]
    return Capacity(n, max(before, after), sum(together) / n)

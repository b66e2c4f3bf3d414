"""How much parallel compute this machine gives right now: the check a side-by-side benchmark runs
before trusting a pipeline's speed-up.

A pipeline of P single-thread ranks is only faster than a sequential schedule if P cores really run at
once. On a shared host (a VM with noisy neighbours) two "cores" may deliver the work of one and a half;
a GPipe schedule at batch 1 keeps one rank busy at a time and hardly notices, a token-level pipeline
keeps both busy and loses its advantage. ``parallel_capacity`` measures it: one thread's rate on the
host's operations (``workload.cpu_peak``: the model's own, as every check of the host's speed times it)
sustained by one process alone, then by ``n`` processes at once, then by one alone again: the faster of
the two alone runs is the core's rate (one alone run caught by a neighbour or a clock still ramping up
would credit the host with more cores than it has).
"""
from __future__ import annotations

import multiprocessing as mp
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


def _host_rate(seconds: float, start, out) -> None:
    from workload.cpu_peak import host_ops, sustained_tflops

    ops = host_ops()
    start.wait()
    out.put(sustained_tflops(ops, seconds) * 1e3)


def _run(n: int, seconds: float) -> list[float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_host_rate, args=(seconds, start, out), daemon=True) for _ in range(n)]
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

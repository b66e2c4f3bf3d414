"""``--n-slices auto`` settled by measurement: before the run's first step, the ranks time K equal
token slices for a few K and keep the fastest.

Why measure rather than model: the planner's latency model (``ours.plan.latency``, fitted from a
one-process profile) and the simulator (``predict``) both missed what slicing costs with every rank
busy: at cpu-small batch 2 the planner's K = 15 ran 6-22 % slower than K = 4, the simulator's 2 x 512
16 % slower (the simulator's first note, in git: ``git log --follow -- results/predict/NOTE.md``). A
fixed per-slice cost fitted from the same profile would not see the contention either. A step timed
inside the run sees everything the run pays (the host as it is now, the emulated network, data
parallelism's other replicas), and steps within one launch agree to a few per cent while launches
differ by 10-15 %: within-launch timing is the sharpest comparison this host allows, so auto lands
within that noise of the best fixed K by construction.

The search (``descend``): K in ``CANDIDATES`` (1, 2, 4, 8, 16; those the sequence can be cut into),
starting from the one nearest the planner's choice (``ours.plan.auto``: simulator, fitted model or
rule of thumb); time it and its neighbours, move to the faster neighbour, stop where neither is
faster. Step time against K falls while slicing fills the pipeline and rises once per-slice costs
dominate, so this finds the best candidate in 3-5 timed steps instead of timing all five. One step
is one sample of a noisy host, though: a search in the main job stopped at K=4 (0.90 s) because its
one step of K=2 took 0.93 s, where K=1 ran at 0.73 s. So where the descent stops, the
kept K and its faster neighbour are timed once more (the neighbour first) and each K counts by the
best of its two steps; if the neighbour wins, the descent goes on from there. A K is timed at most
twice, a search takes 5-7 steps. What each step costs: one forward and backward of the first batch,
no optimizer step, no data-parallel sync (gradients are dropped: the training that follows, and
``--verify``, see none of it); one untimed step first, at the starting K (allocation, first messages).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

CANDIDATES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Tuning:
    """The K a search kept, every K it timed (seconds of each of its steps, K in the order first
    timed), and where it started."""

    k: int
    start: int
    times: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def describe(self) -> str:
        """'tuned: K=4 of K=8 1.02 s, K=4 0.95/0.93 s, K=16 1.3 s, K=2 1.1 s' (a K timed twice: both steps)."""
        return f"tuned: K={self.k} of " + ", ".join(
            f"K={k} " + "/".join(f"{t:.3g}" for t in ts) + " s" for k, ts in self.times.items())


def candidates(seq_len: int) -> tuple[int, ...]:
    """The K a search may try: ``CANDIDATES`` that cut the sequence into slices of at least one token."""
    return tuple(k for k in CANDIDATES if k <= seq_len)


def nearest(k: int, ks: tuple[int, ...]) -> int:
    """The candidate nearest ``k`` on a log scale (the planner's K = 15 starts the search at 16)."""
    return min(ks, key=lambda c: (abs(math.log2(c) - math.log2(max(1, k))), c))


def descend(start: int, time_k: Callable[[int], float], ks: tuple[int, ...] = CANDIDATES) -> Tuning:
    """From ``start`` (one of ``ks``), time it and its neighbours with ``time_k(K) -> seconds``; move
    to the faster neighbour until neither is faster; there, time the kept K's faster neighbour and
    then the kept K once more and compare each by its best step, moving on if the neighbour wins.
    Each K is timed at most twice; a tie keeps the K the search stands on."""
    ks = tuple(sorted(ks))
    times: dict[int, list[float]] = {}

    def t(j: int) -> float:
        if ks[j] not in times:
            times[ks[j]] = [time_k(ks[j])]
        return min(times[ks[j]])

    def again(j: int) -> None:
        if len(times[ks[j]]) < 2:
            times[ks[j]].append(time_k(ks[j]))

    i = ks.index(start)
    t(i)
    while True:
        around = [j for j in (i - 1, i, i + 1) if 0 <= j < len(ks)]
        best = min(around, key=lambda j: (t(j), j != i))
        if best == i and len(around) > 1:  # a local minimum on the steps so far: one more of it and its rival
            rival = min((j for j in around if j != i), key=t)
            again(rival)
            again(i)
            best = min(around, key=lambda j: (t(j), j != i))
        if best == i:
            return Tuning(ks[i], start, {k: tuple(v) for k, v in times.items()})
        i = best

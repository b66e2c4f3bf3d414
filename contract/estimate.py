"""Repetitions of one configuration combined into a median and an interval, two configurations
compared by the ratios of their neighbouring launches, and whether they differ beyond that noise: the
one statistics code of the report and the benchmarks. No torch.

A repetition is one launch of a configuration; its value is the launch's own median step time. On a
shared host the same configuration varies by 10-15 % from launch to launch while its steps within a
launch agree to a few per cent, so the launches, not the steps, are the samples.

The interval (``estimate``):

- **min-max of the repetitions** below ``BOOTSTRAP_FROM`` repetitions. With n launches drawn from one
  distribution, the smallest and the largest bracket its median with probability 1 - 2^(1 - n) (75 %
  at 3, 87.5 % at 4, 94 % at 5), whatever the distribution; a bootstrap of the median from so few
  values can only return the values themselves, and its percentile interval is narrower than min-max
  without being better founded.
- **bootstrap** from ``BOOTSTRAP_FROM`` repetitions on: ``scipy.stats.bootstrap``'s 95 % percentile
  interval of the median over ``RESAMPLES`` resamples (seeded: the same values always give the same
  interval).
- **one run**: no interval; nothing is claimed from it.

Two estimates differ beyond noise (``separated``) only when both have an interval and the intervals do
not overlap.

A comparison (``paired``): a shared host drifts by a quarter within minutes, and every configuration's
own interval carries that drift; but launches made round-robin sit side by side in time, and the ratio
of two neighbours cancels most of it. So two configurations' launches are paired, each with its
neighbour of the other (``neighbour_pairs``), and the comparison is the median of the per-pair ratios
with the interval above over them (min-max below 8 pairs, the bootstrap from 8). It is a claim only
where that interval leaves out 1.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

BOOTSTRAP_FROM = 8  # repetitions from which the interval is a bootstrap one (below: min-max)
RESAMPLES = 2000
CONFIDENCE = 0.95
MIN_MAX, BOOTSTRAP, ONE_RUN = "min-max", "bootstrap 95 %", "one run"
INTERVAL_RULE = (f"median of the repetitions (each a launch's median step time) ± its interval: the min-max of "
                 f"the repetitions below {BOOTSTRAP_FROM} (it brackets the median of the launches with "
                 f"probability 1 - 2^(1-n): 75 % at 3, 87.5 % at 4), a bootstrap 95 % interval of the median from "
                 f"{BOOTSTRAP_FROM} on; one run has none")
PAIRED_RULE = (f"a comparison's ratio is the median of the ratios of neighbouring launches (launched round-robin, "
               f"one pair a round), its interval the min-max of the per-pair ratios below {BOOTSTRAP_FROM} pairs, "
               f"a bootstrap 95 % interval of their median from {BOOTSTRAP_FROM} on; a claim only where it leaves "
               f"out 1")


@dataclass(frozen=True)
class Estimate:
    """A configuration's repetitions: their median, an interval around it, how many, and how the
    interval was made (``MIN_MAX``, ``BOOTSTRAP`` or ``ONE_RUN``)."""

    median: float
    low: float
    high: float
    n: int
    method: str

    @property
    def has_interval(self) -> bool:
        return self.n >= 2

    @property
    def spread(self) -> float:
        """The interval's larger side relative to the median (0.04 for ±4 %); 0 for one run."""
        if not self.median:
            return 0.0
        return max(self.high - self.median, self.median - self.low) / self.median

    def plus_minus(self) -> str:
        """'±4 %' (the larger side, rounded up to a whole per cent), or '(1 run)'."""
        if not self.has_interval:
            return "(1 run)"
        return f"±{max(0, math.ceil(100 * self.spread - 1e-9))} %"


def estimate(values: Sequence[float], bootstrap_from: int = BOOTSTRAP_FROM, resamples: int = RESAMPLES,
             seed: int = 0) -> Estimate:
    """The median of ``values`` (one per repetition) and its interval, by the rule in the module's
    docstring. ValueError for no values."""
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("no repetitions to estimate from")
    med = statistics.median(v)
    if len(v) == 1:
        return Estimate(med, med, med, 1, ONE_RUN)
    if len(v) < bootstrap_from:
        return Estimate(med, v[0], v[-1], len(v), MIN_MAX)
    import numpy as np
    from scipy.stats import bootstrap

    ci = bootstrap((np.asarray(v),), np.median, n_resamples=resamples, confidence_level=CONFIDENCE,
                   method="percentile", rng=np.random.default_rng(seed)).confidence_interval
    return Estimate(med, min(float(ci.low), med), max(float(ci.high), med), len(v), BOOTSTRAP)


def separated(a: Estimate, b: Estimate) -> bool:
    """Whether a and b differ beyond noise: both have an interval and the intervals do not overlap."""
    return a.has_interval and b.has_interval and (a.high < b.low or b.high < a.low)


def noise(*estimates: Estimate) -> float:
    """The largest spread among ``estimates`` (relative, 0.04 for ±4 %): the noise a comparison of
    them could not see beyond."""
    return max((e.spread for e in estimates), default=0.0)


def no_difference(*estimates: Estimate) -> str:
    """The words for a comparison that does not separate: 'no difference beyond noise (±x %)', or,
    where one of them is a single run, that a single run has no interval."""
    if not all(e.has_interval for e in estimates):
        return "no claim: a single run has no interval"
    return f"no difference beyond noise (±{math.ceil(100 * noise(*estimates) - 1e-9)} %)"


def ratio_interval(base: Estimate, other: Estimate) -> tuple[float, float, float]:
    """base / other: the ratio of the medians and its range over the two intervals (low, high)."""
    return base.median / other.median, base.low / other.high, base.high / other.low


Launch = tuple[object, float]  # (when it ran: a sortable timestamp, its value: the launch's median step time)


def neighbour_pairs(a: Sequence[Launch], b: Sequence[Launch]) -> list[tuple[float, float]]:
    """(a's value, b's value) of each pair of neighbouring launches: the launches of both in time order,
    each paired with the next one if that is of the other configuration (launched round-robin: one pair
    a round); a launch whose neighbour is of its own (the other's launch of that round failed) is left
    out."""
    timeline = sorted([(t, 0, v) for t, v in a] + [(t, 1, v) for t, v in b])
    pairs, i = [], 0
    while i + 1 < len(timeline):
        (_, x, u), (_, y, w) = timeline[i], timeline[i + 1]
        if x != y:
            pairs.append((u, w) if x == 0 else (w, u))
            i += 2
        else:
            i += 1
    return pairs


@dataclass(frozen=True)
class Paired:
    """``other`` against ``base`` from their neighbouring launches: ``ratio`` estimates base / other
    (above 1: other is faster) over the per-pair ratios."""

    ratio: Estimate
    pairs: tuple[tuple[float, float], ...]  # (base, other) of each pair

    @property
    def separated(self) -> bool:
        """Whether the ratio's interval leaves out 1 (at least two pairs)."""
        return self.ratio.has_interval and (self.ratio.low > 1 or self.ratio.high < 1)

    def interval(self) -> str:
        """'1.10-1.40x, min-max of 3 pairs: 1.10, 1.25, 1.40' (of the ratio base / other; below 8 pairs
        each pair's ratio, in launch order)."""
        r = self.ratio
        if r.method != MIN_MAX:
            return f"{r.low:.2f}-{r.high:.2f}x, {r.method} of {r.n} pairs"
        return f"{r.low:.2f}-{r.high:.2f}x, min-max of {r.n} pairs: " + ", ".join(f"{x / y:.2f}" for x, y in self.pairs)

    def describe(self) -> str:
        """'1.25x (1.10-1.40x, min-max of 3 pairs)'."""
        if not self.ratio.has_interval:
            return f"{self.ratio.median:.2f}x (1 pair: no interval)"
        return f"{self.ratio.median:.2f}x ({self.interval()})"


def paired(base: Sequence[Launch], other: Sequence[Launch]) -> Paired | None:
    """``other`` against ``base`` (each its launches) from their neighbouring launches, or None where
    no launches pair."""
    pairs = neighbour_pairs(base, other)
    if not pairs:
        return None
    return Paired(estimate([x / y for x, y in pairs]), tuple(pairs))

"""The optimal token slicing: minimise the pipeline latency T = M * sum_i t_i + (P - 1) * max_i f_i.

P is the number of pipeline stages (K, as everywhere in the suite, the token slices a slicing makes)
and M the number of batch slices that share one token slicing
(M = 1 for token slicing only). ``t_i`` is the latency of slice i on one stage (all its work) and
``f_i`` its fill: the part of it the other stages wait for (TeraPipe: f = t; ours' engine: t without
the weight gradients it defers into its waits). Both depend on where the slice starts (its context)
and where it ends, so they are given as tables ``t[s, e]`` and ``f[s, e]`` over boundary positions
s < e (in units of the granularity).

The exact algorithm (TeraPipe's): every slicing has some maximum fill, which is one value of the
fill table. For a bound tau, F(tau) = the least sum of t over slicings whose every fill is <= tau (a
DP over prefix lengths). Then T* = min over tau of M * F(tau) + (P - 1) * tau, because F(tau) is
achieved by a slicing whose max fill is <= tau, and the optimum's own max fill is one of the candidates.

Fast and still exact, by branch and bound over the sorted candidates:
- F is non-increasing in tau, so for a candidate tau_j the value F at any evaluated tau_k > tau_j is
  a lower bound of F(tau_j); also sum_i t_i >= max_i t_i >= max_i f_i where every f <= t. Hence
  T(tau_j) >= M * max(F(tau_k), tau_j) + (P - 1) * tau_j (without the tau_j term where some f > t),
  and a candidate whose bound reaches the best T found is dropped (the bound grows with tau_j, so
  this also stops the ascending scan).
- Candidates still alive are evaluated a batch at a time, the batch being a leading dimension of a
  numpy DP, and evenly spread over the alive ones, so that each round tightens the bounds of all.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

INF = math.inf


@dataclass(frozen=True)
class Solution:
    cuts: tuple[int, ...]  # boundary indices 0 = c_0 < c_1 < ... < c_n = n (positions in the table)
    latency: float  # T = M * sum + (P - 1) * max fill
    total: float  # sum_i t_i of one batch slice
    max_slice: float  # max_i f_i (the fill; max_i t_i where the fill is the slice's time)
    evaluated: int = 0  # candidate bounds whose DP was run (diagnostics)
    candidates: int = 0


def pipeline_latency(times, n_stages: int, n_batch_slices: int = 1, fill_factor: float = 1.0, fills=None) -> float:
    """T = M * sum_i t_i + fill_factor * (P - 1) * max_i f_i (``fills`` None: f = t)."""
    times = list(times)
    fills = times if fills is None else list(fills)
    return n_batch_slices * sum(times) + fill_factor * (n_stages - 1) * max(fills)


def _check_table(table: np.ndarray, shape: tuple | None = None) -> np.ndarray:
    t = np.asarray(table, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1] or t.shape[0] < 2:
        raise ValueError(f"latency table must be (n+1, n+1) with n >= 1, got shape {t.shape}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"the fill table's shape {t.shape} is not the latency table's {shape}")
    t = t.copy()
    n1 = t.shape[0]
    t[np.tril_indices(n1)] = INF  # only s < e are slices
    t[np.isnan(t)] = INF
    return t


def _dp_values(t: np.ndarray, f: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """F(tau) for every tau of ``taus`` at once: the least sum of t of a slicing with every fill <= tau."""
    n = t.shape[0] - 1
    q = len(taus)
    dp = np.full((q, n + 1), INF)
    dp[:, 0] = 0.0
    tmax = float(taus.max())
    col_tau = taus[:, None]
    for e in range(1, n + 1):
        fcol = f[:e, e]
        feasible = np.flatnonzero(fcol <= tmax)
        if feasible.size == 0:
            continue
        lo = int(feasible[0])
        vals = dp[:, lo:e] + t[lo:e, e]
        vals[fcol[lo:] > col_tau] = INF
        dp[:, e] = vals.min(axis=1)
    return dp[:, n]


def _dp_argmin(t: np.ndarray, f: np.ndarray, tau: float) -> tuple[tuple[int, ...], float]:
    """The slicing achieving F(tau) and its sum; of equal sums the one whose last slice starts latest
    (later slices, which carry more context, the shorter)."""
    n = t.shape[0] - 1
    dp = np.full(n + 1, INF)
    dp[0] = 0.0
    back = np.zeros(n + 1, dtype=np.int64)
    for e in range(1, n + 1):
        col = t[:e, e]
        vals = np.where(f[:e, e] <= tau, dp[:e] + col, INF)
        s = e - 1 - int(np.argmin(vals[::-1]))
        dp[e], back[e] = vals[s], s
    if not math.isfinite(dp[n]):
        raise ValueError("no slicing fits under the bound")
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(back[cuts[-1]]))
    return tuple(reversed(cuts)), float(dp[n])


def solve_table(table, n_stages: int, n_batch_slices: int = 1, batch: int = 256,
                upper_bound: float = INF, fill_factor: float = 1.0, fill=None) -> Solution | None:
    """The exact optimal slicing for a latency table ``table[s, e]`` (entries with s >= e ignored) and
    a fill table ``fill[s, e]`` of the same shape (None: the latency table, TeraPipe's T).

    ``fill_factor`` (>= 0) weighs the max term: T = M * sum + fill_factor * (P - 1) * max fill (1: TeraPipe).

    Returns None only if no slicing beats ``upper_bound`` (a T found elsewhere, e.g. for another
    batch slice size) or if the table has no finite slicing.
    """
    if n_stages < 1 or n_batch_slices < 1:
        raise ValueError("n_stages and n_batch_slices must be >= 1")
    t = _check_table(table)
    fl = t if fill is None else _check_table(fill, t.shape)
    fl = np.where(np.isfinite(t), fl, INF)  # a slice without a time has no fill either
    if fill_factor < 0:
        raise ValueError("fill_factor must be >= 0")
    P, M = n_stages, n_batch_slices
    W = fill_factor * (P - 1)  # weight of the max term
    finite = fl[np.isfinite(fl)]
    if finite.size == 0:
        return None
    taus = np.unique(finite)  # sorted ascending
    Q = len(taus)
    below = bool(np.all(fl[np.isfinite(fl)] <= t[np.isfinite(fl)]))  # every fill <= its time: sum >= max fill

    def T_of(f: np.ndarray, tau: np.ndarray) -> np.ndarray:
        return M * f + W * tau

    # The unconstrained optimum of the sum: F at the largest candidate, a lower bound for all F.
    f_min = float(_dp_values(t, fl, taus[-1:])[0])
    if not math.isfinite(f_min):
        return None
    best_T, best_tau = upper_bound, None
    F = np.full(Q, np.nan)
    F[-1] = f_min
    T_last = float(T_of(f_min, taus[-1]))
    if T_last < best_T:
        best_T, best_tau = T_last, Q - 1
    evaluated = 1
    alive = np.ones(Q, dtype=bool)
    alive[-1] = False
    while True:
        # Lower bound of F at each candidate: the largest F evaluated at a larger candidate.
        known = np.where(np.isnan(F), -INF, F)
        above = np.maximum.accumulate(known[::-1])[::-1]  # max over indices >= j
        lbF = np.concatenate([above[1:], [-INF]])  # strictly above j
        lbF = np.maximum(lbF, f_min)
        bound = M * (np.maximum(lbF, taus) if below else lbF) + W * taus
        alive &= bound < best_T
        idx = np.flatnonzero(alive)
        if idx.size == 0:
            break
        if idx.size > batch:
            pick = idx[np.unique(np.linspace(0, idx.size - 1, batch).round().astype(np.int64))]
        else:
            pick = idx
        f = _dp_values(t, fl, taus[pick])
        evaluated += len(pick)
        F[pick] = f
        alive[pick] = False
        T = T_of(f, taus[pick])
        j = int(np.argmin(T))
        if T[j] < best_T:
            best_T, best_tau = float(T[j]), int(pick[j])
    if best_tau is None:
        return None
    cuts, total = _dp_argmin(t, fl, float(taus[best_tau]))
    times = [t[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
    fills = [fl[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
    return Solution(cuts=cuts, latency=pipeline_latency(times, P, M, fill_factor, fills), total=total,
                    max_slice=max(fills), evaluated=evaluated, candidates=Q)


def brute_force(table, n_stages: int, n_batch_slices: int = 1, fill_factor: float = 1.0,
                fill=None) -> tuple[tuple[int, ...], float]:
    """Every slicing of the n positions (2^(n-1) of them): for tests on small n."""
    t = _check_table(table)
    fl = t if fill is None else _check_table(fill, t.shape)
    n = t.shape[0] - 1
    best = (None, INF)
    for mask in itertools.product((False, True), repeat=n - 1):
        cuts = (0, *[i + 1 for i, m in enumerate(mask) if m], n)
        times = [t[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
        fills = [fl[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
        if not all(math.isfinite(x) for x in times + fills):
            continue
        T = pipeline_latency(times, n_stages, n_batch_slices, fill_factor, fills)
        if T < best[1]:
            best = (cuts, T)
    return best

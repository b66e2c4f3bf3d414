"""The optimal token slicing: minimise the pipeline latency T = M * sum_i t_i + (P - 1) * max_i t_i.

P is the number of pipeline stages (K, as everywhere in the suite, the token slices a slicing makes)
and M the number of batch slices that share one token slicing (M = 1 for token slicing only).
``t_i`` is the latency of slice i on one stage; the latency of a slice depends on where it starts
(its context) and where it ends, so it is given as a table ``t[s, e]`` over boundary positions
s < e (in units of the granularity).

The exact algorithm (TeraPipe's): every slicing has some maximum slice latency, which is one value
of the table. For a bound tau, F(tau) = the least sum over slicings whose every slice is <= tau (a
DP over prefix lengths). Then T* = min over tau of M * F(tau) + (P - 1) * tau, because F(tau) is
achieved by a slicing whose max is <= tau, and the optimum's own max is one of the candidates.

Fast and still exact, by branch and bound over the sorted candidates:
- F is non-increasing in tau, so for a candidate tau_j the value F at any evaluated tau_k > tau_j is
  a lower bound of F(tau_j); also sum_i t_i >= max_i t_i. Hence
  T(tau_j) >= M * max(F(tau_k), tau_j) + (P - 1) * tau_j, and a candidate whose bound reaches the
  best T found is dropped (the bound grows with tau_j, so this also stops the ascending scan).
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
    latency: float  # T = M * sum + (P - 1) * max
    total: float  # sum_i t_i of one batch slice
    max_slice: float  # max_i t_i
    evaluated: int = 0  # candidate bounds whose DP was run (diagnostics)
    candidates: int = 0


def pipeline_latency(times, n_stages: int, n_batch_slices: int = 1, fill_factor: float = 1.0) -> float:
    times = list(times)
    return n_batch_slices * sum(times) + fill_factor * (n_stages - 1) * max(times)


def _check_table(table: np.ndarray) -> np.ndarray:
    t = np.asarray(table, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1] or t.shape[0] < 2:
        raise ValueError(f"latency table must be (n+1, n+1) with n >= 1, got shape {t.shape}")
    t = t.copy()
    n1 = t.shape[0]
    t[np.tril_indices(n1)] = INF  # only s < e are slices
    t[np.isnan(t)] = INF
    return t


def _dp_values(t: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """F(tau) for every tau of ``taus`` at once: the least sum of a slicing with every slice <= tau."""
    n = t.shape[0] - 1
    q = len(taus)
    dp = np.full((q, n + 1), INF)
    dp[:, 0] = 0.0
    tmax = float(taus.max())
    col_tau = taus[:, None]
    for e in range(1, n + 1):
        col = t[:e, e]
        feasible = np.flatnonzero(col <= tmax)
        if feasible.size == 0:
            continue
        lo = int(feasible[0])
        c = col[lo:]
        vals = dp[:, lo:e] + c
        vals[c > col_tau] = INF
        dp[:, e] = vals.min(axis=1)
    return dp[:, n]


def _dp_argmin(t: np.ndarray, tau: float) -> tuple[tuple[int, ...], float]:
    """The slicing achieving F(tau) (ties: the first, smallest last start) and its sum."""
    n = t.shape[0] - 1
    dp = np.full(n + 1, INF)
    dp[0] = 0.0
    back = np.zeros(n + 1, dtype=np.int64)
    for e in range(1, n + 1):
        col = t[:e, e]
        vals = np.where(col <= tau, dp[:e] + col, INF)
        s = int(np.argmin(vals))
        dp[e], back[e] = vals[s], s
    if not math.isfinite(dp[n]):
        raise ValueError("no slicing fits under the bound")
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(back[cuts[-1]]))
    return tuple(reversed(cuts)), float(dp[n])


def solve_table(table, n_stages: int, n_batch_slices: int = 1, batch: int = 256,
                upper_bound: float = INF, fill_factor: float = 1.0) -> Solution | None:
    """The exact optimal slicing for a latency table ``table[s, e]`` (entries with s >= e ignored).

    ``fill_factor`` (>= 0) weighs the max term: T = M * sum + fill_factor * (P - 1) * max (1: TeraPipe).

    Returns None only if no slicing beats ``upper_bound`` (a T found elsewhere, e.g. for another
    batch slice size) or if the table has no finite slicing.
    """
    if n_stages < 1 or n_batch_slices < 1:
        raise ValueError("n_stages and n_batch_slices must be >= 1")
    t = _check_table(table)
    if fill_factor < 0:
        raise ValueError("fill_factor must be >= 0")
    P, M = n_stages, n_batch_slices
    W = fill_factor * (P - 1)  # weight of the max term
    finite = t[np.isfinite(t)]
    if finite.size == 0:
        return None
    taus = np.unique(finite)  # sorted ascending
    Q = len(taus)

    def T_of(f: np.ndarray, tau: np.ndarray) -> np.ndarray:
        return M * f + W * tau

    # The unconstrained optimum of the sum: F at the largest candidate, a lower bound for all F.
    f_min = float(_dp_values(t, taus[-1:])[0])
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
        bound = M * np.maximum(lbF, taus) + W * taus
        alive &= bound < best_T
        idx = np.flatnonzero(alive)
        if idx.size == 0:
            break
        if idx.size > batch:
            pick = idx[np.unique(np.linspace(0, idx.size - 1, batch).round().astype(np.int64))]
        else:
            pick = idx
        f = _dp_values(t, taus[pick])
        evaluated += len(pick)
        F[pick] = f
        alive[pick] = False
        T = T_of(f, taus[pick])
        j = int(np.argmin(T))
        if T[j] < best_T:
            best_T, best_tau = float(T[j]), int(pick[j])
    if best_tau is None:
        return None
    cuts, total = _dp_argmin(t, float(taus[best_tau]))
    times = [t[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
    return Solution(cuts=cuts, latency=pipeline_latency(times, P, M, fill_factor), total=total, max_slice=max(times),
                    evaluated=evaluated, candidates=Q)


def brute_force(table, n_stages: int, n_batch_slices: int = 1,
                fill_factor: float = 1.0) -> tuple[tuple[int, ...], float]:
    """Every slicing of the n positions (2^(n-1) of them): for tests on small n."""
    t = _check_table(table)
    n = t.shape[0] - 1
    best = (None, INF)
    for mask in itertools.product((False, True), repeat=n - 1):
        cuts = (0, *[i + 1 for i, m in enumerate(mask) if m], n)
        times = [t[a, b] for a, b in zip(cuts[:-1], cuts[1:])]
        if not all(math.isfinite(x) for x in times):
            continue
        T = pipeline_latency(times, n_stages, n_batch_slices, fill_factor)
        if T < best[1]:
            best = (cuts, T)
    return best

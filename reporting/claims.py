"""The report's claims about step times, and their wording.

Like for like: runs are compared only with runs of the same kind of parallelism on as many devices
(pipeline with pipeline, tensor with tensor; a layout's devices: pp x tp x dp) and of one table (so of
one code commit); a method that changes the optimisation (diloco) never by step time. Each comparison
is the median of the ratios of neighbouring launches (``contract.estimate.paired``), claimed only where
its interval leaves out 1, else "no difference beyond noise"; no claim from a run whose ranks
outnumbered its cores.
"""
from __future__ import annotations

import pandas as pd

from contract.estimate import paired
from reporting.frame import describe_oversubscription
from reporting.tables import fmt_time


def name(r: pd.Series) -> str:
    """A run as a claim names it: '`ours P-2` [auto, planner: K=7 ...]'."""
    return f"`{r['column']}`" + (f" [{r['details']}]" if r["details"] else "")


def timed(r: pd.Series) -> str:
    """A run named with its step time and interval."""
    return f"{name(r)} {fmt_time(r['median_step_time'])} {r['estimate'].plus_minus()}"


def against(base: pd.Series, other: pd.Series) -> tuple[bool, str]:
    """Whether ``other`` is faster than ``base`` beyond noise by their paired launches, and the words:
    '**1.25x** faster (1.10-1.40x, min-max of 3 pairs)' or 'no difference beyond noise (paired: ...)'."""
    p = paired(base["launches"], other["launches"])
    if p is None or not p.ratio.has_interval:
        return False, f"no claim: {'one pair' if p else 'no pair'} of neighbouring launches, no interval"
    if not p.separated:
        return False, f"no difference beyond noise (paired: {p.describe()})"
    r = p.ratio
    if r.median > 1:
        return True, f"**{r.median:.2f}x** faster ({p.interval()})"
    return False, f"**{1 / r.median:.2f}x** slower ({1 / r.high:.2f}-{1 / r.low:.2f}x; paired: {p.describe()})"


def fastest(fair: pd.DataFrame) -> str:
    """The fastest run by median, claimed only where it is faster than every other by their paired launches."""
    best = fair.loc[fair["median_step_time"].idxmin()]
    others = [(r, *against(r, best)) for _, r in fair.iterrows() if r["key"] != best["key"]]
    if all(beyond for _, beyond, _ in others):
        return f"fastest {timed(best)}: " + ", ".join(f"{words} than {name(r)}" for r, _, words in others)
    return f"no fastest: {timed(best)}, " + ", ".join(f"{timed(r)} ({words})" for r, beyond, words in others
                                                       if not beyond)


def ours_against_best_baseline(fair: pd.DataFrame) -> str | None:
    """Ours at its best (by median) against the best baseline (by median), from their paired launches;
    None without both."""
    baselines, ours = fair[fair["role"] == "baseline"], fair[fair["role"] == "ours"]
    if baselines.empty or ours.empty:
        return None
    best = baselines.loc[baselines["median_step_time"].idxmin()]
    mine = ours.loc[ours["median_step_time"].idxmin()]
    _, words = against(best, mine)
    return f"ours {timed(mine)} against the best baseline {timed(best)}: {words}"


def verdict(group: pd.DataFrame) -> str | None:
    """The claims among runs of one kind of parallelism on as many devices (``verdicts``): ours at its
    best against the best baseline, and the fastest run where there are more to compare; runs whose
    ranks outnumbered their cores are left out, and it says so."""
    crowded = group[group["oversubscribed"].map(bool)]
    fair = group[~group["oversubscribed"].map(bool)]
    parts = []
    if len(fair) == 1:
        parts.append(f"only {timed(fair.iloc[0])} to compare")
    elif not fair.empty:
        duel = ours_against_best_baseline(fair)
        if duel is None or len(fair) > 2:
            parts.append(fastest(fair))
        if duel is not None:
            parts.append(duel)
    if not crowded.empty:
        over = crowded.iloc[0]["oversubscribed"]
        parts.append(f"no comparison from {', '.join(f'`{c}`' for c in crowded['column'])}: its ranks outnumbered "
                     f"the cores they had ({describe_oversubscription(over)}), so its times measure CPU contention, "
                     f"not the system")
    return "; ".join(parts) or None


def verdicts(row: pd.DataFrame) -> list[tuple[str, str]]:
    """(qualifier, verdict) of one row of a table: one verdict per kind of parallelism and device count
    (like for like: P-2 against P-2, T-2 against T-2; never P-2 against T-2 or P-2 D-2), and a line for
    the runs of a method that changes the optimisation, which no step time compares."""
    ok = row[(row["status"] == "ok") & (row["role"] != "reference") & row["median_step_time"].notna()]
    out = []
    for (kind, n), group in ok[ok["synchronous"]].groupby(["kind", "devices"], sort=False):
        said = verdict(group)
        if said:
            out.append((f", {kind}, {int(n)} device{'s' if n != 1 else ''}", said))
    other = ok[~ok["synchronous"]]
    if not other.empty:
        out.append(("", f"{', '.join(name(r) for _, r in other.iterrows())}: not compared by step time (its "
                        f"method changes the optimisation: compared by time and bytes to a held-out loss, where it "
                        f"has evals)"))
    return out

"""The report's opening prose: what produced the records (``provenance``) and the summary of its claims
(``summary``: per table, per row, per kind of parallelism and device count, ``reporting.claims``).

Claims are made within one code commit: a table holds the records of one commit (``reporting.tables``),
and the summary says which commit its claims are of; where the records come from several commits it
makes claims per commit, each table's heading naming its own.
"""
from __future__ import annotations

import pandas as pd

from contract.estimate import INTERVAL_RULE, PAIRED_RULE
from reporting.claims import verdicts
from reporting.frame import commit_of
from reporting.tables import heading


def _of_commits(commits: list[str]) -> str:
    """Which commit the claims are of, in words."""
    if len(commits) == 1:
        return f"Every claim is of the records' one code version ({commits[0]})."
    return (f"The records come from {len(commits)} code versions ({', '.join(commits)}): claims are made per "
            f"commit, never across two, each table's heading naming its commit.")


def summary(layouts: list[tuple[dict, pd.DataFrame]], networks: list[tuple[dict, pd.DataFrame]],
            commits: list[str]) -> str:
    """The claims of every table (``commits``: the records' code commits, newest last), or ''."""
    lines = []
    for fixed, g in layouts:
        rows = [(f"micro-batch {mb}{q}", v) for mb, r in g.groupby("mb") for q, v in verdicts(r)]
        if rows and len(g) > 1:
            lines.append(f"- **Layouts**, {heading(fixed)}:")
            lines += [f"  - {what}: {v}" for what, v in rows]
    for fixed, g in networks:
        g = g.sort_values("order", kind="stable")
        rows = [(f"{r['setting'].iloc[0]}{q}", v)
                for net, r in g.groupby("network", sort=False) for q, v in verdicts(r)]
        if rows and len(g) > 1:
            lines.append(f"- **Networks**, {heading(fixed)}:")
            lines += [f"  - {what}: {v}" for what, v in rows]
    if not lines:
        return ""
    return (f"## Summary\n\nLike for like: runs are compared only with runs of the same kind of parallelism on as "
            f"many devices (pipeline with pipeline, tensor with tensor; a layout's devices: pp x tp x dp), and a "
            f"method that changes the optimisation (diloco) never by step time; across kinds the tables show the "
            f"runs side by side, with no claim. {_of_commits(commits)} Every cell: the {INTERVAL_RULE}. "
            f"Every claim: {PAIRED_RULE}.\n\n" + "\n".join(lines))


def predictions(df: pd.DataFrame) -> str:
    """How the predictions shown (``pred``) compare with the runs they sit beside, or '' where none is
    shown: their median relative error and range; where every one errs the same way (three or more), that
    a shift common to every case points at the host's speed, not at a case's model."""
    shown = df[(df["status"] == "ok") & (df["predicted"] > 0) & (df["median_step_time"] > 0)]
    if shown.empty:
        return ""
    errors = ((shown["predicted"] - shown["median_step_time"]) / shown["median_step_time"]).sort_values()
    text = (f"**Predictions** (`pred` in the tables: the simulator's, on this host's calibration, shown only for "
            f"the cases its validation on other runs found modelled, `predict/calibration/validation.md`): "
            f"{len(errors)} run{'s' if len(errors) != 1 else ''} (each the median of its repetitions), each "
            f"prediction against the run's measured step: {_pct(errors.median())} at the median "
            f"({_pct(errors.iloc[0])} to {_pct(errors.iloc[-1])}).")
    if len(errors) >= 3 and ((errors < 0).all() or (errors > 0).all()):
        way = "faster" if errors.iloc[-1] < 0 else "slower"
        text += (f" Every one predicts the run {way} than it ran: a shift common to every case is more likely "
                 f"this host running at another speed than at its calibration than the cases' models (the "
                 f"speed probe `predict records` takes sees the host after the runs, not during them).")
    return text


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def _count(values: list[str]) -> str:
    seen: dict[str, int] = {}
    for v in values:
        seen[v] = seen.get(v, 0) + 1
    return ", ".join(f"{v} ({n} record{'s' if n != 1 else ''})" for v, n in seen.items())


def provenance(records: list[dict]) -> tuple[str, list[str]]:
    """What produced the records, as they say it (``runners.record.provenance``): the code's commits (a
    dirty tree marked), and the library versions; and the warnings, one line each, where the records
    differ in commit or versions, or where some say neither or came from a dirty tree."""
    commits = [commit_of(r) for r in records]
    versions = [", ".join(f"{k} {v}" for k, v in e["versions"].items()) if isinstance(e.get("versions"), dict)
                else "no versions recorded" for e in (r.get("environment") or {} for r in records)]
    warnings = []
    if len(set(commits)) > 1:
        warnings.append(f"the records come from {len(set(commits))} commits: {_count(commits)}; claims are made "
                        f"per commit")
    elif any(c.endswith(" (dirty)") for c in commits):
        warnings.append("the records come from a tree whose tracked files differed from its commit")
    if len(set(versions)) > 1:
        warnings.append(f"the records come from {len(set(versions))} sets of versions: {_count(versions)}")
    text = f"Made by: {_count(commits)}; with {_count(versions)}."
    return text + "".join(f"\n\n**Warning**: {w}." for w in warnings), warnings

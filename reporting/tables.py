"""The report's tables of step times, shaped like the seed's GPT-3 XL results, and the tables of every run
and of the failures.

A table holds the runs of exactly one configuration apart from its axes (``table_groups``): the same
model, hardware, precision, batch, steps, the rest of their identity and, where the records come from
more than one, the same code commit; so a cell never mixes runs of different configs or code. Each
table is headed once by what is fixed in it (``heading``). Layout tables (runs without network
emulation): rows = micro-batch size, columns = system and layout in the seed's notation (``T-4 P-2``),
cells ``19.71 s ±4 %`` or ``Fail (OOM)``. Network tables (runs under emulation): rows = the network
settings, fastest to slowest, columns = system and layout.
"""
from __future__ import annotations

import json

import pandas as pd

from reporting.frame import describe_oversubscription

FAIL = {"oom": "Fail (OOM)", "error": "Fail (error)", "timeout": "Fail (timeout)"}
# The fields a table's cells share, in the order its heading states them (the rest of a run's
# identity, beyond the axes, is added to the heading when it is not the default; the code commit where
# the records come from more than one).
HEADING = ("model", "shape", "hardware", "precision", "recompute", "batch", "steps")


def fmt_time(t: float | None) -> str:
    if t is None or t != t:
        return ""
    return f"{t:.2f} s" if t >= 1 else f"{t:.3f} s"


def cell(row: pd.Series) -> str:
    """A run's cell: its step time and interval (a prediction beside it where there is one), or its failure."""
    if row["status"] == "ok":
        t = row["median_step_time"]
        text = "ok, no step time" if t is None or t != t else f"{fmt_time(t)} {row['estimate'].plus_minus()}"
        pred = row.get("predicted")
        if pred == pred and pred:
            text += f" (pred {fmt_time(pred).removesuffix(' s')})"
        elif row.get("not_modelled"):
            text += " (not modelled)"
        if row.get("oversubscribed"):
            text += " (oversubscribed)"
        return text
    if row["status"] == "unfit":
        return f"Fail ({row['error']})"
    return FAIL.get(row["status"], f"Fail ({row['status']})")


def _columns(g: pd.DataFrame, row_axis: str) -> pd.DataFrame:
    """Columns (system and layout) that stand for one run per row: where runs of different options
    share a column (ours at K = 4 and K = 8, say), the differing options are added to its name."""
    g = g.copy()
    for col, same in g.groupby("column"):
        if same.groupby(row_axis)["key"].nunique().max() > 1:
            opts = [json.loads(o) for o in same["options"]]
            varying = sorted(k for k in set().union(*opts) if len({json.dumps(o.get(k)) for o in opts}) > 1)
            for i, o in zip(same.index, opts):
                g.loc[i, "column"] = col + " (" + ", ".join(f"{k} {_short(o.get(k))}" for k in varying) + ")"
    return g


def _short(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) if len(value) <= 4 else f"{len(value)} values"
    return str(value)


def table_groups(df: pd.DataFrame, emulated: bool) -> list[tuple[dict, pd.DataFrame]]:
    """(heading fields, runs) of each table: runs sharing every identity field but the table's axes."""
    part = df[df["emulated"] == emulated]
    keys = [*HEADING, "rest", "code"] + (["mb"] if emulated else ["network"])
    out = []
    for fixed, g in part.groupby(keys, sort=False):
        fixed = dict(zip(keys, fixed), steps=recorded_steps(g))
        out.append((fixed, _columns(g, "network" if emulated else "mb")))
    return out


def recorded_steps(g: pd.DataFrame) -> str:
    """The measured steps of a table's runs as their records hold them ('17-41 measured steps (48
    configured) after 1 warm-up'), not as configured: a run may end early."""
    c = g.iloc[0]["steps"]  # '<configured> measured steps after <w> warm-up', the same for the table
    configured, _, warmup = c.partition(" measured steps after ")
    lo, hi = min(m[0] for m in g["measured"]), max(m[1] for m in g["measured"])
    counts = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"{counts} measured steps" + ("" if counts == configured else f" ({configured} configured)") \
        + f" after {warmup}"


def heading(fixed: dict) -> str:
    """What a table's runs share, stated once: 'model: tiny (L4 h128 a4 s128); hardware: cpu; ...'."""
    parts = [f"model: {fixed['model']} ({fixed['shape']})", f"hardware: {fixed['hardware']}",
             f"precision: {fixed['precision']}", fixed["recompute"], f"batch: {fixed['batch']}",
             fixed["steps"]]
    if "mb" in fixed:
        parts.append(f"micro-batch: {fixed['mb']}")
    if fixed.get("rest"):
        parts.append(fixed["rest"])
    if fixed.get("code"):
        parts.append(f"code: {fixed['code']}")
    return "; ".join(parts)


def _pivot(g: pd.DataFrame, row_axis: str) -> pd.DataFrame:
    """Cells by row and column; columns in the order their runs were recorded (a sweep's order)."""
    table = g.assign(cell=g.apply(cell, axis=1)).pivot_table(index=row_axis, columns="column", values="cell",
                                                             aggfunc="last").fillna("")
    table = table[list(g.sort_values("timestamp", kind="stable")["column"].unique())]
    table.columns.name = None
    return table


def layout_tables(tables: list[tuple[dict, pd.DataFrame]]) -> list[str]:
    out = []
    for fixed, g in tables:
        table = _pivot(g, "mb")
        if table.size < 2:  # one run: it is in the table of every run
            continue
        table.index.name = "Micro batch size"
        out.append(f"### Layouts: {fixed['model']}, batch {fixed['batch']}\n\n{heading(fixed)}; no network emulation"
                   f"\n\n" + table.to_markdown(tablefmt="github"))
    return out


def network_tables(tables: list[tuple[dict, pd.DataFrame]]) -> list[str]:
    out = []
    for fixed, g in tables:
        g = g.sort_values("order", kind="stable")
        table = _pivot(g, "setting")
        if table.size < 2:
            continue
        table = table.reindex(g["setting"].unique())
        table.index.name = "Network setting"
        out.append(f"### Step time by network setting: {fixed['model']}, micro-batch {fixed['mb']}\n\n"
                   f"{heading(fixed)}\n\n" + table.to_markdown(tablefmt="github"))
    return out


def _busy_range(shares: list[float]) -> str:
    """The ranks' busy shares (CPU time over step time, CPU runs) as their range: how much of a step they computed."""
    if not shares:
        return ""
    lo, hi = min(shares), max(shares)
    return f"{lo:.0%}" if round(100 * lo) == round(100 * hi) else f"{lo:.0%}-{hi:.0%}"


def all_runs(df: pd.DataFrame) -> str:
    cols = ["system", "model", "precision", "layout", "devices", "mb", "batch", "network", "status", "runs",
            "median_step_time",
            "tokens_per_s", "mfu", "peak_mem_mb", "busy", "dp_sync_time", "oversubscribed", "details"]
    if df["faults"].astype(bool).any():  # a straggler, a killed replica: said beside the network
        cols.insert(cols.index("network") + 1, "faults")
    if df["code"].astype(bool).any():  # records of several commits: each run's
        cols.append("code")
    t = df[cols].copy()
    t["median_step_time"] = [fmt_time(v) + (f" {e.plus_minus()}" if e is not None else "")
                             for v, e in zip(df["median_step_time"], df["estimate"])]
    t["runs"] = [f"{n}" + (f" (+{f} failed)" if f and n else "") for n, f in zip(df["runs"], df["failed_runs"])]
    t["oversubscribed"] = df["oversubscribed"].map(lambda o: describe_oversubscription(o) if o else "")
    t["tokens_per_s"] = t["tokens_per_s"].map(lambda v: f"{v:,.0f}" if v == v and v is not None else "")
    t["mfu"] = t["mfu"].map(lambda v: f"{v:.1%}" if v == v and v is not None else "")
    t["peak_mem_mb"] = t["peak_mem_mb"].map(lambda v: f"{v:,.0f}")
    t["busy"] = t["busy"].map(_busy_range)
    t["dp_sync_time"] = t["dp_sync_time"].map(lambda v: fmt_time(v) if v == v and v else "")
    t["network"] = df["network"].where(df["network"] == "none", df["setting"])
    t = t.rename(columns={"median_step_time": "step", "runs": "ok runs", "peak_mem_mb": "peak MiB per rank (max)",
                          "busy": "busy per rank", "dp_sync_time": "DP sync"})
    return ("## Every run\n\nOne line per run (its repetitions combined); oversubscribed: its ranks outnumbered the "
            "cores they had (no comparison is drawn from it).\n\n" + t.to_markdown(index=False, tablefmt="github"))


def failures(df: pd.DataFrame) -> str:
    bad = df[df["status"] != "ok"]
    if bad.empty:
        return ""
    lines = [f"- {r.system} {r.layout} mb={r.mb} ({r.setting}): {r.status}: {r.error[:200]}"
             for r in bad.itertuples()]
    return "## Failed runs\n\n" + "\n".join(lines)

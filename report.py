"""Turn run records into a report that answers first, then shows tables shaped like the seed's GPT-3 XL results.

    python report.py [RESULTS_DIR_OR_FILES ...] [--out REPORT.md] [--plots DIR]

Reads only RunRecords (JSON lines; a line that is not a record is skipped with a warning). The report:
- a summary: per table, per row (micro-batch size, or network setting), and per kind of parallelism
  and device count within it (pipeline with pipeline, tensor with tensor, on as many devices: like for
  like), ours against the best baseline and the fastest run, each ratio the median of the ratios of
  neighbouring launches and claimed only where its interval leaves out 1 (``contract.estimate.paired``;
  else "no difference beyond noise"); no comparison across kinds (the tables show them side by side),
  none by step time of a method that changes the optimisation (diloco: time and bytes to a held-out
  loss instead), and none from a run whose ranks outnumbered its cores;
- layout tables, for runs without network emulation: rows = micro-batch size, columns = system and layout
  in the seed's notation (``T-4 P-2``), cells ``19.71 s`` or ``Fail (OOM)``;
- network tables, for runs under emulation: rows = the network settings (fastest to slowest), columns =
  system and layout (DP degree);
- time to quality, for runs with eval points (``--eval-every``): the race's target against the held-out
  unigram cross-entropy and where synchronous training reaches it (the line ``target: ...``, before the
  tables), then per network setting wall time, tokens and bytes sent to the held-out loss, bytes sent
  per token, which wins; plots of held-out loss against wall time and against bytes sent;
- every run (tokens/s, MFU, peak memory per rank, sync times, the choices a system made) and the failures.
Each table is headed once by what is fixed in it. A table holds the runs of exactly one configuration
apart from its axes, so a cell never mixes runs of different configs. The records of one run (its
repetitions, a sweep's ``repeats``) are combined (``contract.estimate``): a cell shows the median of
their median step times and an interval, ``1.51 s ±4 %``; one run alone shows ``(1 run)``. Plots
(``--plots``): step time (log scale) against the one-way delay, per table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import pandas as pd

from contract.config import VOLATILE_FIELDS, RunConfig
from contract.config import ConfigError
from contract.estimate import (BOOTSTRAP_FROM, INTERVAL_RULE, PAIRED_RULE, estimate, no_difference, paired,
                               ratio_interval, separated)
from contract.records import layout_words, predictions_path, read_predictions, read_records, record_files
from contract.registry import get_system, read_options

FAIL = {"oom": "Fail (OOM)", "error": "Fail (error)", "timeout": "Fail (timeout)"}
# The fields a table's cells share, in the order its heading states them (the rest of a run's
# identity, beyond the axes, is added to the heading when it is not the default).
HEADING = ("model", "shape", "hardware", "precision", "recompute", "batch", "steps")
# RunConfig's fields the tables show as axes, columns or in the heading (the rest of a run's identity,
# where it is not the default, is stated beside the heading)
SHOWN = frozenset({"system", "model", "pp", "tp", "dp", "batch_size", "micro_batch_size", "steps", "warmup",
                   "precision", "recompute", "network", "network_matrix", "network_trace", "network_trace_contents",
                   "options"})


def load_records(paths: list[str]) -> list[dict]:
    """Every record in the files (directories: their *.jsonl), with the simulator's prediction kept
    beside its file (``python -m predict records``) where it has none of its own; a line that is not
    a record is skipped with a warning on stderr."""
    records = []
    warn = lambda why: print(f"report.py: {why}", file=sys.stderr)  # noqa: E731
    for f in record_files(paths):
        found = read_records(f, warn=warn)
        predicted = read_predictions(f, warn=warn)
        for rec in found:
            if rec.get("prediction") is None and rec.get("run_id") in predicted:
                rec["prediction"] = predicted[rec["run_id"]]
        records += found
    return records


def network_setting(r: dict) -> dict:
    """A record's network setting in words and numbers, as the run recorded it: its label, one-way
    delay (ms) and bandwidth (Gbit/s) of its link (None without emulation; a per-link matrix: its
    slowest link, whether all its links are one, the digest of its contents). Records from before
    ``network_setting`` was recorded: the profile their emulation described, else the setting's name."""
    if r.get("network_setting"):
        return r["network_setting"]
    prof = ((r.get("environment") or {}).get("network") or {}).get("profile") or {}
    link = prof.get("link") or {}
    if prof.get("kind") == "matrix":
        link = {k: prof[k][0][1] for k in ("delay_ms", "bandwidth_gbps")}
    return {"label": prof.get("label") or r["network"], "delay_ms": link.get("delay_ms"),
            "bandwidth_gbps": link.get("bandwidth_gbps")}


def hardware_of(environment: dict) -> str:
    """What a run ran on, as its record says: the device kind, and the device's name where it says
    more ('cpu'; 'cuda: Tesla V100-SXM2-16GB'). Part of a report row's identity: records of one
    config on different hardware never share a table."""
    kind = str(environment.get("device_kind") or "")
    name = str(environment.get("device_name") or "")
    return kind if not name or name == kind else f"{kind}: {name}" if kind else name


def network_row(r: dict) -> tuple[str, str, tuple[float, ...]]:
    """A record's network setting as a table's row: (what tells settings apart: the setting, and a
    matrix's and a trace's digests; its label; its order)."""
    setting = network_setting(r)
    return network_key(r, setting), setting["label"], network_order(setting)


def network_key(r: dict, setting: dict) -> str:
    """What tells a record's network setting apart from others: its name, a matrix's digest, a trace's."""
    trace = setting.get("trace") or {}
    return (r["network"] + (f" [{setting['digest']}]" if setting.get("digest") else "")
            + (f" + trace [{trace['digest']}]" if trace.get("digest") else ""))


def network_order(setting: dict) -> tuple[float, ...]:
    """Rows go from the fastest network to the slowest: by delay, then by falling bandwidth, then by
    loss and jitter (a changing link after the same link unchanged)."""
    if setting.get("delay_ms") is None:
        return (-1.0, 0.0, 0.0, 0.0, 0.0)
    return (setting["delay_ms"], -setting["bandwidth_gbps"], setting.get("loss_pct") or 0.0,
            setting.get("jitter_ms") or 0.0, 1.0 if setting.get("trace") else 0.0)


def fmt_time(t: float | None) -> str:
    if t is None or t != t:
        return ""
    return f"{t:.2f} s" if t >= 1 else f"{t:.3f} s"


def cell(row: pd.Series) -> str:
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


def _rest_of_identity(r: dict) -> str:
    """The fields of a run's identity that are neither axes nor in HEADING, where they are not
    RunConfig's defaults, as text (e.g. 'seed 3, sgd lr 0.001')."""
    c = r.get("config") or {}
    parts = []
    for f in dataclasses.fields(RunConfig):
        if f.name in SHOWN or f.name in VOLATILE_FIELDS or f.name not in c:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = c[f.name]
        plain = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
        if value == json.loads(json.dumps(plain)):
            continue
        if f.name == "optimizer":
            parts.append(f"{value.get('kind')} lr {value.get('lr'):g}")
        else:
            parts.append(f"{f.name.replace('_', ' ')} {value}")
    return ", ".join(parts)


def to_frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for i, r in enumerate(records):
        env = r.get("environment") or {}
        c = r.get("config") or {}
        shape = r["model_shape"]
        options = read_options(r["system"], c.get("options") or {})
        setting = network_setting(r)
        hardware = hardware_of(env)
        rows.append({
            "key": (r.get("key") or json.dumps(c, sort_keys=True)) + " on " + hardware,
            "timestamp": r.get("timestamp", ""),
            "launched": (r.get("timestamp", ""), i),  # when: its time, then its place in the records (ties)
            "system": r.get("label") or r["system"],
            "role": r.get("role") or "baseline",
            "options": json.dumps(options, sort_keys=True),
            "model": r["model"],
            "shape": "L{n_layer} h{n_embd} a{n_head} s{seq_len}".format(**shape),
            "hardware": hardware,
            "devices": layout_devices(r["layout"]),
            "kind": parallelism(r["layout"]),
            "synchronous": synchronous(r["system"]),
            "precision": r.get("precision", "fp32"),
            "recompute": "recompute" if r.get("recompute") else "no recompute",
            "batch": f"{r['batch_size']} per pipeline",  # (global: x the DP degree)
            "steps": f"{c.get('steps', '?')} measured steps after {c.get('warmup', '?')} warm-up",
            "measured": len(r.get("step_times") or []),  # as recorded (a run may end early: --target-loss)
            "rest": _rest_of_identity(r),
            "faults": faults_words(c),
            "mb": r["micro_batch_size"],
            "layout": layout_words(r["layout"]),
            "dp": r["layout"].get("dp", 1),
            "network": network_key(r, setting),
            "setting": setting["label"],
            "order": network_order(setting),
            "delay": setting.get("delay_ms") if setting.get("uniform", True) else None,  # a matrix: several
            "emulated": r["network"] != "none",
            "status": r["status"],
            "median_step_time": r.get("median_step_time"),
            "predicted": (r.get("prediction") or {}).get("step_time"),
            "not_modelled": (r.get("prediction") or {}).get("not_modelled"),
            "oversubscribed": r.get("oversubscribed"),
            "tokens_per_s": r.get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "peak_mem_mb": max(r.get("peak_memory_bytes") or [0]) / 2**20,
            "busy": r.get("busy_fraction") or [],
            "dp_sync_time": r.get("dp_sync_time"),
            "details": r.get("details") or "",
            "error": r.get("error") or "",
        })
    df = pd.DataFrame(combine_repetitions(rows))
    if df.empty:
        return df
    df = df.sort_values("timestamp", kind="stable").reset_index(drop=True)
    df["column"] = df["system"] + " " + df["layout"]
    return df


def combine_repetitions(rows: list[dict]) -> list[dict]:
    """One row per run (identity key) from its records, its repetitions: where any is ok, the newest ok
    one's fields with the step time, tokens/s and MFU the medians over the ok ones, ``estimate`` their
    interval (``contract.estimate``), ``runs`` how many were ok and ``failed_runs`` how many were not,
    oversubscribed if any of them was; else the newest record (a failure), as it is."""
    by_key: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["timestamp"]):
        by_key.setdefault(row["key"], []).append(row)
    out = []
    for same in by_key.values():
        ok = [r for r in same if r["status"] == "ok" and r["median_step_time"] is not None]
        if not ok:
            out.append({**same[-1], "estimate": None, "runs": 0, "failed_runs": len(same), "launches": [],
                        "measured": (same[-1]["measured"],) * 2})
            continue
        est = estimate([r["median_step_time"] for r in ok])
        row = {**ok[-1], "estimate": est, "median_step_time": est.median, "runs": len(ok),
               "launches": [(r["launched"], r["median_step_time"]) for r in ok],
               "measured": (min(r["measured"] for r in ok), max(r["measured"] for r in ok)),
               "failed_runs": len(same) - len(ok),
               "oversubscribed": next((r["oversubscribed"] for r in ok if r["oversubscribed"]), None)}
        for name in ("tokens_per_s", "mfu"):
            values = [r[name] for r in ok if r[name] is not None]
            row[name] = statistics.median(values) if values else None
        out.append(row)
    return out


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


def _tables(df: pd.DataFrame, emulated: bool) -> list[tuple[dict, pd.DataFrame]]:
    """(heading fields, runs) of each table: runs sharing every identity field but the table's axes."""
    part = df[df["emulated"] == emulated]
    keys = [*HEADING, "rest"] + (["mb"] if emulated else ["network"])
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


def layout_devices(layout: dict) -> int:
    """The devices a layout spans, pp x tp x dp (fairscale's P-2, one process on CPU: 2)."""
    return layout.get("pp", 1) * layout.get("tp", 1) * layout.get("dp", 1)


KINDS = {"tp": "tensor", "pp": "pipeline", "dp": "data-parallel"}


def parallelism(layout: dict) -> str:
    """A layout's kind of parallelism: 'pipeline', 'tensor', 'tensor + pipeline', 'pipeline +
    data-parallel', ...; 'one device'. Claims compare runs of one kind on as many devices."""
    kinds = [name for dim, name in KINDS.items() if layout.get(dim, 1) > 1]
    return " + ".join(kinds) or "one device"


def synchronous(system: str) -> bool:
    """False for a method that changes the optimisation (it names a reference of its own math:
    ``SystemSpec.reference``, diloco), which a step time does not compare; True for an unknown system."""
    try:
        return get_system(system).reference is None
    except ConfigError:
        return True


def heading(fixed: dict) -> str:
    """What a table's runs share, stated once: 'model: tiny (L4 h128 a4 s128); hardware: cpu; ...'."""
    parts = [f"model: {fixed['model']} ({fixed['shape']})", f"hardware: {fixed['hardware']}",
             f"precision: {fixed['precision']}", fixed["recompute"], f"batch: {fixed['batch']}",
             fixed["steps"]]
    if "mb" in fixed:
        parts.append(f"micro-batch: {fixed['mb']}")
    if fixed.get("rest"):
        parts.append(fixed["rest"])
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


def _name(r: pd.Series) -> str:
    return f"`{r['column']}`" + (f" [{r['details']}]" if r["details"] else "")


def _timed(r: pd.Series) -> str:
    return f"{_name(r)} {fmt_time(r['median_step_time'])} {r['estimate'].plus_minus()}"


def _verdict(group: pd.DataFrame) -> str | None:
    """The claims among runs of one kind of parallelism on as many devices (``_verdicts``): ours at its
    best against the best baseline, and the fastest run where there are more to compare, each from
    the ratios of neighbouring launches (``contract.estimate.paired``) and claimed only where that
    interval leaves out 1; runs whose ranks outnumbered their cores are left out, and it says so."""
    crowded = group[group["oversubscribed"].map(bool)]
    fair = group[~group["oversubscribed"].map(bool)]
    parts = []
    if len(fair) == 1:
        parts.append(f"only {_timed(fair.iloc[0])} to compare")
    elif not fair.empty:
        duel = _ours_against_best_baseline(fair)
        if duel is None or len(fair) > 2:
            parts.append(_fastest(fair))
        if duel is not None:
            parts.append(duel)
    if not crowded.empty:
        over = crowded.iloc[0]["oversubscribed"]
        parts.append(f"no comparison from {', '.join(f'`{c}`' for c in crowded['column'])}: its ranks outnumbered "
                     f"the cores they had ({describe_oversubscription(over)}), so its times measure CPU contention, "
                     f"not the system")
    return "; ".join(parts) or None


def _against(base: pd.Series, other: pd.Series) -> tuple[bool, str]:
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


def _fastest(fair: pd.DataFrame) -> str:
    """The fastest run by median, claimed only where it is faster than every other by their paired launches."""
    fastest = fair.loc[fair["median_step_time"].idxmin()]
    others = [(r, *_against(r, fastest)) for _, r in fair.iterrows() if r["key"] != fastest["key"]]
    if all(beyond for _, beyond, _ in others):
        return f"fastest {_timed(fastest)}: " + ", ".join(f"{words} than {_name(r)}" for r, _, words in others)
    return f"no fastest: {_timed(fastest)}, " + ", ".join(f"{_timed(r)} ({words})" for r, beyond, words in others
                                                            if not beyond)


def _ours_against_best_baseline(fair: pd.DataFrame) -> str | None:
    """Ours at its best (by median) against the best baseline (by median), from their paired launches;
    None without both."""
    baselines, ours = fair[fair["role"] == "baseline"], fair[fair["role"] == "ours"]
    if baselines.empty or ours.empty:
        return None
    best = baselines.loc[baselines["median_step_time"].idxmin()]
    mine = ours.loc[ours["median_step_time"].idxmin()]
    _, words = _against(best, mine)
    return f"ours {_timed(mine)} against the best baseline {_timed(best)}: {words}"


def describe_oversubscription(over: dict) -> str:
    """'12 ranks (12 threads) on 2 cores', as a record's ``oversubscribed`` says it."""
    threads = f" ({over['threads']} threads)" if over.get("threads", over["ranks"]) != over["ranks"] else ""
    machines = f", on {over['machines']} machines" if over.get("machines", 1) > 1 else ""
    return f"{over['ranks']} ranks{threads} on {over['cores']} cores{machines}"


def _verdicts(row: pd.DataFrame) -> list[tuple[str, str]]:
    """(qualifier, verdict) of one row: one verdict per kind of parallelism and device count (like for
    like: P-2 against P-2, T-2 against T-2; never P-2 against T-2 or P-2 D-2), and a line for the runs
    of a method that changes the optimisation, which no step time compares."""
    ok = row[(row["status"] == "ok") & (row["role"] != "reference") & row["median_step_time"].notna()]
    out = []
    for (kind, n), group in ok[ok["synchronous"]].groupby(["kind", "devices"], sort=False):
        verdict = _verdict(group)
        if verdict:
            out.append((f", {kind}, {int(n)} device{'s' if n != 1 else ''}", verdict))
    other = ok[~ok["synchronous"]]
    if not other.empty:
        out.append(("", f"{', '.join(_name(r) for _, r in other.iterrows())}: not compared by step time (its "
                        f"method changes the optimisation: compared by time and bytes to a held-out loss, where it "
                        f"has evals)"))
    return out


def summary(layouts: list[tuple[dict, pd.DataFrame]], networks: list[tuple[dict, pd.DataFrame]]) -> str:
    lines = []
    for fixed, g in layouts:
        rows = [(f"micro-batch {mb}{q}", v) for mb, r in g.groupby("mb") for q, v in _verdicts(r)]
        if rows and len(g) > 1:
            lines.append(f"- **Layouts**, {heading(fixed)}:")
            lines += [f"  - {what}: {v}" for what, v in rows]
    for fixed, g in networks:
        g = g.sort_values("order", kind="stable")
        rows = [(f"{r['setting'].iloc[0]}{q}", v)
                for net, r in g.groupby("network", sort=False) for q, v in _verdicts(r)]
        if rows and len(g) > 1:
            lines.append(f"- **Networks**, {heading(fixed)}:")
            lines += [f"  - {what}: {v}" for what, v in rows]
    if not lines:
        return ""
    return (f"## Summary\n\nLike for like: runs are compared only with runs of the same kind of parallelism on as "
            f"many devices (pipeline with pipeline, tensor with tensor; a layout's devices: pp x tp x dp), and a "
            f"method that changes the optimisation (diloco) never by step time; across kinds the tables show the "
            f"runs side by side, with no claim. Every cell: the {INTERVAL_RULE}. Every claim: {PAIRED_RULE}.\n\n"
            + "\n".join(lines))


def provenance(records: list[dict]) -> tuple[str, list[str]]:
    """What produced the records, as they say it (``runners.record.provenance``): the code's commits (a
    dirty tree marked), and the library versions; and the warnings, one line each, where the records
    differ in commit or versions, or where some say neither or came from a dirty tree."""
    def count(values: list[str]) -> str:
        seen: dict[str, int] = {}
        for v in values:
            seen[v] = seen.get(v, 0) + 1
        return ", ".join(f"{v} ({n} record{'s' if n != 1 else ''})" for v, n in seen.items())

    envs = [r.get("environment") or {} for r in records]
    commits = [f"commit {str(e['git_commit'])[:12]}" + (" (dirty)" if e.get("git_dirty") else "") if e.get("git_commit")
               else "no commit recorded" for e in envs]
    versions = [", ".join(f"{k} {v}" for k, v in e["versions"].items()) if isinstance(e.get("versions"), dict)
                else "no versions recorded" for e in envs]
    warnings = []
    if len(set(commits)) > 1:
        warnings.append(f"the records come from {len(set(commits))} commits: {count(commits)}")
    elif any(c.endswith(" dirty") for c in commits):
        warnings.append("the records come from a tree whose tracked files differed from its commit")
    if len(set(versions)) > 1:
        warnings.append(f"the records come from {len(set(versions))} sets of versions: {count(versions)}")
    text = f"Made by: {count(commits)}; with {count(versions)}."
    return text + "".join(f"\n\n**Warning**: {w}." for w in warnings), warnings


def _busy_range(shares: list[float]) -> str:
    """The ranks' busy shares (CPU time over step time, CPU runs) as their range: how much of a step they computed."""
    if not shares:
        return ""
    lo, hi = min(shares), max(shares)
    return f"{lo:.0%}" if round(100 * lo) == round(100 * hi) else f"{lo:.0%}-{hi:.0%}"


def faults_words(config: dict) -> str:
    """A run's faults (``contract.faults``) in words: 'rank 1 2x slower', 'replica 2 killed after 6 steps,
    rejoins'; '' without."""
    parts = []
    if config.get("slow_rank"):
        rank, factor = config["slow_rank"].split(":")
        parts.append(f"rank {rank} {factor}x slower")
    if config.get("kill_replica"):
        replica, step = config["kill_replica"].split("@")
        parts.append(f"replica {replica} killed after {step} steps" + (", rejoins" if config.get("rejoin") else ""))
    return "; ".join(parts)


def all_runs(df: pd.DataFrame) -> str:
    cols = ["system", "model", "precision", "layout", "devices", "mb", "batch", "network", "status", "runs",
            "median_step_time",
            "tokens_per_s", "mfu", "peak_mem_mb", "busy", "dp_sync_time", "oversubscribed", "details"]
    if df["faults"].astype(bool).any():  # a straggler, a killed replica: said beside the network
        cols.insert(cols.index("network") + 1, "faults")
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


def render(records: list[dict], target: float | None = None) -> str:
    df = to_frame(records)
    if df.empty:
        return "No run records found.\n"
    layouts, networks = _tables(df, emulated=False), _tables(df, emulated=True)
    parts = ["# Results", provenance(records)[0], *quality_target_lines(records), summary(layouts, networks)]
    net, lay = network_tables(networks), layout_tables(layouts)
    if lay:
        parts += ["## Layouts (no network emulation)", *lay]
    if net:
        parts += ["## Networks (emulated)", *net]
    parts.append(quality_section(records, target))  # runs with eval points: time to a loss
    parts += [all_runs(df), failures(df)]
    return "\n\n".join(p for p in parts if p) + "\n"


# Time to quality: runs with eval points (``--eval-every``, ``contract.evaluation``) racing to a held-out
# loss. A run's target is its ``--target-loss``; the report's ``--target`` stands in for runs recorded
# without one. The crossing: ``crossing``.


def _quality_group(r: dict) -> str:
    """What a time-to-quality table's runs share: model, global batch, data and tokens, precision, optimizer."""
    c = r.get("config") or {}
    shape = r["model_shape"]
    opt = c.get("optimizer") or {}
    corpus = (r.get("environment") or {}).get("corpus") or {}
    data = c.get("data") or "synthetic"
    if corpus.get("sha256"):
        data += f" (sha256 {corpus['sha256'][:12]})"
    if c.get("tokenizer", "byte") != "byte":
        data += f", {c['tokenizer']} {shape['vocab_size']}"
    return (f"model {r['model']} (L{shape['n_layer']} h{shape['n_embd']} a{shape['n_head']} s{shape['seq_len']}); "
            f"global batch {r['global_batch_size']}; data {data}; {r.get('precision', 'fp32')}; "
            f"{opt.get('kind', 'adam')} lr {opt.get('lr', 0):g}")


CROSSING_RULE = ("the crossing is interpolated linearly (in loss) between the last eval above the target and the "
                 "first at or below it where the evaluated weights change every step; where they change only every "
                 "c steps (DiLoCo's global weights, at its syncs: c = H/F) it is the first eval at or below the "
                 "target, exact where the evals come every c steps")


def crossing(evals: list[dict], goal: float, every: int = 1) -> dict | None:
    """Where a run's held-out loss first reaches ``goal`` (``CROSSING_RULE``): its step, tokens,
    wall time and bytes sent (every rank's, summed), or None. ``every``: the steps between changes of
    the evaluated weights."""
    prev = None
    for e in evals:
        if e["loss"] <= goal:
            frac = 1.0
            if prev is not None and every == 1 and prev["loss"] > e["loss"]:
                frac = (prev["loss"] - goal) / (prev["loss"] - e["loss"])
            at = lambda key: prev[key] + frac * (e[key] - prev[key]) if prev is not None else e[key]  # noqa: E731
            return {"step": at("step"), "tokens": at("tokens"), "wall_time": at("wall_time"),
                    "bytes": (sum(prev["bytes_sent"]) + frac * (sum(e["bytes_sent"]) - sum(prev["bytes_sent"]))
                              if prev is not None else sum(e["bytes_sent"]))}
        prev = e
    return None


def quality_frame(records: list[dict], target: float | None = None) -> pd.DataFrame:
    """One row per ok run with eval points and a target: its repetition group (runs that differ only in
    ``--seed``), column, network setting, target and where it crossed it (``crossing``; the newest
    record of a repetition)."""
    rows = []
    for r in records:
        evals = r.get("evals") or []
        c = r.get("config") or {}
        goal = c.get("target_loss") if c.get("target_loss") is not None else target
        if r.get("status") != "ok" or not evals or goal is None:
            continue
        ident = json.loads(r["key"]) if r.get("key") else dict(c)
        ident.pop("seed", None)
        every = int((r.get("options") or {}).get("eval_weights_every") or 1)
        local_steps = "eval_weights_every" in (r.get("options") or {})  # replicas step apart (DiLoCo)
        hit = crossing(evals, goal, every)
        last = evals[-1]
        setting, label, order = network_row(r)
        rows.append({
            "repetitions": json.dumps(ident, sort_keys=True), "timestamp": r.get("timestamp", ""),
            "seed": c.get("seed", 0), "group": _quality_group(r), "target": goal,
            "column": f"{r.get('label') or r['system']} {layout_words(r['layout'])}",
            "network": setting, "network_label": label, "order": order, "network_name": r["network"],
            "reached": hit is not None, "steps": last["step"], "weights_every": every,
            "synchronous": not local_steps,
            "oversubscribed": describe_oversubscription(r["oversubscribed"]) if r.get("oversubscribed") else "",
            "time": hit["wall_time"] if hit else None, "tokens": hit["tokens"] if hit else None,
            "bytes": hit["bytes"] if hit else None,
            "bytes_per_token": sum(last["bytes_sent"]) / last["tokens"] if last["tokens"] else None,
            "evals": evals,
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    return (df.sort_values("timestamp", kind="stable").drop_duplicates(["repetitions", "seed"], keep="last")
            .reset_index(drop=True))


def quality_targets(records: list[dict]) -> dict[str, dict]:
    """Per group (``_quality_group``): where synchronous training is at its token budget, from the
    reference's runs with eval points and no target (the newest record per seed): the tokens N of
    its last eval, the held-out losses there (one per seed) and their median, the race's target."""
    found: dict[str, dict[int, tuple[str, dict]]] = {}
    for r in records:
        c = r.get("config") or {}
        if r.get("system") != "reference" or r.get("status") != "ok" or not r.get("evals") or c.get("target_loss"):
            continue
        seeds = found.setdefault(_quality_group(r), {})
        seed = c.get("seed", 0)
        if seed not in seeds or r.get("timestamp", "") >= seeds[seed][0]:
            seeds[seed] = (r.get("timestamp", ""), r["evals"][-1])
    out = {}
    for group, seeds in found.items():
        last = [e for _, e in seeds.values()]
        losses = [e["loss"] for e in last]
        out[group] = {"tokens": statistics.median(e["tokens"] for e in last), "losses": losses,
                      "loss": statistics.median(losses), "seeds": sorted(seeds)}
    return out


def _unigram(records: list[dict], group: str) -> float | None:
    """The held-out unigram cross-entropy over the eval batch of a group's text, as its runs recorded it."""
    for r in records:
        uni = ((r.get("environment") or {}).get("corpus") or {}).get("unigram_nats")
        if uni and r.get("evals") and _quality_group(r) == group:
            return uni["eval_batch"]
    return None


MIN_BELOW_UNIGRAM = 0.5  # nats: a target above (unigram - this) measures little beyond token frequencies


def quality_target_lines(records: list[dict]) -> list[str]:
    """Per race (group and target): ``target: X nats (unigram: Y nats; synchronous at N tokens)``, the
    reference's losses there, and a warning where X is not MIN_BELOW_UNIGRAM below Y."""
    df = quality_frame(records)
    if df.empty:
        return []
    refs = quality_targets(records)
    lines = []
    for (group, goal), _ in df.groupby(["group", "target"], sort=False):
        uni, ref = _unigram(records, group), refs.get(group)
        uni_text = f"{uni:.3f}" if uni is not None else "?"
        tokens_text = f"{ref['tokens']:,.0f}" if ref else "?"
        line = f"target: {goal:.3f} nats (unigram: {uni_text} nats; synchronous at {tokens_text} tokens)"
        notes = []
        if ref:
            notes.append(f"the reference's held-out loss at {ref['tokens']:,.0f} tokens, seeds "
                         f"{', '.join(map(str, ref['seeds']))}: {', '.join(f'{x:.3f}' for x in ref['losses'])} "
                         f"(median {ref['loss']:.3f})")
        else:
            notes.append("no reference run with eval points in these records: where the target comes from is not shown")
        if uni is None:
            notes.append("the records carry no unigram cross-entropy")
        elif goal > uni - MIN_BELOW_UNIGRAM:
            notes.append(f"**the target is not {MIN_BELOW_UNIGRAM} nats below the unigram figure**: the race measures "
                         "little beyond learning token frequencies")
        lines.append(f"{line}\n\n{group}: " + "; ".join(notes) + ".")
    return lines


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 10 else f"{t:.2f} s"


def _tokens(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _interval(values, fmt) -> str:
    """The median of a column's runs and its interval (``contract.estimate``): '12.3 s [11.0 s-14.1 s]'."""
    est = estimate(values)
    return fmt(est.median) + (f" [{fmt(est.low)}-{fmt(est.high)}]" if est.has_interval else " (1 run)")


def _to_target_cell(column: str, fmt):
    """A table's cell: the median and interval of ``column`` at the crossing over the runs that
    reached the target, how many did, or "not reached in N steps"."""
    def cell(runs: pd.DataFrame) -> str:
        reached = runs[runs["reached"]]
        n = len(runs)
        if reached.empty:
            return f"not reached in {int(runs['steps'].max())} steps" + (f" ({n} runs)" if n > 1 else "")
        text = _interval(reached[column], fmt)
        return (f"{len(reached)}/{n} reached: " + text) if len(reached) < n else text
    return cell


quality_cell = _to_target_cell("time", _seconds)


def _quality_axes(g: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(network settings, fastest to slowest; columns, in recorded order)."""
    return (list(g.sort_values("order", kind="stable")["network"].unique()),
            list(g.sort_values("timestamp", kind="stable")["column"].unique()))


def _quality_table(g: pd.DataFrame, value) -> str:
    nets, cols = _quality_axes(g)
    labels = dict(zip(g["network"], g["network_label"]))
    rows = []
    for net in nets:
        at = g[g["network"] == net]
        rows.append([labels[net]] + [value(at[at["column"] == col]) if (at["column"] == col).any() else ""
                                     for col in cols])
    return pd.DataFrame(rows, columns=["Network setting", *cols]).to_markdown(index=False, tablefmt="github",
                                                                               disable_numparse=True)


def _bytes_cell(runs: pd.DataFrame) -> str:
    values = runs["bytes_per_token"].dropna()
    if values.empty:
        return ""
    return _interval(values, lambda b: f"{b:,.0f}" if b >= 10 else f"{b:.2f}")


def _to_target(est, column: str) -> str:
    return f"`{column}` {_seconds(est.median)} {est.plus_minus()}"


def quality_winners(g: pd.DataFrame) -> list[str]:
    """Per network setting: the fastest column to the target among those that reached it in every run,
    against the next, claimed only where their intervals separate (``contract.estimate``)."""
    lines = []
    for net in _quality_axes(g)[0]:
        at = g[g["network"] == net]
        label = at["network_label"].iloc[0]
        done = sorted(((estimate(runs["time"]), col) for col, runs in at.groupby("column") if runs["reached"].all()),
                      key=lambda ec: ec[0].median)
        if not done:
            lines.append(f"- {label}: no column reached the target in every run")
            continue
        (best, col) = done[0]
        text = f"- {label}: {_to_target(best, col)}"
        if len(done) > 1:
            other, ocol = done[1]
            if separated(best, other):
                ratio, low, high = ratio_interval(other, best)
                text += f", **{ratio:.2f}x** ({low:.2f}-{high:.2f}x) faster than {_to_target(other, ocol)}"
            else:
                text += f" against {_to_target(other, ocol)}: {no_difference(best, other)}"
        missed = [c for c, runs in at.groupby("column") if not runs["reached"].all()]
        if missed:
            text += "; not reached in every run: " + ", ".join(f"`{c}`" for c in missed)
        lines.append(text)
    return lines


def _contention(g: pd.DataFrame) -> list[str]:
    """A note where a group's runs had more ranks than cores: their times hold CPU contention."""
    over = sorted(set(g["oversubscribed"]) - {""})
    if not over:
        return []
    every = "every run" if (g["oversubscribed"] != "").all() else "some runs"
    return [f"Oversubscribed: {every} here ({'; '.join(over)}): the times hold CPU contention, alike for every column "
            "that shares it; the tokens and bytes do not depend on it."]


def against_synchronous(g: pd.DataFrame) -> list[str]:
    """Per network setting, every column that reached the target in every run against the synchronous
    one (the runs whose replicas never step apart: a single such column), where their intervals
    separate; [] where there is no single synchronous column."""
    sync = g[g["synchronous"]]["column"].unique()
    if len(sync) != 1:
        return []
    lines = []
    for net in _quality_axes(g)[0]:
        at = g[g["network"] == net]
        base = at[at["column"] == sync[0]]
        if base.empty or not base["reached"].all():
            continue
        b = estimate(base["time"])
        parts = []
        for col, runs in at[at["column"] != sync[0]].groupby("column", sort=False):
            if not runs["reached"].all():
                parts.append(f"`{col}` did not reach the target in every run")
                continue
            e = estimate(runs["time"])
            if separated(b, e):
                ratio, low, high = ratio_interval(b, e)
                word = "faster" if ratio > 1 else "slower"
                shown = ratio if ratio > 1 else 1 / ratio
                span = (low, high) if ratio > 1 else (1 / high, 1 / low)
                parts.append(f"{_to_target(e, col)}: **{shown:.2f}x** ({span[0]:.2f}-{span[1]:.2f}x) {word}")
            else:
                parts.append(f"{_to_target(e, col)}: {no_difference(b, e)}")
        lines.append(f"- {at['network_label'].iloc[0]}, against {_to_target(b, sync[0])}: " + "; ".join(parts))
    return lines


def quality_section(records: list[dict], target: float | None = None) -> str:
    """The time-to-quality section ("" if no record has eval points and a target)."""
    df = quality_frame(records, target)
    if df.empty:
        return ""
    parts = ["## Time to quality"]
    for (group, goal), g in df.groupby(["group", "target"], sort=False):
        parts += [f"### Held-out loss {goal:g}: {group}",
                  f"Cells: at the crossing of the target, the median over the runs that differ only in seed and "
                  f"in brackets its interval (``contract.estimate``: the min-max of the runs below {BOOTSTRAP_FROM}, "
                  f"a bootstrap 95 % interval of the median from {BOOTSTRAP_FROM}; one run has none); "
                  f"{CROSSING_RULE}. The time leaves out the harness's timing barriers and the evals; bytes are "
                  "every rank's TCP payload, summed.",
                  "#### Training wall time to the target", *_contention(g), _quality_table(g, quality_cell),
                  "Which wins (only where the intervals separate):\n\n" + "\n".join(quality_winners(g)),
                  *(["Against synchronous training (the ratio of medians and its range over the intervals, only "
                     "where they separate):\n\n" + "\n".join(against)] if (against := against_synchronous(g)) else []),
                  "#### Tokens to the target", _quality_table(g, _to_target_cell("tokens", _tokens)),
                  "#### Bytes sent to the target", _quality_table(g, _to_target_cell("bytes", _bytes)),
                  f"#### Bytes sent per token: {group}",
                  "Every rank's TCP payload bytes, summed, over the tokens trained, at the last eval.",
                  _quality_table(g, _bytes_cell)]
    return "\n\n".join(parts)


def plot_quality(records: list[dict], directory: Path, target: float | None = None) -> list[Path]:
    """Held-out loss against training wall time, and against bytes sent (every rank's, summed): one
    picture each per group, a panel per network setting, one line per run (a step line where the
    evaluated weights change only at syncs), the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = quality_frame(records, target)
    paths: list[Path] = []
    if df.empty:
        return paths
    for gi, ((group, goal), g) in enumerate(df.groupby(["group", "target"], sort=False)):
        nets, cols = _quality_axes(g)
        ends = [run[-1]["wall_time"] for run in g["evals"]]
        spread = max(ends) > 5 * max(min(ends), 1e-9)  # runs seconds and minutes apart: log above 1 s
        axes_of = {"time": ("training wall time (s" + (", log above 1 s" if spread else "")
                            + "; timing barriers and evals left out)", lambda e: e["wall_time"],
                            "symlog" if spread else "linear"),
                   "bytes": ("bytes sent, every rank's, summed (log)", lambda e: sum(e["bytes_sent"]), "log")}
        colors = {col: f"C{i % 10}" for i, col in enumerate(cols)}
        for kind, (xlabel, x_of, scale) in axes_of.items():
            width = min(len(nets), 2)
            fig, panels = plt.subplots((len(nets) + 1) // 2, width, figsize=(6.5 * width, 4.4 * ((len(nets) + 1) // 2)),
                                       squeeze=False)
            for ax, net in zip(panels.flat, nets):
                at = g[g["network"] == net]
                for col in cols:
                    for k, (_, run) in enumerate(at[at["column"] == col].iterrows()):
                        ev = [e for e in run["evals"] if scale != "log" or x_of(e) > 0]
                        ax.plot([x_of(e) for e in ev], [e["loss"] for e in ev], color=colors[col], marker=".",
                                markersize=3, linewidth=1, alpha=0.8, label=col if k == 0 else None,
                                drawstyle="steps-post" if run["weights_every"] > 1 else "default")
                ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"target {goal:g}")
                if scale == "log":
                    ax.set_xscale("log")
                else:
                    if scale == "symlog":
                        ax.set_xscale("symlog", linthresh=1.0)
                    ax.set_xlim(left=0)
                ax.set_xlabel(xlabel, fontsize=8)
                ax.set_ylabel("held-out loss")
                ax.set_title(at["network_label"].iloc[0], fontsize=9)
                ax.grid(True, alpha=0.3)
            for ax in list(panels.flat)[len(nets):]:
                ax.axis("off")
            handles, labels = panels.flat[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
            fig.suptitle(group, fontsize=8)
            fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(cols) + 3) // 3), 1, 0.97))
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"quality-{gi}-{kind}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def plot_networks(df: pd.DataFrame, directory: Path) -> list[Path]:
    """One plot per network table: median step time (log) against the one-way delay (ms, log),
    one line per column, each line labelled at its right end inside the picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for i, (fixed, g) in enumerate(_tables(df, emulated=True)):
        for label in g[(g["status"] == "ok") & g["delay"].isna()]["setting"].unique():
            print(f"plot: left out {label}: its links differ, it has no one delay", file=sys.stderr)
        g = g[(g["status"] == "ok") & g["delay"].notna()]
        if g["network"].nunique() < 2:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.8))
        ends = []
        for col, s in g.groupby("column"):
            s = s.sort_values("delay")
            (line,) = ax.plot(s["delay"], s["median_step_time"], marker="o")
            ends.append((s["median_step_time"].iloc[-1], s["delay"].iloc[-1], col, line.get_color()))
        low, high = min(g["median_step_time"]), max(g["median_step_time"])
        gap = max(0.04, 0.045 * math.log10(high / low))  # labels of lines that end close together are stacked
        placed = -math.inf
        for t, x, col, color in sorted(ends):
            placed = max(math.log10(t) + gap / 3, placed + gap)
            ax.annotate(col, (x, t), xytext=(x, 10 ** placed), textcoords="data", ha="right", fontsize=8,
                        color=color)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("one-way delay (ms); bandwidth as the network setting says")
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{fixed['model']} {fixed['shape']}, micro-batch {fixed['mb']}, batch {fixed['batch']}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"network-{fixed['model']}-mb{fixed['mb']}-{i}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def check_outputs(inputs: list[str], out: str | None, plots: str | None) -> str | None:
    """Why the report cannot write where it is asked to (one line), or None: the report never writes
    over what it reads (a records file, the predictions kept beside one) nor over a file that holds
    run records; ``--out`` is a file, ``--plots`` a directory."""
    if plots and Path(plots).exists() and not Path(plots).is_dir():
        return f"--plots {plots} is not a directory"
    if not out:
        return None
    if Path(out).is_dir():
        return f"--out {out} is a directory, not a file"
    read = [f for p in record_files(inputs) for f in (p, predictions_path(p))]
    same = next((f for f in read if f.exists() and Path(out).exists() and Path(out).samefile(f)), None)
    if same is not None:
        return f"--out {out} is {same}, which the report reads: give the report a file of its own"
    if Path(out).is_file() and read_records(out):
        return f"--out {out} holds run records: give the report a file of its own"
    return None


def _loss(text: str) -> float:
    """--target: a held-out loss, finite and > 0 (as the run command's --target-loss)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"a held-out loss is a finite number > 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", default=["results"], help="record files or directories (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--plots", default=None, help="write network plots (PNG) into this directory")
    ap.add_argument("--target", type=_loss, default=None,
                    help="the held-out loss of the time-to-quality tables, for runs recorded without --target-loss")
    ap.add_argument("--quality-target", action="store_true",
                    help="print only the quality race's target: the median held-out loss of the reference's runs "
                         "with eval points (one group of them) at their last eval, 3 decimals")
    args = ap.parse_args(argv)
    missing = [p for p in args.inputs if not Path(p).exists()]
    if missing:
        print(f"python report.py: error: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    bad = check_outputs(args.inputs, args.out, args.plots)
    if bad:
        print(f"python report.py: error: {bad}", file=sys.stderr)
        return 2
    records = load_records(args.inputs)
    if args.quality_target:
        targets = quality_targets(records)
        if len(targets) != 1:
            print(f"python report.py: error: --quality-target needs the reference's runs of one group, found "
                  f"{len(targets)}", file=sys.stderr)
            return 2
        print(f"{next(iter(targets.values()))['loss']:.3f}")
        return 0
    for warning in provenance(records)[1]:
        print(f"report.py: warning: {warning}", file=sys.stderr)
    text = render(records, args.target)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.plots:
        quality = plot_quality(records, Path(args.plots), args.target)
        for p in plot_networks(to_frame(records), Path(args.plots)) + quality:
            print(f"plot: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

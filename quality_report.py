"""Time to quality, from run records with eval points (``--eval-every``, ``contract.evaluation``):
what ``report.py`` shows for runs that race to a held-out loss.

- **Time to quality** per group of runs (same model, global batch, data, precision, learning rate and
  target loss): rows are the network settings, columns system and layout; a cell is the training
  wall time and tokens at the first eval at or below the target, the median over the group's
  repetitions (runs that differ only in ``--seed``) with their range, or "not reached in N steps".
  Time and tokens are read at eval points, so they are as fine as ``--eval-every``.
- **Bytes sent per token**: every rank's TCP payload bytes, summed, over the tokens trained, at the
  last eval point (the median over repetitions).
- **Which wins**: per network setting, the column with the shortest median time to the target among
  those that reached it in every repetition, its margin over the next (the ratio of medians, and
  the range of ratios over the repetitions' extremes).
- **Plots**: held-out loss against training wall time, one picture per network setting, one line
  per run, the target dashed.

The target is each run's ``--target-loss``; ``target`` (the report's ``--target``) overrides it for
runs recorded without one.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Callable

import pandas as pd

# A record's network setting as the report reads it: (what tells settings apart, its label, its sort
# key: rows go from the fastest network to the slowest). ``report.py`` passes its own reading.
NetworkOf = Callable[[dict], tuple[str, str, tuple[float, float]]]


def _plain_network(r: dict) -> tuple[str, str, tuple[float, float]]:
    """The setting's name alone, in the order given (what a caller without a reading of its own gets)."""
    return r["network"], r["network"], (0.0, 0.0)


def _layout(layout: dict) -> str:
    parts = [f"{k[0].upper()}-{layout[k]}" for k in ("tp", "pp", "dp") if layout.get(k, 1) > 1]
    return " ".join(parts) or "1 device"


def _group(r: dict) -> str:
    """What a table's runs share."""
    c = r.get("config") or {}
    shape = r["model_shape"]
    opt = c.get("optimizer") or {}
    corpus = (r.get("environment") or {}).get("corpus") or {}
    data = c.get("data") or "synthetic"
    if corpus.get("sha256"):
        data += f" (sha256 {corpus['sha256'][:12]})"
    return (f"model {r['model']} (L{shape['n_layer']} h{shape['n_embd']} a{shape['n_head']} s{shape['seq_len']}); "
            f"global batch {r['global_batch_size']}; data {data}; {r.get('precision', 'fp32')}; "
            f"{opt.get('kind', 'adam')} lr {opt.get('lr', 0):g}")


def to_frame(records: list[dict], target: float | None = None, network: NetworkOf = _plain_network) -> pd.DataFrame:
    """One row per ok run with eval points: its repetition group, column, network, target and
    what it reached."""
    rows = []
    for r in records:
        evals = r.get("evals") or []
        c = r.get("config") or {}
        goal = c.get("target_loss") if c.get("target_loss") is not None else target
        if r.get("status") != "ok" or not evals or goal is None:
            continue
        ident = json.loads(r["key"]) if r.get("key") else dict(c)
        ident.pop("seed", None)
        hit = next((e for e in evals if e["loss"] <= goal), None)
        last = evals[-1]
        setting, label, order = network(r)
        rows.append({
            "repetitions": json.dumps(ident, sort_keys=True), "timestamp": r.get("timestamp", ""),
            "seed": c.get("seed", 0), "group": _group(r), "target": goal,
            "column": f"{r.get('label') or r['system']} {_layout(r['layout'])}",
            "network": setting, "network_label": label, "order": order, "network_name": r["network"],
            "reached": hit is not None, "steps": last["step"],
            "time": hit["wall_time"] if hit else None, "tokens": hit["tokens"] if hit else None,
            "bytes_to_target": sum(hit["bytes_sent"]) if hit else None,
            "bytes_per_token": sum(last["bytes_sent"]) / last["tokens"] if last["tokens"] else None,
            "evals": evals,
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # the newest record of a repetition (same identity and seed) wins
    return (df.sort_values("timestamp", kind="stable").drop_duplicates(["repetitions", "seed"], keep="last")
            .reset_index(drop=True))


def _fmt_s(t: float) -> str:
    return f"{t:.1f} s" if t >= 10 else f"{t:.2f} s"


def _fmt_tokens(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def cell(runs: pd.DataFrame) -> str:
    """One column's runs at one network setting: median [range] time and tokens to the target."""
    reached = runs[runs["reached"]]
    n = len(runs)
    if reached.empty:
        return f"not reached in {int(runs['steps'].max())} steps" + (f" ({n} runs)" if n > 1 else "")
    times, tokens = reached["time"], reached["tokens"]
    text = f"{_fmt_s(statistics.median(times))}, {_fmt_tokens(statistics.median(tokens))} tokens"
    if len(reached) > 1:
        text += f" [{_fmt_s(times.min()).removesuffix(' s')}-{_fmt_s(times.max())}]"
    if len(reached) < n:
        text += f" ({len(reached)}/{n} reached)"
    elif n > 1:
        text += f" ({n} runs)"
    return text


def _ordered(g: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(network settings, fastest to slowest; columns, in recorded order)."""
    nets = list(g.sort_values("order", kind="stable")["network"].unique())
    cols = list(g.sort_values("timestamp", kind="stable")["column"].unique())
    return nets, cols


def _table(g: pd.DataFrame, value) -> str:
    nets, cols = _ordered(g)
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
    med = statistics.median(values)
    return f"{med:,.0f}" if med >= 10 else f"{med:.2f}"


def winners(g: pd.DataFrame) -> list[str]:
    """Per network setting: the fastest column to the target, by how much, with the spread."""
    lines = []
    nets, _ = _ordered(g)
    for net in nets:
        at = g[g["network"] == net]
        done = [(col, runs) for col, runs in at.groupby("column") if runs["reached"].all()]
        if not done:
            lines.append(f"- {at['network_label'].iloc[0]}: no column reached the target in every run")
            continue
        done.sort(key=lambda cr: statistics.median(cr[1]["time"]))
        best, runs = done[0]
        t = statistics.median(runs["time"])
        text = f"- {at['network_label'].iloc[0]}: `{best}` {_fmt_s(t)} (n={len(runs)})"
        if len(done) > 1:
            other, oruns = done[1]
            o = statistics.median(oruns["time"])
            lo, hi = oruns["time"].min() / runs["time"].max(), oruns["time"].max() / runs["time"].min()
            text += (f", **{o / t:.2f}x** faster than `{other}` ({_fmt_s(o)}, n={len(oruns)}; "
                     f"ratio over the extremes {lo:.2f}-{hi:.2f}x"
                     + (", the ranges overlap" if lo <= 1 else "") + ")")
        missed = [col for col, runs in at.groupby("column") if not runs["reached"].all()]
        if missed:
            text += "; not reached in every run: " + ", ".join(f"`{c}`" for c in missed)
        lines.append(text)
    return lines


def render(records: list[dict], target: float | None = None, network: NetworkOf = _plain_network) -> str:
    """The time-to-quality section ("" if no record has eval points and a target)."""
    df = to_frame(records, target, network)
    if df.empty:
        return ""
    parts = ["## Time to quality"]
    for (group, goal), g in df.groupby(["group", "target"], sort=False):
        parts += [f"### Held-out loss {goal:g}: {group}",
                  "Cells: training wall time and tokens to the first eval at or below the target (median over the "
                  "runs that differ only in seed, [range], runs); the time leaves out the harness's timing "
                  "barriers and the evals.",
                  _table(g, cell),
                  "Which wins:\n\n" + "\n".join(winners(g)),
                  f"#### Bytes sent per token: {group}",
                  "Every rank's TCP payload bytes, summed, over the tokens trained, at the last eval (median over "
                  "runs).",
                  _table(g, _bytes_cell)]
    return "\n\n".join(parts)


def plot(records: list[dict], directory: Path, target: float | None = None,
         network: NetworkOf = _plain_network) -> list[Path]:
    """Held-out loss against training wall time: one picture per group and network setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = to_frame(records, target, network)
    paths: list[Path] = []
    if df.empty:
        return paths
    for gi, ((group, goal), g) in enumerate(df.groupby(["group", "target"], sort=False)):
        nets, cols = _ordered(g)
        colors = {col: f"C{i % 10}" for i, col in enumerate(cols)}
        for net in nets:
            at = g[g["network"] == net]
            fig, ax = plt.subplots(figsize=(8, 4.8))
            for col in cols:
                for k, (_, run) in enumerate(at[at["column"] == col].iterrows()):
                    ev = run["evals"]
                    ax.plot([e["wall_time"] for e in ev], [e["loss"] for e in ev], color=colors[col], marker=".",
                            alpha=0.85, label=col if k == 0 else None)
            ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"target {goal:g}")
            ax.set_xscale("symlog", linthresh=1.0)  # runs seconds and minutes apart on one axis; linear below 1 s
            ax.set_xlim(left=0)
            ax.set_xlabel("training wall time (s, log above 1 s; timing barriers and evals left out)")
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{at['network_label'].iloc[0]}\n{group}", fontsize=8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            directory.mkdir(parents=True, exist_ok=True)
            stem = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in Path(at["network_name"].iloc[0]).stem)
            path = directory / f"quality-{gi}-{stem}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths

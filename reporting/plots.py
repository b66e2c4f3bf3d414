"""The report's pictures (``--plots``): step time against the network's delay, and the quality race's
held-out loss against wall time and against bytes sent."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from reporting.quality import quality_axes, quality_frame
from reporting.tables import table_groups


def _pyplot():
    """matplotlib's pyplot, drawing to files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, dpi: int) -> Path:
    """The picture written to ``path`` (its directory made where it is missing), and closed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def network_lines(df: pd.DataFrame) -> list[tuple[int, dict, dict[str, pd.DataFrame], list[str]]]:
    """What the network pictures draw, per network table (``reporting.tables.table_groups``) with at
    least two delays: (its index, its heading fields, per column (system and layout) the points in order
    of delay: ``delay`` (ms), ``bandwidth`` (Gbit/s), ``median`` step time (s) and ``low``/``high``, its
    repetitions' interval (``contract.estimate``; a single run: the median), and the settings left out,
    with why). A point is a setting of one plain link: a per-link matrix has no one delay, and a lossy,
    jittery or changing link is not the plain link at its delay."""
    out = []
    for i, (fixed, g) in enumerate(table_groups(df, emulated=True)):
        g = g[(g["status"] == "ok") & g["median_step_time"].notna()]
        other = g[~g["plain_link"]].drop_duplicates("setting")
        left = [f"{label}: " + ("its links differ, it has no one delay" if pd.isna(delay)
                                else "its link loses, jitters or changes: not a point of the plain link at its delay")
                for label, delay in zip(other["setting"], other["delay"])]
        g = g[g["plain_link"]]
        if g["delay"].nunique() < 2:
            out.append((i, fixed, {}, left))
            continue
        lines = {}
        for col, s in g.groupby("column", sort=False):
            s = s.sort_values("delay")
            lines[col] = pd.DataFrame({
                "delay": s["delay"].to_numpy(float), "bandwidth": s["bandwidth"].to_numpy(float),
                "median": s["median_step_time"].to_numpy(float),
                "low": [e.low if e.has_interval else e.median for e in s["estimate"]],
                "high": [e.high if e.has_interval else e.median for e in s["estimate"]]})
        out.append((i, fixed, lines, left))
    return out


def _axes(ax, lines: dict[str, pd.DataFrame]) -> None:
    """Both axes logarithmic, labelled in plain numbers: each delay point on x with its bandwidth under
    it, seconds on y (1, 2, 5 a decade; every digit where the times span less than two decades)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    points = pd.concat(lines.values())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(points["delay"].unique())
    labels = []
    for d in ticks:
        bandwidths = "/".join(f"{b:g}" for b in sorted(points[points["delay"] == d]["bandwidth"].dropna().unique()))
        labels.append(f"{d:g} ms\n{bandwidths} Gbit/s" if bandwidths else f"{d:g} ms")
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    decades = math.log10(points["high"].max() / points["low"].min())
    ax.yaxis.set_major_locator(LogLocator(subs=range(1, 10) if decades < 2 else (1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.margins(x=0.06, y=0.12)
    ax.set_xlabel("one-way delay (ms), and the link's bandwidth (Gbit/s)")
    ax.set_ylabel("step time (s), median; bars: interval")
    ax.grid(True, which="major", alpha=0.3)


def _label_ends(ax, ends: list[tuple[float, float, str, str]]) -> None:
    """Each line's name at its right end, inside the picture; names of lines that end close together stacked."""
    low, high = min(t for t, *_ in ends), max(t for t, *_ in ends)
    gap = max(0.04, 0.045 * math.log10(high / low))
    placed = -math.inf
    for t, x, col, color in sorted(ends):
        placed = max(math.log10(t) + gap / 3, placed + gap)
        ax.annotate(col, (x, t), xytext=(x, 10 ** placed), textcoords="data", ha="right", fontsize=8, color=color)


def plot_networks(df: pd.DataFrame, directory: Path) -> list[Path]:
    """One picture per network table with two delays or more (``network_lines``): the median step time
    (s, log) against the link's one-way delay (ms, log; each point's bandwidth, Gbit/s, under its delay),
    one line per system and layout, each point with its repetitions' interval as an error bar, each line
    named at its right end. The settings left out are told on stderr."""
    plt = _pyplot()
    paths = []
    for i, fixed, lines, left in network_lines(df):
        for why in left:
            print(f"plot: left out {why}", file=sys.stderr)
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.8))
        ends = []
        for col, p in lines.items():
            bars = ax.errorbar(p["delay"], p["median"], yerr=[p["median"] - p["low"], p["high"] - p["median"]],
                               marker="o", capsize=3, linewidth=1.5)
            ends.append((p["median"].iloc[-1], p["delay"].iloc[-1], col, bars.lines[0].get_color()))
        _label_ends(ax, ends)
        _axes(ax, lines)
        ax.set_title(f"{fixed['model']} {fixed['shape']}, micro-batch {fixed['mb']}, batch {fixed['batch']}"
                     + (f", {fixed['code']}" if fixed.get("code") else ""), fontsize=10)
        fig.tight_layout()
        paths.append(_save(plt, fig, directory / f"network-{fixed['model']}-mb{fixed['mb']}-{i}.png", dpi=110))
    return paths


def plot_quality(records: list[dict], directory: Path, target: float | None = None) -> list[Path]:
    """Held-out loss against training wall time, and against bytes sent (every rank's, summed): one
    picture each per group, a panel per network setting, one line per run (a step line where the
    evaluated weights change only at syncs), the target dashed."""
    plt = _pyplot()
    df = quality_frame(records, target)
    paths: list[Path] = []
    if df.empty:
        return paths
    for gi, ((group, goal), g) in enumerate(df.groupby(["group", "target"], sort=False)):
        nets, cols = quality_axes(g)
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
            paths.append(_save(plt, fig, directory / f"quality-{gi}-{kind}.png", dpi=100))
    return paths

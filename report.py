"""Turn run records into markdown tables shaped like the seed's GPT-3 XL results.

    python report.py [RESULTS_DIR_OR_FILES ...] [--out REPORT.md] [--plots DIR]

Reads only RunRecords (JSON lines). Tables:
- layout tables (one per system and fixed setting): rows = micro-batch size, columns = layouts
  written as in the seed (``T-8``, ``P-8``, ``T-4 P-2``), cells ``19.71 s`` or ``Fail (OOM)``;
- network tables: rows = network setting, columns = systems and DP degree;
- a summary of every run with tokens/s, MFU and memory.
Each table is headed by what is fixed (model, hardware, precision, recompute, batch).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

REQUIRED = ("system", "status", "model", "model_shape", "layout", "batch_size", "micro_batch_size", "network")
FAIL = {"oom": "Fail (OOM)", "error": "Fail (error)", "timeout": "Fail (timeout)"}


def load_records(paths: list[str]) -> list[dict]:
    """Every record in the files (directories: their *.jsonl); a line that is not a record is
    skipped with a warning on stderr."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    records = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(f"report.py: skipping {f}:{n}: not JSON", file=sys.stderr)
                continue
            missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
            if missing:
                print(f"report.py: skipping {f}:{n}: not a run record (no {', '.join(missing)})", file=sys.stderr)
                continue
            records.append(rec)
    return records


def layout_label(layout: dict, system: str = "") -> str:
    parts = [f"{k[0].upper()}-{layout[k]}" for k in ("tp", "pp", "dp") if layout.get(k, 1) > 1]
    return " ".join(parts) or "1 device"


def network_label(name: str) -> str:
    try:
        from network_emulation.profiles import parse_profile

        return parse_profile(name).label
    except Exception:
        return name


def network_order(name: str) -> tuple[float, float]:
    """Rows go from the fastest network to the slowest: by delay, then by falling bandwidth."""
    try:
        from network_emulation.profiles import parse_profile

        link = parse_profile(name).link(0, 1)
    except Exception:
        return (float("inf"), 0.0)
    return (-1.0, 0.0) if link is None else (link.delay_ms, -link.bandwidth_gbps)


def fmt_time(t: float | None) -> str:
    if t is None or t != t:
        return ""
    return f"{t:.2f} s" if t >= 1 else f"{t:.3f} s"


def cell(row: pd.Series) -> str:
    return fmt_time(row["median_step_time"]) if row["status"] == "ok" else FAIL.get(row["status"], row["status"])


def to_frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        env = r.get("environment") or {}
        rows.append({
            "key": r.get("key") or json.dumps(r.get("config"), sort_keys=True),
            "timestamp": r.get("timestamp", ""),
            "system": r.get("label") or r["system"],
            "model": r["model"],
            "shape": "L{n_layer} h{n_embd} a{n_head} s{seq_len}".format(**r["model_shape"]),
            "hardware": str(env.get("device_name", env.get("device_kind", "?"))),
            "devices": env.get("device_count"),
            "precision": r["precision"],
            "recompute": "recompute" if r["recompute"] else "no recompute",
            "batch": r["batch_size"],
            "global_batch": r["global_batch_size"],
            "mb": r["micro_batch_size"],
            "layout": layout_label(r["layout"]),
            "dp": r["layout"].get("dp", 1),
            "network": r["network"],
            "status": r["status"],
            "median_step_time": r.get("median_step_time"),
            "tokens_per_s": r.get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "peak_mem_mb": max(r.get("peak_memory_bytes") or [0]) / 2**20,
            "dp_sync_time": r.get("dp_sync_time"),
            "details": r.get("details") or "",
            "error": r.get("error") or "",
        })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # The newest record of the same configuration wins (a re-run replaces an older measurement).
    return df.sort_values("timestamp").drop_duplicates("key", keep="last").reset_index(drop=True)


def heading(fixed: dict) -> str:
    return "; ".join(f"{k}: {v}" for k, v in fixed.items())


def markdown(df: pd.DataFrame) -> str:
    return df.to_markdown(tablefmt="github")


def layout_tables(df: pd.DataFrame) -> list[str]:
    out = []
    keys = ["system", "model", "shape", "hardware", "precision", "recompute", "batch", "network"]
    for fixed, g in df.groupby(keys, sort=False):
        fixed = dict(zip(keys, fixed))
        table = g.assign(cell=g.apply(cell, axis=1)).pivot_table(
            index="mb", columns="layout", values="cell", aggfunc="last").fillna("")
        table.index.name = "Micro batch size"
        table.columns.name = None
        fixed["network"] = network_label(fixed["network"])
        out.append(f"### {fixed.pop('system')}: layouts\n\n{heading(fixed)}\n\n" + markdown(table))
    return out


def network_tables(df: pd.DataFrame) -> list[str]:
    out = []
    keys = ["model", "shape", "hardware", "precision", "recompute", "batch", "mb"]
    for fixed, g in df.groupby(keys, sort=False):
        if g["network"].nunique() < 2:
            continue
        fixed = dict(zip(keys, fixed))
        g = g.assign(cell=g.apply(cell, axis=1), column=g["system"] + " " + g["layout"],
                     order=g["network"].map(network_order), setting=g["network"].map(network_label))
        g = g.sort_values("order")
        table = g.pivot_table(index="setting", columns="column", values="cell", aggfunc="last").fillna("")
        table = table.reindex(g["setting"].unique())
        table.index.name = "Network setting"
        table.columns.name = None
        out.append(f"### Step time by network setting\n\n{heading(fixed)}\n\n" + markdown(table))
    return out


def summary_table(df: pd.DataFrame) -> str:
    cols = ["system", "model", "layout", "devices", "mb", "batch", "network", "status", "median_step_time", "tokens_per_s", "mfu",
            "peak_mem_mb", "dp_sync_time", "details"]
    t = df[cols].copy()
    t["median_step_time"] = t["median_step_time"].map(fmt_time)
    t["tokens_per_s"] = t["tokens_per_s"].map(lambda v: f"{v:,.0f}" if v == v and v is not None else "")
    t["mfu"] = t["mfu"].map(lambda v: f"{v:.1%}" if v == v and v is not None else "")
    t["peak_mem_mb"] = t["peak_mem_mb"].map(lambda v: f"{v:,.0f}")
    t["dp_sync_time"] = t["dp_sync_time"].map(lambda v: fmt_time(v) if v else "")
    t["network"] = t["network"].map(network_label)
    return "### All runs\n\n" + t.to_markdown(index=False, tablefmt="github")


def failures(df: pd.DataFrame) -> str:
    bad = df[df["status"] != "ok"]
    if bad.empty:
        return ""
    lines = [f"- {r.system} {r.layout} mb={r.mb} ({network_label(r.network)}): {r.status}: {r.error[:200]}"
             for r in bad.itertuples()]
    return "### Failed runs\n\n" + "\n".join(lines)


def plot_networks(df: pd.DataFrame, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = df[df["status"] == "ok"]
    for i, ((model, mb), g) in enumerate(ok.groupby(["model", "mb"])):
        if g["network"].nunique() < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for col, s in g.assign(column=g["system"] + " " + g["layout"], order=g["network"].map(network_order)).groupby("column"):
            s = s.sort_values("order")
            ax.plot(s["network"].map(network_label), s["median_step_time"], marker="o", label=col)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{model}, micro-batch {mb}")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=8)
        fig.tight_layout()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"network-{model}-mb{mb}-{i}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def render(records: list[dict]) -> str:
    df = to_frame(records)
    if df.empty:
        return "No run records found.\n"
    parts = ["# Results", *network_tables(df), *layout_tables(df), summary_table(df), failures(df)]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", default=["results"], help="record files or directories (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--plots", default=None, help="write network plots (PNG) into this directory")
    args = ap.parse_args(argv)
    missing = [p for p in args.inputs if not Path(p).exists()]
    if missing:
        print(f"python report.py: error: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = load_records(args.inputs)
    text = render(records)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.plots:
        for p in plot_networks(to_frame(records), Path(args.plots)):
            print(f"plot: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

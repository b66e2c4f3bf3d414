"""Turn run records into a report that answers first, then shows tables shaped like the seed's GPT-3 XL results.

    pipebench report [RESULTS_DIR_OR_FILES ...] [--out REPORT.md] [--plots DIR]    (or python report.py ...)

The command over the ``reporting`` package, which makes the report: it reads run records only (a
directory: its ``*.jsonl`` files that hold run records; the others are counted in one line), makes
claims like for like and within one code commit, and prints the summary, the layout and network
tables, time to quality, every run and the failures. ``--out`` also writes it to a file, ``--plots``
draws its pictures into a directory; the report never writes over what it reads.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from contract.cli import Parser, cannot_create_in, cannot_write_file
from contract.records import predictions_path, read_records, record_files
from reporting import load_records, plot_networks, plot_quality, quality_targets, render, to_frame
from reporting.summary import provenance


def check_outputs(inputs: list[str], out: str | None, plots: str | None) -> str | None:
    """Why the report cannot write where it is asked to (one line), or None: the report never writes
    over what it reads (a records file, the predictions kept beside one) nor over a file that holds
    run records; ``--out`` is a file, ``--plots`` a directory."""
    if plots and Path(plots).exists() and not Path(plots).is_dir():
        return f"--plots {plots} is not a directory"
    if plots and (why := cannot_create_in(Path(plots))):
        return f"--plots {plots}: {why}"
    if not out:
        return None
    if why := cannot_write_file(out, "--out"):
        return why
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


def parser(prog: str = "python report.py") -> argparse.ArgumentParser:
    ap = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", default=["results"], help="record files or directories (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--plots", default=None, help="write network plots (PNG) into this directory")
    ap.add_argument("--target", type=_loss, default=None,
                    help="the held-out loss of the time-to-quality tables, for runs recorded without --target-loss")
    ap.add_argument("--quality-target", action="store_true",
                    help="print only the quality race's target: the median held-out loss of the reference's runs "
                         "with eval points (one group of them) at their last eval, 3 decimals")
    return ap


def main(argv: list[str] | None = None, prog: str = "python report.py") -> int:
    """The command; ``prog``: the command as typed (``pipebench report`` through pipebench), which its
    usage and error lines name."""
    args = parser(prog).parse_args(argv)

    def fail(why: str) -> int:
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 2

    missing = [p for p in args.inputs if not Path(p).exists()]
    if missing:
        return fail(f"no such file or directory: {', '.join(missing)}")
    bad = check_outputs(args.inputs, args.out, args.plots)
    if bad:
        return fail(bad)
    name = prog.removeprefix("python ")  # the warnings' prefix: the command, not the interpreter
    records = load_records(args.inputs, name=name)
    if args.quality_target:
        targets = quality_targets(records)
        if len(targets) != 1:
            return fail(f"--quality-target needs the reference's runs of one group, found {len(targets)}")
        print(f"{next(iter(targets.values()))['loss']:.3f}")
        return 0
    for warning in provenance(records)[1]:
        print(f"{name}: warning: {warning}", file=sys.stderr)
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

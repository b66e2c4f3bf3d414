"""Where slicing along the tokens starts to pay: ``python -m bench seq-sweep``.

ours (``--ours``: the planner's slicing by default) against every Torch Pipe schedule that can run the
batch (the run command's own judgement decides; a schedule it refuses is said on stderr), across
sequence lengths, at each batch per pipeline (micro-batch 1), for each model family at one tiny
width: ``--layers`` layers of ``--hidden`` with ``--heads`` heads (llama: ``--kv-heads`` key/value
heads, its SwiGLU MLP of 2/3 of 4h rounded up to 256, which at hidden 128 is gpt's 4h), on P stages.
Per (family, sequence, batch) the configurations are launched round-robin (``bench.sittings``), each
launch the real run command; the fastest baseline schedule by median step time is ours' comparator,
and the comparison is the median of the ratios of their neighbouring launches with its interval
(``contract.estimate.paired``: min-max below 8 pairs), a claim only where the interval leaves out 1.
Slicing pays from the shortest sequence at which ours is faster beyond noise and stays so at every
longer one run.

At a tiny width attention's cost (s^2 h per layer) overtakes the linears' (s h^2) early, and a 32k
sequence is mostly attention: the later a token slice, the more context it attends to, which the
planner's unequal slices absorb. Peak memory per rank is each launch's RSS, the largest over the
repetitions.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from tabulate import tabulate

from bench import cannot_run
from bench.sittings import Sitting, megabytes, run_alternating
from contract.estimate import INTERVAL_RULE, PAIRED_RULE
from contract.cli import NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, count_or_word

FAMILIES = {"gpt": "tiny", "llama": "llama-tiny"}  # each family's named model; every dimension is overridden
SEQS = (1024, 2048, 4096, 8192, 16384, 32768)


def model_args(family: str, seq: int, opts: argparse.Namespace) -> list[str]:
    """The run command's model flags for ``family`` at ``seq`` tokens and the sweep's width."""
    args = ["--model", FAMILIES[family], "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
            "--num-heads", str(opts.heads), "--seq-length", str(seq), "--vocab-size", str(opts.vocab)]
    return args + (["--kv-heads", str(opts.kv_heads)] if family == "llama" else [])


def configurations(batch: int, common: list[str], opts: argparse.Namespace, where: str) -> dict[str, list[str]]:
    """Every Torch Pipe schedule that can run the batch, then ours at each ``--ours`` slicing."""
    layout = ["--pp", str(opts.pp), "--batch-size", str(batch), "--micro-batch-size", "1"]
    configs = {}
    for schedule in opts.schedules:
        args = ["--system", "torch_pipe", "--schedule", schedule, *layout]
        why = cannot_run(args + common)
        if why:
            print(f"{where}batch {batch}: torch_pipe {schedule} skipped: {why}", file=sys.stderr, flush=True)
            continue
        configs[f"torch_pipe {schedule}"] = args
    for k in opts.ours:
        configs[f"ours K={k}"] = ["--system", "ours", "--n-slices", str(k), *layout]
    return configs


def slice_count_of(details: str) -> str:
    """'K=42' from ours' details ('auto, planner: K=42 (2304,...)'), else the details."""
    m = re.search(r"K=\d+", details)
    return m.group(0) if m else details


def compare(s: Sitting) -> dict | None:
    """The fastest baseline and the fastest ours of a sitting (by median step time), and their paired ratio."""
    baselines = sorted((s.median(n), n) for n in s.runs if n.startswith("torch_pipe") and s.median(n))
    ours = sorted((s.median(n), n) for n in s.runs if n.startswith("ours") and s.median(n))
    if not baselines or not ours:
        return None
    (base_t, base), (ours_t, mine) = baselines[0], ours[0]
    ks = "/".join(sorted({slice_count_of(r.details) for r in s.ok(mine)}))
    asked = mine.removeprefix("ours K=")
    return dict(base=base, ours=mine, ks=f"{asked}, {ks}" if asked in ("auto", "search") else f"K={asked}",
                ratio=base_t / ours_t, paired=s.paired(base, mine))


def pays_from(points: list[tuple[int, dict | None]]) -> int | None:
    """The shortest sequence from which on ours is faster beyond noise at every longer sequence run."""
    start = None
    for seq, c in sorted(points, key=lambda p: p[0]):
        faster = c is not None and c["paired"] is not None and c["paired"].separated and c["paired"].ratio.low > 1
        start = (start or seq) if faster else None
    return start


def run(opts: argparse.Namespace) -> int:
    command = "python -m bench " + shlex.join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    capacities: list[float] = []
    sittings: dict[tuple[str, int, int], Sitting] = {}
    for family in opts.families:
        for seq in opts.seq:
            common = model_args(family, seq, opts) + ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
            where = f"{family} s={seq} "
            for batch in opts.batch:
                if opts.max_tokens and seq * batch > opts.max_tokens:
                    print(f"{where}batch {batch}: skipped ({seq * batch} tokens a step, over --max-tokens "
                          f"{opts.max_tokens})", file=sys.stderr, flush=True)
                    continue
                configs = configurations(batch, common, opts, where)
                sittings[family, seq, batch] = run_alternating(batch, configs, common, opts, capacities, where)

    rows, summary, pays = [], [], []
    for (family, seq, batch), s in sittings.items():
        for name in s.runs:
            ks = "/".join(sorted({slice_count_of(r.details) for r in s.ok(name)})) if name.startswith("ours") else ""
            rows.append([family, seq, batch, name, ks, s.ms(name), len(s.ok(name)), megabytes(s.peak_memory(name))])
        c = compare(s)
        if c is None:
            summary.append([family, seq, batch, "-", "-", "-", "-", "-", "-", "no comparison: a side failed"])
            continue
        p = c["paired"]
        verdict = "-" if p is None else (("ours faster" if p.ratio.low > 1 else "ours slower") if p.separated
                                         else "no difference beyond noise")
        summary.append([family, seq, batch, c["base"].removeprefix("torch_pipe "), s.ms(c["base"]), c["ks"],
                        s.ms(c["ours"]), f"{c['ratio']:.2f}x", p.describe() if p else "-", verdict])
    for family in opts.families:
        for batch in opts.batch:
            points = [(seq, compare(sittings[family, seq, batch])) for seq in opts.seq
                      if (family, seq, batch) in sittings]
            start = pays_from(points)
            if start is None:
                pays.append(f"{family}, batch {batch}: ours is not faster beyond noise at the longest sequences run")
                continue
            ratios = [c["paired"].ratio.median for seq, c in points if seq >= start]
            pays.append(f"{family}, batch {batch}: ours faster beyond noise from {start} tokens on (paired "
                        f"{min(ratios):.2f}x to {max(ratios):.2f}x over {len(ratios)} sequence length(s))")

    kv = f", llama {opts.kv_heads} key/value heads" if "llama" in opts.families else ""
    cores = f"; the machine check: {min(capacities):.2f}-{max(capacities):.2f} effective cores of {opts.pp}" \
        if capacities else ""
    text = "\n".join([
        f"# {command}",
        f"# {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads{kv}, vocabulary {opts.vocab}; P={opts.pp}, "
        f"micro-batch 1, {opts.reps} round-robin launches of each configuration, {opts.steps} measured step(s) after "
        f"{opts.warmup} warm-up each" + (f"; steps of more than {opts.max_tokens} tokens not run"
                                         if opts.max_tokens else ""),
        f"# the host's load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{os.cpu_count()} cores{cores}",
        f"# step ms: {INTERVAL_RULE}",
        f"# paired: {PAIRED_RULE}",
        "",
        tabulate(rows, headers=["family", "seq", "batch", "config", "ours' K", "step ms", "runs", "peak MB per rank"],
                 tablefmt="github"),
        "",
        "per sequence and batch: the fastest baseline schedule against ours (ratio: of the medians; paired: "
        "the baseline's / ours' step time over neighbouring launches)",
        "",
        tabulate(summary, headers=["family", "seq", "batch", "best baseline", "ms", "ours", "ms", "ratio", "paired",
                                   "beyond noise?"], tablefmt="github"),
        "",
        *pays,
        ""])
    print(text)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(text)
    return 0


def fill_parser(p: argparse.ArgumentParser) -> None:
    from baselines.torch_pipe import SCHEDULES
    from ours import slice_count

    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--seq", type=POSITIVE_INT, nargs="+", default=list(SEQS), help="sequence lengths (tokens)")
    p.add_argument("--batch", type=POSITIVE_INT, nargs="+", default=[1, 2], help="batch sizes per pipeline")
    p.add_argument("--layers", type=POSITIVE_INT, default=2)
    p.add_argument("--hidden", type=POSITIVE_INT, default=128)
    p.add_argument("--heads", type=POSITIVE_INT, default=4)
    p.add_argument("--kv-heads", type=POSITIVE_INT, default=2, help="llama's key/value heads")
    p.add_argument("--vocab", type=POSITIVE_INT, default=512)
    p.add_argument("--pp", type=POSITIVE_INT, default=2)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   help="the Torch Pipe schedules (each where it can run the batch and the layers)")
    p.add_argument("--ours", type=count_or_word(slice_count, 1), nargs="+", default=["auto"], metavar="K|auto",
                   help="ours' token slice counts (default: auto, the planner's slicing)")
    p.add_argument("--max-tokens", type=NONNEGATIVE_INT, default=0,
                   help="skip a sequence and batch whose step holds more tokens than this (0: none skipped)")
    p.add_argument("--reps", type=POSITIVE_INT, default=3, help="round-robin launches of every configuration")
    p.add_argument("--steps", type=POSITIVE_INT, default=2, help="measured steps per launch")
    p.add_argument("--warmup", type=NONNEGATIVE_INT, default=1)
    p.add_argument("--timeout", type=POSITIVE, default=1800.0, help="seconds before a launch is stopped")
    p.add_argument("--no-capacity-check", action="store_true",
                   help="skip measuring, before each repetition, how many cores the machine really gives at once")
    p.add_argument("--out", help="also write the tables to this file")

"""network-slope: how many one-way network delays each system pays per training step.

Runs every configuration (ours P-2; ours P-2 D-2 with each DP mode; torch_pipe GPipe and 1F1B P-2) at
two or more one-way delays with one fixed bandwidth, each rank on a virtual host of the local virtual
cluster (``--network "delay Xms bandwidth YGbps"``; needs root), side by side in one invocation: the
order of (configuration, delay) runs is reversed on every other repetition, so that drifts of a shared
machine hit all alike. Each run is the real run command in a subprocess (``runners.invoke``) writing its record to a
temporary file (``run_record``).

For each configuration it fits, by least squares over every run, the record's median step time
against the one-way delay; the slope (seconds per second of delay) is the number of delays the step
pays. The same fit of the record's ``dp_sync_time`` and ``barrier_time`` (the step's closing
barrier, as waited by the last rank to reach it) splits it; the rest is the schedule (the pipeline's
own messages, and the barrier's signal on its way to the ranks that reached it first: the timing
barrier, ``contract.rank.StepBarrier``, pays one delay per round, and the last rank to arrive
leaves it at once). A step that
hides a delay behind computation pays less than one, so fit over delays large against a step's
computation (the tiny model: 10 ms and up).

For the data-parallel configurations it also prints the DP sync against the wire: the bytes the sync
must move over the busiest host's link (both directions: for a central PS the server's link carries
the pushes and the pulls of D-1 replicas, 2(D-1)M for M bytes of a stage's parameters; for the
sharded PS and the ring all-reduce each host sends and receives 2(D-1)/D M) divided by the bandwidth.

    python -m bench.network_slope --delays 20 80 160 --bandwidth 10 --keep runs.jsonl    (tiny model)
    python -m bench.network_slope --from-records runs.jsonl                    (the tables again)
    python -m bench.network_slope --model cpu-small --bandwidth 1 --delays 1 10 \
        --configs allreduce central_ps sharded_ps -- --seq-length 16             (DP sync against the wire)

On a loaded machine the computation in a step varies from run to run far more than the delays do;
the column "fastest" fits the fastest step of each run instead of its median (a delay is paid by
every step, a preemption by some), which is steadier there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from contract.records import read_records
from runners.invoke import run_command
from contract.estimate import estimate
from contract.cli import NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT

DP_MODES = ("allreduce", "central_ps", "sharded_ps")
CONFIG_KEYS = ("ours", *DP_MODES, "gpipe", "1f1b")


@dataclass(frozen=True)
class BenchConfig:
    key: str  # what --configs selects
    label: str
    args: tuple[str, ...]  # run-command arguments besides the common ones
    dp: int = 1
    dp_mode: str | None = None


def bench_configs(pp: int, dp: int, n_slices: int) -> list[BenchConfig]:
    ours = ("--system", "ours", "--pp", str(pp), "--n-slices", str(n_slices))
    out = [BenchConfig("ours", f"ours P-{pp}", ours)]
    for mode in DP_MODES:
        out.append(BenchConfig(mode, f"ours P-{pp} D-{dp} {mode}", (*ours, "--dp", str(dp), "--dp-mode", mode), dp,
                               mode))
    for schedule, name in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        out.append(BenchConfig(schedule, f"torch_pipe {name} P-{pp}",
                               ("--system", "torch_pipe", "--pp", str(pp), "--schedule", schedule)))
    return out


@dataclass(frozen=True)
class Sample:
    delay_ms: float
    step: float
    dp_sync: float
    barrier: float | None
    fastest: float | None = None  # the run's fastest step


@dataclass(frozen=True)
class Slope:
    """Delays paid per step (seconds of step per second of one-way delay), by part."""

    total: float
    dp_sync: float
    barrier: float | None

    @property
    def schedule(self) -> float | None:
        return None if self.barrier is None else self.total - self.dp_sync - self.barrier


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (needs two distinct xs)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs runs at two different delays at least")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def slope_of(samples: list[Sample]) -> Slope:
    xs = [s.delay_ms * 1e-3 for s in samples]
    total = fit_slope(xs, [s.step for s in samples])
    dp = fit_slope(xs, [s.dp_sync for s in samples])
    barrier = None
    if all(s.barrier is not None for s in samples):
        barrier = fit_slope(xs, [s.barrier for s in samples])
    return Slope(total, dp, barrier)


def busiest_link_bytes(mode: str, dp: int, stage_bytes: float) -> float:
    """Bytes one DP sync of a stage (``stage_bytes`` of parameters) moves over the busiest host's link,
    both directions counted (see the module docstring)."""
    if dp == 1:
        return 0.0
    if mode == "central_ps":
        return 2 * (dp - 1) * stage_bytes
    if mode in ("sharded_ps", "allreduce"):
        return 4 * (dp - 1) / dp * stage_bytes
    raise ValueError(f"unknown dp mode {mode!r}")


def stage_param_counts(model: str, pp: int, overrides: dict[str, int]) -> list[int]:
    """Parameters held by each of the pp stages (built on the meta device: no memory, no init)."""

    from workload.configs import get_model_config
    from workload.model import meta_gpt
    from workload.partition import stage_specs

    cfg = get_model_config(model).with_overrides(**overrides)
    counts = []
    for spec in stage_specs(cfg.n_layer, pp):
        m = meta_gpt(cfg)
        n = sum(p.numel() for name, p in m.named_parameters()
                if (not name.startswith("blocks.") or spec.first_layer <= int(name.split(".")[1]) < spec.end_layer)
                and (spec.is_first or not name.startswith(("wte.", "wpe.")))
                and (spec.is_last or not name.startswith(("ln_f.", "lm_head."))))
        counts.append(n)
    return counts


def run_record(args: list[str], timeout: float) -> dict | None:
    """The run command with ``args``; its record (None if the run failed)."""
    inv = run_command(args, timeout=timeout)
    rec = inv.record or {}
    if inv.returncode != 0 or rec.get("status") != "ok" or rec.get("median_step_time") is None:
        print(f"  run failed ({' '.join(args)}): {str(rec.get('error') or inv.last_line)[:500]}", file=sys.stderr)
        return None
    return rec


def config_of(rec: dict) -> BenchConfig:
    """The bench configuration a record was run as (its label as ``bench_configs`` names it)."""
    pp, dp = rec["layout"]["pp"], rec["layout"].get("dp", 1)
    if rec["system"] not in ("ours", "torch_pipe"):
        raise ValueError(f"{rec['system']} is not one of the bench's systems")
    if rec["system"] == "torch_pipe":
        schedule = rec["options"]["schedule"]
        name = {"gpipe": "GPipe", "1f1b": "1F1B"}.get(schedule, schedule)
        return BenchConfig(schedule, f"torch_pipe {name} P-{pp}", ())
    if dp == 1:
        return BenchConfig("ours", f"ours P-{pp}", ())
    mode = rec["options"]["dp_mode"]
    return BenchConfig(mode, f"ours P-{pp} D-{dp} {mode}", (), dp, mode)


def _bench_records(path: str) -> list[dict]:
    """The records of ``path`` that are runs of the bench's configurations (``config_of``) over a link it can
    read (``link_of``); lines that are not records, and records of other runs, are told on stderr (the
    latter counted, with the first few) and skipped."""
    def warn(why: str) -> None:
        print(f"network-slope: {why}", file=sys.stderr)

    kept, others = [], []
    for n, rec in enumerate(read_records(path, warn=warn), 1):
        try:
            config_of(rec), link_of(rec)
        except (KeyError, TypeError, ValueError) as exc:
            others.append(f"record {n} ({rec.get('label') or rec['system']}: {type(exc).__name__}: {exc})")
            continue
        kept.append(rec)
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        warn(f"{path}: {len(others)} record(s) not of the bench's configurations skipped: "
             f"{'; '.join(others[:3])}{more}")
    return kept


def link_of(rec: dict) -> tuple[float, float]:
    """(one-way delay ms, bandwidth Gbit/s) the record's network profile asked for."""
    from network_emulation.profiles import parse_profile

    link = parse_profile(rec["network"]).link(0, 1)
    if link is None:
        raise ValueError(f"network {rec['network']!r} is no emulated link")
    return link.delay_ms, link.bandwidth_gbps


def sample_of(rec: dict) -> Sample:
    return Sample(link_of(rec)[0], rec["median_step_time"], rec.get("dp_sync_time") or 0.0, rec.get("barrier_time"),
                  rec.get("min_step_time"))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _table(rows: list[list[str]], headers: list[str]) -> str:
    """A table as aligned text (``tabulate``): the configuration on the left, its numbers right-aligned."""
    return tabulate(rows, headers=headers, tablefmt="presto", disable_numparse=True,
                    colalign=("left",) + ("right",) * (len(headers) - 1))


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def report(records: list[dict], wire_bytes: int, loads: list[float]) -> None:
    """Print the delays-paid table and the DP-sync-against-the-wire table of these records."""
    by_label: dict[str, tuple[BenchConfig, list[dict]]] = {}
    for rec in records:
        c = config_of(rec)
        by_label.setdefault(c.label, (c, []))[1].append(rec)
    delays = sorted({link_of(r)[0] for r in records})
    bandwidths = sorted({link_of(r)[1] for r in records})
    r0 = records[0]
    reps = max(sum(1 for r in rs if link_of(r)[0] == d) for _, rs in by_label.values() for d in delays)
    shape = r0["model_shape"]
    print(f"\nDelays paid per step: {r0['model']} ({shape['n_layer']} layers, hidden {shape['n_embd']}, sequence "
          f"{shape['seq_len']}), batch {r0['batch_size']}, micro-batch "
          f"{r0['micro_batch_size']}, K = {len(r0['options'].get('slices') or [1])}, "
          f"{'/'.join(f'{b:g}' for b in bandwidths)} Gbit/s, up to {reps} repetitions (step ms: median over "
          f"repetitions of the record's median step; delays paid: least-squares slope of step time against "
          f"one-way delay, split into schedule, DP sync and closing barrier; fastest: the same fit of each "
          f"run's fastest step)")
    head = [f"{d:g} ms" for d in delays]

    def medians(rs: list[dict], key) -> list[float | None]:
        out = []
        for d in delays:
            v = [key(r) for r in rs if link_of(r)[0] == d]
            out.append(estimate(v).median if v else None)  # the report's statistics (contract.estimate)
        return out

    rows = []
    for c, rs in by_label.values():
        ss = [sample_of(r) for r in rs]
        cells = [_ms(m) for m in medians(rs, lambda r: r["median_step_time"])]
        if len({s.delay_ms for s in ss}) < 2:
            rows.append([c.label, *cells, "-", "-", "-", "-", "-", str(len(ss))])
            continue
        sl = slope_of(ss)
        fastest = None
        if all(s.fastest is not None for s in ss):
            fastest = fit_slope([s.delay_ms * 1e-3 for s in ss], [s.fastest for s in ss])
        rows.append([c.label, *cells, f"{sl.total:.1f}", _num(sl.schedule), f"{sl.dp_sync:.1f}", _num(sl.barrier),
                     _num(fastest), str(len(ss))])
    print(_table(rows, ["configuration", *head, "delays paid", "schedule", "DP sync", "barrier", "fastest", "runs"]))

    dp_configs = [(c, rs) for c, rs in by_label.values() if c.dp > 1]
    if not dp_configs:
        return
    print(f"\nDP sync against the wire (bound = bytes over the busiest host's link / bandwidth, at {wire_bytes} "
          f"bytes per parameter; DP sync: the record's, the slowest rank's per step)")
    rows = []
    for c, rs in dp_configs:
        shape = rs[0]["model_shape"]
        overrides = {k: shape[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size")}
        stage_bytes = max(stage_param_counts(rs[0]["model"], rs[0]["layout"]["pp"], overrides)) * wire_bytes
        bound = busiest_link_bytes(c.dp_mode, c.dp, stage_bytes) * 8 / (link_of(rs[0])[1] * 1e9)
        meds = medians(rs, lambda r: r.get("dp_sync_time") or 0.0)
        ratios = ", ".join("-" if m is None else f"{m / bound:.2f}x" for m in meds)
        rows.append([c.label, f"{stage_bytes / 2**20:.1f}", f"{bound * 1e3:.1f}", *map(_ms, meds), ratios])
    print(_table(rows, ["configuration", "stage MiB", "bound ms", *head, "DP sync / bound (each delay)"]))
    if loads:
        print(f"load average (1 min) at each repetition's start and at the end: {', '.join(f'{l:.2f}' for l in loads)}")


def run(opts: argparse.Namespace) -> int:
    if opts.from_records:
        records = []
        for path in opts.from_records:
            if not Path(path).is_file():
                what = "a directory, not a records file" if Path(path).is_dir() else "no such file"
                print(f"network-slope: error: --from-records {path}: {what}", file=sys.stderr)
                return 2
            records += _bench_records(path)
        records = [r for r in records if r.get("status") == "ok" and r.get("median_step_time") is not None]
        if not records:
            print("network-slope: error: no successful runs of the bench's configurations in the records given",
                  file=sys.stderr)
            return 2
        report(records, opts.wire_bytes, [])
        return 0
    if len(set(opts.delays)) < 2:
        print("network-slope: error: --delays needs two different delays at least", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("network-slope: error: the runs use the local virtual cluster (--network), which needs root",
              file=sys.stderr)
        return 2
    run_args = [a for a in opts.run_args if a != "--"]
    configs = [c for c in bench_configs(opts.pp, opts.dp, opts.n_slices) if c.key in opts.configs]
    common = ["--model", opts.model, "--batch-size", str(opts.batch_size), "--micro-batch-size",
              str(opts.micro_batch_size),
              "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--timeout", str(opts.timeout), *run_args]
    plan = [(c, d) for c in configs for d in opts.delays]
    records: list[dict] = []
    loads: list[float] = []
    for rep in range(opts.start_rep, opts.start_rep + opts.reps):
        loads.append(os.getloadavg()[0])
        print(f"rep {rep + 1}: load average {loads[-1]:.2f}", file=sys.stderr, flush=True)
        for c, d in (plan if rep % 2 == 0 else plan[::-1]):  # alternate, so drifts hit all alike
            network = f"delay {d:g}ms bandwidth {opts.bandwidth:g}Gbps"
            rec = run_record([*c.args, *common, "--network", network], opts.timeout + 120)
            if rec is None:
                continue
            if opts.keep:
                with open(opts.keep, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            records.append(rec)
            s = sample_of(rec)
            print(f"  {c.label} at {d:g} ms: step {_ms(s.step)} ms, dp sync {_ms(s.dp_sync)} ms, "
                  f"closing barrier {_ms(s.barrier)} ms", file=sys.stderr, flush=True)
    loads.append(os.getloadavg()[0])
    if not records:
        print("network-slope: every run failed", file=sys.stderr)
        return 1
    report(records, opts.wire_bytes, loads)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``network-slope`` on a bench command line's subparsers."""
    p = subparsers.add_parser("network-slope", help="delays paid per step by each system on a slow network",
                              description=__doc__.split("\n\n")[0])
    fill_parser(p)
    return p


def fill_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delays", type=NONNEGATIVE, nargs="+", default=[20.0, 80.0, 160.0], help="one-way delays in ms")
    p.add_argument("--bandwidth", type=POSITIVE, default=10.0, help="Gbit/s of every link")
    p.add_argument("--configs", nargs="+", choices=CONFIG_KEYS, default=list(CONFIG_KEYS),
                   help="which configurations to run (default: all)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=2, help="batch per pipeline")
    p.add_argument("--micro-batch-size", type=POSITIVE_INT, default=1)
    p.add_argument("--n-slices", type=POSITIVE_INT, default=4, help="ours' token slices K")
    p.add_argument("--pp", type=POSITIVE_INT, default=2)
    p.add_argument("--dp", type=POSITIVE_INT, default=2, help="pipelines of the data-parallel configurations")
    p.add_argument("--reps", type=POSITIVE_INT, default=2, help="alternating repetitions")
    p.add_argument("--steps", type=POSITIVE_INT, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=NONNEGATIVE_INT, default=2)
    p.add_argument("--timeout", type=POSITIVE, default=600.0, help="seconds per run")
    p.add_argument("--wire-bytes", type=POSITIVE_INT, default=4, help="bytes per parameter on the wire (for the bound)")
    p.add_argument("--keep", default=None, help="append every run's record to this JSON-lines file")
    p.add_argument("--start-rep", type=NONNEGATIVE_INT, default=0,
                   help="number of the first repetition (its parity sets the order: continue an alternation)")
    p.add_argument("--from-records", nargs="+", default=None, metavar="FILE",
                   help="run nothing: print the tables of the records kept in these files (--keep)")
    p.add_argument("run_args", nargs=argparse.REMAINDER,
                   help="after --: more run-command arguments for every run (e.g. model overrides)")
    p.set_defaults(run=run)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a bad request: one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m bench.network_slope", description=__doc__.split("\n\n")[0])
    fill_parser(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

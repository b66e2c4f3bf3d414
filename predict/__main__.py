"""pipebench predict (python -m predict): a run's step time without running it, and the simulator's
calibration and checks. One mode a command (``pipebench predict MODE --help``: its flags):

    pipebench predict scenario FILE.toml [--json] [--set SECTION.KEY=VALUE ...]   # a run on a GPU cluster,
                                            # described whole (predict.scenario: model, cluster, run): step time,
                                            # parts, memory; FILE a path or the name of a shipped scenario
                                            # (predict/scenarios: seed-gpipe-default); --set run.pp=4: one key
                                            # changed before it is judged
    pipebench predict validate-seed [--json] [--out DIR] [--calibrate]   # every cell of the seed's GPT-3 XL
                                            # tables predicted; the V100's calibration cells named, not scored
    pipebench predict validate-seed --sensitivity [--out DIR]   # every cell as the calibration cell in turn
    pipebench predict validate-published [--json] [--out DIR] [--jobs N]   # Megatron-LM's published tables (the
                                            # development set beyond the seed) predicted, per GPU type
    pipebench predict compare FILE.toml [--json] [--top N]   # every system and layout that fits a model on a
                                            # cluster, predicted and ranked (predict.compare)
    pipebench predict fit-kernels [--write]   # the GPU device files' GEMM curves fitted to the published kernel
                                            # benchmarks they name (workload/devices/kernels/)
    pipebench predict run --system ours --model cpu-small --pp 2 ... [--network d10-1g]
                              [--device-file "V100 SXM2 16GB"]   # one run: the run command's flags (also
                                            # without the word run: pipebench predict --system ours ...)
    pipebench predict sweep SWEEP_FILE [--device-file NAME]   # the predicted report tables of a sweep
    pipebench predict records RECORDS.jsonl ...   # this machine's prediction of every recorded CPU run, kept
                                            # beside its records (X.predictions.json) for the report's cells
    pipebench predict calibrate     # this host and code version: profiles, stall probe, runs without delay,
                                    # overheads, the host's speed (predict/calibration/<host>-<code>/)
    pipebench predict calibrate --refit   # the kept calibration runs fitted again (a change to the fit)
    pipebench predict validate [RECORDS.jsonl ...] [--name validation]   # recorded runs (default: the main
                                    # job's, results/local.jsonl) predicted against measured, by case; kept
                                    # only with --name: the report shows predictions only for the cases
                                    # predict/calibration/validation.json finds modelled (--name N: results/predict/N)
    pipebench predict plan-check [EVALUATION.json] [--out DIR]   # the planner's evaluation: formula vs simulator

Without --device-file a run is predicted for this machine (its calibration in predict/calibration and a
profile of the model's shape); with one (a device file's name or path: workload/devices), for that GPU,
every rank on a node of its own, NCCL over the network profile's link (``--network none``: NVLink).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from contract.cli import DEVICE_FILE, NONNEGATIVE_INT, POSITIVE_INT, Parser, old_names
from contract.records import predictions_path

REPORTS = Path(__file__).resolve().parents[1] / "results" / "predict"  # what the checks write
PROG = "python -m predict"  # the command's name where pipebench does not give its own


def _calibrate(args) -> int:
    from predict.this_machine import calibrate_here, refit_here

    if args.refit:
        refit_here()
    else:
        calibrate_here(steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    return 0


def _probe(args) -> int:
    from predict.this_machine import keep_speed, speed_probe

    speed = speed_probe()
    if args.out:
        keep_speed(Path(args.out), speed, args.label)
    print(f"speed probe{f' ({args.label})' if args.label else ''}: {speed * 1e3:.1f} GFLOP/s")
    return 0


def _validate(args) -> int:
    from predict.this_machine import NothingToValidate, validate_records

    if args.name is not None and not _plain_name(args.name):
        print(f"{args.prog}: error: --name {args.name!r}: a plain name (letters, digits, '.', '_', "
              "'-'; no path): the check is kept as results/predict/NAME.{md,json} (validation: in "
              "predict/calibration/)", file=sys.stderr)
        return 2
    if why := _not_files(args.records):
        hint = " (run the main job first: runners/run_all.sh)" if why.startswith("no such file") else ""
        print(f"{args.prog}: error: {why}{hint}", file=sys.stderr)
        return 2
    try:
        validate_records([Path(p) for p in args.records], name=args.name,
                         out=None if args.name in (None, "validation") else REPORTS, warn=_warner(args.prog))
    except (FileNotFoundError, NothingToValidate) as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.name is None:
        print("(nothing written: --name validation keeps it as predict/calibration/validation.{md,json}, the one the "
              "report's predictions are gated by; another name: results/predict/NAME.{md,json})", file=sys.stderr)
    return 0


def _not_files(paths: list[str]) -> str | None:
    """Why the records files ``paths`` cannot be read (one line), or None."""
    dirs = [p for p in paths if Path(p).is_dir()]
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        return f"no such file: {', '.join(missing)}"
    return f"{', '.join(dirs)}: a directory, not a records file" if dirs else None


def _warner(prog: str):
    """A records file's skipped or cut line told on stderr under the command's name."""
    return lambda why: print(f"{prog}: {why}", file=sys.stderr)


def _plain_name(name: str) -> bool:
    """A name that stays a file's name inside its folder: no path, no hidden or parent entry."""
    return bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name))


def _out_dir_error(out: str | None) -> str | None:
    """Why ``--out DIR`` cannot take a check's report (a file, not a folder; a folder not creatable), judged
    before any work; None where it can (it is created)."""
    if out is None:
        return None
    d = Path(out)
    if d.exists() and not d.is_dir():
        return f"--out {out} is a file: give a folder (DIR/NAME.md and .json are written in it)"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: cannot make the folder ({exc.strerror or exc.__class__.__name__})"
    return None


def _write(out: str | None, stem: str, text: str, data) -> None:
    """A check's report, where one is asked for (``--out DIR``): DIR/STEM.md and DIR/STEM.json."""
    if out is None:
        return
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{stem}.md").write_text(text)
    (d / f"{stem}.json").write_text(json.dumps(data, indent=1))
    print(f"written: {d / stem}.md, .json", file=sys.stderr)


def _validate_seed(args) -> int:
    from predict.seed_tables import calibrate, markdown, validate

    if args.calibrate and args.sensitivity:
        print(f"{args.prog}: error: give --calibrate or --sensitivity, not both", file=sys.stderr)
        return 2
    if _out_dir_error(args.out):
        print(f"{args.prog}: error: {_out_dir_error(args.out)}", file=sys.stderr)
        return 2
    if args.calibrate:
        fitted = calibrate(write=True)
        print("the seed's stack's stall shares calibrated: " + ", ".join(f"{k} {v:.4f}" for k, v in fitted.items()),
              file=sys.stderr)
    if args.sensitivity:
        from predict.seed_tables import sensitivity, sensitivity_markdown

        def progress(r):
            what = (f"cannot calibrate ({r['unfit']})" if "unfit" in r else
                    f"median {r['median'] * 100:.1f} %, largest {r['largest'] * 100:.1f} %")
            print(f"{r['precision']} calibrated on {r['cell']}: {what}", file=sys.stderr, flush=True)

        rows = sensitivity(progress=progress)
        text = sensitivity_markdown(rows)
        print(json.dumps(rows) if args.json else text)
        _write(args.out, "seed-calibration-sensitivity", text, rows)
        return 0
    res = validate()
    text = markdown(res)
    print(json.dumps(res["summary"]) if args.json else text)
    _write(args.out, "seed-validation", text, res)
    return 0


def _fit_kernels(args) -> int:
    from predict.fitting import fit_kernels, write_kernel_fits
    from workload.compute import device_files, read_device

    if args.write:
        fits = write_kernel_fits()
    else:
        fits = {p.name: fit_kernels(d) for p in device_files() if (d := read_device(p)).kernels}
    for name, by_precision in fits.items():
        for prec, f in by_precision.items():
            print(f"{name} {prec}: efficiency {f['efficiency']:.4f}, half {f['half']:.1f} (K), {f['rows']} GEMMs of "
                  f"{f['file']}, rms log error {f['rms_log_error']:.3f}")
    return 0


def _compare(args) -> int:
    from predict.compare import as_json, compare, table
    from predict.scenario import ScenarioError

    try:
        res = compare(_scenario_file(args.file), jobs=args.jobs, progress=not args.json)
    except ScenarioError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(res, args.top)) if args.json else table(res, args.top))
    return 0


def _validate_published(args) -> int:
    from predict.published import calibrate, markdown, validate, write_validated

    if args.calibrate:
        fitted = calibrate(write=True)
        print("stacks' stall shares calibrated: " + ", ".join(f"{k} {v:.4f}" for k, v in fitted.items()),
              file=sys.stderr)

    def progress(r):
        what = "oom" if r["predicted"] == "oom" else f"{r['predicted']:.3f} s ({r.get('error', 0) * 100:+.1f} %)"
        print(f"{r['name']}: published {r['published']:.3f} s, predicted {what}", file=sys.stderr, flush=True)

    res = validate(jobs=args.jobs, progress=progress, select=args.only)
    if args.calibrate and not args.only:  # a whole run on the stall shares just fitted: the files' status
        print("validated written into " + ", ".join(write_validated(res)), file=sys.stderr)
    text = markdown(res)
    print(json.dumps(res["gpus"]) if args.json else text)
    _write(args.out, "published-validation", text, res)
    return 0


def _scenario(args) -> int:
    from predict.scenario import ScenarioError, line, load, predict_scenario

    try:
        res = predict_scenario(load(_scenario_file(args.file), args.set))
    except ScenarioError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res) if args.json else line(res))
    return 0


def _plan_check(args) -> int:
    from predict.slicing import check_evaluation, markdown

    res = check_evaluation(args.evaluation)
    text = markdown(res)
    print(text)
    _write(args.out, "plan-check", text, res)
    return 0


def _target(device_file: str | None, cfg, in_flight: int | None):
    """(compute model, link, cores, transport) of a prediction: this machine, or a GPU's device file."""
    from predict.this_machine import load_calibration

    if device_file is None:
        from predict.this_machine import at_host_speed

        cal = load_calibration()
        print(f"with the {cal.name}", file=sys.stderr)
        compute = at_host_speed(cal.compute(cfg.model), cal,
                                log=lambda line: print(line, file=sys.stderr))
        return compute, cal.link(cfg.network, None, cfg.network_matrix), cal.cores, "gloo"
    from predict.from_config import gpu_compute_of, single_link
    from contract.links import Link
    from predict.scenario import NVLINK_DELAY_MS, NVLINK_GBPS

    compute = gpu_compute_of(cfg, device_file)
    link = single_link(cfg.network, cfg.network_matrix)
    if link is None:
        nvlink = NVLINK_GBPS.get(compute.device.part.split()[0], 1000.0)
        return compute, Link.from_ms_gbps(NVLINK_DELAY_MS, nvlink, in_flight), None, "nccl"
    return compute, Link.from_ms_gbps(link.delay_ms, link.bandwidth_gbps, in_flight), None, "nccl"


def _predict(cfg, device_file: str | None, in_flight: int | None):
    from predict.from_config import spec_from_config
    from predict.step_time import predict

    compute, link, cores, transport = _target(device_file, cfg, in_flight)
    gpu = None if device_file is None else compute
    if gpu is not None:
        from predict.from_config import check_memory

        check_memory(cfg, gpu)  # OutOfMemory: the run cannot fit its GPU
    return predict(spec_from_config(cfg, link, transport, compute=gpu), compute, cores)


def _in_flight(text: str) -> int:
    """--in-flight: messages in flight per link and direction, at least one."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of messages >= 1, got {text!r}")
    return n


def _target_flags(p) -> None:
    """The flags of where a run is predicted (the one-run mode and sweep): a GPU's device file or this
    machine; ``--device-file`` is the name every command gives it (``--gpu``: the old name)."""
    p.add_argument(*DEVICE_FILE, dest="device_file", default=None, metavar="NAME", help="a device file's name or path "
                   f"(workload/devices){old_names(DEVICE_FILE)} (default: this machine, from its calibration)")
    p.add_argument("--in-flight", type=_in_flight, default=None,
                   help="messages in flight per link and direction on a GPU's links (default: as many as issued)")


def run_parser(prog: str = f"{PROG} run"):
    """The one-run mode's parser: the run command's flags (``runners.request``) and the target's."""
    from runners.request import build_parser

    p = build_parser(prog=prog)
    p.description = ("One run predicted from the run command's own flags (pipebench run --help), without "
                     "running it: its step time, its parts and each rank's time.")
    _target_flags(p.add_argument_group("where it is predicted"))
    return p


def predict_run(argv: list[str], prog: str = f"{PROG} run") -> int:
    """One run from the run command's own flags: its predicted step time and breakdown."""
    from contract import ConfigError
    from predict.from_config import NotModelled, OutOfMemory
    from predict.simulator import SimulationError
    from contract.registry import get_system
    from runners.request import config_from_args, judge
    from workload.compute import DeviceError

    parser = run_parser(prog)
    args = target = parser.parse_args(argv)
    oom = None
    try:
        spec = get_system(args.system)
        cfg = config_from_args(args, spec)
        judge(cfg, spec)
        p = _predict(cfg, target.device_file, target.in_flight)
    except OutOfMemory as exc:
        oom = exc
    except (ConfigError, NotModelled, FileNotFoundError, DeviceError, SimulationError) as exc:
        print(f"{parser.prog}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    where = target.device_file or "this machine"
    print(f"{cfg.system} {cfg.model.name} {cfg.precision} pp={cfg.pp} tp={cfg.tp} dp={cfg.dp} "
          f"mb={cfg.micro_batch_size} batch={cfg.batch_size} network {cfg.network} on {where}:")
    if target.device_file:
        from predict.compare import device_status
        from workload.compute import find_device

        print(f"device file: {device_status(find_device(target.device_file))}")
    if oom is not None:
        print(f"predicted: {oom}")
        return 0
    print(p.line())
    print("per rank: " + ", ".join(f"{t:.4f}" for t in p.per_rank) + " s")
    return 0


def _sweep(args) -> int:
    """The sweep file's runs predicted, shown as report.py shows measured ones."""
    from contract import ConfigError
    from reporting import render
    from predict.from_config import NotModelled, OutOfMemory
    from runners.record import build_record
    from runners.request import parse_request
    from runners.sweep.plan import SweepError, load_sweep
    from workload.compute import DeviceError

    target = args
    try:
        sweep = load_sweep(target.sweep)
    except SweepError as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 2
    records, skipped = [], []
    for run in sweep.valid_runs:
        cfg, spec = parse_request(run.args)
        try:
            p = _predict(cfg, target.device_file, target.in_flight)
        except OutOfMemory as exc:  # the report's Fail (OOM) cell, as a run that did not fit would be
            rec = build_record(cfg, spec, "oom", str(exc), None, {"device_name": target.device_file})
            records.append(rec.__dict__)
            continue
        except (ConfigError, NotModelled, FileNotFoundError, DeviceError) as exc:
            skipped.append(f"{run.label()}: {exc}")
            continue
        rec = build_record(cfg, spec, "ok", None, None,
                           {"device_name": target.device_file or "this machine (predicted)"})
        rec.median_step_time = p.step_time
        records.append(rec.__dict__)
    print(render(records).replace("# Results", f"# Predicted: sweep {sweep.name}", 1))
    for line in skipped:
        print(f"not predicted: {line}", file=sys.stderr)
    return 0


def _records(args) -> int:
    from predict.this_machine import predict_records

    if why := _not_files(args.records):
        print(f"{args.prog}: error: {why}", file=sys.stderr)
        return 2
    for path in args.records:
        out = predictions_path(path)
        before = out.stat().st_mtime_ns if out.exists() else None
        predicted = predict_records(Path(path), log=lambda line: print(line, file=sys.stderr),
                                    warn=_warner(args.prog))
        after = out.stat().st_mtime_ns if out.exists() else None
        where = "nothing written" if after is None else (f"{out} kept as it was" if after == before else out)
        print(f"{path}: {len(predicted)} run(s) predicted ({where})")
    return 0


def _scenario_file(text: str) -> str | Path:
    """A scenario as given: a path, else (a bare name not here) the shipped scenario of that name."""
    from predict.seed_tables import SCENARIOS

    if Path(text).exists() or Path(text).name != text:
        return text
    shipped = [SCENARIOS / name for name in (text, f"{text}.toml")]
    return next((s for s in shipped if s.is_file()), text)


RUN = "run"  # the one-run mode: the run command's parser (run_parser), built only where it is asked for


def build_parser(prog: str = PROG) -> Parser:
    """The modes, each a subcommand; the one-run mode's flags are the run command's (``run_parser``)."""
    first, rest = __doc__.split("\n\n", 1)
    p = Parser(prog=prog, description=first, epilog=rest.rstrip())
    sub = p.add_subparsers(dest="cmd", metavar="MODE", required=True, parser_class=Parser)
    sub.add_parser(RUN, add_help=False, help="one run predicted from the run command's flags (also given directly: "
                   f"{prog} --system ...; {prog} run --help: the flags)")
    q = sub.add_parser("sweep", help="a sweep file's runs predicted, as the report shows measured ones")
    q.add_argument("sweep", metavar="SWEEP_FILE", help="a sweep file (TOML): a path, or a name in sweeps/")
    _target_flags(q)
    q.set_defaults(fn=_sweep)
    q = sub.add_parser("scenario", help="a run on a GPU cluster described by a scenario file (predict.scenario)")
    q.add_argument("file", help="the scenario (TOML): a path, or the name of a shipped one (predict/scenarios)")
    q.add_argument("--json", action="store_true", help="one JSON object: step_time_s, parts, memory, status")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change one key of the file before it is judged (repeatable; VALUE as TOML, else a string): "
                        "--set run.pp=4 --set run.batch_size=2")
    q.set_defaults(fn=_scenario)
    q = sub.add_parser("records", help="this machine's prediction of every recorded CPU run, kept beside its "
                       "records file for the report")
    q.add_argument("records", nargs="+", help="records files (JSON lines)")
    q.set_defaults(fn=_records)
    q = sub.add_parser("probe", help="this host's speed now: the calibration's speed probe (a few seconds)")
    q.add_argument("--out", default=None, help="also append it to this file (JSON lines: when, speed_tflops, label; "
                   "a sweep's --speed-probes keep theirs in RECORDS.speed, which predict records reads)")
    q.add_argument("--label", default="", help="what the probe is taken beside (e.g. 'before layout')")
    q.set_defaults(fn=_probe)
    q = sub.add_parser("validate", help="recorded runs predicted against measured, by case")
    q.add_argument("records", nargs="*", default=["results/local.jsonl"],
                   help="records files (default: the main job's, results/local.jsonl)")
    q.add_argument("--name", default=None, help="keep it: validation as predict/calibration/validation.{md,json}, the "
                   "one the report's predictions are gated by; another name: results/predict/NAME.{md,json}, a "
                   "check that gates nothing (default: print it, write nothing)")
    q.set_defaults(fn=_validate)
    q = sub.add_parser("validate-seed", help="every cell of the seed's GPT-3 XL tables predicted (the V100's "
                       "calibration cells named, not scored)")
    q.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    q.add_argument("--out", default=None, help="write DIR/seed-validation.{md,json} (default: write nothing)")
    q.add_argument("--calibrate", action="store_true", help="first refit the seed's stack's stall shares on their "
                   "calibration cells (writes predict/stacks.json)")
    q.add_argument("--sensitivity", action="store_true", help="instead: every cell of a precision as its one "
                   "calibration cell in turn, the validation's median and largest error for each (a few minutes; "
                   "--out writes DIR/seed-calibration-sensitivity.{md,json})")
    q.set_defaults(fn=_validate_seed)
    q = sub.add_parser("calibrate", help="this host and code version's calibration (about 22 minutes on 2 cores)")
    q.add_argument("--steps", type=POSITIVE_INT, default=6, help="measured steps per run (their median: its time)")
    q.add_argument("--warmup", type=NONNEGATIVE_INT, default=1, help="warm-up steps per run, not timed")
    q.add_argument("--repeats", type=POSITIVE_INT, default=3, help="runs of each calibration config, round-robin (each "
                   "config's median record in calibration-runs.jsonl is fitted)")
    q.add_argument("--refit", action="store_true", help="run nothing: fit this host and code version's kept "
                   "calibration runs again (after a change to the fit itself)")
    q.set_defaults(fn=_calibrate)
    q = sub.add_parser("compare", help="every system, layout, schedule, micro-batch and recompute choice that fits "
                       "a model on a cluster, predicted and ranked (predict.compare)")
    q.add_argument("file", help="a compare file (TOML: [run] model, [cluster], [compare] global_batch): a path, or "
                   "the name of a shipped one (predict/scenarios)")
    q.add_argument("--json", action="store_true", help="one JSON object: every candidate that runs, ranked")
    q.add_argument("--top", type=POSITIVE_INT, default=None, help="only the N fastest, table and --json (default: all)")
    q.add_argument("--jobs", type=POSITIVE_INT, default=None,
                   help="candidates predicted at once, in processes (default: the cores)")
    q.set_defaults(fn=_compare)
    q = sub.add_parser("fit-kernels", help="the GPU device files' GEMM curves fitted to the published kernel "
                       "benchmarks they name (workload/devices/kernels/)")
    q.add_argument("--write", action="store_true", help="write the fits into the device files")
    q.set_defaults(fn=_fit_kernels)
    q = sub.add_parser("validate-published", help="Megatron-LM's published tables (the development set beyond the "
                       "seed) predicted, per GPU type")
    q.add_argument("--json", action="store_true", help="print the per-GPU summary as one JSON object")
    q.add_argument("--out", default=None, help="write DIR/published-validation.{md,json}")
    q.add_argument("--jobs", type=POSITIVE_INT, default=1, help="cells predicted at once, in processes (default: 1)")
    q.add_argument("--only", default=None, help="only the cells whose name contains this text")
    q.add_argument("--calibrate", action="store_true", help="first refit the stacks' stall shares on their calibration "
                   "cells (predict/stacks.json); without --only, each GPU's result then goes into its device file")
    q.set_defaults(fn=_validate_published)
    q = sub.add_parser("plan-check", help="the planner's evaluation: its formula against the simulator")
    q.add_argument("evaluation", nargs="?", default="results/plan/cpu-small-p2-evaluation.json",
                   help="the evaluation (python -m bench plan-evaluation)")
    q.add_argument("--out", default=None, help="write DIR/plan-check.{md,json} (default: write nothing)")
    q.set_defaults(fn=_plan_check)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or PROG
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = [RUN, *argv]  # the one-run mode's flags given without its name
    if argv and argv[0] == RUN:
        return predict_run(argv[1:], f"{prog} {RUN}")
    args = build_parser(prog).parse_args(argv)
    args.prog = f"{prog} {args.cmd}"
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""python -m runners.predict {calibrate,validate,seed}: the simulator's calibration and checks.

    python -m runners.predict calibrate     # this machine: profiles, stall probe, runs without delay, overheads
    python -m runners.predict validate      # emulated runs: predicted against measured (root)
    python -m runners.predict seed          # the V100 device file from the seed's default GPipe row; the seed tables
    python -m runners.predict plan-check [EVALUATION.json]   # the planner's evaluation: formula vs simulator

Predicting one run from the run command's flags and report.py's predicted column are wired by the
run command's owner (``runners.predict.glue.spec_from_config`` is the one place that reads a RunConfig).
"""
from __future__ import annotations

import argparse
import json
import sys

from runners.predict.local import RESULTS


def _calibrate(args) -> int:
    from runners.predict.local import calibrate_here

    calibrate_here(steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    return 0


def _validate(args) -> int:
    from runners.predict.local import validate

    validate(steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    return 0


def _seed(args) -> int:
    from runners.predict.seed import calibrate_seed, fp16_check, markdown, predict_seed

    dev = calibrate_seed("fp32", write=not args.no_write)
    res = predict_seed(dev)
    fp16 = fp16_check()
    text = markdown(res, fp16)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "seed-predictions.json").write_text(json.dumps(dict(fp32=res, fp16=fp16), indent=1))
        (RESULTS / "seed-predictions.md").write_text(text)
    return 0


def _plan_check(args) -> int:
    from runners.predict.planner import check_evaluation, markdown

    res = check_evaluation(args.evaluation)
    text = markdown(res)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "plan-check.md").write_text(text)
    (RESULTS / "plan-check.json").write_text(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runners.predict", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("calibrate", _calibrate), ("validate", _validate)):
        q = sub.add_parser(name)
        q.add_argument("--steps", type=int, default=3)
        q.add_argument("--warmup", type=int, default=1)
        if name == "calibrate":
            q.add_argument("--repeats", type=int, default=2, help="runs of each calibration config (the fastest kept, "
                           "with every earlier one in calibration-runs.jsonl)")
        else:
            q.add_argument("--repeats", type=int, default=1, help="runs of each validation config (the fastest kept)")
        q.set_defaults(fn=fn)
    q = sub.add_parser("seed")
    q.add_argument("--no-write", action="store_true", help="print only; leave the device file and results alone")
    q.set_defaults(fn=_seed)
    q = sub.add_parser("plan-check")
    q.add_argument("evaluation", nargs="?", default="results/plan/cpu-small-p2-evaluation.json")
    q.set_defaults(fn=_plan_check)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""How far reference runs that differ only in micro-batching land from each other under each
precision policy, over many seeds (the distribution that ``runners.tolerance`` derives its tolerances
from), and how far each system's --verify lands from the reference (what the tolerances are then held
against).

Every case (a system and layout on the tiny test model: 4 layers, hidden 64, 4 heads, sequence 32,
vocabulary 128; batch 4 per pipeline, micro-batch 1) runs the real run command with ``--verify`` once
per (policy, seed, steps); each run appends one line to ``--keep`` (default
``results/measured-here/verify-spread.jsonl``): the case, its policy class (``runners.tolerance``),
the seed, the steps, and the record's verification (largest loss difference, largest gradient
difference, absolute and as a fraction of each parameter's largest reference gradient). A reference
case (``REFERENCE_CASES``) trains the reference at micro-batch 1 and at another micro-batch size (the
same global batch; under the half-weights policies with ``--half-weights``) and compares the two as
``--verify`` would. A run already there is not run again, so the measurement goes in chunks
(``--budget`` seconds each, e.g. under the shared CPU lock) and resumes where it stopped. The
reference of a (seed, policy, global batch) is trained once and shared by every case
(``runners.reference_cache``).

    python -m tools.verify_spread run --precision bf16 fp16 --cases reference --seeds 0-11 --budget 240
    python -m tools.verify_spread run --precision bf16 fp16 --seeds 0-23 --budget 240
    python -m tools.verify_spread run --precision bf16 --cases "megatron P-2" --steps 1 2 4 8 --seeds 0-3
    python -m tools.verify_spread summary           (the tables, and the tolerance each policy's rule gives)

``summary`` prints, per policy class and case, the runs, the median and the maximum of each
difference, and the tolerance that ``runners.tolerance.derive`` gives over the class's reference runs
at ``DERIVED_AT_STEPS`` steps, beside the one in force and the systems' largest differences;
``--write FILE`` also writes them as markdown.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from contract.cli import POSITIVE, POSITIVE_INT, Parser, cannot_write_file
from runners.invoke import run_command
from runners.tolerance import (DERIVED_AT_STEPS, DERIVED_TOKENS, Tolerance, derivation_runs, derive, policy_class,
                               tolerance_table)

REPO = Path(__file__).resolve().parent.parent
KEEP = REPO / "results" / "measured-here" / "verify-spread.jsonl"
# the models it runs: the tests' (tests.conftest.TINY), and the tiny model itself (hidden 128, sequence 128)
MODELS = {"test": ("--model", "tiny", "--num-layers", "4", "--hidden-size", "64", "--num-heads", "4",
                   "--seq-length", "32", "--vocab-size", "128"),
          "tiny": ("--model", "tiny")}
TOKENS = {"test": 32, "tiny": 128}  # tokens per micro-batch of the runs judged (micro-batch 1)
BATCH = ("--batch-size", "4", "--micro-batch-size", "1")
CASES: dict[str, tuple[str, ...]] = {
    "torch_pipe 1f1b P-2": ("--system", "torch_pipe", "--pp", "2", "--schedule", "1f1b"),
    "torch_pipe zbv P-2": ("--system", "torch_pipe", "--pp", "2", "--schedule", "zbv"),
    "torch_pipe 1f1b P-2 D-2": ("--system", "torch_pipe", "--pp", "2", "--dp", "2", "--schedule", "1f1b"),
    "fairscale_fsdp P-2": ("--system", "fairscale_fsdp", "--pp", "2"),
    "fairscale_fsdp P-2 D-2": ("--system", "fairscale_fsdp", "--pp", "2", "--dp", "2"),
    "megatron P-2": ("--system", "megatron", "--pp", "2"),
    "megatron T-2": ("--system", "megatron", "--tp", "2"),
    "megatron D-2": ("--system", "megatron", "--dp", "2"),
    "ours P-2 K-2": ("--system", "ours", "--pp", "2", "--n-slices", "2"),
    "ours P-2 D-2 sharded_ps": ("--system", "ours", "--pp", "2", "--dp", "2", "--n-slices", "2",
                                "--dp-mode", "sharded_ps"),
    "ours T-2 P-2 K-2": ("--system", "ours", "--tp", "2", "--pp", "2", "--n-slices", "2"),
    "diloco D-2 H=4": ("--system", "diloco", "--dp", "2", "--inner-steps", "4"),
}
HALF_WEIGHTS = ("megatron",)  # the systems whose spec keeps half weights (contract.SystemSpec.half_weights)
# The reference against itself: (the flags of the run compared with, the flags of the run compared), at
# micro-batch 1 unless they say another; each also under the half-weights policies (--half-weights).
REFERENCE_CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "reference micro-batch 2": ((), ("--micro-batch-size", "2")),
    "reference micro-batch 4": ((), ("--micro-batch-size", "4")),
}
HALF = " half weights"
REFERENCE_CASES.update({name.replace("reference", "reference" + HALF): (("--half-weights", *a), ("--half-weights", *b))
                        for name, (a, b) in REFERENCE_CASES.items()})


def seeds(text: str) -> list[int]:
    """'0-23' or '0,3,5' or '7'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def case_class(case: str, precision: str) -> str:
    return policy_class(precision, half_weights=case.split()[0] in HALF_WEIGHTS or case.startswith("reference" + HALF))


def runnable(case: str, precision: str) -> bool:
    """A half-weights reference case runs under a half policy only; diloco has no fp16."""
    return not ((case.startswith("reference" + HALF) and precision == "fp32")
                or (case.startswith("diloco") and precision == "fp16"))


def reference_pair(case: str, common: list[str]) -> tuple[dict, str]:
    """The reference under ``common`` flags at micro-batch 1 and as the case varies it, each trained (or
    taken from the reference cache) and compared as --verify compares: (the verification, the policy's
    tolerance in force)."""
    from runners.request import Placement, parse_request, resolve_devices
    from runners.run import compare, reference_result
    from runners.tolerance import verify_tolerance

    configs = []
    for flags in REFERENCE_CASES[case]:
        cfg, spec = parse_request(["--system", "reference", *common, *flags])
        configs.append(resolve_devices(cfg.replace(verify=True), spec, Placement()))  # verify: its gradients kept
    (base, _), (other, _) = (reference_result(cfg) for cfg in configs)
    try:
        v = compare(other, base, verify_tolerance(configs[0], configs[0].options.half_weights))
    finally:
        base.remove_run_dir()
        other.remove_run_dir()
    measured = all(math.isfinite(x) for x in (v.max_abs_loss_diff, v.max_rel_grad_diff)) and v.n_grads
    return {**v.__dict__, "status": "ok" if measured else "error", "error": v.reason}, v.tolerance


FIELDS = ("case", "shape", "tokens", "precision", "class", "seed", "steps", "status")  # of every kept line


class KeptError(Exception):
    """The kept measurements cannot be read, or a file cannot be written: one line."""


def load(path: Path, warn=None) -> list[dict]:
    """The kept lines of ``path`` (none if it does not exist); a line that is not JSON, or not an object with
    ``FIELDS``, is told to ``warn`` (stderr by default) and skipped; a path that is not a file: KeptError."""
    if not path.exists():
        return []
    if not path.is_file():
        raise KeptError(f"--keep {path}: not a file")
    warn = warn or (lambda why: print(f"verify-spread: {why}", file=sys.stderr))
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            row = "not JSON"
        if row is None:
            continue
        missing = [k for k in FIELDS if k not in row] if isinstance(row, dict) else None
        if missing is None or missing:
            why = "no " + ", ".join(missing) if missing else row if isinstance(row, str) else "not an object"
            warn(f"{path}:{n}: not a kept verify-spread line ({why}): skipped")
            continue
        rows.append(row)
    return rows


def run(opts: argparse.Namespace) -> int:
    keep = Path(opts.keep)
    if why := cannot_write_file(str(keep), "--keep"):
        raise KeptError(why)
    keep.parent.mkdir(parents=True, exist_ok=True)
    shape = " ".join([opts.model, *opts.extra])
    done = {(r["case"], r["shape"], r["precision"], r["seed"], r["steps"]) for r in load(keep)}
    cases = [c for name in opts.cases for c in ([*REFERENCE_CASES] if name == "reference" else [name])]
    todo = [(case, precision, seed, steps) for seed in opts.seeds for steps in opts.steps
            for precision in opts.precision for case in cases
            if (case, shape, precision, seed, steps) not in done and runnable(case, precision)]
    began = time.monotonic()
    print(f"verify-spread: {len(todo)} runs to go ({len(done)} kept in {keep})", flush=True)
    for n, (case, precision, seed, steps) in enumerate(todo):
        if opts.budget is not None and time.monotonic() - began > opts.budget:
            print(f"verify-spread: budget of {opts.budget:g} s spent, {len(todo) - n} runs left; run again to go on")
            return 0
        common = [*MODELS[opts.model], *BATCH, "--precision", precision, "--seed", str(seed), "--steps", str(steps),
                  "--warmup", "0", "--timeout", str(opts.timeout), *opts.extra]
        line = {"case": case, "shape": shape, "tokens": TOKENS[opts.model], "precision": precision,
                "class": case_class(case, precision), "seed": seed, "steps": steps}
        if case in REFERENCE_CASES:
            v, tolerance = reference_pair(case, common)
            line.update(status=v["status"], tolerance=tolerance)
        else:
            inv = run_command([*CASES[case], *common, "--verify"], timeout=opts.timeout + 60)
            rec = inv.record or {}
            v = rec.get("verify") or {}
            line.update(status=rec.get("status", f"no record (exit {inv.returncode})"), tolerance=v.get("tolerance"))
            if rec.get("status") != "ok" or not v:
                line["error"] = rec.get("error") or inv.last_line
        line.update({k: v.get(k) for k in ("max_abs_loss_diff", "max_abs_grad_diff", "max_rel_grad_diff", "passed")})
        if v.get("error"):
            line["error"] = v["error"]
        with keep.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"[{n + 1}/{len(todo)}] {case} {precision} seed {seed} steps {steps}: {line['status']} "
              f"rel {line['max_rel_grad_diff']} loss {line['max_abs_loss_diff']} "
              f"{'PASS' if line.get('passed') else 'FAIL'}", flush=True)
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def summary_lines(rows: list[dict]) -> list[str]:
    """Markdown: per policy class, case, model shape and steps, the spread; the runs whose verification
    failed or did not run; then per class the tolerance the rule gives against the one in force."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("max_rel_grad_diff") is not None]
    out = ["| policy | case | shape (tokens per micro-batch) | steps | runs | rel grad diff median | max | "
           "abs grad diff max | loss diff median | max |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        groups.setdefault((r["class"], r["case"], r["tokens"], r["shape"], r["steps"]), []).append(r)
    for (cls, case, tokens, shape, steps), rs in sorted(groups.items()):
        rel = [r["max_rel_grad_diff"] for r in rs]
        loss = [r["max_abs_loss_diff"] for r in rs]
        out.append(f"| {cls} | {case} | {shape} ({tokens}) | {steps} | {len(rs)} | {_fmt(statistics.median(rel))} | "
                   f"{_fmt(max(rel))} | {_fmt(max(r['max_abs_grad_diff'] for r in rs))} | "
                   f"{_fmt(statistics.median(loss))} | {_fmt(max(loss))} |")
    table = tolerance_table()
    bad = [r for r in rows if r not in ok or not within(r, table.get(r["class"]))]
    if bad:
        out += ["", "Runs that did not run, or whose differences are beyond the tolerance in force:", ""]
        out += [f"- {r['case']} {r['precision']} {r['shape']} seed {r['seed']} steps {r['steps']}: {r['status']}, "
                f"rel {_fmt(r.get('max_rel_grad_diff'))}, loss {_fmt(r.get('max_abs_loss_diff'))} "
                f"{r.get('error', '')}".rstrip() for r in bad]
    out += ["", f"Each policy's tolerance by the rule (``runners.tolerance.derive``) over its reference runs (the "
                f"reference against itself at another micro-batch size) on the tests' model ({DERIVED_TOKENS} tokens "
                f"per micro-batch) at {DERIVED_AT_STEPS} steps, and the systems' largest differences at those steps:",
            "", "| policy | reference runs | rel grad diff max | abs grad diff max | loss diff max | derived "
                "| in force | systems' runs | rel grad diff max | loss diff max | beyond |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cls in sorted({r["class"] for r in ok}):
        rs = derivation_runs(cls, ok)
        if not rs:
            continue
        force = table.get(cls)
        systems = [r for r in ok if r["class"] == cls and not r["case"].startswith("reference")
                   and r["steps"] == DERIVED_AT_STEPS and r["tokens"] == DERIVED_TOKENS]
        sys_max = [_fmt(max((r[k] for r in systems), default=None)) for k in ("max_rel_grad_diff", "max_abs_loss_diff")]
        out.append(f"| {cls} | {len(rs)} | {_fmt(max(r['max_rel_grad_diff'] for r in rs))} | "
                   f"{_fmt(max(r['max_abs_grad_diff'] for r in rs))} | "
                   f"{_fmt(max(r['max_abs_loss_diff'] for r in rs))} | "
                   f"{derive(cls, rs).describe()} | {force.describe() if force else '-'} | {len(systems)} | "
                   f"{' | '.join(sys_max)} | {sum(not within(r, force) for r in systems)} |")
    return out


def within(row: dict, tolerance: Tolerance | None) -> bool:
    """Whether a kept run's differences are within ``tolerance`` (None: no tolerance to hold it to)."""
    if tolerance is None:
        return True
    grad = row["max_rel_grad_diff"] if tolerance.relative else row["max_abs_grad_diff"]
    return row["max_abs_loss_diff"] <= tolerance.loss and grad <= tolerance.grad


def summary(opts: argparse.Namespace) -> int:
    if not Path(opts.keep).exists():
        raise KeptError(f"--keep {opts.keep}: no such file (python -m tools.verify_spread run makes it)")
    if opts.write and (why := cannot_write_file(opts.write, "--write")):
        raise KeptError(why)
    lines = summary_lines(load(Path(opts.keep)))
    print("\n".join(lines))
    if opts.write:
        Path(opts.write).write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.verify_spread", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cases' --verify at many seeds (resumable)")
    r.add_argument("--precision", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"])
    r.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, *REFERENCE_CASES, "reference"],
                   metavar="CASE", help="systems' cases, reference cases, or 'reference': every reference case")
    r.add_argument("--seeds", type=seeds, default=seeds("0-23"), help="e.g. 0-23 or 0,5,9")
    r.add_argument("--model", default="test", choices=list(MODELS),
                   help="test: the tests' model (4 layers, hidden 64, sequence 32); tiny: hidden 128, sequence 128")
    r.add_argument("--steps", type=POSITIVE_INT, nargs="+", default=[DERIVED_AT_STEPS], help="optimizer steps per run")
    r.add_argument("--budget", type=POSITIVE, default=None, help="stop starting runs after this many seconds")
    r.add_argument("--timeout", type=POSITIVE, default=300.0)
    r.add_argument("--keep", default=str(KEEP))
    r.add_argument("extra", nargs="*", help="after --: more run-command flags (e.g. --seq-length 128)")
    s = sub.add_parser("summary", help="the spread per policy and case, and the tolerances it gives")
    s.add_argument("--keep", default=str(KEEP))
    s.add_argument("--write", default=None, help="also write the tables (markdown) to this file")
    opts = p.parse_args(argv)
    try:
        return run(opts) if opts.command == "run" else summary(opts)
    except KeptError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
